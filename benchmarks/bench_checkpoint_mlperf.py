"""bench-io's MLPerf Storage checkpointing workload against fio doing the same writes and reads; target: within 5%.

MLPerf's own implementation (DLIO at the branch mlperf_storage_v2.0, which mlpstorage v2.0 installs from git) is not
on PyPI: PyPI's dlio-benchmark 2.0.0 (2024-08) predates DLIO's transformer checkpointing (2025-02) and the separate
checkpoint write/read counts (2025-04), so it cannot run this workload. fio stands in for it: for each checkpoint
one fio run with one chain of jobs per rank (wait_for: the rank's files one after another, as DLIO's rank writes
them), each job one file of the rank's DLIO layout (corpusforge/iobench/mlperf.py) at the same scaled size,
ioengine=psync, the same request size, buffered, fallocate=none, end_fsync=1 (DLIO fsyncs every file); then
every file's page cache dropped, then one fio run per checkpoint reading them back (invalidate=1, fadvise
sequential: bench-io does the same). A rank's duration in fio is the sum of its jobs' job_runtime (ms; file
creation and opening left out, which favours fio slightly); per checkpoint the duration is the maximum over
ranks and the throughput the checkpoint's bytes over it, averaged over the checkpoints, on both sides.

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

from corpusforge.iobench import report
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


def fio_jobs(checkpoints: list[list[list[tuple[str, int]]]], rw: str, bs: int, pause: float) -> str:
    """A fio job file for every checkpoint, one after another (stonewall: the next starts once every rank is done,
    DLIO's barrier); within one, a chain per rank, the rank's next job after its previous one (wait_for). A file
    is one job of whole requests and, where its size is not a multiple of `bs` (sizes are whole 4 KiB blocks), one
    more job for the rest in one request, as bench-io's last request (fio drops a partial last block otherwise);
    the file's last job fsyncs it. Each rank's first job starts `pause` seconds late (startdelay, not timed):
    bench-io's emulated compute before each checkpoint (--mlperf-pause)."""
    lines = ["[global]", "ioengine=psync", "direct=0", "fallocate=none", f"rw={rw}", "invalidate=1"]
    for i, files in enumerate(checkpoints):
        first = True
        for rank, mine in enumerate(files):
            previous = None
            for j, (path, size) in enumerate(mine):
                body = size // bs * bs
                parts = [(f"c{i}r{rank}f{j}", 0, body, bs)] if body else []
                parts += [(f"c{i}r{rank}f{j}t", body, size - body, size - body)] if size > body else []
                for k, (name, offset, length, request) in enumerate(parts):
                    lines += ["", f"[{name}]", f"filename={path}", f"offset={offset}", f"size={length}"]
                    lines += [f"bs={request}"]
                    lines += ["end_fsync=1"] if rw == "write" and k == len(parts) - 1 else []
                    lines += [f"wait_for={previous}"] if previous else [f"startdelay={round(pause * 1000)}ms"]
                    lines += ["stonewall"] if first and i else []
                    previous, first = name, False
    return "\n".join(lines) + "\n"


def fio_run(job_file: str, checkpoints: int, ranks: int) -> tuple[list[float], list[int]]:
    """Per checkpoint: the slowest rank's duration (the sum of its jobs' job_runtime) and the bytes moved."""
    out = subprocess.run(["fio", "--output-format=json", job_file], check=True, capture_output=True, text=True).stdout
    per_rank = [[0.0] * ranks for _ in range(checkpoints)]
    moved = [0] * checkpoints
    for job in json.loads(out[out.index("{") :])["jobs"]:
        i, rest = job["jobname"][1:].split("r")  # c<checkpoint>r<rank>f<file>[t]
        per_rank[int(i)][int(rest.split("f")[0])] += job["job_runtime"] / 1e3
        moved[int(i)] += job["write"]["io_bytes"] + job["read"]["io_bytes"]
    return [max(r) for r in per_rank], moved


def fio(args) -> dict:
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
            job_file = os.path.join(root, f"{rw}.fio")
            with open(job_file, "w") as f:
                f.write(fio_jobs(checkpoints, rw, args.block_size, args.pause))
            durations, moved = fio_run(job_file, len(checkpoints), len(checkpoints[0]))
            if set(moved) != {expected}:
                raise SystemExit(f"fio {rw} moved {moved} bytes per checkpoint, not {expected}; see {job_file}")
            rates = [n / d / 1e6 for n, d in zip(moved, durations)]
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
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
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
