"""What a training run's ranks read, written to files: `record_samples()` wraps the trainer's data stream so that each
train micro-batch is kept under the first loader unit it holds; `save()` writes them to {out_dir}/samples-*.npz.
Runs of any world size (or a run stopped and resumed) then compare by unit: the same units must hold the same tokens.

    torchrun ... curriculum_record.py RUNS.json     (RUNS.json: a list of override lists, run one after another)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np


def record_samples() -> dict:
    """Patch the trainer (in this process) to record {first unit: (tokens, source of each row)} into the dict."""
    from corpusforge.train import trainer

    store: dict = {}
    to_device, read = trainer.batch_to_device, trainer.DataStream.next
    last: dict = {}

    def keep_sources(batch, *args, **kwargs):
        last["source"] = batch.get("dataset_id")
        return to_device(batch, *args, **kwargs)

    def next_batch(self):
        batch, wait = read(self)
        loader = self.loader
        if loader is self.plan.data.train:  # counted when handed over: the units of this micro-batch end there
            first = loader.consumed_samples - loader.global_batch_size + loader.dp_rank * loader.micro_batch_size
            source = last["source"]
            store[first] = (batch["tokens"].cpu().numpy().copy(), None if source is None else np.asarray(source))
        return batch, wait

    trainer.batch_to_device, trainer.DataStream.next = keep_sources, next_batch
    return store


def save(store: dict, out_dir: str | Path, tag: str) -> None:
    arrays = {f"{u}": t for u, (t, _) in store.items()}
    arrays.update({f"{u}-source": s for u, (_, s) in store.items() if s is not None})
    np.savez(Path(out_dir) / f"samples-{tag}-rank{os.environ.get('RANK', '0')}.npz", **arrays)
    store.clear()


def load(out_dir: str | Path) -> dict[int, tuple[np.ndarray, np.ndarray | None]]:
    """Every recorded micro-batch under out_dir, of every rank and run: {first unit: (tokens, sources)}."""
    out: dict = {}
    for path in sorted(Path(out_dir).glob("samples-*.npz")):
        with np.load(path) as f:
            for key in f.files:
                if not key.endswith("-source"):
                    out[int(key)] = (f[key], f[f"{key}-source"] if f"{key}-source" in f.files else None)
    return out


if __name__ == "__main__":
    import torch.distributed as dist

    from corpusforge.train import load_config, train

    with open(sys.argv[1]) as f:
        runs = json.load(f)
    store = record_samples()
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *args, **kwargs: None  # multirun.py's why
    for i, overrides in enumerate(runs):
        cfg = load_config(None, overrides)
        train(cfg)
        save(store, cfg.out_dir, f"run{i}")
    dist.barrier()
    destroy()
