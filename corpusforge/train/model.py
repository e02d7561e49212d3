"""A GPT-2-style decoder, small enough to read top to bottom (after nanoGPT's model.py).

Pre-LayerNorm blocks, GELU MLP of width 4d, learned absolute positions, causal attention through
F.scaled_dot_product_attention (FlashAttention kernels on GPU; given the documents packed in each sample, `cu_seqlens`,
causal within each document and blocked across them: doc_attention.py), the token embedding tied to the output head,
and the vocabulary padded to a multiple of 128 so the head's matmul uses full tensor-core tiles (Karpathy: padding
50257 to 50304 made nanoGPT ~25% faster). Padded rows never receive a target, so they only learn to be unlikely.

Shapes: B batch, T sequence, C = n_embd, nh heads, hs = C / nh, V padded vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from corpusforge.train.doc_attention import DocumentMask, attend, document_mask


def pad_vocab(vocab_size: int, multiple: int = 128) -> int:
    """The vocabulary rounded up to a multiple of `multiple`.

    Example:
        >>> pad_vocab(50257), pad_vocab(100277)
        (50304, 100352)
    """
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int  # the tokenizer's; the embedding holds padded_vocab rows
    block_size: int  # longest sequence (learned positions)
    dropout: float = 0.0
    bias: bool = True

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim, self.dropout = cfg.n_embd // cfg.n_head, cfg.dropout
        # q, k, v as three matrices (GPT-2's checkpoint fuses them in c_attn; export-hf fuses them back) so that
        # tensor parallelism can split each by whole heads
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual = True  # scaled at init, see GPT._init_weights
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 rather than n_head: under tensor parallelism each rank holds n_head / tp of the heads
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        drop = self.dropout if self.training else 0.0
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)  # (B, nh, T, hs)
        else:  # within documents
            y = attend(q, k, v, mask, drop)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: DocumentMask | None = None) -> torch.Tensor:
        # the mask as a keyword: tensor parallelism's PrepareModuleInput lays out the positional inputs only
        x = x + self.attn(self.ln_1(x), mask=mask)
        return x + self.mlp(self.ln_2(x))


def init_gpt2_weights(module: nn.Module, n_layer: int) -> None:
    """GPT-2's initialisation of one module, for `model.apply`: N(0, 0.02) everywhere; projections into the residual
    stream (marked `residual`) scaled by 1/sqrt(2 * n_layer), as each block adds two of them (Radford et al. 2019,
    section 2.3; nanoGPT model.py).

    Example: gpt.apply(partial(init_gpt2_weights, n_layer=12))
    """
    if isinstance(module, nn.Linear):
        std = 0.02 / math.sqrt(2 * n_layer) if getattr(module, "residual", False) else 0.02
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def init_parameter(module: nn.Module, name: str, out: torch.Tensor, n_layer: int, generator: torch.Generator) -> None:
    """Fill `out`, the whole (unsharded) tensor of `module`'s parameter `name`, by the same rule as
    init_gpt2_weights (and Llama's, which is the same): matrices of linear maps and embeddings N(0, 0.02) (residual
    projections scaled by 1/sqrt(2 * n_layer)) drawn from `generator`, biases 0, norm gains 1. For a model built on
    the meta device (parallel.materialize), where every parameter is drawn from its own generator.

    Example:
        >>> w = torch.empty(4, 8); init_parameter(nn.Linear(8, 4), "weight", w, 12, torch.Generator().manual_seed(0))
    """
    if name == "weight" and isinstance(module, nn.Linear | nn.Embedding):
        std = 0.02 / math.sqrt(2 * n_layer) if getattr(module, "residual", False) else 0.02
        out.normal_(mean=0.0, std=std, generator=generator)
    elif name == "bias":
        out.zero_()
    else:  # LayerNorm and RMSNorm gains
        out.fill_(1.0)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.padded_vocab, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                # a ModuleDict keyed "0".. (same state-dict keys as a ModuleList) so that a pipeline stage that
                # drops layers keeps the others' names
                h=nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)}),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        # Weight tying (Press & Wolf 2017, as in GPT-2): one (V, C) matrix embeds tokens and scores them.
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        init_gpt2_weights(module, self.cfg.n_layer)

    def forward(
        self, idx: torch.Tensor, position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (B, T, V) of int64 tokens `idx` (B, T); positions default to 0..T-1. A pipeline stage without the
        embeddings (set to None) takes hidden states (B, T, C) instead, and one without the head returns them.

        With `cu_seqlens` (B, T + 1), the documents of each sample as the loaders give them (document_boundaries),
        attention stays within each document; give position_ids restarting per document with them (the loaders'
        position_ids then do)."""
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.cfg.block_size}")
        x = idx
        if self.transformer.wte is not None:
            if position_ids is None:
                position_ids = torch.arange(T, device=idx.device)  # (T,)
            x = self.transformer.wte(idx) + self.transformer.wpe(position_ids)  # (B, T, C)
            x = self.transformer.drop(x)
        mask = None if cu_seqlens is None else document_mask(cu_seqlens, cu_seqlens.shape[-1] - 1)  # once per forward
        for block in self.transformer.h.values():
            x = block(x, mask=mask)
        if self.transformer.ln_f is not None:
            x = self.transformer.ln_f(x)
        return self.lm_head(x) if self.lm_head is not None else x  # (B, T, V)

    def num_params(self, embeddings: bool = True) -> int:
        """Parameters (the tied matrix once); without the position embedding when embeddings=False, as in
        nanoGPT's count, which is the N of the 6N FLOPs per token estimate."""
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings else n - self.transformer.wpe.weight.numel()


def flops_per_token(cfg: GPTConfig, n_params: int, seq_length: int) -> int:
    """Training FLOPs per token: 6N for the matmuls forward and backward plus 12·L·T·C for attention scores
    (PaLM, Chowdhery et al. 2022, appendix B; nanoGPT estimate_mfu)."""
    return 6 * n_params + 12 * cfg.n_layer * seq_length * cfg.n_embd


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the positions where loss_mask is 1, computed in float32.

    logits (B, T, V), labels (B, T) int64, loss_mask (B, T) float32.
    """
    per_token = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), reduction="none")  # (B*T,)
    if hasattr(per_token, "full_tensor"):  # vocabulary-sharded logits under loss_parallel: the per-token losses
        per_token = per_token.full_tensor()  # are replicated already, so this is no communication
    mask = loss_mask.view(-1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
