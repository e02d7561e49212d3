"""The GPT model: GPT-2 shapes and parameter counts, initialisation, weight tying, padded vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from corpusforge.train.model import GPT, GPTConfig, loss_fn, pad_vocab


def test_pad_vocab():
    assert (pad_vocab(50257), pad_vocab(100277), pad_vocab(128)) == (50304, 100352, 128)


def test_gpt2_124m_parameter_count():
    # nanoGPT: GPT-2 124M with the padded 50304 vocabulary has 124,475,904 parameters (wte tied with the head).
    with torch.device("meta"):
        model = GPT(GPTConfig(12, 12, 768, 50257, 1024))
    assert model.num_params() == 124_475_904
    assert model.num_params(embeddings=False) == 124_475_904 - 1024 * 768


@pytest.mark.parametrize("shape, millions", [((24, 16, 1024), 355), ((36, 20, 1280), 774), ((48, 25, 1600), 1558)])
def test_gpt2_family_sizes(shape, millions):
    with torch.device("meta"):
        model = GPT(GPTConfig(*shape, 50257, 1024))
    assert model.num_params() / 1e6 == pytest.approx(millions, rel=0.01)


def test_init_weight_tying_and_shapes():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=8, n_head=4, n_embd=128, vocab_size=1000, block_size=64)
    model = GPT(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wte.weight.shape == (1024, 128)  # padded to a multiple of 128
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h.values()])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in model.transformer.h.values()])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert fc.std().item() == pytest.approx(0.02, rel=0.05)
    logits = model(torch.randint(0, 1000, (2, 64)))
    assert logits.shape == (2, 64, 1024)
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_loss_mask_and_causality():
    torch.manual_seed(0)
    model = GPT(GPTConfig(2, 2, 32, 100, 16)).eval()
    x = torch.randint(0, 100, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 100
    a, b = model(x), model(y)
    assert torch.equal(a[0, :10], b[0, :10])  # positions before a change do not see it
    logits, labels = torch.randn(2, 4, 8), torch.randint(0, 8, (2, 4))
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0]])
    full = torch.nn.functional.cross_entropy(logits.view(-1, 8), labels.view(-1), reduction="none").view(2, 4)
    assert loss_fn(logits, labels, mask).item() == pytest.approx((full[0, 0] + full[0, 1] + full[1, 0]).item() / 3)
