"""Attention within documents: causal inside each document of a packed sample, blocked across documents.

A sample of S tokens packs several documents. The loaders give its boundaries as Megatron-LM does
(--dataloader-inter-document-masking): `cu_seqlens` (B, S + 1) int32, the start of each document then S, padded with
S (corpusforge/data/gpt_dataset.py, _document_boundaries). The model turns them, once per forward, into a per-token
document id (B, T) and a mask every layer shares (`document_mask`); `attend` then runs one of torch's own kernels:

- CUDA: flex attention (torch.nn.attention.flex_attention), compiled, with a block mask built from the document ids
  (mask_mod `causal & same_doc`): blocks of 128 x 128 wholly across documents are skipped, not computed and masked.
- CPU, or dropout on (flex attention has none): F.scaled_dot_product_attention with the dense (B, 1, T, T) boolean
  mask. Flex attention runs eagerly on CPU too (tests compare it with this path) but materialises the same scores.

Without boundaries (mask None), `attend` is exactly the plain causal call (is_causal=True): the same kernel, the
same bits.

Shapes: B batch, h heads, T sequence, hs head size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def document_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) int64: the document of each position, from cu_seqlens (B, S + 1) or (S + 1,) with S = T; an empty
    document (a repeated boundary) holds no position, and the padding entries (= S) none either.

    Example:
        >>> document_ids(torch.tensor([[0, 2, 2, 3, 3]], dtype=torch.int32), 3).tolist()
        [[0, 0, 2]]
    """
    cu = cu_seqlens.to(torch.int64)
    if cu.dim() == 1:
        cu = cu.unsqueeze(0)
    positions = torch.arange(T, device=cu.device).expand(cu.shape[0], T).contiguous()
    return torch.searchsorted(cu, positions, right=True) - 1  # (B, T): the last boundary at or before t


@dataclass
class DocumentMask:
    """Which keys each query sees, made once per forward and shared by every layer."""

    doc: torch.Tensor
    """(B, T) int64 document ids."""

    block_mask: Any = None
    """flex attention's BlockMask (CUDA), or None."""

    @functools.cached_property
    def dense(self) -> torch.Tensor:
        """(B, 1, T, T) bool, True where attention is allowed: causal and within one document."""
        T = self.doc.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.doc.device).tril()
        return (self.doc[:, None, :, None] == self.doc[:, None, None, :]) & causal


def document_mask(cu_seqlens: torch.Tensor, T: int, use_flex: bool | None = None) -> DocumentMask:
    """The mask of documents `cu_seqlens` for sequences of T: with a flex block mask on CUDA (or where use_flex)."""
    doc = document_ids(cu_seqlens, T)
    if use_flex is None:
        use_flex = doc.is_cuda
    if not use_flex:
        return DocumentMask(doc)
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_same_doc(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    block_mask = create_block_mask(causal_same_doc, doc.shape[0], None, T, T, device=doc.device)
    return DocumentMask(doc, block_mask)


@functools.cache
def _compiled_flex() -> Any:
    """flex_attention compiled once per process (uncompiled it materialises the scores: no gain over SDPA)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None, dropout_p: float = 0.0
) -> torch.Tensor:
    """Attention of q, k, v (B, h, T, hs) -> (B, h, T, hs): plain causal without a mask, else within documents."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if mask.block_mask is not None and dropout_p == 0.0:
        flex = _compiled_flex() if q.is_cuda else _eager_flex()
        return flex(q, k, v, block_mask=mask.block_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, dropout_p=dropout_p)


def _eager_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention
