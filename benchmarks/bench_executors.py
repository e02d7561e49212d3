"""What running `corpusforge preprocess` on Ray costs against the local executor, on the same input, in one run.

    python benchmarks/bench_executors.py --size-mb 1000 [--workers 2] [--repeats 3] [--cores-per-node 64]
                                         [--out benchmarks/results/executors-<date>.json]

On a realistic JSONL corpus (benchmarks/make_corpus.py; reused when already made), rounds of:

  local        `corpusforge preprocess C --output-prefix P --workers W --json`: forked workers (the default)
  ray          the same with `--executor ray --ray-address auto`, on a Ray cluster of W CPUs that this script
               started beforehand with `ray start --head --num-cpus W --block`: a cluster's steady state, as
               under Slurm, where `ray start` runs once per allocation and jobs come and go. The worker pool
               (corpusforge.executors.pool) is warm from the job before; the first job on the cluster, which starts
               it, is reported apart (ray-first-job)
  ray-per-job  the same with `--ray-keep-workers 0`: every job starts its own worker processes and ends them,
               as Ray does without the pool (and as the first job on a cluster does)
  ray-cold     the same with `--executor ray --workers W` and no cluster: preprocess starts a local Ray itself

and the same local/ray rounds on a `--small-mb` corpus: the difference between the two sizes gives the marginal
cost of a MB under each executor, i.e. the overhead once the fixed start-up is paid (what matters at TB scale).
Then once `--workers 1` (local), the throughput of one worker on one shard at a time: the per-shard rate from
which a cluster's rate follows. `seconds` is the CLI's own timer (from the call to preprocess() to the summary:
connecting to Ray and starting its workers included), `wall` the process from start to exit; the median of the
rounds is reported. The outputs of every run must be byte-identical (sha256 of .bin and .idx) or the run fails.

Rounds alternate the order of the variants, and the Ray overhead is also given per round (ray / local - 1 of
the same round), whose median and range say how far the machine's other load moved the figure.

The parts are copied into the final .bin at their offsets as they finish, overlapped with tokenizing: on one
node by the driver's threads, on several by the nodes themselves (preprocess's _PartMerger), so the copying
no longer funnels through one process. Its rate per node (corpusforge.indexed.merge of the output, onto the same
disk) and the per-shard rate give the expected scaling: input MB/s on N nodes of C cores = min(N x C x per-shard
MB/s, N x per-node copy ceiling, the shared file system's write bandwidth, which is not measured here), plus the
fixed start-up.

Prints a table; writes everything, with the machine, versions and git commit, as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_preprocess import machine_info  # noqa: E402
from make_corpus import MB, CorpusSpec, ensure_corpus  # noqa: E402

CLI = [sys.executable, "-m", "corpusforge.cli"]
TARGET_OVERHEAD = 0.10  # issue 7: the Ray executor within 10% of the local one at 1 GB


def run_cli(corpus: Path, prefix: Path, extra: list[str]) -> dict:
    """One `corpusforge preprocess` run: its JSON summary, wall seconds, and the sha256 of its outputs."""
    args = [*CLI, "preprocess", str(corpus), "--output-prefix", str(prefix), "--tokenizer", "cl100k_base", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run([*args, *extra], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args + extra)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout)
    out = Path(f"{prefix}_text_document")
    digest = {ext: _sha256(Path(f"{out}.{ext}")) for ext in ("bin", "idx")}
    return {"seconds": summary["seconds"], "wall_s": round(wall, 3), "summary": summary, "sha256": digest}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


class RayCluster:
    """`ray start --head --block` in its own process group, stopped by signalling that group (never `ray stop`,
    which would end every Ray process on the machine)."""

    def __init__(self, cpus: int) -> None:
        self.cpus = cpus
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> RayCluster:
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [str(ray_bin), "start", "--head", f"--num-cpus={self.cpus}", "--block", "--include-dashboard=false"]
        cmd.append("--disable-usage-stats")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        probe = "import logging, ray; ray.init(address='auto', logging_level=logging.ERROR); ray.shutdown()"
        deadline = time.time() + 120
        while time.time() < deadline:
            if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
                return self
            if self.proc.poll() is not None:
                raise SystemExit("ray start --head failed")
            time.sleep(1)
        self.__exit__()
        raise SystemExit("the Ray cluster did not come up in 120 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # what `ray stop` would clean: the pointer ray.init(address='auto') follows, now to a dead cluster
        Path("/tmp/ray/ray_current_cluster").unlink(missing_ok=True)


def merge_rate(dataset: Path, work: Path) -> dict:
    """corpusforge.indexed.merge of `dataset` twice into one, onto the same disk, with the streams preprocess uses
    on one node: what one node copies into place, GB/s."""
    from corpusforge import indexed

    out = work / "merge-probe"
    t0 = time.perf_counter()
    indexed.merge([dataset, dataset], out)
    seconds = time.perf_counter() - t0
    nbytes = 2 * (indexed.bin_path(dataset).stat().st_size + indexed.idx_path(dataset).stat().st_size)
    for path_of in (indexed.bin_path, indexed.idx_path):
        path_of(out).unlink()
    gb_s = round(nbytes / 1e9 / seconds, 3)
    return {"bytes": nbytes, "seconds": round(seconds, 3), "gb_s": gb_s, "streams": indexed.MERGE_STREAMS}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small-mb", type=float, default=200, help="second size, for the marginal overhead; 0: none")
    ap.add_argument("--cores-per-node", type=int, default=64, help="for the scaling table")
    ap.add_argument("--work", type=Path, default=HERE / "work" / "bench-executors")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out_json = args.out or HERE / "results" / f"executors-{date}.json"
    corpus, corpus_stats = ensure_corpus(CorpusSpec(size_mb=args.size_mb))
    work = args.work / f"{args.size_mb:g}mb"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    machine = machine_info(None)
    machine["packages"]["ray"] = _version("ray")
    w = str(args.workers)

    small = ensure_corpus(CorpusSpec(size_mb=args.small_mb))[0] if args.small_mb else None
    runs: dict[str, list[dict]] = {
        "local": [], "ray": [], "ray-per-job": [], "ray-cold": [], "local-small": [], "ray-small": [],
    }  # fmt: skip
    on_cluster = ["--executor", "ray", "--ray-address", "auto"]
    variants = (("local", ["--workers", w]), ("ray", on_cluster))
    with RayCluster(args.workers):
        first = run_cli(corpus, work / "ray-first-job", on_cluster)  # starts the worker pool the rounds find warm
        print(f"first job on the cluster: {first['seconds']:7.2f} s", flush=True)
        for r in range(args.repeats):
            for name, extra in variants if r % 2 == 0 else variants[::-1]:
                runs[name].append(run_cli(corpus, work / f"{name}-{r}", extra))
                print(f"round {r + 1}: {name:8s} {runs[name][-1]['seconds']:7.2f} s", flush=True)
            for name, extra in (variants if r % 2 == 0 else variants[::-1]) if small else ():
                runs[f"{name}-small"].append(run_cli(small, work / f"{name}-small-{r}", extra))
                print(f"round {r + 1}: {name}-small {runs[f'{name}-small'][-1]['seconds']:7.2f} s", flush=True)
        # after the rounds: each of these ends the pool it started, so the next finds none
        for r in range(args.repeats):
            runs["ray-per-job"].append(
                run_cli(corpus, work / f"ray-per-job-{r}", [*on_cluster, "--ray-keep-workers", "0"])
            )
            print(f"round {r + 1}: ray-per-job {runs['ray-per-job'][-1]['seconds']:7.2f} s", flush=True)
    # after the cluster is gone: preprocess must start a Ray of its own
    for r in range(args.repeats):
        runs["ray-cold"].append(run_cli(corpus, work / f"ray-cold-{r}", ["--executor", "ray", "--workers", w]))
        print(f"round {r + 1}: ray-cold {runs['ray-cold'][-1]['seconds']:7.2f} s", flush=True)
    single = run_cli(corpus, work / "local-1", ["--workers", "1"])
    merge = merge_rate(work / "local-0_text_document", work)

    hashes = {json.dumps(x["sha256"]) for name, rs in runs.items() if "small" not in name for x in [*rs, single, first]}
    small_hashes = {json.dumps(x["sha256"]) for name, rs in runs.items() if "small" in name for x in rs}
    identical = len(hashes) == 1 and len(small_hashes) <= 1
    small_bytes = small.stat().st_size if small else 0
    report = summarize(args, corpus, corpus_stats, machine, runs, single, merge, identical, small_bytes)
    report["ray_first_job"] = {"seconds": first["seconds"], "wall_s": first["wall_s"]}
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    print(f"\nwrote {out_json}")
    shutil.rmtree(work, ignore_errors=True)
    if not report["check"]["identical"]:
        raise SystemExit("outputs differ between executors: see the JSON")


def summarize(args, corpus, corpus_stats, machine, runs, single, merge, identical: bool, small_bytes: int) -> dict:
    file_bytes = corpus.stat().st_size
    tokens_bytes = single["summary"]["tokens"] * np.dtype(single["summary"]["dtype"]).itemsize
    variants = {}
    for name, rs in runs.items():
        if not rs:
            continue
        sec, wall = statistics.median(x["seconds"] for x in rs), statistics.median(x["wall_s"] for x in rs)
        variants[name] = {
            "seconds": sec,
            "wall_s": wall,
            "file_mb_s": round(file_bytes / MB / sec, 1),
            "runs_seconds": [x["seconds"] for x in rs],
            "runs_wall_s": [x["wall_s"] for x in rs],
            "tasks": rs[0]["summary"]["tasks"],
            "workers": rs[0]["summary"]["workers"],
        }
    local = variants["local"]
    for name in ("ray", "ray-per-job", "ray-cold"):
        v = variants[name]
        v["overhead"] = round(v["seconds"] / local["seconds"] - 1, 4)
        v["overhead_wall"] = round(v["wall_s"] / local["wall_s"] - 1, 4)
        v["extra_seconds"] = round(v["seconds"] - local["seconds"], 3)
    # paired: each round's Ray run against that round's local run, which saw about the same load
    paired = sorted(x["seconds"] / y["seconds"] - 1 for x, y in zip(runs["ray"], runs["local"]))
    variants["ray"]["overhead_per_round"] = [round(x, 4) for x in paired]
    variants["ray"]["overhead_per_round_median"] = round(statistics.median(paired), 4)
    marginal = None
    if small_bytes:  # seconds per extra MB, each executor: the overhead with the start-up taken out
        mb = (file_bytes - small_bytes) / MB
        per_mb = {n: (variants[n]["seconds"] - variants[f"{n}-small"]["seconds"]) / mb for n in ("local", "ray")}
        marginal = {
            "small_mb": round(small_bytes / MB, 1),
            "local_s_per_gb": round(per_mb["local"] * 1000, 3),
            "ray_s_per_gb": round(per_mb["ray"] * 1000, 3),
            "overhead": round(per_mb["ray"] / per_mb["local"] - 1, 4),
            "ray_fixed_extra_s": round(
                variants["ray-small"]["seconds"]
                - variants["local-small"]["seconds"]
                - (per_mb["ray"] - per_mb["local"]) * small_bytes / MB,
                3,
            ),
        }
    per_shard = file_bytes / MB / single["seconds"]  # one worker, one shard at a time
    per_worker_ray = variants["ray"]["file_mb_s"] / args.workers
    # the copy into place carries the tokens (and index): input MB/s at which one node's copying is saturated;
    # every node copies its share of the parts, so the ceiling grows with the nodes (up to the file system's)
    merge_ceiling = merge["gb_s"] * 1e3 * file_bytes / tokens_bytes
    scaling = [
        {
            "nodes": n,
            "cores": n * args.cores_per_node,
            "expected_mb_s": round(min(n * args.cores_per_node * per_shard, n * merge_ceiling)),
            "bound": "merge" if args.cores_per_node * per_shard > merge_ceiling else "tokenizing",
        }
        for n in (1, 2, 4, 8, 16)
    ]
    return {
        "benchmark": "executors",
        "command": ["bench_executors.py", *sys.argv[1:]],
        "machine": machine,
        "workers": args.workers,
        "input": {"path": str(corpus), "file_bytes": file_bytes, "documents": corpus_stats.get("documents")},
        "variants": variants,
        "single_worker": {
            "seconds": single["seconds"],
            "file_mb_s": round(per_shard, 1),
            "tasks": single["summary"]["tasks"],
        },
        "per_worker_mb_s": {"local_1_worker": round(per_shard, 1), "ray": round(per_worker_ray, 1)},
        "marginal": marginal,
        "merge": {**merge, "ceiling_input_mb_s_per_node": round(merge_ceiling)},
        "scaling": {"cores_per_node": args.cores_per_node, "rows": scaling},
        "target": {"overhead": f"< {TARGET_OVERHEAD:.0%}", "met": variants["ray"]["overhead"] < TARGET_OVERHEAD},
        "check": {"identical": identical, "sha256": single["sha256"]},
        "notes": [
            "MB = 10^6 bytes of the JSONL file; seconds = the CLI's own timer, median of the rounds",
            f"load average at start {machine['load_average_at_start']}: other work on the machine adds noise",
        ],
    }


def print_table(report: dict) -> None:
    v = report["variants"]
    print(f"\n{report['input']['file_bytes'] / MB:,.0f} MB, {report['workers']} workers, median of rounds")
    print(f"{'variant':11s} {'seconds':>8s} {'wall s':>8s} {'MB/s':>8s} {'vs local':>9s} {'extra s':>8s}")
    for name in ("local", "ray", "ray-per-job", "ray-cold"):
        x = v[name]
        rel = f"{x['overhead']:+.1%}" if "overhead" in x else ""
        extra = f"{x['extra_seconds']:+.2f}" if "extra_seconds" in x else ""
        print(f"{name:11s} {x['seconds']:8.2f} {x['wall_s']:8.2f} {x['file_mb_s']:8.1f} {rel:>9s} {extra:>8s}")
    if "ray_first_job" in report:
        f = report["ray_first_job"]
        print(f"{'ray, 1st':11s} {f['seconds']:8.2f} {f['wall_s']:8.2f}   (the cluster's first job: starts the pool)")
    if report["marginal"]:
        m = report["marginal"]
        print(
            f"marginal, between {m['small_mb']:g} MB and this size: local {m['local_s_per_gb']} s/GB, ray "
            f"{m['ray_s_per_gb']} s/GB ({m['overhead']:+.1%}); Ray's fixed extra {m['ray_fixed_extra_s']} s"
        )
    s = report["single_worker"]
    print(f"{'1 worker':10s} {s['seconds']:8.2f} {'':8s} {s['file_mb_s']:8.1f}   (per-shard rate)")
    m = report["merge"]
    ceiling = m["ceiling_input_mb_s_per_node"]
    print(f"\ncopy into place: {m['gb_s']} GB/s of tokens per node = input ceiling {ceiling:,} MB/s per node")
    print(f"expected on N nodes x {report['scaling']['cores_per_node']} cores (this machine's per-shard rate):")
    for row in report["scaling"]["rows"]:
        print(f"  {row['nodes']:3d} nodes  {row['expected_mb_s']:8,} MB/s  ({row['bound']}-bound)")
    t = report["target"]
    rounds = ", ".join(f"{x:+.1%}" for x in v["ray"]["overhead_per_round"])
    print(
        f"\nRay overhead {v['ray']['overhead']:+.1%} (medians), "
        f"{v['ray']['overhead_per_round_median']:+.1%} (median of rounds: {rounds}), "
        f"target {t['overhead']}: {'met' if t['met'] else 'NOT met'}; outputs identical: {report['check']['identical']}"
    )


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
