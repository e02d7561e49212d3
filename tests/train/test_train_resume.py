"""Exact resume: a run stopped at step k and resumed gives the losses of the uninterrupted run, step for step."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import trainkit

from corpusforge.train import CheckpointError, load_config, train
from corpusforge.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from corpusforge.train.config import new_key
from corpusforge.train.metrics import read_metrics


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


def run(corpus, out_dir, *extra: str):
    overrides = trainkit.tiny_overrides(
        corpus, out_dir, max_steps=12, checkpoint_interval=4, eval_interval=4, dropout=0.1
    )
    sections = [f"{new_key(k)}={v}" for k, v in (e.split("=", 1) for e in extra)]  # flat names, as sections
    return train(load_config(None, [*overrides, *sections]), log=lambda line: None)


def series(out_dir, kind="train", key="loss"):
    return {r["step"]: r[key] for r in read_metrics(out_dir / "metrics.jsonl", kind)}


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_resume_gives_the_same_losses_step_for_step(corpus, tmp_path, workers):
    whole, split = tmp_path / "whole", tmp_path / "split"
    run(corpus, whole, f"num_workers={workers}")
    first = run(corpus, split, f"num_workers={workers}", "stop_at_step=6")  # stops mid-schedule, saves step 6
    assert first["last_step"] == 6 and latest_checkpoint(split).name == "step_00000006"
    second = run(corpus, split, f"num_workers={workers}")  # resume="auto" finds step 6
    assert second["first_step"] == 7 and second["last_step"] == 12
    a, b = series(whole), series(split)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert [a[s] for s in a] == [b[s] for s in a]  # exactly equal floats, not approximately
    assert series(whole, "train", "grad_norm") == series(split, "train", "grad_norm")
    val_a, val_b = series(whole, "valid", "val_loss"), series(split, "valid", "val_loss")
    assert sorted(val_b) == [4, 6, 8, 12]  # the stopped run also evaluated at its last step
    assert all(val_a[s] == val_b[s] for s in val_a)
    assert a[12] < a[1]
    assert [p.name for p in list_checkpoints(split)] == ["step_00000008", "step_00000012"]  # keep_checkpoints=2


def test_resume_never_starts_over(corpus, tmp_path):
    run(corpus, tmp_path, "stop_at_step=4")
    again = run(corpus, tmp_path, "stop_at_step=4", "resume=never")
    assert again["first_step"] == 1


def test_bfloat16_autocast_on_cpu(corpus, tmp_path):
    summary = run(corpus, tmp_path, 'dtype="bfloat16"', "max_steps=6", "eval_interval=3")
    assert summary["final_loss"] < 4.2 and summary["final_val_loss"] < 4.2  # ln 64 = 4.16 at the start


@pytest.mark.slow
def test_compiled_run_resumes_uncompiled(corpus, tmp_path):
    """torch.compile (Inductor on CPU here) keeps state-dict keys, so either kind of run resumes the other."""
    first = run(corpus, tmp_path, "compile=true", "stop_at_step=4", "eval_interval=0")
    assert first["last_step"] == 4
    second = run(corpus, tmp_path, "compile=false", "eval_interval=0")
    assert second["first_step"] == 5 and second["final_loss"] < 4.0


def test_synthetic_data_source_needs_no_dataset_and_resumes(tmp_path):
    """data_source="synthetic" (the data path's cost baseline on GPU) runs the same loop without a loader."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    run("", whole, 'data_source="synthetic"', "max_steps=8", "eval_interval=0")
    run("", split, 'data_source="synthetic"', "max_steps=8", "eval_interval=0", "stop_at_step=3")
    assert run("", split, 'data_source="synthetic"', "max_steps=8", "eval_interval=0")["first_step"] == 4
    assert series(whole) == series(split)


def write_full_state(step_dir, cfg) -> None:
    """Rewrite a checkpoint as versions before sharded checkpoints wrote it: model.pt and optimizer.pt, the full
    state dicts (keyed by parameter name) of torch.distributed.checkpoint.state_dict, beside trainer.pt."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from corpusforge.train.optim import make_optimizer
    from corpusforge.train.trainer import build_model, model_config

    model = build_model(model_config(cfg))
    optimizer = make_optimizer(model, cfg, torch.device("cpu"))
    load_checkpoint(step_dir, model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    torch.save(model_sd, step_dir / "model.pt")
    torch.save(optim_sd, step_dir / "optimizer.pt")
    for sharded in [step_dir / ".metadata", *step_dir.glob("*.distcp")]:
        sharded.unlink()


def test_full_state_checkpoint_is_refused_then_converted_and_resumed(corpus, tmp_path):
    """A checkpoint of the earlier full-state format: one line naming the command; after that command (a real
    process) the run resumes with the losses of an uninterrupted run."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    run(corpus, whole, "schedule.max_steps=8", "metrics.eval_interval=0")
    run(corpus, split, "schedule.max_steps=8", "metrics.eval_interval=0", "schedule.stop_at_step=4")
    step = latest_checkpoint(split)
    write_full_state(step, load_config(None, trainkit.tiny_overrides(corpus, split, dropout=0.1)))
    command = "convert it .* once with: python -m corpusforge.train.checkpoint"
    with pytest.raises(CheckpointError, match=f"{re.escape(str(step))}: a full-state checkpoint .*{command}") as e:
        run(corpus, split, "schedule.max_steps=8", "metrics.eval_interval=0")
    assert "\n" not in str(e.value)
    done = subprocess.run([sys.executable, "-m", "corpusforge.train.checkpoint", str(step)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (step / ".metadata").is_file() and not (step / "model.pt").exists()
    assert run(corpus, split, "schedule.max_steps=8", "metrics.eval_interval=0")["first_step"] == 5
    assert series(whole) == series(split)
