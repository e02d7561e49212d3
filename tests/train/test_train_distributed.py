"""Real processes: a 2-rank gloo DDP run that learns, FSDP2 on gloo stopped and resumed, and a checkpoint save
killed with SIGKILL. The three 2-rank runs share one torchrun launch (tests/train/multirun.py): starting torchrun
and torch in each process costs more than these tiny runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trainkit

from corpusforge.train import load_config, train
from corpusforge.train.checkpoint import TMP, latest_checkpoint, load_checkpoint, load_meta
from corpusforge.train.metrics import read_metrics
from corpusforge.train.model import GPT
from corpusforge.train.optim import make_optimizer
from corpusforge.train.trainer import gpt_config

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return trainkit.write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov_text_document")


def fsdp_overrides(corpus: str, out: Path, *extra: str) -> list[str]:
    return [*trainkit.tiny_overrides(corpus, out, parallel='"fsdp"', max_steps=12, checkpoint_interval=6), *extra]


@pytest.fixture(scope="module")
def two_ranks(corpus, tmp_path_factory) -> tuple[str, Path]:
    """(stdout, work dir) of one 2-rank launch: DDP for 40 steps (ddp/), then FSDP2 stopped at step 6 and resumed
    to step 12 (fsdp/)."""
    work = tmp_path_factory.mktemp("torchrun2")
    fsdp = work / "fsdp"
    runs = [trainkit.tiny_overrides(corpus, work / "ddp"), fsdp_overrides(corpus, fsdp, "schedule.stop_at_step=6"),
            fsdp_overrides(corpus, fsdp)]  # fmt: skip
    return trainkit.torchrun_runs(runs, 2, work).stdout, work


def losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out_dir / "metrics.jsonl", "train")}


def test_two_rank_ddp_learns_and_matches_one_rank(corpus, two_ranks, tmp_path):
    """2 ranks x 8 samples equals 1 rank x 2 micro-batches of 8: the same samples, the averaged gradient."""
    stdout, work = two_ranks
    assert "data_wait p50/p99 r0" in stdout and " r1 " in stdout  # both ranks' waits on every line
    records = read_metrics(work / "ddp" / "metrics.jsonl", "train")
    assert all(len(r["data_wait_ms"]) == 2 for r in records)
    summary = read_metrics(work / "ddp" / "metrics.jsonl", "summary")[0]
    entropy = trainkit.unigram_entropy(corpus)
    assert summary["ranks"] == 2 and summary["steps"] == 40
    assert summary["final_val_loss"] < 0.4 * entropy, (summary, entropy)  # ~1.0 nats against ~4.16
    single = tmp_path / "single"
    train(load_config(None, trainkit.tiny_overrides(corpus, single)), log=lambda line: None)
    a, b = losses(work / "ddp"), losses(single)
    assert sorted(a) == sorted(b)
    assert [a[s] for s in a] == pytest.approx([b[s] for s in a], rel=2e-3)
    assert load_meta(latest_checkpoint(work / "ddp"))["world_size"] == 2


@pytest.mark.slow
def test_fsdp2_on_gloo_matches_ddp_and_resumes(corpus, two_ranks, tmp_path):
    _, work = two_ranks
    single = tmp_path / "single"
    train(load_config(None, trainkit.tiny_overrides(corpus, single, max_steps=12)), log=lambda line: None)
    a, b = losses(work / "fsdp"), losses(single)
    assert sorted(a) == list(range(1, 13))
    assert [a[s] for s in a] == pytest.approx([b[s] for s in a], rel=2e-3)
    saved = latest_checkpoint(work / "fsdp")
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # a shard each


def printed_line(proc: subprocess.Popen, line: str, timeout: float) -> bool:
    """Whether `proc` printed `line` (a whole line of its stdout) within `timeout` seconds; False as soon as it
    ends without printing it. Read on a thread, so that a job that hangs fails the test instead of hanging it."""
    seen = threading.Event()

    def read() -> None:
        for got in proc.stdout:
            if got.strip() == line:
                seen.set()
                return

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not seen.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            return seen.is_set()
    return True


def test_killed_save_leaves_the_last_checkpoint_usable(corpus, tmp_path):
    out = tmp_path / "run"
    overrides = trainkit.tiny_overrides(corpus, out, max_steps=30, checkpoint_interval=10, eval_interval=0)
    log = tmp_path / "job.log"
    with open(log, "w") as stderr:
        job = subprocess.Popen(
            [sys.executable, str(HERE / "kill_job.py"), *overrides],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))},
        )
    try:
        if not printed_line(job, "SAVING", timeout=300):
            status = "still running after 300 s" if job.poll() is None else f"exit {job.returncode}"
            pytest.fail(f"the job never reached the save of step 20 ({status}); log:\n{log.read_text()[-3000:]}")
        job.send_signal(signal.SIGKILL)  # mid-save: the shards of step 20 written, not published
    finally:
        job.kill()
        job.wait()
    partial = out / "checkpoints" / f"{TMP}step_00000020"
    assert (partial / ".metadata").is_file() and not (partial / "meta.json").exists()
    last = latest_checkpoint(out)
    assert last.name == "step_00000010"
    cfg = load_config(None, overrides)
    model = GPT(gpt_config(cfg))
    state = load_checkpoint(last, model, make_optimizer(model, cfg, model.lm_head.weight.device))
    assert state["step"] == 10 and state["loader"]["consumed_samples"] == 10 * 16
    summary = train(cfg, log=lambda line: None)  # resume="auto": continues after step 10, clears the debris
    assert summary["first_step"] == 11 and summary["last_step"] == 30
    assert not partial.exists() and latest_checkpoint(out).name == "step_00000030"
