"""Time to first batch of 8 ranks on one node opening a 2,500-dataset blend: corpusforge (one rank per node reads the
indices, storage.node_share_dir) against megatron-core (BlendedMegatronDatasetBuilder: rank 0 builds, a
torch.distributed barrier, then the other ranks load), on a real CephFS (ceph-fuse) and on local disk.

    python benchmarks/bench_startup.py [--ranks 8] [--datasets 2500] [--docs 200] [--samples 2000000]
        [--where cephfs,local] [--caches cold,warm] [--sides megatron,corpusforge,corpusforge-noshare]
        [--rounds 1] [--count-ops] [--out benchmarks/results/startup-<date>.json]

The blend is bench_blend.py's (2,500 token datasets of 200 documents under benchmarks/work/blend/, seeded weights),
copied once to the CephFS of a one-node Ceph cluster that this script starts (tests/ceph_cluster.py: mon, memstore
OSD, MDS, ceph-fuse on loopback) and stops at the end. Each run is `torchrun --standalone --nproc-per-node R` on
gloo; every rank builds the train split (--samples samples of 2,048 tokens) with its index cache directory on the
same file system as the data, then reads its first micro-batch (4 samples at rank * 4). "cold": an empty index
cache directory (the first job on a blend); "warm": the cache left by the cold run of the same side (a restart, or
a cache made by prepare-cache). Before each run the page cache of the data and cache files is dropped
(posix_fadvise DONTNEED per file, and the dentry/inode caches: drop_caches=2) and the MDS recalls the ceph-fuse
client's capabilities and cached inodes (`ceph tell mds.a cache drop`).

Times: from torchrun's launch to the last rank holding its first batch (what a job waits), and, inside the ranks,
from after imports and init_process_group to the first batch (the data path alone). Metadata operations on the
shared file system: the MDS's client requests during the run (`perf dump`, mds_server.handle_client_request), and,
with --count-ops, a further untimed run per side under `strace -f -e trace=%file` counting each rank's system calls
(its threads' included) that name a path under the data or cache directory (open, stat, access, ...), so that
what the leader and the others make can be told apart. Sides alternate order from round to round; medians; load
average with every run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

MICRO_BATCH = 4
SEQ_LENGTH = 2048
SEED = 1234
EOD = 50256


# -- inside a rank ---------------------------------------------------------------------------------------------------


def megatron_train(spec: dict):
    from argparse import Namespace

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    blend = spec["blend"]
    tokenizer = build_tokenizer(Namespace(tokenizer_type="NullTokenizer", vocab_size=50257, tokenizer_metadata=None))
    config = GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ_LENGTH, blend=(blend[0::2], blend[1::2]), split="1",
        path_to_cache=spec["cache"], tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False,
    )  # fmt: skip
    # Megatron-LM's build_train_valid_test_datasets: rank 0 builds, barrier, the others build (load its cache).
    return BlendedMegatronDatasetBuilder(GPTDataset, [spec["samples"], 0, 0], lambda: True, config).build()[0]


def corpusforge_train(spec: dict, share: bool):
    from corpusforge.data import build_gpt_datasets
    from corpusforge.storage import StorageConfig

    storage = StorageConfig(node_share_dir=spec["share_dir"] if share else None)
    train, _, _ = build_gpt_datasets(
        spec["blend"], SEQ_LENGTH, "1", SEED, (spec["samples"], 0, 0), spec["cache"], storage, eod_token_id=EOD
    )  # no barrier: each rank goes on as soon as it has its indices
    return train


def rank_main(spec: dict) -> None:
    t_exec = time.time()
    import torch.distributed as dist

    if spec["side"] == "megatron":
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
        import megatron.core.datasets.gpt_dataset  # noqa: F401
    else:
        import corpusforge.data  # noqa: F401
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t_init = time.time()
    if spec["side"] == "megatron":
        train = megatron_train(spec)
    else:
        train = corpusforge_train(spec, share=spec["side"] == "corpusforge")
    batch = [train[i] for i in range(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)]
    t_batch = time.time()
    first = int(batch[0]["tokens"][:4].sum())
    out = {"rank": rank, "pid": os.getpid(), "t_exec": t_exec, "t_init": t_init, "t_batch": t_batch, "check": first}
    Path(spec["results"], f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------------------------------


def drop_caches(*roots: Path) -> None:
    """The page cache of every file under `roots` (fadvise DONTNEED), then the dentry and inode caches."""
    from corpusforge.storage import drop_page_cache

    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                try:
                    drop_page_cache(os.path.join(dirpath, name))
                except OSError:
                    pass
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("2\n")


def drop_cephfs_client_caches(ceph) -> None:
    """Empty what the ceph-fuse client caches (inodes, dentries, file data): the MDS recalls every capability of
    its clients and trims its own cache (`ceph tell mds.a cache drop`), after the kernel has forgotten the FUSE
    inodes (drop_caches=2, in drop_caches). A remount would do as much but waits on the old client's session."""
    ceph.ceph("tell", "mds.a", "cache", "drop", "30", timeout=90)


