"""export-hf: a trained run of either family loads with AutoModelForCausalLM and gives the trainer's logits."""

from __future__ import annotations

import pytest
import torch
import trainkit
from click.testing import CliRunner

from corpusforge.cli import main
from corpusforge.train import load_config, train
from corpusforge.train.checkpoint import latest_checkpoint, load_checkpoint
from corpusforge.train.optim import make_optimizer
from corpusforge.train.trainer import build_model, model_config

FAMILIES = {
    "gpt2": ['model.family="gpt2"', "model.bias=false"],  # no biases: the export writes GPT-2's as zeros
    "llama": ['model.family="llama"', "model.n_head=4", "model.n_kv_head=2", "model.ffn_hidden=64"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_model_gives_the_trainers_logits(corpus, tmp_path, family):
    from transformers import AutoModelForCausalLM

    base = trainkit.tiny_overrides(corpus, tmp_path / "run", n_layer=2, max_steps=3, eval_interval=0)
    args = [*base, *FAMILIES[family]]
    cfg = load_config(None, args)
    train(cfg, log=lambda line: None)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    result = CliRunner().invoke(main, ["export-hf", str(tmp_path / "run"), "--output", str(tmp_path / "hf"),
                                       "--tokenizer", str(tmp_path / "tok"), "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    model = build_model(model_config(cfg))
    load_checkpoint(latest_checkpoint(tmp_path / "run"), model, make_optimizer(model, cfg, torch.device("cpu")))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[family]
    x = torch.randint(0, 64, (2, 32))
    with torch.no_grad():
        ours, theirs = model.eval()(x), hf(x).logits
    assert ours.abs().max() > 0.1  # trained weights, not zeros
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)


def test_export_without_a_checkpoint_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["export-hf", str(tmp_path), "--output", str(tmp_path / "hf")])
    assert result.exit_code == 1 and "no complete checkpoint" in result.output
