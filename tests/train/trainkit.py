"""A tiny generated corpus and config for the trainer tests (imported by the tests and their subprocesses).

The corpus is a Markov chain over VOCAB tokens: after token a comes NEXT[a] with probability 0.9, else a uniform
token. Its unigram distribution is close to uniform (entropy ~ln VOCAB), while a model that learns the bigram
reaches ~0.7 nats: a loss well below the unigram entropy proves that the model learned from the data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from corpusforge.indexed import IndexedDatasetWriter
from corpusforge.train.config import new_key

VOCAB = 64
FOLLOW = 0.9


def write_markov_corpus(prefix: Path | str, num_docs: int = 200, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    follow = rng.permutation(VOCAB)
    lengths = rng.integers(40, 200, size=num_docs)
    docs = []
    for n in lengths:
        doc = np.empty(n, dtype=np.int64)
        doc[0] = rng.integers(VOCAB)
        jumps, randoms = rng.random(n) >= FOLLOW, rng.integers(0, VOCAB, size=n)
        for i in range(1, n):
            doc[i] = randoms[i] if jumps[i] else follow[doc[i - 1]]
        docs.append(doc)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(np.concatenate(docs), lengths)
    return str(prefix)


def unigram_entropy(prefix: str) -> float:
    """Entropy in nats of the corpus's token frequencies: the best loss without context."""
    from corpusforge.indexed import IndexedDataset

    counts = np.bincount(np.asarray(IndexedDataset(prefix).tokens), minlength=VOCAB).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def tiny_overrides(data_path: str, out_dir: Path | str, **extra) -> list[str]:
    """key=value overrides of a model and run small enough for a shared 2-core CI machine; `extra` keys may be
    written flat (max_steps=4), as tests did before the sections: they become their section's key."""
    values = {
        "data.path": f'"{data_path}"',
        "out_dir": f'"{out_dir}"',
        "model.vocab_size": VOCAB,
        "model.name": '"custom"',
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.seq_length": 32,
        "schedule.micro_batch_size": 8,
        "schedule.global_batch_tokens": 512,
        "schedule.max_steps": 40,
        "schedule.warmup_steps": 4,
        "optimizer.lr": 1e-2,
        "schedule.min_lr": 1e-3,
        "metrics.eval_interval": 20,
        "metrics.eval_batches": 2,
        "metrics.log_interval": 1,
        "checkpoint.interval": 20,
        "data.num_workers": 0,
        "device": '"cpu"',
        "compile": "false",
        "metrics.tensorboard": "false",
        "data.split": '"90,10,0"',
    }
    values.update({new_key(k): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in values.items()]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(overrides: list[str], nproc: int, timeout: int = 240, check: bool = True, options: list[str] = (),
             wrapper: list[str] = (), launcher: list[str] = ()):  # fmt: skip
    """`torchrun -m corpusforge.train` in its own process group of `nproc` gloo ranks, killed after `timeout`
    seconds (a hung collective fails the test instead of hanging CI); returns the CompletedProcess. `options`: more
    torchrun flags (--log-dir D --redirects 3: each rank's output in its own file); `wrapper`: a script and its
    arguments that each rank runs instead, which runs `-m corpusforge.train` with the overrides (rank_view.py);
    `launcher`: a command that runs torchrun itself, its ranks inheriting what it sets (a cgroup)."""
    tail = [*options, *(wrapper or ["-m", "corpusforge.train"]), *overrides]
    return _launch(tail, nproc, timeout, check, f"torchrun {nproc}", launcher)


def rank_logs(log_dir: Path | str) -> dict[int, str]:
    """{local rank: its stderr} of a torchrun launched with options ["--log-dir", log_dir, "--redirects", "3"]."""
    found = sorted(Path(log_dir).glob("*/attempt_*/*/stderr.log"))
    return {int(p.parent.name): p.read_text() for p in found}


def torchrun_runs(runs: list[list[str]], nproc: int, work: Path | str, timeout: int = 600):
    """Several runs (override lists) in one `torchrun` launch of `nproc` gloo ranks, one after another
    (multirun.py), under one hard timeout; returns the CompletedProcess. Their order is kept: a run may resume
    from an earlier one's checkpoint."""
    import json

    spec = Path(work) / "runs.json"
    spec.write_text(json.dumps(runs))
    script = Path(__file__).resolve().parent / "multirun.py"
    return _launch([str(script), str(spec)], nproc, timeout, True, f"torchrun {nproc} ({len(runs)} runs)")


def _launch(tail: list[str], nproc: int, timeout: int, check: bool, what: str, launcher: list[str] = ()):
    import os
    import subprocess
    import sys

    cmd = [*launcher, sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", *tail]  # fmt: skip
    here = str(Path(__file__).resolve().parent)  # trainkit for the scripts here, before the caller's own path
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error" in line or "rank" in line]
        raise AssertionError(f"{what} exit {done.returncode}:\n" + done.stdout[-2000:] + "\n".join(errors[-40:]))
    return done


def run_records(out_dir: Path | str, kind: str = "train") -> dict[int, dict]:
    from corpusforge.train.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(Path(out_dir) / "metrics.jsonl", kind)}
