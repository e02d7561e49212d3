"""Loader throughput feeding a fixed-compute step, and time to first step, for a blend on CephFS read directly, the
same blend on local disk, and the CephFS blend staged to local disk in the background
(StorageConfig(local_cache_dir=..., local_cache_staging="background")).

    python benchmarks/bench_staging.py [--datasets 500] [--docs 200] [--seconds 40] [--compute-ms 0,20]
        [--micro-batch 8] [--rounds 1] [--out benchmarks/results/staging-<date>.json]

The blend is the first --datasets of bench_blend.py's (200 documents each, seeded weights), on local disk under
benchmarks/work/blend/ and copied to the CephFS of a one-node Ceph cluster that this script starts (tests/
ceph_cluster.py) and stops. Each run is a fresh process: it builds the train split (index cache on local disk,
built before the timed part, as prepare-cache would), then loops for --seconds: take the next micro-batch of
2,048-token samples from corpusforge's loader, then "compute" for --compute-ms (a sleep, as bench-io's `train`
pattern emulates an accelerator). Before each run the page cache of the data is dropped (fadvise per file, dentries
and inodes) and the MDS recalls the client's caches, except for "local-cached": the local blend read from the page
cache, as a staged copy is read right after staging wrote it. Reported: time from the start of the data work (datasets
opened) to the first batch in hand; tokens/s over the whole run, over its first 10 s, and, for the staged run,
before and after staging completed (the status file's time); the seconds staging took.
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
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

SEQ_LENGTH = 2048


def child(spec: dict) -> dict:
    import torch  # noqa: F401 - imported before the timed part, as a training script has

    from corpusforge.data import build_gpt_datasets, make_loader
    from corpusforge.storage import StorageConfig
    from corpusforge.storage.stage import wait_for_staging

    blend, steps_s, compute = spec["blend"], spec["seconds"], spec["compute_ms"] / 1000
    storage = StorageConfig()
    if spec["staged"]:
        storage = StorageConfig(local_cache_dir=spec["local_cache"], local_cache_staging="background")
    samples = 400_000
    # The index cache is built (untimed) by the driver's warm-up run; the timed part starts at the open.
    t_open = time.perf_counter()
    train, _, _ = build_gpt_datasets(blend, SEQ_LENGTH, "1", 1234, (samples, 0, 0), spec["cache"], storage)
    loader = iter(make_loader(train, spec["micro_batch"]))
    batch = next(loader)
    t_first, wall_first = time.perf_counter(), time.time()
    times, tokens = [t_first], [int(batch["tokens"].numel())]
    waits = [0.0]
    while time.perf_counter() - t_first < steps_s:
        time.sleep(compute)
        t0 = time.perf_counter()
        batch = next(loader)
        t1 = time.perf_counter()
        waits.append(t1 - t0)
        times.append(t1)
        tokens.append(int(batch["tokens"].numel()))
    staged_at = None
    if spec["staged"] and wait_for_staging(timeout=0):  # staging ended within the run: when, from its status file
        status = next(Path(spec["local_cache"]).glob("stage-*.json"))
        done = json.loads(status.read_text())
        if done["datasets_done"] == done["datasets"]:
            staged_at = round(status.stat().st_mtime - wall_first, 3)
    return {"first_batch_s": round(t_first - t_open, 3), "times": [round(t - t_first, 4) for t in times],
            "tokens": tokens, "median_wait_ms": round(1000 * statistics.median(waits), 3),
            "staged_at_s": staged_at, "load": round(os.getloadavg()[0], 2)}  # fmt: skip


def rates(run: dict, after: float | None) -> dict:
    times, tokens = run["times"], run["tokens"]

    def rate(lo: float, hi: float) -> float | None:
        picked = [k for k in range(1, len(times)) if lo < times[k] <= hi]
        if len(picked) < 2:
            return None
        return round(sum(tokens[k] for k in picked) / (times[picked[-1]] - times[picked[0] - 1]))

    out = {"tokens_per_s": rate(0, 1e9), "tokens_per_s_first_10s": rate(0, 10)}
    if after is not None:
        out["tokens_per_s_before_staged"] = rate(0, after)
        out["tokens_per_s_after_staged"] = rate(after, 1e9)
    return out


def drop(paths: list[Path], ceph) -> None:
    from corpusforge.storage import drop_page_cache

    for root in paths:
        for p in root.glob("*"):
            if p.is_file():
                drop_page_cache(str(p))
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    if ceph is not None:
        ceph.ceph("tell", "mds.a", "cache", "drop", "30", timeout=90)


def run_child(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{spec['name']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", type=int, default=500)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--compute-ms", default="0,20")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cases", default="cephfs-direct,local,cephfs-staged,local-cached")
    ap.add_argument("--work", type=Path, default=HERE / "work" / "blend")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from bench_blend import blend_list, make_datasets
    from bench_loader import machine_info
    from ceph_cluster import CephCluster

    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"staging-{date}.json"
    machine = machine_info()
    prefixes = make_datasets(args.work, args.datasets, args.docs)[: args.datasets]
    tmp = Path(tempfile.mkdtemp(prefix="ceph-", dir="/tmp"))
    scratch = Path(tempfile.mkdtemp(prefix="staging-", dir=args.work.parent))
    runs: list[dict] = []
    wanted = args.cases.split(",")
    ceph = CephCluster.start(tmp, memstore_bytes=4 << 30)
    try:
        remote = ceph.cephfs_mount / "staging"
        remote.mkdir()
        t0 = time.perf_counter()
        for p in prefixes:
            for ext in (".bin", ".idx"):
                shutil.copyfile(p + ext, remote / (Path(p).name + ext))
        copy_s = time.perf_counter() - t0
        print(f"copied {len(prefixes)} datasets to CephFS in {copy_s:.1f} s", flush=True)
        blends = {"local": blend_list(prefixes), "cephfs": blend_list([str(remote / Path(p).name) for p in prefixes])}
        cache = scratch / "index-cache"
        cases = [("cephfs-direct", "cephfs", False), ("local", "local", False), ("cephfs-staged", "cephfs", True),
                 ("local-cached", "local", False)]  # fmt: skip
        for where in ("local", "cephfs"):  # the index caches, built once, untimed (prepare-cache's job)
            run_child({"name": "warm-up", "blend": blends[where], "seconds": 0, "compute_ms": 0, "staged": False,
                       "cache": str(cache), "micro_batch": args.micro_batch, "local_cache": ""})  # fmt: skip
        for r in range(args.rounds):
            for compute in [float(c) for c in args.compute_ms.split(",")]:
                for name, where, staged in cases if r % 2 == 0 else cases[::-1]:
                    local_cache = scratch / "stage-cache"
                    shutil.rmtree(local_cache, ignore_errors=True)
                    if name not in wanted:
                        continue
                    if name == "local-cached":  # the blend read once into the page cache, as staged copies are
                        for p in prefixes:
                            Path(p + ".bin").read_bytes()
                    else:
                        drop([args.work, remote], ceph)
                    spec = {"name": name, "blend": blends[where], "seconds": args.seconds, "compute_ms": compute,
                            "staged": staged, "cache": str(cache), "micro_batch": args.micro_batch,
                            "local_cache": str(local_cache)}  # fmt: skip
                    load = os.getloadavg()[0]
                    result = run_child(spec)
                    record = {"case": name, "compute_ms": compute, "round": r, "load_before": round(load, 2),
                              "first_batch_s": result["first_batch_s"], "staged_at_s": result["staged_at_s"],
                              "median_wait_ms": result["median_wait_ms"], "load_after": result["load"],
                              **rates(result, result["staged_at_s"])}  # fmt: skip
                    runs.append(record)
                    print(json.dumps(record), flush=True)
    finally:
        ceph.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(runs)
    report = {"benchmark": "staging to node-local disk", "date": date, "machine": machine,
              "config": {k: str(v) for k, v in vars(args).items()}, "copy_to_cephfs_s": round(copy_s, 1),
              "medians": summary, "runs": runs}  # fmt: skip
    out.write_text(json.dumps(report, indent=1) + "\n")
    for key, m in summary.items():
        print(f"{key:28s} " + "  ".join(f"{k} {v}" for k, v in m.items()))
    print(f"wrote {out}")


def summarize(runs: list[dict]) -> dict:
    out: dict[str, dict] = {}
    keys = ("first_batch_s", "tokens_per_s", "tokens_per_s_first_10s", "tokens_per_s_before_staged",
            "tokens_per_s_after_staged", "staged_at_s", "median_wait_ms")  # fmt: skip
    for run in runs:
        out.setdefault(f"{run['case']}/compute={run['compute_ms']:g}ms", []).append(run)  # type: ignore[arg-type]
    summary = {}
    for name, rs in out.items():
        summary[name] = {k: statistics.median(r[k] for r in rs) for k in keys if all(r.get(k) is not None for r in rs)}
    for name, m in summary.items():
        case, compute = name.split("/")
        local = summary.get(f"local/{compute}", {}).get("tokens_per_s")
        cached = summary.get(f"local-cached/{compute}", {}).get("tokens_per_s")
        if case == "cephfs-staged" and local and m.get("tokens_per_s_after_staged"):
            m["after_staged_over_local"] = round(m["tokens_per_s_after_staged"] / local, 3)
            if cached:
                m["after_staged_over_local_cached"] = round(m["tokens_per_s_after_staged"] / cached, 3)
        if case == "cephfs-direct" and local:
            m["over_local"] = round(m["tokens_per_s"] / local, 3)
    return summary


if __name__ == "__main__":
    main()
