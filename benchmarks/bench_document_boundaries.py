"""What document boundaries (GPTDatasetConfig.document_boundaries: cu_seqlens, max_seqlen, positions per document)
cost the loader, measured as benchmarks/bench_getitem.py measures reading: one process, warm page cache.

    python benchmarks/bench_document_boundaries.py [--tokens 2e7] [--docs 9600] [--ids 20000] [--rounds 5]
                                                   [--out benchmarks/results/document-boundaries-<date>.json]

bench_loader's generated dataset (uint16, document lengths uniform, ~2,000 tokens on average: one or two documents
a sample of 2,048), train split, one epoch of samples. The same seeded random ids are read with the option off and
on, in rounds that alternate which goes first (median of the rounds reported):

  per sample   ds[i] for every id
  batched      ds.__getitems__(8 ids), what a DataLoader with a batch sampler calls
  worker path  ds.read_raw(8 ids) then batch.assemble (what the loader's workers and its main process do)

With --reset-position-ids both sides restart positions at eod tokens (what a job that trains documents as documents
would run without boundaries). The target (issue 30): at most 10% more time per sample, per sample and batched.

Each case is timed in wall time and in this thread's CPU time (which leaves out the time the process waited for a
core), with its minor page faults. On cores shared with other jobs a round's figure moves 2x between rounds, so each
round also reads the ids in chunks of CHUNK alternately with the option off and on, and the median of those chunks'
on/off ratios is reported as well (extra_*_paired).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_loader as bench  # noqa: E402

from corpusforge.data import GPTDataset  # noqa: E402
from corpusforge.data.batch import assemble  # noqa: E402

BATCH = 8
CHUNK = 400  # ids a paired chunk reads on each side (50 batches): ~2-6 ms, under a scheduler's time slice


def per_sample(ds, ids: list[int]) -> None:
    for i in ids:
        ds[i]


def batched(ds, ids: list[int]) -> None:
    for lo in range(0, len(ids), BATCH):
        ds.__getitems__(ids[lo : lo + BATCH])


def worker_path(ds, ids: list[int]) -> None:
    for lo in range(0, len(ids), BATCH):
        assemble(ds.read_raw(ids[lo : lo + BATCH]), ds.config, as_torch=True)


def timed(fn, ds, ids: list[int]) -> tuple[float, float, float]:
    """us per sample of wall time and of this thread's CPU time, and minor page faults per sample."""
    faults, cpu, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time(), time.perf_counter()
    fn(ds, ids)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return wall / len(ids) * 1e6, cpu / len(ids) * 1e6, faults / len(ids)


