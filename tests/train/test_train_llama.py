"""The Llama-3-style model: published parameter counts, shapes, causality, GQA and RoPE against transformers."""

from __future__ import annotations

import pytest
import torch

from corpusforge.train.llama import Llama, LlamaConfig, llama_ffn_hidden


def tiny(**kw) -> LlamaConfig:
    base = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=160, vocab_size=300, block_size=32)
    return LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "shape, params",
    [
        # (n_layer, n_head, n_kv_head, n_embd, ffn_hidden, tied): parameter counts of the published checkpoints
        ((16, 32, 8, 2048, 8192, True), 1_235_814_400),  # Llama 3.2 1B
        ((28, 24, 8, 3072, 8192, True), 3_212_749_824),  # Llama 3.2 3B
        ((32, 32, 8, 4096, 14336, False), 8_030_261_248),  # Llama 3.1 8B
        ((80, 64, 8, 8192, 28672, False), 70_553_706_496),  # Llama 3.1 70B
    ],
)
def test_published_parameter_counts(shape, params):
    n_layer, n_head, n_kv, n_embd, ffn, tied = shape
    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layer, n_head, n_kv, n_embd, ffn, 128256, 8192, tie_embeddings=tied))
    assert model.num_params() == params


def test_ffn_hidden_rule_gives_the_published_widths():
    assert llama_ffn_hidden(4096, 1.3, 1024) == 14336  # 8B
    assert llama_ffn_hidden(8192, 1.3, 4096) == 28672  # 70B
    assert llama_ffn_hidden(2048, 1.5, 256) == 8192  # 3.2 1B


def test_shapes_tying_and_causality():
    torch.manual_seed(0)
    model = Llama(tiny()).eval()
    assert model.tok_embeddings.weight.shape == (384, 64)  # padded to a multiple of 128
    assert model.layers["0"].attention.wk.weight.shape == (2 * 16, 64)  # n_kv_head x head_dim rows
    assert model.output.weight is not model.tok_embeddings.weight
    tied = Llama(tiny(tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    x = torch.randint(0, 300, (2, 32))
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 1) % 300
    a, b = model(x), model(y)
    assert a.shape == (2, 32, 384)
    assert torch.equal(a[:, :20], b[:, :20])  # positions before a change do not see it
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def reference_gqa(model: Llama, x: torch.Tensor) -> torch.Tensor:
    """The first layer's attention written out by hand: every query head h reads key/value head h // groups."""
    attn, cfg = model.layers["0"].attention, model.cfg
    B, T, C = x.shape
    hs, groups = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    q = (x @ attn.wq.weight.T).view(B, T, cfg.n_head, hs)
    k = (x @ attn.wk.weight.T).view(B, T, cfg.n_kv_head, hs)
    v = (x @ attn.wv.weight.T).view(B, T, cfg.n_kv_head, hs)
    pos = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)  # (T, hs)
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]  # (T, 1, hs)

    def rot(t):
        a, b = t[..., : hs // 2], t[..., hs // 2 :]
        return t * cos + torch.cat([-b, a], dim=-1) * sin

    q, k = rot(q), rot(k)
    out = torch.empty(B, T, cfg.n_head, hs)
    causal = torch.ones(T, T).tril().bool()
    for h in range(cfg.n_head):
        scores = (q[:, :, h] @ k[:, :, h // groups].transpose(1, 2)) / hs**0.5  # (B, T, T)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[:, :, h] = weights @ v[:, :, h // groups]
    return out.reshape(B, T, C) @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_gqa_attention_equals_a_written_out_reference(n_kv_head):
    torch.manual_seed(0)
    model = Llama(tiny(n_kv_head=n_kv_head, rope_theta=10000.0)).eval()
    x = torch.randn(2, 32, 64)
    got = model.layers["0"].attention(x)
    assert torch.allclose(got, reference_gqa(model, x), atol=1e-5)


@pytest.mark.parametrize("rope_scaling", [0.0, 8.0])
def test_logits_equal_transformers_llama(rope_scaling):
    """The same weights in transformers' LlamaForCausalLM give the same logits (and so export-hf is a renaming)."""
    from corpusforge.train.export_hf import to_hf

    torch.manual_seed(0)
    # original context 8 < 32 tokens: the long-context frequency scaling is exercised, not only stored
    model = Llama(tiny(rope_scaling=rope_scaling, rope_original_context=8)).eval()
    hf = to_hf(model)
    x = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert torch.allclose(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)
