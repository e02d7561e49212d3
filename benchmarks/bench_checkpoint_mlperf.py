"""bench-io's MLPerf Storage checkpointing workload against fio doing the same writes and reads; target: within 5%.

MLPerf's own implementation (DLIO at the branch mlperf_storage_v2.0, which mlpstorage v2.0 installs from git) is not
on PyPI: PyPI's dlio-benchmark 2.0.0 (2024-08) predates DLIO's transformer checkpointing (2025-02) and the separate
checkpoint write/read counts (2025-04), so it cannot run this workload. fio stands in for it, doing each rank's
exact sequence of system calls: per checkpoint, after the same untimed pause, one fio run with one job per rank
that replays an iolog (version 2) of that rank's files in DLIO's layout (corpusforge/iobench/mlperf.py) at the
same scaled sizes: open (creating the file), writes of the request size with the last one short, fsync, close,
file after file; ioengine=psync, buffered. Then every file's page cache dropped, and the reads the same way
(invalidate=1; fio's default fadvise_hint advises sequential reads, as bench-io does). A rank's duration in fio is
its job's job_runtime (from the job's start after fio's barrier to its end, the opens, writes and fsyncs
included; whole milliseconds); per checkpoint the duration is the maximum over ranks and the throughput the
checkpoint's bytes over it, averaged over the checkpoints, on both sides: MLPerf's metric.

An earlier version ran one fio job per file, chained per rank with wait_for, and summed a rank's job_runtime:
fio starts a waiting job only on its main loop's 100 ms polls, so a rank's files went in lock-step with every
other rank's, with untimed gaps between them, and startdelay (counted from fio's start) paused only before the
first checkpoint. One job per rank per checkpoint has neither.

The sides alternate (bench-io first in even repeats, fio first in odd ones) on the same directory; the script
reports medians over repeats, the paired ratios, and the load average before and after each run.

    python benchmarks/bench_checkpoint_mlperf.py --dir /var/tmp/ckpt --model llama3-8b --scale 0.005 \\
        --json benchmarks/results/checkpoint-mlperf-2026-11-28.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from corpusforge.iobench import patterns, report
from corpusforge.iobench.config import BenchConfig, MiB
from corpusforge.iobench.mlperf import MODELS
from corpusforge.iobench.runner import run_bench
from corpusforge.storage.pagecache import drop_page_cache


def bench_io(args) -> dict:
    config = BenchConfig(
        paths=(args.dir,),
        patterns=("checkpoint",),
        mlperf=args.model,
        scale=args.scale,
        mlperf_checkpoints=args.checkpoints,
        mlperf_processes=args.processes,
        mlperf_pause=args.pause,
        block_sizes=(args.block_size,),
        hang_seconds=600.0,
        stall_seconds=60.0,
    )
    run = run_bench(config)
    bad = [r for r in run.results if r.verdict != "ok"]
    if bad:
        raise SystemExit(f"bench-io: {bad[0].verdict}: {bad[0].message}")
    rows = {r.phase: r for r in run.results}
    return {
        phase: {"mb_s": rows[phase].mb_s, "duration_max_s": rows[phase].extra["duration_max_s"]}
        for phase in ("write", "read")
    }


def rank_iolog(files: list[tuple[str, int]], rw: str, bs: int) -> str:
    """One rank's checkpoint as a fio iolog (version 2): each file opened (created, for writes), moved whole in
    requests of `bs` with the last one short where the size is not a multiple of `bs` (sizes are whole 4 KiB
    blocks), fsynced after a write, closed; file after file, in DLIO's order. Replayed by one fio job, this is the
    rank's exact sequence of system calls in one timed window, as bench-io's and DLIO's rank makes them."""
    lines = ["fio version 2 iolog", *(f"{path} add" for path, _ in files)]
    for path, size in files:
        lines.append(f"{path} open")
        lines += [f"{path} {rw} {off} {min(bs, size - off)}" for off in range(0, size, bs)]
        lines += [f"{path} sync 0 0"] if rw == "write" else []
        lines.append(f"{path} close")
    return "\n".join(lines) + "\n"


def fio_checkpoint(folder: str, files: list[list[tuple[str, int]]], rw: str, bs: int) -> tuple[float, int]:
    """One checkpoint in one fio run, a job per rank replaying its iolog; all jobs start together (fio starts the
    jobs of one run at once, after setting them up: DLIO's barrier). Returns the slowest rank's duration (its
    job_runtime: from the job's start to its end, the opens, writes and fsyncs included; whole ms) and the bytes
    moved."""
    lines = ["[global]", "ioengine=psync", "direct=0", f"rw={rw}", "invalidate=1"]
    for rank, mine in enumerate(files):
        log = os.path.join(folder, f"rank{rank}.{rw}.iolog")
        with open(log, "w") as f:
            f.write(rank_iolog(mine, rw, bs))
        lines += ["", f"[r{rank}]", f"read_iolog={log}"]
    job_file = os.path.join(folder, f"{rw}.fio")
    with open(job_file, "w") as f:
        f.write("\n".join(lines) + "\n")
    out = subprocess.run(["fio", "--output-format=json", job_file], check=True, capture_output=True, text=True).stdout
    jobs = json.loads(out[out.index("{") :])["jobs"]
    moved = sum(job["write"]["io_bytes"] + job["read"]["io_bytes"] for job in jobs)
    return max(job["job_runtime"] for job in jobs) / 1e3, moved


