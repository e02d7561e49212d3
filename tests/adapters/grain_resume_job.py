"""One rank reading corpusforge data through Grain, in its own process: with --state-out it takes --save-at batches,
saves Grain's iterator state (atomically) and then waits to be killed, as a preempted job is; with --state-in it
restores that state in a fresh process, takes --steps batches and writes them. Used by test_adapter_grain.py.

    python grain_resume_job.py --data DIR --kind loader --workers 2 --rank 1 --world 2 --mbs 2 \\
        --save-at 3 --state-out S          # ... then:  --state-in S --steps 4 --out B.npz
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from titan_grain_data import build_train  # noqa: E402

from corpusforge.adapters.grain import GrainSource, grain_dataset, grain_loader  # noqa: E402
from corpusforge.fsutil import atomic_write, write_bytes_atomic  # noqa: E402


def iterator(source: GrainSource, kind: str, workers: int):
    if kind == "loader":
        return iter(grain_loader(source, worker_count=workers))
    return iter(grain_dataset(source, per_sample=True).to_iter_dataset())


def encode(state) -> bytes:
    """DataLoader states are bytes already; a MapDataset iterator's is a dict of numbers."""
    return state if isinstance(state, bytes) else json.dumps(state).encode()


def decode(data: bytes, kind: str):
    return data if kind == "loader" else json.loads(data)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--kind", choices=["loader", "dataset"], default="loader")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--state-out")
    p.add_argument("--state-in")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--out")
    a = p.parse_args()
    source = GrainSource(build_train(a.data), a.mbs, a.rank, a.world)
    it = iterator(source, a.kind, a.workers)
    if a.state_out:
        for _ in range(a.save_at):
            next(it)
        write_bytes_atomic(a.state_out, encode(it.get_state()))
        for _ in it:  # the test kills this process (and its Grain workers) while it reads on
            time.sleep(0.05)
        time.sleep(600)
    it.set_state(decode(Path(a.state_in).read_bytes(), a.kind))
    batches = [next(it) for _ in range(a.steps)]
    with atomic_write(a.out) as f:
        np.savez(f, **{k: np.stack([b[k] for b in batches]) for k in batches[0]})


if __name__ == "__main__":
    main()
