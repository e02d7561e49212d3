"""Grain reading corpusforge's samples (as torchtitan HEAD and MaxText load data): a random-access source per
data-parallel rank, Grain's DataLoader with worker processes, and Grain's own iterator checkpoint.

    corpusforge preprocess examples/tiny-corpus.jsonl.zst --output-prefix out/tiny     # out/tiny_text_document
    python examples/adapters/grain_source.py out/tiny_text_document

In a training job, give each rank its dp_rank and dp_world_size; save `it.get_state()` with the checkpoint and call
`it.set_state(saved)` on a fresh iterator to continue with the next batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grain.python as grain

from corpusforge.adapters.grain import GrainSource, grain_dataset, grain_loader
from corpusforge.data import build_gpt_datasets


def main(prefix: str) -> None:
    train, _, _ = build_gpt_datasets(prefix, seq_length=256, split="99,1,0", seed=1234, num_samples=(2000, 0, 0),
                                     cache_dir=Path(prefix).parent / "index-cache")  # fmt: skip
    source = GrainSource(train, micro_batch_size=4, dp_rank=0, dp_world_size=1)  # a Grain RandomAccessDataSource
    it = iter(grain_loader(source, worker_count=2))  # micro-batches in corpusforge's order, read by 2 workers
    batches = [next(it) for _ in range(3)]
    for step, batch in enumerate(batches):
        shapes = {k: v.shape for k, v in batch.items()}
        print(f"step {step}: {shapes}, first ids {batch['tokens'][0, :6].tolist()}")
    state = it.get_state()  # bytes (JSON): store them with the model checkpoint
    expected = next(it)["tokens"]
    resumed = iter(grain_loader(source, worker_count=2))
    resumed.set_state(state)
    print(f"resumed from a {len(state)}-byte state: next batch same: {(next(resumed)['tokens'] == expected).all()}")
    # The same samples as a Grain MapDataset, batched by Grain (compose shuffles, maps, mixtures as with any source)
    no_threads = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # Grain's default polls 500 ahead
    first = next(iter(grain_dataset(source).to_iter_dataset(no_threads)))
    same = (first["tokens"] == batches[0]["tokens"]).all()
    print(f"MapDataset: first batch {first['tokens'].shape}, equal to the DataLoader's: {same}")


if __name__ == "__main__":  # Grain's workers are spawned: they import this file, which must not run main again
    main(sys.argv[1] if len(sys.argv) > 1 else "out/tiny_text_document")
