"""Real processes: a 2-rank gloo DDP run that learns, FSDP2 on gloo, and a checkpoint save killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import socket
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(overrides: list[str], nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "corpusforge.train",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "terminate" in line or "rank" in line]
    assert done.returncode == 0, done.stdout[-2000:] + "\n".join(errors[-40:])
    return done


def losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out_dir / "metrics.jsonl", "train")}


def test_two_rank_ddp_learns_and_matches_one_rank(corpus, tmp_path):
    """2 ranks x 8 samples equals 1 rank x 2 micro-batches of 8: the same samples, the averaged gradient."""
    ddp = torchrun(trainkit.tiny_overrides(corpus, tmp_path / "ddp"))
    assert "data_wait p50/p99 r0" in ddp.stdout and " r1 " in ddp.stdout  # both ranks' waits on every line
    records = read_metrics(tmp_path / "ddp" / "metrics.jsonl", "train")
    assert all(len(r["data_wait_ms"]) == 2 for r in records)
    summary = read_metrics(tmp_path / "ddp" / "metrics.jsonl", "summary")[0]
    entropy = trainkit.unigram_entropy(corpus)
    assert summary["ranks"] == 2 and summary["steps"] == 40
    assert summary["final_val_loss"] < 0.4 * entropy, (summary, entropy)  # ~1.0 nats against ~4.16
    single = tmp_path / "single"
    train(load_config(None, trainkit.tiny_overrides(corpus, single)), log=lambda line: None)
    a, b = losses(tmp_path / "ddp"), losses(single)
    assert sorted(a) == sorted(b)
    assert [a[s] for s in a] == pytest.approx([b[s] for s in a], rel=2e-3)
    assert load_meta(latest_checkpoint(tmp_path / "ddp"))["world_size"] == 2


@pytest.mark.slow
def test_fsdp2_on_gloo_matches_ddp_and_resumes(corpus, tmp_path):
    fsdp = tmp_path / "fsdp"
    torchrun(
        trainkit.tiny_overrides(corpus, fsdp, parallel='"fsdp"', max_steps=12, checkpoint_interval=6, stop_at_step=6)
    )
    torchrun(trainkit.tiny_overrides(corpus, fsdp, parallel='"fsdp"', max_steps=12, checkpoint_interval=6))
    single = tmp_path / "single"
    train(load_config(None, trainkit.tiny_overrides(corpus, single, max_steps=12)), log=lambda line: None)
    a, b = losses(fsdp), losses(single)
    assert sorted(a) == list(range(1, 13))
    assert [a[s] for s in a] == pytest.approx([b[s] for s in a], rel=2e-3)


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
            env={**os.environ, "PYTHONPATH": str(HERE)},
        )
    try:
        if not printed_line(job, "SAVING", timeout=300):
            status = "still running after 300 s" if job.poll() is None else f"exit {job.returncode}"
            pytest.fail(f"the job never reached the save of step 20 ({status}); log:\n{log.read_text()[-3000:]}")
        job.send_signal(signal.SIGKILL)  # mid-save: model.pt of step 20 written, the rest not
    finally:
        job.kill()
        job.wait()
    partial = out / "checkpoints" / f"{TMP}step_00000020"
    assert (partial / "model.pt").is_file() and not (partial / "meta.json").exists()
    last = latest_checkpoint(out)
    assert last.name == "step_00000010"
    cfg = load_config(None, overrides)
    model = GPT(gpt_config(cfg))
    state = load_checkpoint(last, model, make_optimizer(model, cfg, model.lm_head.weight.device))
    assert state["step"] == 10 and state["loader"]["consumed_samples"] == 10 * 16
    summary = train(cfg, log=lambda line: None)  # resume="auto": continues after step 10, clears the debris
    assert summary["first_step"] == 11 and summary["last_step"] == 30
    assert not partial.exists() and latest_checkpoint(out).name == "step_00000030"
