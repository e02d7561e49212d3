"""A RETRO decoder (Borgeaud et al. 2021, "Improving language models by retrieving from trillions of tokens"), small
enough to read top to bottom, built from the GPT-2 blocks of model.py.

The sequence is cut into L chunks of m tokens (m = chunk_length, 64). Every chunk u has K retrieved neighbours of
R tokens each (R = 2m: the neighbour chunk and its continuation in its document, sec. 2.3). The model is

    decoder   the GPT-2 decoder of model.py; at the RETRO layers P (below) a chunked cross-attention (CCA) sits
              between self-attention and the MLP: x += attn(ln_1 x); x += CCA(ln_x x, E); x += mlp(ln_2 x)
    encoder   2 bidirectional layers over each neighbour's R tokens (embedded with the decoder's own token and
              position embeddings); the first one also cross-attends to the activations H_u of the chunk that
              retrieved it, taken at the first RETRO layer (ln_x of its input): E = Encoder(neighbours, H)
    CCA       token i of chunk u attends to the K*R encoded tokens of the neighbours of chunk u', where the attending
              window is shifted by m - 1: the last token of chunk u is the first to see chunk u's neighbours, which
              were retrieved with chunk u's own tokens, so no token sees neighbours of text after it (sec. 2.4).
              Tokens 0..m-2 attend to nothing.

Details follow Megatron-Core's RETRO (megatron/core/models/retro/, removed in Megatron-LM fc6969f, January 2026):
RETRO layers at 1-based layers 6, 9, 12, ... for 15 layers or fewer, else 9, 12, 15, ... (decoder_spec.py,
`retro_layer_start = 6 if num_layers <= 15 else 9`); only the first encoder layer cross-attends (encoder_spec.py);
the encoder is built inside the first RETRO layer and its output is reused by the later ones (decoder_attention.py);
neighbours share the decoder's embedding module, positions included (model.py). Four choices differ: a missing
neighbour (-1 in the neighbours file) is masked wherever it would be read (Megatron has no mask: a -1 read as a
chunk id); the encoder ends with a LayerNorm (Megatron's encoder block had none: post_process=False); it starts with
one on the embedded neighbours; and it trains at a tenth of the decoder's learning rate (encoder_lr_scale). Without
the last two, a small model trained from scratch never learnt to use its neighbours: the encoder's output collapsed
to one vector whatever the neighbour within ~50 steps, and the loss with real neighbours equalled the loss with
random ones (benchmarks/retro_effect.py, 2026-11-25; the copy test in tests/train/test_retro_model.py).

Missing neighbours: `neighbour_mask` (B, L, K, R) says which neighbour tokens are real (False for a -1 neighbour and
for the padding after a document's end). Masked tokens are never keys of any attention, so their ids cannot change
a logit. A chunk whose K neighbours are all missing gets no CCA output at all (zero, not the projection's bias):
its tokens are computed as if the layer had no cross-attention, and a batch whose neighbours are all missing gives
the logits of `neighbours=None` (retrieval off).

Shapes: B batch, T = L*m sequence, C = n_embd, Ce = encoder width, K neighbours, R = retrieved tokens per neighbour,
N = B*L*K neighbours in a batch, nh heads, hs = head size, V padded vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from corpusforge.configs import ConfigError
from corpusforge.train.model import MLP, Block, GPTConfig, init_gpt2_weights, pad_vocab


def retro_layer_numbers(n_layer: int) -> tuple[int, ...]:
    """0-based indices of the decoder layers with chunked cross-attention, as Megatron placed them: 1-based layers
    6, 9, 12, ... up to n_layer when n_layer <= 15, else from 9 (get_retro_decoder_block_spec). Below 6 layers
    Megatron has none (it fails); here that is an error naming the fix.

    Example:
        >>> retro_layer_numbers(12), retro_layer_numbers(16)
        ((5, 8, 11), (8, 11, 14))
    """
    start = 6 if n_layer <= 15 else 9
    layers = tuple(n - 1 for n in range(start, n_layer + 1, 3))
    if not layers:
        raise ConfigError(
            f"a RETRO decoder of {n_layer} layers has no layer for chunked cross-attention (Megatron's rule starts at "
            f"layer 6); use n_layer >= 6 or list the layers in cca_layers"
        )
    return layers


@dataclass(frozen=True)
class RetroConfig:
    """The shape of a RETRO model: a GPT-2 decoder, a retrieval encoder, and where they meet.

    Example:
        >>> cfg = RetroConfig(n_layer=6, n_head=4, n_embd=128, vocab_size=1000, block_size=256)
        >>> cfg.cca_layer_indices, cfg.retrieved_length
        ((5,), 128)
    """

    n_layer: int
    """Decoder layers."""

    n_head: int
    """Decoder attention heads (n_embd / n_head is the head size)."""

    n_embd: int
    """Decoder width C."""

    vocab_size: int
    """The tokenizer's vocabulary; the embedding holds it padded to a multiple of 128 (model.pad_vocab)."""

    block_size: int
    """Longest decoder sequence (learned positions); at least retrieved_length, as neighbours use the same table."""

    chunk_length: int = 64
    """Tokens per chunk m: the unit of retrieval and of chunked cross-attention (RETRO sec. 2.3: 64). Must be the
    chunk length the retrieval database was built with."""

    num_neighbours: int = 2
    """Neighbours K per chunk (RETRO trains with K = 2; Megatron's retro_num_neighbors)."""

    retrieved_chunks: int = 2
    """Chunks per neighbour: the neighbour and its continuation (Megatron's retro_num_retrieved_chunks)."""

    encoder_layers: int = 2
    """Retrieval encoder layers; the first cross-attends to the decoder's chunk activations (Megatron: 2)."""

    encoder_n_embd: int | None = None
    """Encoder width Ce; None: the decoder's (as Megatron). The paper uses 896 for every model size."""

    encoder_n_head: int | None = None
    """Encoder heads; None: the decoder's head size at the encoder's width."""

    encoder_lr_scale: float = 0.1
    """The encoder's learning rate as a fraction of the decoder's (RetroModel.lr_scales; the optimizer keeps one
    group per scale). At the start the CCA attends uniformly, so the only gradient the encoder gets is the same for
    every neighbour token; at the decoder's rate its weights follow that signal and its output stopped depending on
    the neighbour (tests/train/test_retro_model.py, the copy test) before the CCA learnt where to look. 1.0: one
    rate for all."""

    cca_layers: tuple[int, ...] | None = None
    """0-based decoder layers with chunked cross-attention; None: Megatron's rule (retro_layer_numbers)."""

    dropout: float = 0.0
    """Dropout on attention weights and residual branches, decoder and encoder."""

    bias: bool = True
    """Biases in linear layers and LayerNorms (GPT-2 has them)."""

    @property
    def retrieved_length(self) -> int:
        """R: tokens per neighbour (neighbour + continuation)."""
        return self.retrieved_chunks * self.chunk_length

    @property
    def padded_vocab(self) -> int:
        return pad_vocab(self.vocab_size)

    @property
    def cca_layer_indices(self) -> tuple[int, ...]:
        return tuple(self.cca_layers) if self.cca_layers is not None else retro_layer_numbers(self.n_layer)

    @property
    def enc_embd(self) -> int:
        return self.encoder_n_embd or self.n_embd

    @property
    def enc_head(self) -> int:
        return self.encoder_n_head or max(1, self.enc_embd // (self.n_embd // self.n_head))

    def decoder(self) -> GPTConfig:
        """The decoder's GPT-2 shape (what the model.py blocks take)."""
        return GPTConfig(self.n_layer, self.n_head, self.n_embd, self.vocab_size, self.block_size,
                         self.dropout, self.bias)  # fmt: skip

    def encoder(self) -> GPTConfig:
        """The encoder's shape as a GPTConfig (for model.py's MLP)."""
        return GPTConfig(self.encoder_layers, self.enc_head, self.enc_embd, self.vocab_size, self.block_size,
                         self.dropout, self.bias)  # fmt: skip

    def __post_init__(self) -> None:
        problems = []
        if self.n_embd % self.n_head or self.enc_embd % self.enc_head:
            problems.append(f"n_embd {self.n_embd} / n_head {self.n_head} and the encoder's must divide evenly")
        if self.block_size % self.chunk_length:
            problems.append(f"block_size {self.block_size} is not a multiple of chunk_length {self.chunk_length}")
        if self.retrieved_length > self.block_size:
            problems.append(f"block_size {self.block_size} is shorter than a neighbour ({self.retrieved_length})")
        if self.encoder_layers < 1 or self.num_neighbours < 1 or self.retrieved_chunks < 1:
            problems.append("encoder_layers, num_neighbours and retrieved_chunks must be >= 1")
        if not 0.0 < self.encoder_lr_scale <= 1.0:
            problems.append(f"encoder_lr_scale {self.encoder_lr_scale} must be in (0, 1]")
        if problems:
            raise ConfigError("RETRO model: " + "; ".join(problems))
        layers = self.cca_layer_indices  # raises for a decoder too shallow for Megatron's rule
        if not layers or any(not 0 <= i < self.n_layer for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"cca_layers {layers} must be distinct layer indices in [0, {self.n_layer})")


# Presets. The decoders of the paper's two smallest models (Borgeaud et al. 2021, Table 2: d, d_ffw = 4d, heads,
# layers; 132M and 368M baselines, 172M and 425M with retrieval), all with the paper's encoder of width 896 and 2
# layers. Table 2 gives the 172M model 16 heads of size 64 at d = 896 (an attention width of 1024); here the
# attention width is d, so it has 14 heads of 64. The tiny one has every part of the model (6 layers: one RETRO
# layer by Megatron's rule) at a width a CPU trains.
RETRO_PRESETS: dict[str, dict] = {
    "retro-tiny-cpu": dict(n_layer=6, n_head=4, n_embd=128, encoder_n_embd=128),
    "retro-172m": dict(n_layer=12, n_head=14, n_embd=896, encoder_n_embd=896, encoder_n_head=14),
    "retro-425m": dict(n_layer=12, n_head=12, n_embd=1536, encoder_n_embd=896, encoder_n_head=14),
}


def retro_preset(name: str, vocab_size: int, block_size: int = 2048, **overrides) -> RetroConfig:
    """The RetroConfig of preset `name` for a tokenizer's vocabulary and a sequence length.

    Example:
        >>> retro_preset("retro-172m", 50257).cca_layer_indices
        (5, 8, 11)
    """
    if name not in RETRO_PRESETS:
        raise ConfigError(f"unknown RETRO preset {name!r}; choose one of {', '.join(RETRO_PRESETS)}")
    return RetroConfig(**{**RETRO_PRESETS[name], "vocab_size": vocab_size, "block_size": block_size, **overrides})


class Attention(nn.Module):
    """Multi-head attention of queries from `x` (width Cq) to keys and values from `context` (width Ckv; `x` itself
    when None), without a causal mask: the encoder's self-attention and both cross-attentions. `key_mask`
    (N, Tk) bool says which keys may be attended; a row without any must not be passed (its softmax is 0/0)."""

    def __init__(self, q_dim: int, kv_dim: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.head_dim, self.dropout = q_dim // n_head, dropout
        self.q_proj = nn.Linear(q_dim, q_dim, bias=bias)
        self.k_proj = nn.Linear(kv_dim, q_dim, bias=bias)
        self.v_proj = nn.Linear(kv_dim, q_dim, bias=bias)
        self.c_proj = nn.Linear(q_dim, q_dim, bias=bias)
        self.c_proj.residual = True  # scaled at init, see RetroModel._init_weights
        self.resid_dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None = None, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        context = x if context is None else context
        N, Tq, _ = x.shape
        Tk = context.shape[1]
        q = self.q_proj(x).view(N, Tq, -1, self.head_dim).transpose(1, 2)  # (N, nh, Tq, hs)
        k = self.k_proj(context).view(N, Tk, -1, self.head_dim).transpose(1, 2)  # (N, nh, Tk, hs)
        v = self.v_proj(context).view(N, Tk, -1, self.head_dim).transpose(1, 2)  # (N, nh, Tk, hs)
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (N, 1, 1, Tk), True = attend
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)  # (N, nh, Tq, hs)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(N, Tq, -1)))  # (N, Tq, Cq)


class EncoderLayer(nn.Module):
    """A bidirectional pre-LayerNorm layer over each neighbour's R tokens; with `cross`, it also attends to the
    activations of the chunk that retrieved the neighbour (RetroEncoderCrossAttention)."""

    def __init__(self, cfg: RetroConfig, cross: bool) -> None:
        super().__init__()
        enc, d, nh = cfg.encoder(), cfg.enc_embd, cfg.enc_head
        self.ln_1 = nn.LayerNorm(d, bias=cfg.bias)
        self.attn = Attention(d, d, nh, cfg.dropout, cfg.bias)
        self.ln_x = nn.LayerNorm(d, bias=cfg.bias) if cross else None
        self.cross = Attention(d, cfg.n_embd, nh, cfg.dropout, cfg.bias) if cross else None
        self.ln_2 = nn.LayerNorm(d, bias=cfg.bias)
        self.mlp = MLP(enc)

    def forward(self, x: torch.Tensor, self_mask: torch.Tensor, chunks: torch.Tensor | None) -> torch.Tensor:
        # x (B*L, K*R, Ce): the K neighbours of one chunk side by side. Self-attention stays inside each neighbour,
        # so it runs on (N, R, Ce); the cross-attention has no mask, and every query of the K neighbours attends
        # to the same m chunk tokens, so it runs once per chunk on (B*L, K*R, Ce) against chunks (B*L, m, C).
        BL, KR, d = x.shape
        n = self_mask.shape[0]  # N = B*L*K
        x = x + self.attn(self.ln_1(x).view(n, -1, d), key_mask=self_mask).view(BL, KR, d)
        if self.cross is not None:
            x = x + self.cross(self.ln_x(x), context=chunks)
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    """The retrieval encoder: E = Encoder(neighbour embeddings, chunk activations H)."""

    def __init__(self, cfg: RetroConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Neighbours are embedded by the decoder's table (width C), whose entries are N(0, 0.02): normalised first,
        # so that the token identities the CCA must tell apart start at unit scale in the encoder's residual stream
        # (at 0.02 the first few updates of the encoder's biases and weights, the same for every token, outweighed
        # them; the encoder's output became one vector whatever the neighbour). A narrower encoder reads them through
        # a projection (the paper's 896-wide encoder under wider decoders).
        self.ln_in = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.proj_in = nn.Linear(cfg.n_embd, cfg.enc_embd, bias=False) if cfg.enc_embd != cfg.n_embd else None
        self.h = nn.ModuleDict({str(i): EncoderLayer(cfg, cross=i == 0) for i in range(cfg.encoder_layers)})
        self.ln_f = nn.LayerNorm(cfg.enc_embd, bias=cfg.bias)

    def forward(self, emb: torch.Tensor, mask: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """emb (B*L, K*R, C) embedded neighbours, mask (B*L, K*R) real tokens, chunks (B*L, m, C) -> (B*L, K*R, Ce)."""
        R = self.cfg.retrieved_length
        x = self.ln_in(emb)
        x = x if self.proj_in is None else self.proj_in(x)  # (B*L, K*R, Ce)
        self_mask = mask.reshape(-1, R)  # (N, R)
        # A missing neighbour has no real token to attend to; let it attend to all of its (pad) tokens so that
        # its softmax stays finite. Nothing reads its outputs: they are masked keys of the CCA.
        self_mask = self_mask | ~self_mask.any(-1, keepdim=True)
        for layer in self.h.values():
            x = layer(x, self_mask, chunks)
        return self.ln_f(x)


class ChunkedCrossAttention(nn.Module):
    """RETRO's CCA: each chunk's tokens, shifted by m - 1, attend to the encoded neighbours of their chunk."""

    def __init__(self, cfg: RetroConfig) -> None:
        super().__init__()
        self.m = cfg.chunk_length
        self.attn = Attention(cfg.n_embd, cfg.enc_embd, cfg.n_head, cfg.dropout, cfg.bias)

    def forward(
        self, h: torch.Tensor, enc: torch.Tensor, key_mask: torch.Tensor, any_key: torch.Tensor
    ) -> torch.Tensor:
        """h (B, T, C) normed hidden states, enc (B*L, K*R, Ce), key_mask (B*L, K*R), any_key (B*L,) -> (B, T, C)."""
        B, T, C = h.shape
        m = self.m
        # Token t attends to the neighbours of chunk (t + 1) // m - 1: the window of chunk u starts at its last
        # token, u*m + m - 1 (Megatron: attending_chunks = hidden_states[pad:], pad = (ns - 1) % m). The last
        # window runs m - 1 positions past the end; they are zeros and their outputs are dropped below.
        q = F.pad(h[:, m - 1 :], (0, 0, 0, m - 1))  # (B, T, C), position t holds token t + m - 1
        y = self.attn(q.reshape(-1, m, C), context=enc, key_mask=key_mask)  # (B*L, m, C)
        y = y * any_key[:, None, None]  # a chunk without neighbours adds exactly nothing
        # Back to token positions: window position t is token t + m - 1; tokens 0..m-2 get zeros.
        return F.pad(y.reshape(B, T, C), (0, 0, m - 1, 0))[:, :T]  # (B, T, C)


class RetroBlock(Block):
    """A decoder layer with chunked cross-attention between self-attention and the MLP. Its ln_1/attn/ln_2/mlp are
    model.py's Block, state-dict names included, so a GPT checkpoint loads into a RETRO decoder ("RETROfitting",
    sec. 4.4) with only ln_x, cca and the encoder left to train."""

    def __init__(self, cfg: RetroConfig) -> None:
        super().__init__(cfg.decoder())
        self.ln_x = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.cca = ChunkedCrossAttention(cfg)

    def forward(self, x: torch.Tensor, retrieval: Retrieval | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        if retrieval is not None:
            h = self.ln_x(x)  # (B, T, C)
            enc = retrieval.encode(h)  # (B*L, K*R, Ce): run at the first RETRO layer, reused by the others
            x = x + self.cca(h, enc, retrieval.key_mask, retrieval.any_key)
        return x + self.mlp(self.ln_2(x))


class Retrieval:
    """A batch's neighbours on their way through the decoder: embedded once, encoded at the first RETRO layer with
    that layer's chunk activations, then reused. A plain object, not a dataclass: FSDP2 rebuilds dataclass
    arguments of a sharded block's forward (to cast their tensors), which would drop the cache of the encoding."""

    def __init__(self, encoder: Encoder, emb: torch.Tensor, mask: torch.Tensor, chunk_length: int) -> None:
        self.encoder = encoder
        self.emb = emb  # (B*L, K*R, C)
        self.mask = mask  # (B*L, K*R) bool, True for real tokens
        self.chunk_length = chunk_length
        self.encoded: torch.Tensor | None = None
        self.any_key = self.mask.any(-1)  # (B*L,): chunks with at least one real neighbour token
        # A chunk without neighbours attends to all of its (pad) keys to keep its softmax finite; its output is
        # multiplied by any_key = 0 (ChunkedCrossAttention), so none of those keys reaches a logit.
        self.key_mask = self.mask | ~self.any_key[:, None]

    def encode(self, h: torch.Tensor) -> torch.Tensor:
        if self.encoded is None:
            chunks = h.reshape(-1, self.chunk_length, h.shape[-1])  # (B*L, m, C): H_u, unshifted
            self.encoded = self.encoder(self.emb, self.mask, chunks)
        return self.encoded


class RetroModel(nn.Module):
    """The RETRO decoder with its retrieval encoder. State-dict names follow model.GPT (transformer.wte, .wpe,
    .h.{i}, .ln_f, lm_head), with transformer.h.{i}.ln_x/.cca at the RETRO layers and encoder.*.

    Example:
        >>> model = RetroModel(retro_preset("retro-tiny-cpu", vocab_size=1000, block_size=256))
        >>> tokens = torch.randint(0, 1000, (2, 256))
        >>> neighbours = torch.randint(0, 1000, (2, 4, 2, 128))  # (B, L, K, R)
        >>> model(tokens, neighbours, neighbours >= 0).shape
        torch.Size([2, 256, 1024])
    """

    def __init__(self, cfg: RetroConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dec, cca = cfg.decoder(), set(cfg.cca_layer_indices)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.padded_vocab, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleDict({str(i): RetroBlock(cfg) if i in cca else Block(dec) for i in range(cfg.n_layer)}),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.encoder = Encoder(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as model.GPT
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2's scheme (model.GPT._init_weights): N(0, 0.02), projections into a residual stream scaled by
        # 1/sqrt(2 * layers). The decoder's depth is used for the encoder too: its outputs enter the decoder.
        init_gpt2_weights(module, self.cfg.n_layer)

    def forward(
        self,
        idx: torch.Tensor,
        neighbours: torch.Tensor | None = None,
        neighbour_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) of tokens `idx` (B, T) given neighbour tokens (B, L, K, R) and which of them are real
        (B, L, K, R) bool; T must be L * chunk_length. neighbours=None runs the decoder without retrieval (every
        CCA skipped), which is also what a batch whose neighbours are all missing computes."""
        cfg, T = self.cfg, idx.shape[1]
        if T > cfg.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {cfg.block_size}")
        wte, wpe = self.transformer.wte, self.transformer.wpe
        if position_ids is None:
            position_ids = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.drop(wte(idx) + wpe(position_ids))  # (B, T, C)
        retrieval = None
        if neighbours is not None:
            retrieval = self._retrieval(neighbours, neighbour_mask, T)
        for block in self.transformer.h.values():
            x = block(x, retrieval) if isinstance(block, RetroBlock) else block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)

    def _retrieval(self, neighbours: torch.Tensor, mask: torch.Tensor | None, T: int) -> Retrieval:
        cfg = self.cfg
        B, L, K, R = neighbours.shape
        if L * cfg.chunk_length != T or R != cfg.retrieved_length or K != cfg.num_neighbours:
            raise ValueError(
                f"neighbours of shape {tuple(neighbours.shape)} do not fit a sequence of {T} tokens: expected "
                f"(B, {T // cfg.chunk_length}, {cfg.num_neighbours}, {cfg.retrieved_length})"
            )
        mask = neighbours >= 0 if mask is None else mask.bool()
        ids = neighbours.clamp(min=0)  # masked tokens are never read, but must still be valid rows of the table
        pos = torch.arange(R, device=neighbours.device)
        emb = self.transformer.wte(ids) + self.transformer.wpe(pos)  # (B, L, K, R, C): the decoder's embedding
        emb = self.transformer.drop(emb).view(B * L, K * R, cfg.n_embd)
        return Retrieval(self.encoder, emb, mask.reshape(B * L, K * R), cfg.chunk_length)

    def lr_scales(self) -> dict[str, float]:
        """Learning-rate multipliers by parameter-name prefix, for corpusforge.train.optim.make_optimizer: the
        encoder trains at encoder_lr_scale of the decoder's rate (see RetroConfig.encoder_lr_scale).

        Example:
            >>> RetroModel(retro_preset("retro-tiny-cpu", 1000, 256)).lr_scales()
            {'encoder.': 0.1}
        """
        return {"encoder.": self.cfg.encoder_lr_scale}

    def num_params(self, embeddings: bool = True) -> int:
        """Parameters (the tied matrix once); without the position embedding when embeddings=False (model.GPT)."""
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings else n - self.transformer.wpe.weight.numel()


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _attention_params(q_dim: int, kv_dim: int, bias: bool) -> tuple[int, int]:
    """(parameters applied per query token: q and output projections, per key token: k and v projections)."""
    return 2 * _linear(q_dim, q_dim, bias), 2 * _linear(kv_dim, q_dim, bias)


def flops_per_token(cfg: RetroConfig, seq_length: int) -> int:
    """Training FLOPs per decoder token (forward and backward: 6 per weight a token passes through, plus 12 per
    query-key pair and width for attention, as model.flops_per_token / PaLM appendix B), counting the encoder and
    the cross-attentions. Each decoder token carries K*R/m neighbour tokens through the encoder (4 at K = 2,
    R = 128, m = 64), which is where most of RETRO's extra compute goes. LayerNorms and softmax are left out.

    Example:
        >>> flops_per_token(retro_preset("retro-tiny-cpu", 1000, 256), 256)
        24098304
    """
    C, Ce, m, bias = cfg.n_embd, cfg.enc_embd, cfg.chunk_length, cfg.bias
    K, R = cfg.num_neighbours, cfg.retrieved_length
    n_cca = len(cfg.cca_layer_indices)
    nb_per_token = K * R / m  # neighbour tokens encoded per decoder token
    block = sum(_attention_params(C, C, bias)) + _linear(C, 4 * C, bias) + _linear(4 * C, C, bias)
    decoder = cfg.n_layer * block + cfg.padded_vocab * C  # + the tied head
    cca_q, cca_kv = _attention_params(C, Ce, bias)
    enc_block = sum(_attention_params(Ce, Ce, bias)) + _linear(Ce, 4 * Ce, bias) + _linear(4 * Ce, Ce, bias)
    enc_x_q, enc_x_kv = _attention_params(Ce, C, bias)
    encoder_per_nb = cfg.encoder_layers * enc_block + enc_x_q + (C * Ce if Ce != C else 0)  # + proj_in
    # the encoder's cross-attention projects each chunk token once for all K neighbours: per decoder token, once
    weight_passes = decoder + n_cca * (cca_q + nb_per_token * cca_kv) + nb_per_token * encoder_per_nb + enc_x_kv
    attention = (
        cfg.n_layer * seq_length * C  # decoder self-attention (causal, counted whole as PaLM does)
        + n_cca * K * R * C  # CCA: every token attends to K*R neighbour tokens
        + nb_per_token * (cfg.encoder_layers * R * Ce + m * Ce)  # encoder: within a neighbour, and to its chunk
    )
    return int(round(6 * weight_passes + 12 * attention))
