"""bench-io against fio: the same files, pattern, block size and process count; the figures must agree within 10%.

For each (pattern, block size, processes, cache mode) the script lets bench-io write its read files once, then
alternates bench-io and fio on those very files (fio: ioengine=psync, one job per file, group_reporting;
rand-read with norandommap so that both may hit a block twice, and blockalign=4k like bench-io), `--repeats`
times, and compares the medians. Cache modes: O_DIRECT (direct=1) and buffered after posix_fadvise(DONTNEED)
(fio's invalidate=1, bench-io's drop_cache).

fio comes from the system's packages: `apt-get install -y fio`.

    python benchmarks/bench_io_vs_fio.py --dir /path/on/disk --json benchmarks/results/bench-io-vs-fio.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from corpusforge.iobench import patterns
from corpusforge.iobench.config import BenchConfig, KiB, MiB
from corpusforge.iobench.runner import direct_supported, run_case
from corpusforge.iobench.stats import aggregate


def bench_io(config: BenchConfig, root: str, pattern: str, bs: int, procs: int, direct: bool) -> dict:
    case = patterns.Case(pattern, root, os.path.join(root, "scratch"), procs, 1, bs, direct, config)
    outcome = run_case(case, 0)
    if outcome.verdict != "ok":
        raise SystemExit(f"bench-io {pattern}: {outcome.message}")
    row = aggregate(case, root, [outcome], "")[0]
    return {"mb_s": row.mb_s, "iops": row.iops, "p50_ms": row.latency_ms["p50"], "p99_ms": row.latency_ms["p99"]}


def fio(config: BenchConfig, root: str, pattern: str, bs: int, procs: int, direct: bool) -> dict:
    rw = {"seq-read": "read", "rand-read": "randread"}[pattern]
    cmd = [
        "fio",
        "--output-format=json",
        "--group_reporting",
        "--ioengine=psync",
        f"--direct={int(direct)}",
        "--invalidate=1",
        f"--bs={bs}",
        f"--rw={rw}",
        f"--size={config.file_size}",
        "--thread=0",
    ]
    if pattern == "rand-read":
        cmd += ["--norandommap", "--blockalign=4k", f"--number_ios={config.rand_ops}", "--randrepeat=0"]
    for slot in range(procs):
        path, _, _ = patterns.read_region(patterns.Case(pattern, root, "", procs, 1, bs, direct, config), slot)
        cmd += [f"--name=job{slot}", f"--filename={path}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]["read"]
    pct = job["clat_ns"].get("percentile", {})
    return {
        "mb_s": job["bw_bytes"] / 1e6,
        "iops": job["iops"],
        "p50_ms": pct.get("50.000000", 0) / 1e6,
        "p99_ms": pct.get("99.000000", 0) / 1e6,
    }


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def spread(runs: list[dict]) -> float:
    """(max - min) / median of MB/s over the repeats: how steady the machine was for this row."""
    values = [r["mb_s"] for r in runs]
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the storage to measure [default: a temp dir here]")
    ap.add_argument("--file-size", type=int, default=512, help="MiB per process")
    ap.add_argument("--procs", default="1,2")
    ap.add_argument("--seq-block-sizes", default="4,64,1024,16384", help="KiB")
    ap.add_argument("--sample-size", type=int, default=8, help="KiB per random read")
    ap.add_argument("--rand-ops", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--cache",
        choices=("both", "direct", "buffered"),
        default="both",
        help="O_DIRECT rows, buffered rows (after posix_fadvise DONTNEED), or both",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not shutil.which("fio"):
        raise SystemExit("fio is not installed: apt-get install -y fio")
    base = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "work")
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench-io-vs-fio-", dir=base)
    config = BenchConfig(
        paths=(root,),
        file_size=args.file_size * MiB,
        sample_size=args.sample_size * KiB,
        rand_ops=args.rand_ops,
        duration=120.0,
        stall_seconds=10.0,
        hang_seconds=120.0,
    )
    modes = [True, False] if direct_supported(root) else [False]
    modes = [m for m in modes if args.cache == "both" or m == (args.cache == "direct")]
    rows = []
    try:
        procs_list = [int(p) for p in args.procs.split(",")]
        for procs in procs_list:
            cases = [("seq-read", int(k) * KiB) for k in args.seq_block_sizes.split(",")]
            cases += [("rand-read", config.sample_size)]
            for pattern, bs in cases:
                for direct in modes:
                    ours, theirs = [], []
                    for i in range(args.repeats):  # back to back, in alternating order: drift hits both alike
                        if i % 2 == 0:
                            ours.append(bench_io(config, root, pattern, bs, procs, direct))
                            theirs.append(fio(config, root, pattern, bs, procs, direct))
                        else:
                            theirs.append(fio(config, root, pattern, bs, procs, direct))
                            ours.append(bench_io(config, root, pattern, bs, procs, direct))
                    row = {
                        "pattern": pattern,
                        "block_size": bs,
                        "procs": procs,
                        "cache": "O_DIRECT" if direct else "fadvise DONTNEED",
                        "bench_io_mb_s": median(ours, "mb_s"),
                        "fio_mb_s": median(theirs, "mb_s"),
                        "bench_io_iops": median(ours, "iops"),
                        "fio_iops": median(theirs, "iops"),
                        "bench_io_p50_ms": median(ours, "p50_ms"),
                        "fio_p50_ms": median(theirs, "p50_ms"),
                        "runs": {"bench_io": ours, "fio": theirs},
                    }
                    # The median of the per-pair ratios: each pair ran back to back, under the same load.
                    row["ratio"] = statistics.median(a["mb_s"] / b["mb_s"] for a, b in zip(ours, theirs))
                    row["within_10pct"] = abs(row["ratio"] - 1) <= 0.10
                    row["fio_spread"], row["bench_io_spread"] = spread(theirs), spread(ours)
                    rows.append(row)
                    print(
                        f"{pattern:9s} bs={bs // KiB:>6} KiB procs={procs} {row['cache']:17s} "
                        f"bench-io {row['bench_io_mb_s']:9.1f} MB/s  fio {row['fio_mb_s']:9.1f} MB/s  "
                        f"ratio {row['ratio']:.3f} {'ok' if row['within_10pct'] else 'OUTSIDE 10%'}  "
                        f"spread bench-io {row['bench_io_spread']:.0%} fio {row['fio_spread']:.0%}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fio_version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    doc = {
        "benchmark": "bench-io vs fio",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": os.uname().release,
            "fio": fio_version,
            "load_average_at_end": os.getloadavg(),
        },
        "file_system": subprocess.run(["df", "-T", base], capture_output=True, text=True).stdout.split("\n")[1],
        "config": {
            "file_size_mib": args.file_size,
            "rand_ops": args.rand_ops,
            "repeats": args.repeats,
            "cache": args.cache,
        },
        "rows": rows,
        "all_within_10pct": all(r["within_10pct"] for r in rows),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"all within 10%: {doc['all_within_10pct']}")
    sys.exit(0 if doc["all_within_10pct"] else 1)


if __name__ == "__main__":
    main()
