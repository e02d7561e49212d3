"""A Llama-3-style decoder, readable top to bottom (after Meta's llama3 model.py and torchtitan's llama3 model).

Pre-RMSNorm blocks; rotary positions (RoPE, Su et al. 2021) with Llama 3.1's long-context frequency scaling;
grouped-query attention (GQA, Ainslie et al. 2023: n_kv_head key/value heads shared by n_head / n_kv_head query heads
each) through F.scaled_dot_product_attention (within each document of a packed sample, given `cu_seqlens`:
doc_attention.py); a SwiGLU MLP (Shazeer 2020: w2(silu(w1 x) * w3 x)); no biases; the
token embedding and the output head are separate matrices unless `tie_embeddings` (Llama 3.2 1B and 3B tie them).

The rotary convention is Hugging Face's (`rotate_half`: the first and second halves of each head are the pairs),
so the weights map one to one onto transformers' LlamaForCausalLM, with no permutation of wq/wk.

The layers live in a ModuleDict keyed "0".."L-1" (not a ModuleList) so that a pipeline stage that drops some layers
keeps the others' names, and checkpoints written by stages line up with the whole model's keys (as torchtitan does).
A module set to None (a pipeline stage without the embedding, norm or head) is skipped by forward().

Shapes: B batch, T sequence, C = n_embd, nh query heads, nkv key/value heads, hs = C / nh, F ffn_hidden, V padded
vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from corpusforge.train.doc_attention import DocumentMask, attend, document_mask
from corpusforge.train.model import pad_vocab


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    ffn_hidden: int
    vocab_size: int  # the tokenizer's; the embedding holds padded_vocab rows
    block_size: int  # longest sequence trained on
    rope_theta: float = 500000.0
    rope_scaling: float = 0.0  # Llama 3.1 "llama3" scaling factor (8 for 3.1, 32 for 3.2); 0: none
    rope_original_context: int = 8192  # the context the scaled frequencies were trained at
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0  # on the residual branches (0 in Llama's pretraining)

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def llama_ffn_hidden(n_embd: int, multiplier: float = 1.0, multiple_of: int = 256) -> int:
    """Llama's MLP width: 2/3 of 4C (so SwiGLU's three matrices cost what GPT's two of 4C do), times
    ffn_dim_multiplier, rounded up to a multiple of `multiple_of` (Meta llama3 model.py FeedForward).

    Example:
        >>> llama_ffn_hidden(4096, 1.3, 1024)   # Llama 3.1 8B
        14336
    """
    hidden = int(multiplier * int(2 * 4 * n_embd / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """(hs/2,) inverse frequencies θ^(-2i/hs), with Llama 3.1's scaling when rope_scaling > 0: wavelengths longer
    than the original context / 1 are slowed by the factor, shorter than context / 4 kept, the band between
    blended (Meta llama3 `apply_scaling`; transformers `_compute_llama3_parameters`, low 1, high 4)."""
    hs = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs))  # (hs/2,)
    if not cfg.rope_scaling:
        return inv
    factor, low, high, context = cfg.rope_scaling, 1.0, 4.0, cfg.rope_original_context
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > context / low, inv / factor, inv)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, hs) rotated by the angles of its positions; cos, sin (B or 1, 1, T, hs)."""
    return x * cos + rotate_half(x) * sin


def rope_tables(inv_freq: torch.Tensor, position_ids: torch.Tensor | None, T: int, dtype: torch.dtype) -> tuple:
    """(cos, sin), each (B or 1, 1, T, hs), for `position_ids` (B, T) or (T,), or 0..T-1 when None."""
    if position_ids is None:
        position_ids = torch.arange(T, device=inv_freq.device)
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)  # (1, T)
    angles = position_ids.float().unsqueeze(-1) * inv_freq.float()  # (B, T, hs/2)
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # (B, 1, T, hs)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g, computed in float32 (Zhang & Sennrich 2019; as Llama and transformers do)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.wo.residual = True
        # Rebuilt, not saved (checkpoints hold learned weights only). Here rather than once in the model because
        # under sequence parallelism only the attention sees the whole sequence, and a pipeline stage may hold
        # no embedding: (hs/2,)
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        cos, sin = rope_tables(self.inv_freq, position_ids, T, x.dtype)  # (B or 1, 1, T, hs)
        # -1 rather than n_head: under tensor parallelism each rank holds n_head / tp of the heads
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = q.size(1) // k.size(1)
        if groups > 1:  # each key/value head serves `groups` query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, nh, T, hs)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:  # within documents
            y = attend(q, k, v, mask)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, nh*hs) -> (B, T, C)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)  # down
        self.w2.residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, C) -> 2 x (B, T, F) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        # the mask as a keyword: tensor parallelism's PrepareModuleInput lays out the positional inputs only
        x = x + self.dropout(self.attention(self.attention_norm(x), position_ids, mask=mask))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # N(0, 0.02), projections into the residual stream scaled by 1/sqrt(2 * n_layer) as in GPT-2 (torchtitan
        # uses a depth-scaled truncated normal to the same effect); norms start at 1.
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def reset_buffers(self) -> None:
        """Recompute the rotary frequencies (a model built on the meta device has none until materialised)."""
        for block in self.layers.values():
            block.attention.inv_freq = rope_frequencies(self.cfg).to(block.attention.inv_freq.device)

    def forward(
        self, idx: torch.Tensor, position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (B, T, V) of int64 tokens `idx` (B, T). A pipeline stage without the embedding takes the hidden
        states (B, T, C) instead, and one without the head returns them. With `cu_seqlens` (B, T + 1), the documents
        of each sample (the loaders' document_boundaries), attention stays within each document; give position_ids
        restarting per document with them."""
        if idx.shape[1] > self.cfg.block_size:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than block_size {self.cfg.block_size}")
        x = self.tok_embeddings(idx) if self.tok_embeddings is not None else idx  # (B, T, C)
        mask = None if cu_seqlens is None else document_mask(cu_seqlens, cu_seqlens.shape[-1] - 1)  # once per forward
        for block in self.layers.values():
            x = block(x, position_ids, mask=mask)
        if self.norm is not None:
            x = self.norm(x)
        return self.output(x) if self.output is not None else x  # (B, T, V)

    def num_params(self, embeddings: bool = True) -> int:
        """Parameters (a tied matrix once); without the input embedding when embeddings=False, the N of 6N (a
        lookup costs no FLOPs, the output head does)."""
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings or self.cfg.tie_embeddings else n - self.tok_embeddings.weight.numel()


def flops_per_token(cfg: LlamaConfig, n_params: int, seq_length: int) -> int:
    """6N + 12·L·T·C, as for GPT (PaLM appendix B; torchtitan counts the same)."""
    return 6 * n_params + 12 * cfg.n_layer * seq_length * cfg.n_embd