def paired(fn, off, on, ids: list[int], chunk: int, flip: bool) -> list[tuple[float, float]]:
    """(wall, CPU) ratio on/off of each chunk of `chunk` ids, read off then on (on then off where `flip`, and every
    other chunk the other way): a core lost to another job in the middle of a round spoils one chunk's pair, not the
    whole round's figure."""
    ratios = []
    for k, lo in enumerate(range(0, len(ids) - chunk + 1, chunk)):
        part = ids[lo : lo + chunk]
        first, second = (on, off) if (k % 2 == 1) != flip else (off, on)
        a, b = timed(fn, first, part), timed(fn, second, part)
        (w_off, c_off, _), (w_on, c_on, _) = (a, b) if first is off else (b, a)
        ratios.append((w_on / w_off, c_on / c_off))
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=2e7)
    ap.add_argument("--docs", type=float, default=9600)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--ids", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reset-position-ids", action="store_true", help="both sides restart positions at eod")
    args = ap.parse_args()
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    tag = "-reset-position-ids" if args.reset_position_ids else ""
    out = args.out or HERE / "results" / f"document-boundaries{tag}-{date}.json"
    tokens, docs, seq = int(args.tokens), int(args.docs), args.seq_length
    prefix = HERE / "work" / "loader" / f"gen_{tokens:.0e}tok_{docs}doc_text_document".replace("+", "")
    bench.make_dataset(prefix, tokens, docs)
    bench.warm(f"{prefix}.bin")
    sizes = [tokens * 969 // 1000 // seq - 1, tokens * 30 // 1000 // seq - 1, max(1, tokens // 1000 // seq - 1)]
    off = bench.ours_build(str(prefix), seq, sizes)[0]
    if args.reset_position_ids:
        config = dataclasses.replace(off.config, reset_position_ids=True)
        off = GPTDataset(off.indexed, "train", off.documents, off.num_samples, config)
    on = GPTDataset(
        off.indexed, "train", off.documents, off.num_samples, dataclasses.replace(off.config, document_boundaries=True)
    )
    for ds in (off, on):
        ds.load_kernels()
    ids = np.random.default_rng(0).integers(0, len(off), args.ids).tolist()
    for i in ids[:200]:  # the same tokens and labels either way
        a, b = off[i], on[i]
        assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in ("tokens", "labels", "loss_mask"))
        assert int(b["cu_seqlens"][0]) == 0 and int(b["cu_seqlens"][-1]) == seq
    pieces = np.mean([int(np.argmax(on[i]["cu_seqlens"].numpy() == seq)) for i in ids[:2000]])
    for fn in (per_sample, batched, worker_path):  # first calls are not throughput
        fn(off, ids[:500])
        fn(on, ids[:500])
    plan = {f"{fn.__name__} {name}": (fn, ds) for fn in (per_sample, batched, worker_path) for name, ds in
            (("off", off), ("on", on))}  # fmt: skip
    runs: dict[str, list[float]] = {k: [] for k in plan}
    cpu_runs: dict[str, list[float]] = {k: [] for k in plan}
    fault_runs: dict[str, list[float]] = {k: [] for k in plan}
    pairs: dict[str, list[tuple[float, float]]] = {fn.__name__: [] for fn in (per_sample, batched, worker_path)}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name in list(plan) if r % 2 == 0 else list(plan)[::-1]:
            fn, ds = plan[name]
            wall, cpu, faults = timed(fn, ds, ids)
            runs[name].append(round(wall, 2))
            cpu_runs[name].append(round(cpu, 2))
            fault_runs[name].append(round(faults, 3))
        for fn in (per_sample, batched, worker_path):
            pairs[fn.__name__] += paired(fn, off, on, ids, CHUNK, r % 2 == 1)
        load.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_runs.items()}
    names = [fn.__name__ for fn in (per_sample, batched, worker_path)]
    cost = {n: round(med[f"{n} on"] / med[f"{n} off"] - 1, 4) for n in names}
    cpu_cost = {n: round(cpu_med[f"{n} on"] / cpu_med[f"{n} off"] - 1, 4) for n in names}
    paired_cost = {n: round(statistics.median(w for w, _ in pairs[n]) - 1, 4) for n in names}
    paired_cpu_cost = {n: round(statistics.median(c for _, c in pairs[n]) - 1, 4) for n in names}
    report = {
        "benchmark": "document_boundaries",
        "machine": bench.machine_info(),
        "load_average_per_round": [round(x, 2) for x in load],
        "config": {"tokens": tokens, "documents": docs, "seq_length": seq, "ids": args.ids, "rounds": args.rounds,
                   "batch": BATCH, "read_mode": off.indexed.read_mode,
                   "reset_position_ids": args.reset_position_ids, "mean_documents_per_sample": round(pieces, 2)},
        "median_us_per_sample": med,
        "extra_time_with_boundaries": cost,
        "median_cpu_us_per_sample": cpu_med,
        "extra_cpu_time_with_boundaries": cpu_cost,
        "minor_page_faults_per_sample": {k: statistics.median(v) for k, v in fault_runs.items()},
        "paired_chunk_ids": CHUNK,
        "paired_chunks": {n: len(v) for n, v in pairs.items()},
        "extra_time_with_boundaries_paired": paired_cost,
        "extra_cpu_time_with_boundaries_paired": paired_cpu_cost,
        "runs": runs,
        "cpu_runs": cpu_runs,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nmedian of {args.rounds} rounds, us per sample ({args.ids} random ids, warm page cache):")
    for k, v in med.items():
        print(f"  {k:24s} {v:8.2f}")
    for k, v in cost.items():
        print(
            f"  {k}: {v:+.1%} with document boundaries ({cpu_cost[k]:+.1%} in this thread's CPU time); median of "
            f"{len(pairs[k])} paired chunks of {CHUNK} ids: {paired_cost[k]:+.1%} ({paired_cpu_cost[k]:+.1%} CPU)"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