def mds_requests(ceph) -> int | None:
    if ceph is None:
        return None
    asok = ceph.root / "run" / "mds.a.asok"
    dump = subprocess.run(["ceph", "--admin-daemon", str(asok), "perf", "dump"], capture_output=True, text=True)
    return int(json.loads(dump.stdout)["mds_server"]["handle_client_request"])


def launch(spec: dict, ranks: int, strace_dir: Path | None = None) -> tuple[float, list[dict]]:
    results = Path(spec["results"])
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    spec_file = results / "spec.json"
    spec_file.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               __file__, "--rank", str(spec_file)]  # fmt: skip
    if strace_dir is not None:
        traced = "trace=%file,clone,clone3"  # clone: which thread belongs to which rank
        command = ["strace", "-f", "-ff", "-qq", "-e", traced, "-o", str(strace_dir / "t"), *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    t0 = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{spec['side']} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return t0, [json.loads((results / f"rank{r}.json").read_text()) for r in range(ranks)]


def count_ops(strace_dir: Path, ranks: list[dict], roots: list[str]) -> dict:
    """Per rank (its threads included: megatron-core builds on a thread pool): the traced calls naming a path under
    `roots`, by system call and kind of file (".idx", ".bin", ".npy", ".json", other: directories and locks)."""
    pattern = re.compile(r"^(\w+)\(.*?\"((?:" + "|".join(re.escape(r) for r in roots) + r')[^"]*)"')
    thread = re.compile(r"^clone3?\(.*CLONE_THREAD.*\)\s+=\s+(\d+)")
    owner: dict[int, int] = {}  # thread id -> the thread that created it
    for trace in strace_dir.glob("t.*"):
        for line in trace.read_text(errors="replace").splitlines():
            m = thread.match(line)
            if m:
                owner[int(m.group(1))] = int(trace.name[2:])

    def process_of(tid: int) -> int:
        while tid in owner:
            tid = owner[tid]
        return tid

    calls: dict[int, Counter] = {r["pid"]: Counter() for r in ranks}
    for trace in strace_dir.glob("t.*"):
        pid = process_of(int(trace.name[2:]))
        if pid not in calls:
            continue
        for line in trace.read_text(errors="replace").splitlines():
            m = pattern.match(line)
            if m:
                kind = next((k for k in (".idx", ".bin", ".npy", ".json") if m.group(2).endswith(k)), "other")
                calls[pid][f"{m.group(1)} {kind}"] += 1
    return {r["rank"]: dict(sorted(calls[r["pid"]].items())) for r in ranks}


def op_costs(where: str, root: Path, blend: list, ceph) -> dict:
    """What one metadata operation costs here, cold: a stat of each .bin, then an open + read + close of each .idx
    (after the caches are dropped again), one process, in the blend's order; milliseconds per operation."""
    prefixes = blend[0::2]
    out = {}
    for name, op in (("stat_ms", _stat_bin), ("open_read_close_ms", _read_idx)):
        drop_caches(root, Path(prefixes[0]).parent)
        if where == "cephfs":
            drop_cephfs_client_caches(ceph)
        t0 = time.perf_counter()
        for prefix in prefixes:
            op(prefix)
        out[name] = round(1000 * (time.perf_counter() - t0) / len(prefixes), 4)
    return out


def _stat_bin(prefix: str) -> None:
    os.stat(f"{prefix}.bin")


def _read_idx(prefix: str) -> None:
    fd = os.open(f"{prefix}.idx", os.O_RDONLY)
    os.read(fd, 1 << 20)
    os.close(fd)


def one_run(args, ceph, side: str, where: str, cache: str, roots: dict, blends: dict, count: bool) -> dict:
    root = roots[where]
    cache_dir = root / f"cache-{side}"
    if cache == "cold":
        shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(exist_ok=True)
    share_dir = Path("/dev/shm") / f"bench-startup-{os.getpid()}"
    shutil.rmtree(share_dir, ignore_errors=True)
    data_root = Path(blends[where][0]).parent
    drop_caches(root, data_root)
    if where == "cephfs":
        drop_cephfs_client_caches(ceph)
    results = Path(tempfile.gettempdir()) / "bench-startup-ranks"
    spec = {"side": side, "blend": blends[where], "cache": str(cache_dir), "samples": args.samples,
            "share_dir": str(share_dir), "results": str(results)}  # fmt: skip
    load = os.getloadavg()[0]
    before = mds_requests(ceph) if where == "cephfs" else None
    strace_dir = Path(tempfile.mkdtemp(prefix="strace-")) if count else None
    t0, ranks = launch(spec, args.ranks, strace_dir)
    record = {"side": side, "where": where, "cache": cache, "load_before": round(load, 2),
              "launch_to_first_batch_s": round(max(r["t_batch"] for r in ranks) - t0, 3),
              "init_to_first_batch_s": round(max(r["t_batch"] - r["t_init"] for r in ranks), 3),
              "imports_and_init_s": round(max(r["t_init"] - r["t_exec"] for r in ranks), 3),
              "load_after": round(os.getloadavg()[0], 2), "check": [r["check"] for r in ranks]}  # fmt: skip
    if before is not None:
        record["mds_requests"] = mds_requests(ceph) - before
    if strace_dir is not None:
        record["syscalls_by_rank"] = count_ops(strace_dir, ranks, [str(root), str(data_root)])
        record["syscalls_per_rank"] = {k: sum(v.values()) for k, v in record["syscalls_by_rank"].items()}
        shutil.rmtree(strace_dir)
    shutil.rmtree(share_dir, ignore_errors=True)
    return record


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        rank_main(json.loads(Path(sys.argv[2]).read_text()))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--datasets", type=int, default=2500)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--samples", type=int, default=2_000_000)
    ap.add_argument("--where", default="cephfs,local")
    ap.add_argument("--caches", default="cold,warm")
    ap.add_argument("--sides", default="megatron,corpusforge,corpusforge-noshare")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--count-ops", action="store_true", help="one more untimed run per side and place under strace")
    ap.add_argument("--count-caches", default=None, help="cache states of the counted runs (default: --caches)")
    ap.add_argument("--work", type=Path, default=HERE / "work" / "blend")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from bench_blend import blend_list, make_datasets
    from bench_loader import machine_info

    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"startup-{date}.json"
    machine = machine_info()
    prefixes = make_datasets(args.work, args.datasets, args.docs)
    wheres, caches, sides = args.where.split(","), args.caches.split(","), args.sides.split(",")
    local_root = Path(tempfile.mkdtemp(prefix="startup-local-", dir=args.work.parent))
    roots, blends = {"local": local_root}, {"local": blend_list(prefixes)}
    ceph = None
    runs: list[dict] = []
    counted: list[dict] = []
    costs: dict = {}
    tmp = Path(tempfile.mkdtemp(prefix="ceph-", dir="/tmp"))
    try:
        if "cephfs" in wheres:
            from ceph_cluster import CephCluster

            ceph = CephCluster.start(tmp, memstore_bytes=6 << 30)
            t0 = time.perf_counter()
            roots["cephfs"] = ceph.cephfs_mount / "startup"
            shutil.copytree(
                args.work, roots["cephfs"] / "blend", ignore=shutil.ignore_patterns("*prepare-*", "*blend-*")
            )
            blends["cephfs"] = blend_list([str(roots["cephfs"] / "blend" / Path(p).name) for p in prefixes])
            print(f"copied the blend to CephFS in {time.perf_counter() - t0:.1f} s", flush=True)
        costs = {where: op_costs(where, roots[where], blends[where], ceph) for where in wheres}
        print(f"cold metadata operations: {json.dumps(costs)}", flush=True)
        for r in range(args.rounds):
            for where in wheres:
                for cache in caches:
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        runs.append(one_run(args, ceph, side, where, cache, roots, blends, count=False))
                        print(json.dumps(runs[-1]), flush=True)
        if args.count_ops:
            for where in wheres:
                for cache in (args.count_caches or args.caches).split(","):
                    for side in sides:
                        counted.append(one_run(args, ceph, side, where, cache, roots, blends, count=True))
                        print(json.dumps(counted[-1]), flush=True)
    finally:
        if ceph is not None:
            ceph.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(local_root, ignore_errors=True)
    summary = summarize(runs, args.datasets)
    report = {"benchmark": "time to first batch, one node", "date": date, "machine": machine,
              "config": {**{k: str(v) for k, v in vars(args).items()}, "micro_batch": MICRO_BATCH,
                         "seq_length": SEQ_LENGTH},
              "medians": summary, "cold_op_ms": costs, "runs": runs, "counted_runs": counted}  # fmt: skip
    out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(summary)
    print(f"wrote {out}")


