"""Attention within documents (train/doc_attention.py) in GPT-2 and Llama: each document of a packed sample gets the
logits and loss it gets alone, and without boundaries the models are today's, bit for bit."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from corpusforge.data import GPTDataset, GPTDatasetConfig
from corpusforge.data.batch import reset_positions
from corpusforge.indexed import IndexedDataset, IndexedDatasetWriter
from corpusforge.train import llama as llama_module
from corpusforge.train import model as gpt_module
from corpusforge.train.doc_attention import attend, document_ids, document_mask
from corpusforge.train.llama import Llama, LlamaConfig
from corpusforge.train.model import GPT, GPTConfig, loss_fn

T = 32


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=100, block_size=T)).eval()


def llama() -> Llama:
    torch.manual_seed(0)
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, vocab_size=100, block_size=T,
                      rope_theta=10000.0)  # fmt: skip
    return Llama(cfg).eval()


def packed(lengths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens (B, T), position_ids (B, T) restarting per document, cu_seqlens (B, T + 1) padded with T, as the
    loaders give them, for documents of `lengths` per sample (an empty one included where asked)."""
    cu = np.full((len(lengths), T + 1), T, np.int32)
    for b, row in enumerate(lengths):
        assert sum(row) == T
        cu[b, : len(row) + 1] = np.cumsum([0, *row])
    positions = np.zeros((len(lengths), T), np.int32)
    reset_positions(cu, positions)
    tokens = torch.randint(1, 100, (len(lengths), T), generator=torch.Generator().manual_seed(1))
    return tokens, torch.from_numpy(positions).long(), torch.from_numpy(cu)


LENGTHS = [[5, 11, 1, 15], [7, 0, 25]]  # several documents, one of a single token, one empty piece


