"""Reading samples in one process, warm: corpusforge against megatron-core's GPTDataset, call for call.

    python benchmarks/bench_getitem.py [--tokens 1e8] [--docs 48000] [--ids 20000] [--rounds 5]
                                       [--out benchmarks/results/getitem-<date>.json]

bench_loader's dataset generator (uint16, document lengths uniform) writes the token dataset once under
benchmarks/work/loader/; both sides build train with split 969,30,1 and one epoch of samples of 2048 tokens, the
.bin is read into the page cache, and the same --ids seeded random sample ids are read, in rounds that alternate
which side goes first (the median of the rounds is reported, with the load average before and after each):

  per sample   ds[i] for every id, both sides: megatron-core's GPTDataset.__getitem__ (int64 tensors) against
               corpusforge's GPTDataset.__getitem__ (int32 tensors, read mode "auto": the memory map here).
  batched      batches of 8 ids as a torch DataLoader makes them in the main process: megatron-core's GPTDataset
               has no batched call, so [ds[i] for i in batch] and torch's default_collate (what the DataLoader's
               fetcher does for it); corpusforge's ds.__getitems__(batch) (what the DataLoader calls when a dataset
               has it), which returns the (8, S) tensors directly.
  ours batched against their per sample, the comparison the README's 7.7x was, is printed too, and named so.

The same samples first: every field of 200 of the ids is compared between the two sides.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_loader as bench  # noqa: E402

BATCH = 8


def per_sample(ds, ids: list[int]) -> None:
    for i in ids:
        ds[i]


def megatron_batched(ds, ids: list[int]) -> None:
    from torch.utils.data import default_collate

    for lo in range(0, len(ids), BATCH):
        default_collate([ds[i] for i in ids[lo : lo + BATCH]])


def ours_batched(ds, ids: list[int]) -> None:
    for lo in range(0, len(ids), BATCH):
        ds.__getitems__(ids[lo : lo + BATCH])


def timed(fn, ds, ids: list[int]) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    fn(ds, ids)
    seconds = time.perf_counter() - t0
    return {"us_per_sample": round(seconds / len(ids) * 1e6, 2), "load_before": round(load, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=1e8)
    ap.add_argument("--docs", type=float, default=48000)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--ids", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch.distributed

    torch.distributed.get_rank = lambda *a, **k: 0  # megatron-core asks even without a process group
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"getitem-{date}.json"
    tokens, docs, seq = int(args.tokens), int(args.docs), args.seq_length
    prefix = HERE / "work" / "loader" / f"gen_{tokens:.0e}tok_{docs}doc_text_document".replace("+", "")
    bench.make_dataset(prefix, tokens, docs)
    bench.warm(f"{prefix}.bin")
    train = tokens * 969 // 1000
    sizes = [train // seq - 1, tokens * 30 // 1000 // seq - 1, max(1, tokens // 1000 // seq - 1)]
    theirs = bench.megatron_build(str(prefix), seq, sizes, Path(tempfile.mkdtemp()))[0]
    ours = bench.ours_build(str(prefix), seq, sizes)[0]
    ids = np.random.default_rng(0).integers(0, len(ours), args.ids).tolist()
    for i in ids[:200]:  # the same samples, every field
        a, b = ours[i], theirs[i]
        assert sorted(a) == sorted(b)
        for key in b:
            np.testing.assert_array_equal(a[key].numpy(), b[key].numpy(), err_msg=f"sample {i} {key}")
    per_sample(theirs, ids[:500])  # first calls (numba loading, torch's first tensors) are not throughput
    per_sample(ours, ids[:500])
    ours_batched(ours, ids[:500])
    megatron_batched(theirs, ids[:500])
    plan = {
        "megatron per sample": (per_sample, theirs),
        "corpusforge per sample": (per_sample, ours),
        "megatron batched (ds[i] x 8 + default_collate)": (megatron_batched, theirs),
        "corpusforge batched (__getitems__ of 8)": (ours_batched, ours),
    }
    runs: dict[str, list[dict]] = {k: [] for k in plan}
    for r in range(args.rounds):
        order = list(plan) if r % 2 == 0 else list(plan)[::-1]
        for name in order:
            fn, ds = plan[name]
            runs[name].append(timed(fn, ds, ids))
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]['us_per_sample']}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(x["us_per_sample"] for x in v) for k, v in runs.items()}
    ratios = {
        "per sample: corpusforge ds[i] vs megatron ds[i]": round(
            med["megatron per sample"] / med["corpusforge per sample"], 2
        ),
        "batched: corpusforge __getitems__(8) vs megatron ds[i] x 8 + default_collate": round(
            med["megatron batched (ds[i] x 8 + default_collate)"] / med["corpusforge batched (__getitems__ of 8)"], 2
        ),
        "corpusforge __getitems__(8) vs megatron ds[i] per sample (the README's old 7.7x comparison)": round(
            med["megatron per sample"] / med["corpusforge batched (__getitems__ of 8)"], 2
        ),
    }
    report = {
        "benchmark": "getitem",
        "machine": bench.machine_info(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "config": {
            "tokens": tokens,
            "documents": docs,
            "seq_length": seq,
            "ids": args.ids,
            "rounds": args.rounds,
            "batch": BATCH,
            "read_mode": ours.indexed.read_mode,
        },
        "median_us_per_sample": med,
        "ratios": ratios,
        "same_samples_checked": 200,
        "runs": runs,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nmedian of {args.rounds} rounds, us per sample ({args.ids} random ids, warm page cache):")
    for k, v in med.items():
        print(f"  {k:50s} {v:8.2f}")
    for k, v in ratios.items():
        print(f"  {k}: {v}x")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
