"""The index build as a training job meets it: in a fresh process, corpusforge against megatron-core.

    python benchmarks/bench_first_build.py [--tokens 1e8] [--docs 48000] [--rounds 5] [--builds 6]
                                           [--out benchmarks/results/loader-first-build-<date>.json]

Each round starts a new interpreter per side, alternating which goes first, on bench_loader's generated dataset
(written under benchmarks/work/loader/ if missing; the .bin read into the page cache first) and measures: importing
the side's dataset modules (megatron-core: its GPTDataset and builder, torch with them; corpusforge:
corpusforge.data), the first build of train/valid/test (split 969,30,1, one epoch of train samples of 2048 tokens)
into an empty cache directory until the cache files are written (megatron-core: np.save, no fsync; corpusforge:
wait_for_index_files), then --builds - 1 more builds in the same process (their median: a warm process that has only
built), the first sample read after them (ds[0]: torch tensors; corpusforge imports torch there, and reads a
process's first 64 samples through numpy: numba is not started by it), and --builds / 2 builds after that read (the
median of all but the first: a warm process that has read a sample), then 200 samples more and --builds / 2 builds
again (a process that has trained a little: corpusforge's compiled kernels are loaded by then).
The builds' CPU time is recorded too (process_time: every thread; on a busy machine the wall time also holds the
waits for a core, which swing with the load). Medians of the rounds, with the load average before each child;
prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEQ = 2048
SAMPLES_BEFORE_TRAINING_BUILDS = 200  # samples read before the last builds: a process that has trained a little


def child(side: str, tokens: int, docs: int, builds: int) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    if side == "megatron":
        import torch.distributed

        torch.distributed.get_rank = lambda *a, **k: 0  # megatron-core asks even without a process group
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
        import megatron.core.datasets.gpt_dataset  # noqa: F401
    else:
        import corpusforge.data  # noqa: F401
    imported = time.perf_counter() - t0
    sys.path.insert(0, str(HERE))
    import bench_loader as bench  # the same build calls as bench_loader (its imports are done by now or untimed)

    prefix = str(dataset_prefix(tokens, docs))
    train = tokens * 969 // 1000
    sizes = [train // SEQ - 1, tokens * 30 // 1000 // SEQ - 1, max(1, tokens // 1000 // SEQ - 1)]

    def build() -> tuple[object, float, float | None, float]:
        """One build of the three splits into an empty cache directory: (train dataset, seconds, seconds until the
        datasets were usable (corpusforge: its cache files are written after), CPU seconds)."""
        cache = Path(tempfile.mkdtemp(prefix="first-build-"))
        c0 = time.process_time()  # every thread of the process: a wait on the machine's load is not in it
        t0 = time.perf_counter()
        returned = None
        if side == "megatron":
            train_ds = bench.megatron_build(prefix, SEQ, sizes, cache)[0]
        else:
            from corpusforge.data.cache import wait_for_index_caches, wait_for_index_files

            train_ds = bench.ours_build(prefix, SEQ, sizes, cache=cache)[0]
            returned = time.perf_counter() - t0
            wait_for_index_files()  # as megatron-core leaves its caches: np.save, no fsync
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if side != "megatron":
            wait_for_index_caches()  # its fsyncs (megatron-core does none), outside the timings
        shutil.rmtree(cache)
        return train_ds, seconds, returned, cpu

    first = [build() for _ in range(builds)]
    train_ds = first[-1][0]
    seconds, cpu = [b[1] for b in first], [b[3] for b in first]
    returned = [b[2] for b in first if b[2] is not None]
    t0 = time.perf_counter()
    train_ds[0]
    first_sample = time.perf_counter() - t0
    after_read = [build()[1] for _ in range(max(2, builds // 2))]  # a process that has read a sample (torch in)
    # A process that trains has read more than a few samples: past corpusforge's first 64 (read through numpy), its
    # compiled kernels are loaded, and its builds shuffle and index with them (megatron-core's are unchanged).
    for i in range(1, 1 + SAMPLES_BEFORE_TRAINING_BUILDS):
        train_ds[i]
    after_samples = [build()[1] for _ in range(max(2, builds // 2))]
    return {
        "warm_build_after_read_s": statistics.median(after_read[1:]),
        "warm_build_after_samples_s": statistics.median(after_samples[1:]),
        "import_s": imported,
        "first_build_s": seconds[0],
        "warm_build_s": statistics.median(seconds[1:]),
        "first_build_cpu_s": cpu[0],
        "warm_build_cpu_s": statistics.median(cpu[1:]),
        **(
            {"first_build_returned_s": returned[0], "warm_build_returned_s": statistics.median(returned[1:])}
            if returned
            else {}
        ),
        "first_sample_s": first_sample,
        "load_before": load,
    }


def dataset_prefix(tokens: int, docs: int) -> Path:
    return HERE / "work" / "loader" / f"gen_{tokens:.0e}tok_{docs}doc_text_document".replace("+", "")


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], *map(int, sys.argv[3:]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=1e8)
    ap.add_argument("--docs", type=int, default=48000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--builds", type=int, default=6, help="builds per process: the first, then the warm ones")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import bench_loader as bench

    tokens = int(args.tokens)
    prefix = dataset_prefix(tokens, args.docs)
    bench.make_dataset(prefix, tokens, args.docs)
    bench.warm(f"{prefix}.bin")
    child_args = [str(tokens), str(args.docs), str(args.builds)]

    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"loader-first-build-{date}.json"
    runs: dict[str, list[dict]] = {"megatron": [], "corpusforge": []}
    for r in range(args.rounds):
        for side in ("megatron", "corpusforge") if r % 2 == 0 else ("corpusforge", "megatron"):
            proc = subprocess.run(
                [sys.executable, __file__, "--child", side, *child_args], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
            runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            x = runs[side][-1]
            print(f"round {r + 1} {side:12s} " + "  ".join(f"{k} {v:.3f}" for k, v in x.items()), flush=True)
    medians = {
        side: {k: round(statistics.median(x[k] for x in rs), 4) for k in rs[0]} for side, rs in runs.items()
    }  # fmt: skip
    for m in medians.values():
        m["import_and_first_build_s"] = round(m["import_s"] + m["first_build_s"], 3)
    ratios = {
        k: round(medians["megatron"][k] / medians["corpusforge"][k], 2)
        for k in (
            "first_build_s",
            "warm_build_s",
            "warm_build_after_read_s",
            "warm_build_after_samples_s",
            "import_and_first_build_s",
            "first_sample_s",
            "first_build_cpu_s",
            "warm_build_cpu_s",
        )
    }
    report = {
        "benchmark": "loader-first-build",
        "machine": bench.machine_info(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "dataset": {"tokens": tokens, "documents": args.docs, "seq_length": SEQ, "builds_per_process": args.builds},
        "medians": medians,
        "ratios_megatron_over_corpusforge": ratios,
        "runs": runs,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    head = f"{'import s':>9s} {'1st build ms':>13s} {'warm build ms':>14s} {'after read ms':>14s}"
    head += f" {'after 200 ms':>13s} {'sum s':>7s}"
    print(f"\n{'median of ' + str(args.rounds):16s} {head} {'1st sample ms':>14s}")
    for side, m in medians.items():
        row = f"{m['import_s']:9.3f} {m['first_build_s'] * 1e3:13.1f} {m['warm_build_s'] * 1e3:14.1f}"
        row += f" {m['warm_build_after_read_s'] * 1e3:14.1f} {m['warm_build_after_samples_s'] * 1e3:13.1f}"
        row += f" {m['import_and_first_build_s']:7.3f}"
        print(f"{side:16s} {row} {m['first_sample_s'] * 1e3:14.1f}")
    for side, m in medians.items():
        print(
            f"{side:16s} CPU of the builds (all threads): first {m['first_build_cpu_s'] * 1e3:.1f} ms, "
            f"warm {m['warm_build_cpu_s'] * 1e3:.1f} ms"
        )
    print("megatron-core / corpusforge:", json.dumps(ratios))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