@pytest.mark.parametrize("make", [gpt, llama], ids=["gpt2", "llama-gqa"])
def test_each_document_as_if_alone(make):
    model = make()
    tokens, positions, cu = packed(LENGTHS)
    labels = torch.randint(0, 100, tokens.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(tokens, positions, cu_seqlens=cu)  # (B, T, V)
        plain = model(tokens, positions)
        for b, row in enumerate(LENGTHS):
            start = 0
            for n in row:
                if n:
                    alone = model(tokens[b : b + 1, start : start + n])  # positions 0..n-1 by default
                    torch.testing.assert_close(logits[b, start : start + n], alone[0], rtol=0, atol=1e-5)
                    ones = torch.ones(1, n)
                    packed_loss = loss_fn(
                        logits[b : b + 1, start : start + n], labels[b : b + 1, start : start + n], ones
                    )
                    alone_loss = loss_fn(alone, labels[b : b + 1, start : start + n], ones)
                    torch.testing.assert_close(packed_loss, alone_loss, rtol=0, atol=1e-5)
                start += n
    # the mask matters: a later document sees the earlier ones without it
    assert not torch.allclose(plain[0, 5:16], logits[0, 5:16], atol=1e-3)


def test_loader_samples_through_the_models(tmp_path):
    """The loader's own packed samples (document_boundaries): each document piece's logits are the piece's alone."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 12, size=40)
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
        w.add_documents(rng.integers(1, 100, size=int(lengths.sum())), lengths)
    config = GPTDatasetConfig(T, seed=2, eod_token_id=0, document_boundaries=True)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "d")), "train", (0, 40), 6, config)
    batch = {k: torch.from_numpy(v) for k, v in ds.get_batch(np.arange(4)).items()}
    tokens, positions, cu = batch["tokens"].long(), batch["position_ids"].long(), batch["cu_seqlens"]
    for model in (gpt(), llama()):
        with torch.no_grad():
            logits = model(tokens, positions, cu_seqlens=cu)
            for b in range(len(tokens)):
                bounds = cu[b].tolist()
                for lo, hi in zip(bounds[:-1], bounds[1:]):
                    if hi > lo:
                        alone = model(tokens[b : b + 1, lo:hi])
                        torch.testing.assert_close(logits[b, lo:hi], alone[0], rtol=0, atol=1e-5)


# -- without boundaries: today's models, bit for bit. The forwards below are copies of the attention as it was
# before document masks (commit 225ce00), put back by monkeypatch to compute the reference.


def _gpt_attention_before(self, x):
    B, T, _ = x.shape
    q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
    drop = self.dropout if self.training else 0.0
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
    y = y.transpose(1, 2).reshape(B, T, -1)
    return self.resid_dropout(self.c_proj(y))


def _gpt_block_before(self, x, mask=None):  # the models pass mask=None without boundaries
    assert mask is None
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


def _llama_attention_before(self, x, position_ids=None):
    B, T, _ = x.shape
    cos, sin = llama_module.rope_tables(self.inv_freq, position_ids, T, x.dtype)
    q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
    k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
    v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
    q, k = llama_module.apply_rope(q, cos, sin), llama_module.apply_rope(k, cos, sin)
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def _llama_block_before(self, x, position_ids=None, mask=None):
    assert mask is None
    x = x + self.dropout(self.attention(self.attention_norm(x), position_ids))
    return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


def _run(model, tokens, positions, train: bool):
    model.train(train)
    torch.manual_seed(7)  # dropout draws the same
    logits = model(tokens, positions)
    loss = logits.float().square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return logits.detach(), grads


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("train", [False, True])
def test_without_boundaries_bit_for_bit(monkeypatch, name, train):
    torch.manual_seed(0)
    if name == "gpt2":
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=100, block_size=T, dropout=0.1 * train))
    else:
        model = llama()  # no dropout: 0 in Llama's pretraining
    tokens, positions, _ = packed(LENGTHS)
    now = _run(model, tokens, positions, train)
    if name == "gpt2":
        monkeypatch.setattr(gpt_module.CausalSelfAttention, "forward", _gpt_attention_before)
        monkeypatch.setattr(gpt_module.Block, "forward", _gpt_block_before)
    else:
        monkeypatch.setattr(llama_module.Attention, "forward", _llama_attention_before)
        monkeypatch.setattr(llama_module.Block, "forward", _llama_block_before)
    before = _run(model, tokens, positions, train)
    assert torch.equal(now[0], before[0])
    assert all(torch.equal(a, b) for a, b in zip(now[1], before[1]))


def test_document_ids_and_mask():
    cu = torch.tensor([[0, 2, 2, 5, 6, 6, 6]], dtype=torch.int32)
    assert document_ids(cu, 6).tolist() == [[0, 0, 2, 2, 2, 3]]
    dense = document_mask(cu, 6).dense[0, 0]
    assert dense[4].tolist() == [False, False, True, True, True, False]
    assert dense[5].tolist() == [False] * 5 + [True]


def test_flex_attention_equals_the_dense_mask():
    """The CUDA path's kernel (flex attention with the block mask), run eagerly on CPU, gives the dense path's
    output: the block mask says what the dense mask says."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    _, _, cu = packed(LENGTHS)
    q, k, v = (torch.randn(2, 4, T, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    dense = attend(q, k, v, document_mask(cu, T, use_flex=False))
    with warnings.catch_warnings():  # flex attention warns that it runs uncompiled
        warnings.simplefilter("ignore")
        flex = attend(q, k, v, document_mask(cu, T, use_flex=True))
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_flex_on_gpu_equals_each_document_alone():
    model = llama().cuda()
    tokens, positions, cu = (t.cuda() for t in packed(LENGTHS))
    with torch.no_grad():
        logits = model(tokens, positions, cu_seqlens=cu)
        start = 0
        for n in LENGTHS[0]:
            if n:
                alone = model(tokens[:1, start : start + n])
                torch.testing.assert_close(logits[0, start : start + n], alone[0], rtol=0, atol=1e-4)
            start += n