def fio(args) -> dict:
    """fio doing bench-io's checkpoints: per checkpoint the pause (not timed), then one fio run (fio_checkpoint);
    every write done, then every file's page cache dropped, then the reads the same way."""
    model = MODELS[args.model]
    root = os.path.join(args.dir, "fio-checkpoints")
    os.makedirs(root)
    try:
        checkpoints = []
        for i in range(args.checkpoints):
            folder = os.path.join(root, f"global_epoch1_step{i + 1}")
            os.makedirs(folder)
            ranks = range(args.processes or model.ranks)
            checkpoints.append([[(os.path.join(folder, f"{n}.pt"), s) for n, s in model.rank_files(r, args.scale)]
                                for r in ranks])  # fmt: skip
        expected = sum(size for mine in checkpoints[0] for _, size in mine)
        result = {}
        for rw in ("write", "read"):
            if rw == "read":  # the rules: every write done, then the cache cleared, then the reads
                for files in checkpoints:
                    for path, _ in (f for mine in files for f in mine):
                        drop_page_cache(path)
            durations = []
            for i, files in enumerate(checkpoints):
                time.sleep(args.pause)  # bench-io's emulated compute before each checkpoint (--mlperf-pause)
                folder = os.path.join(root, f"global_epoch1_step{i + 1}")
                seconds, moved = fio_checkpoint(folder, files, rw, args.block_size)
                if moved != expected:
                    raise SystemExit(f"fio {rw} moved {moved} bytes in checkpoint {i}, not {expected}; see {folder}")
                durations.append(seconds)
            rates = [expected / d / 1e6 for d in durations]
            result[rw] = {"mb_s": statistics.mean(rates), "duration_max_s": durations}
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def fio_version() -> str:
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


def git_commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="An existing directory on the mount to measure.")
    ap.add_argument("--model", default="llama3-8b", choices=list(MODELS))
    ap.add_argument("--scale", type=float, default=0.005)
    ap.add_argument("--processes", type=int, default=0, help="0: the rules' count; fewer: MLPerf's subset mode.")
    ap.add_argument("--checkpoints", type=int, default=10, help="Written, then read (the rules: 10).")
    ap.add_argument("--pause", type=float, default=1.0, help="Seconds before each checkpoint (the rules: 5).")
    ap.add_argument("--block-size", type=int, default=MiB, help="Request size in bytes, both sides.")
    ap.add_argument("--repeats", type=int, default=5, help="Runs per side (the rules: five).")
    ap.add_argument(
        "--same-session",
        action="store_true",
        help="Ablation: bench-io's writers stay in bench-io's session (patterns.own_session off), as before 677f88b.",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.same_session:  # the workers are forked: they inherit the patched module
        patterns.own_session = lambda: None
    if shutil.which("fio") is None:
        sys.exit("fio: not installed; apt-get install -y fio")
    runs = {"bench-io": [], "fio": []}
    for k in range(args.repeats):
        order = ("bench-io", "fio") if k % 2 == 0 else ("fio", "bench-io")
        for side in order:
            load_before = os.getloadavg()
            t0 = time.time()
            got = bench_io(args) if side == "bench-io" else fio(args)
            got.update(repeat=k, wall_s=time.time() - t0, load_before=load_before, load_after=os.getloadavg())
            runs[side].append(got)
            print(
                f"repeat {k} {side:8s} write {got['write']['mb_s']:8.1f} MB/s  read {got['read']['mb_s']:8.1f} MB/s"
                f"  load {load_before[0]:.2f}->{got['load_after'][0]:.2f}",
                flush=True,
            )
    summary = {}
    for phase in ("write", "read"):
        ours = [r[phase]["mb_s"] for r in runs["bench-io"]]
        theirs = [r[phase]["mb_s"] for r in runs["fio"]]
        summary[phase] = {
            "bench_io_median_mb_s": statistics.median(ours),
            "fio_median_mb_s": statistics.median(theirs),
            "ratio_of_medians": statistics.median(ours) / statistics.median(theirs),
            "paired_ratio_median": statistics.median(a / b for a, b in zip(ours, theirs)),
            "bench_io_spread": (max(ours) - min(ours)) / statistics.median(ours),
            "fio_spread": (max(theirs) - min(theirs)) / statistics.median(theirs),
        }
        s = summary[phase]
        print(
            f"{phase:5s}: bench-io {s['bench_io_median_mb_s']:.1f} MB/s, fio {s['fio_median_mb_s']:.1f} MB/s, "
            f"ratio {s['ratio_of_medians']:.3f} (paired {s['paired_ratio_median']:.3f}); "
            f"spread {s['bench_io_spread']:.0%} / {s['fio_spread']:.0%}"
        )
    model = MODELS[args.model]
    doc = {
        "benchmark": "MLPerf Storage v2.0 checkpointing: bench-io --pattern checkpoint --mlperf vs fio",
        "environment": {**report.environment(), "fio": fio_version(), "commit": git_commit()},
        "args": vars(args),
        "workload": {
            "processes": args.processes or model.ranks,
            "checkpoint_bytes": model.total_bytes(args.scale, args.processes or None),
            "files_per_rank": [len(model.rank_files(r)) for r in range(args.processes or model.ranks)],
        },
        "summary": summary,
        "runs": runs,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