def summarize(runs: list[dict], datasets: int) -> dict:
    keys = ("launch_to_first_batch_s", "init_to_first_batch_s", "imports_and_init_s", "mds_requests")
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(f"{run['where']}/{run['cache']}/{run['side']}", []).append(run)
    out = {}
    for name, rs in groups.items():
        out[name] = {k: statistics.median(r[k] for r in rs) for k in keys if k in rs[0]}
        if "mds_requests" in out[name]:
            out[name]["mds_requests_per_dataset"] = round(out[name]["mds_requests"] / datasets, 2)
    for name in list(out):
        where, cache, side = name.split("/")
        mega = out.get(f"{where}/{cache}/megatron")
        if side != "megatron" and mega:
            out[name]["fraction_of_megatron_launch"] = round(
                out[name]["launch_to_first_batch_s"] / mega["launch_to_first_batch_s"], 3
            )
            out[name]["fraction_of_megatron_data_path"] = round(
                out[name]["init_to_first_batch_s"] / mega["init_to_first_batch_s"], 3
            )
    return out


def print_table(summary: dict) -> None:
    head = f"{'launch->batch s':>16s} {'init->batch s':>14s} {'MDS req':>9s} {'x megatron':>11s}"
    print(f"\n{'where/cache/side':40s} {head}")
    for name, m in summary.items():
        frac = m.get("fraction_of_megatron_launch", "")
        print(f"{name:40s} {m['launch_to_first_batch_s']:16.2f} {m['init_to_first_batch_s']:14.2f} "
              f"{m.get('mds_requests', '-')!s:>9s} {frac!s:>11s}")  # fmt: skip


if __name__ == "__main__":
    main()
