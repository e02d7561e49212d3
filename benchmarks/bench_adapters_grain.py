"""What the Grain and torchtitan adapters cost per sample against corpusforge's own loader, in one run.

    python benchmarks/bench_adapters_grain.py [--tokens 2e7] [--docs 9600] [--samples 4000] [--rounds 5]
                                              [--out benchmarks/results/adapters-grain-torchtitan-<date>.json]

bench_loader's generated dataset (uint16, ~2,000-token documents), its train split, warm page cache, one process
(no workers), micro-batches of 8 samples of 2,048 tokens, the first --samples samples of rank 0 of 1, in rounds that
alternate the order of the paths (medians of the rounds' wall and CPU time reported, and the median over rounds of
each path's time against the anchor's in the same round):

  corpusforge                  make_loader(train, 8): the anchor, int32 torch tensors
  grain loader                 grain_loader(GrainSource(train, 8)), Grain's DataLoader over micro-batch records
                               (numpy), with its default read options (no threads): the like-for-like row
  grain loader 2 threads       the same, reading with 2 threads, 8 micro-batches ahead
  grain loader grain default   the same with Grain's default ReadOptions() (16 threads, 500 read ahead)
  grain mapdataset             grain_dataset(source).to_iter_dataset(no threads): the micro-batch records as a
                               MapDataset
  grain mapdataset per sample  grain_dataset(source, per_sample=True), no threads: sample records batched by
                               Grain's .batch
  torchtitan                   CorpusforgeDataLoader, built as torchtitan's Trainer builds it: int64 inputs,
                               labels IGNORE_INDEX where the loss mask is 0

Every path's batches are checked equal to the anchor's first. The target (issue 31): within 10% per sample of
corpusforge's loader, batched where the trainer batches.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path

import grain.python as grain
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_loader as bench  # noqa: E402

from corpusforge.adapters.grain import GrainSource, grain_dataset, grain_loader  # noqa: E402
from corpusforge.adapters.torchtitan import CorpusforgeDataLoader  # noqa: E402
from corpusforge.data import build_gpt_datasets, make_loader  # noqa: E402

BATCH = 8


def paths(train, prefix: str, seq: int, samples: int, cache: Path) -> dict:
    """name: a function making a fresh iterable of that path's batches (made outside the timing)."""
    source = GrainSource(train, BATCH)
    titan = CorpusforgeDataLoader.Config(blend=[prefix], split=bench.SPLIT, seed=bench.SEED, num_samples=samples,
                                         cache_dir=str(cache), eod_token_id=bench.EOD)  # fmt: skip

    def torchtitan():
        return titan.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=seq, local_batch_size=BATCH)

    unthreaded = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # grain_loader's default
    two_threads = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
    return {
        "corpusforge": lambda: make_loader(train, BATCH),
        "grain loader": lambda: grain_loader(source),
        "grain loader 2 threads": lambda: grain_loader(source, read_options=two_threads),
        "grain loader grain default": lambda: grain_loader(source, read_options=grain.ReadOptions()),
        "grain mapdataset": lambda: grain_dataset(source).to_iter_dataset(unthreaded),
        "grain mapdataset per sample": lambda: grain_dataset(source, per_sample=True).to_iter_dataset(unthreaded),
        "torchtitan": torchtitan,
    }


def tokens_of(batch) -> np.ndarray:
    if isinstance(batch, tuple):  # torchtitan's (inputs, labels)
        return batch[0]["input"].numpy()
    value = batch["tokens"]
    return value if isinstance(value, np.ndarray) else value.numpy()


def timed(make, batches: int) -> tuple[float, float]:
    """(wall, CPU time of this process's threads) in us per sample; CPU time, since this machine is shared."""
    iterable = make()
    t0, c0 = time.perf_counter(), time.process_time()
    it = iter(iterable)
    for _ in range(batches):
        next(it)
    samples = batches * BATCH
    return (time.perf_counter() - t0) / samples * 1e6, (time.process_time() - c0) / samples * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=2e7)
    ap.add_argument("--docs", type=float, default=9600)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"adapters-grain-torchtitan-{date}.json"
    tokens, docs, seq = int(args.tokens), int(args.docs), args.seq_length
    prefix = HERE / "work" / "loader" / f"gen_{tokens:.0e}tok_{docs}doc_text_document".replace("+", "")
    cache = HERE / "work" / "adapters-cache"
    bench.make_dataset(prefix, tokens, docs)
    bench.warm(f"{prefix}.bin")
    train, _, _ = build_gpt_datasets(str(prefix), seq, bench.SPLIT, bench.SEED, (args.samples, 0, 0), cache,
                                     eod_token_id=bench.EOD)  # fmt: skip
    train.load_kernels()
    plan = paths(train, str(prefix), seq, args.samples, cache)
    batches = args.samples // BATCH
    first = {}  # also the first calls, which are not throughput
    for name, make in plan.items():
        it = iter(make())
        first[name] = [tokens_of(next(it)) for _ in range(3)]
    for name, got in first.items():
        assert all(np.array_equal(a, b) for a, b in zip(got, first["corpusforge"])), name
    runs: dict[str, list[float]] = {k: [] for k in plan}
    cpu: dict[str, list[float]] = {k: [] for k in plan}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name in list(plan) if r % 2 == 0 else list(plan)[::-1]:
            wall, used = timed(plan[name], batches)
            runs[name].append(round(wall, 2))
            cpu[name].append(round(used, 2))
        load.append(os.getloadavg()[0])
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]}/{cpu[k][-1]}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    def cost_of(per_round: dict[str, list[float]]) -> dict[str, float]:
        """Median over rounds of each path's time / the anchor's in the same round (load drifts between rounds)."""
        anchor = per_round["corpusforge"]
        return {k: round(statistics.median(a / b - 1 for a, b in zip(v, anchor)), 4) for k, v in per_round.items()
                if k != "corpusforge"}  # fmt: skip

    cost, cost_cpu = cost_of(runs), cost_of(cpu)
    versions = bench.machine_info()
    versions["adapter_packages"] = {name: importlib.metadata.version(name) for name in ("grain", "torchtitan")}
    report = {
        "benchmark": "adapters_grain_torchtitan",
        "machine": versions,
        "load_average_per_round": [round(x, 2) for x in load],
        "config": {"tokens": tokens, "documents": docs, "seq_length": seq, "samples": args.samples,
                   "rounds": args.rounds, "micro_batch": BATCH, "workers": 0, "read_mode": train.indexed.read_mode},
        "median_us_per_sample": med,
        "median_cpu_us_per_sample": med_cpu,
        "extra_time_vs_corpusforge": cost,
        "extra_cpu_time_vs_corpusforge": cost_cpu,
        "runs": runs,
        "runs_cpu": cpu,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nmedian of {args.rounds} rounds, us per sample, wall / CPU ({args.samples} samples, batches of {BATCH}):")
    for k, v in med.items():
        extra = f"  {cost[k]:+.1%} / {cost_cpu[k]:+.1%} vs corpusforge" if k in cost else ""
        print(f"  {k:28s} {v:8.2f} / {med_cpu[k]:8.2f}{extra}")
    print(f"load average per round: {[round(x, 2) for x in load]}\nwrote {out}")


if __name__ == "__main__":
    main()
