"""prepare-cache --megatron against megatron-core writing the same cache files, on a blend of many small datasets.

    python benchmarks/bench_prepare_cache.py [--datasets 2500] [--docs 200] [--samples 2000000]
        [--seq-length 2048] [--split 1] [--rounds 3] [--out benchmarks/results/prepare-cache-<date>.json]

The blend is bench_blend.py's (--datasets token datasets of --docs documents, lengths uniform in [1, 2000), seeded
weights in [0.5, 1.5), under benchmarks/work/blend/). Each run is a fresh interpreter, the sides alternating which
goes first, writing into an empty cache directory of its own; every run's cache is kept until the last round and
deleted at the end. Why not between runs: this machine's ext4 has no journal, and there a new inode skips every
inode of its block group freed in the last 60 s (360 s while its inode-table block is dirty: ext4's
recently_deleted(), one buffer-cache lookup each), so that the 10,003 files of a run that follows the deletion of the
previous run's 10,003 cost up to 3 s of system time instead of 0.2-0.4 (perf: find_get_block_common and
recently_deleted under __ext4_new_inode). With --delete-between, the old method (each run's previous cache deleted
and synced before it), the runs measure that:

- megatron-core: BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0]) with Megatron-LM's NullTokenizer and
  path_to_cache, as tools/prepare_cache.py calls it (np.save, no fsync);
- corpusforge: prepare_megatron_cache with the same arguments (the directory is empty: its files written in a
  staging directory beside it and published by one rename; durable, the default: one syncfs before the rename).

Timed from the first line of work to the files complete (imports timed apart: each side the modules its builder
uses, megatron-core's dataset modules, corpusforge's blended, gpt_dataset, storage.datasets and prepare_cache; wall
and CPU time, user + system of every thread: on a loaded machine the CPU time is the steadier figure), and the whole
process's wall time as the parent sees it. The last round checks that both directories hold the same file names
with the same bytes. Prints a table (medians, load average before and after each run; the system time of each run,
which is the files' creation in the kernel, apart) and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_blend import SEED, blend_list, make_datasets  # noqa: E402

VOCAB = 50257


def megatron_side(blend: list, spec: dict, cache: Path) -> float:
    from argparse import Namespace

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    tokenizer = build_tokenizer(Namespace(tokenizer_type="NullTokenizer", vocab_size=VOCAB, tokenizer_metadata=None))
    config = GPTDatasetConfig(
        random_seed=SEED, sequence_length=spec["seq_length"], blend=(blend[0::2], blend[1::2]), split=spec["split"],
        path_to_cache=str(cache), tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False,
    )  # fmt: skip
    BlendedMegatronDatasetBuilder(GPTDataset, [spec["samples"], 0, 0], lambda: True, config).build()
    return 0.0  # np.save, no fsync


def corpusforge_side(blend: list, spec: dict, cache: Path) -> float:
    """Returns the seconds spent in syncfs (which also writes other jobs' dirty data of the file system)."""
    from corpusforge.data.prepare_cache import MegatronCacheConfig, prepare_megatron_cache

    data_path = tuple(str(x) for p, w in zip(blend[0::2], blend[1::2]) for x in (w, p))  # Megatron's order
    config = MegatronCacheConfig(
        data_path, str(cache), spec["seq_length"], split=spec["split"], seed=SEED, train_samples=spec["samples"],
        valid_samples=0, test_samples=0, vocab_size=VOCAB, durable=spec["fsync"],
    )  # fmt: skip
    return prepare_megatron_cache(config).sync_seconds


def child(side: str, spec: dict) -> dict:
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    if side == "megatron":
        import torch.distributed

        torch.distributed.get_rank = lambda *a, **k: 0  # its BlendedDataset asks even without a process group
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
        import megatron.core.datasets.gpt_dataset  # noqa: F401
    else:  # the modules its build uses, as for megatron-core (prepare_cache imports them where used, for --help)
        import corpusforge.data.blended  # noqa: F401
        import corpusforge.data.gpt_dataset  # noqa: F401
        import corpusforge.data.prepare_cache  # noqa: F401
        import corpusforge.storage.datasets  # noqa: F401
    imported = time.perf_counter() - t0
    blend = blend_list(make_datasets(Path(spec["work"]), spec["datasets"], spec["docs"]))
    cache = Path(spec["cache"])
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    sync_s = (megatron_side if side == "megatron" else corpusforge_side)(blend, spec, cache)
    seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    files = [n for n in os.listdir(cache) if not n.startswith(".")]
    return {
        "import_s": round(imported, 3),
        "build_s": round(seconds, 3),
        "build_cpu_s": round(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, 3),  # every thread, user + sys
        "build_sys_s": round(r1.ru_stime - r0.ru_stime, 3),
        "sync_s": round(sync_s, 3),
        "files": len(files),
        "bytes": sum((cache / n).stat().st_size for n in files),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def same_files(a: Path, b: Path) -> bool:
    names = sorted(n for n in os.listdir(a) if not n.startswith("."))
    if names != sorted(n for n in os.listdir(b) if not n.startswith(".")):
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], json.loads(sys.argv[3]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", type=int, default=2500)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--samples", type=int, default=2_000_000)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--split", default="1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-fsync", dest="fsync", action="store_false", help="corpusforge without its syncfs")
    ap.add_argument("--delete-between", action="store_true", help="delete each run's cache before the next run")
    ap.add_argument("--work", type=Path, default=HERE / "work" / "blend")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from bench_loader import machine_info

    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"prepare-cache-{date}.json"
    make_datasets(args.work, args.datasets, args.docs)
    spec = {"work": str(args.work), "datasets": args.datasets, "docs": args.docs, "samples": args.samples,
            "seq_length": args.seq_length, "split": args.split, "fsync": args.fsync,
            "delete_between": args.delete_between}  # fmt: skip
    runs: dict[str, list[dict]] = {"megatron": [], "corpusforge": []}
    caches: dict[str, Path] = {}
    kept: list[Path] = []
    for r in range(args.rounds):
        for side in ("megatron", "corpusforge") if r % 2 == 0 else ("corpusforge", "megatron"):
            cache = Path(tempfile.mkdtemp(prefix=f"prepare-{side}-", dir=args.work))
            t0 = time.perf_counter()
            command = [sys.executable, __file__, "--child", side, json.dumps({**spec, "cache": str(cache)})]
            proc = subprocess.run(command, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
            runs[side].append({**json.loads(proc.stdout.strip().splitlines()[-1]), "process_wall_s": round(wall, 3)})
            print(f"round {r + 1} {side:12s} " + "  ".join(f"{k} {v}" for k, v in runs[side][-1].items()), flush=True)
            if r == args.rounds - 1:
                caches[side] = cache
            elif args.delete_between:
                shutil.rmtree(cache)
                os.sync()  # the deletions' write-back, here rather than inside the next timed run
            else:
                kept.append(cache)
    identical = same_files(caches["megatron"], caches["corpusforge"])
    for cache in [*kept, *caches.values()]:
        shutil.rmtree(cache)
    keys = ("import_s", "build_s", "build_cpu_s", "build_sys_s", "sync_s", "process_wall_s", "peak_rss_mb")
    medians = {side: {k: round(statistics.median(x[k] for x in rs), 3) for k in keys} for side, rs in runs.items()}
    ratio = round(medians["megatron"]["build_s"] / medians["corpusforge"]["build_s"], 2)
    cpu_ratio = round(medians["megatron"]["build_cpu_s"] / medians["corpusforge"]["build_cpu_s"], 2)
    wall_ratio = round(medians["megatron"]["process_wall_s"] / medians["corpusforge"]["process_wall_s"], 2)
    # Each round's own ratio (the two runs of a round are minutes apart at most): how reliably a target is met.
    rounds = [round(m["build_s"] / c["build_s"], 2) for m, c in zip(runs["megatron"], runs["corpusforge"])]
    report = {
        "benchmark": "prepare-cache --megatron",
        "date": date,
        "machine": machine_info(),
        "config": {
            **spec,
            "rounds": args.rounds,
            "weights": "uniform [0.5, 1.5), seed 1",
            "tokenizer": "NullTokenizer",
        },
        "medians": medians,
        "build_ratio_megatron_over_corpusforge": ratio,
        "build_cpu_ratio_megatron_over_corpusforge": cpu_ratio,
        "process_wall_ratio_megatron_over_corpusforge": wall_ratio,
        "round_build_ratios": rounds,
        "same_files_same_bytes": identical,
        "files": runs["megatron"][-1]["files"],
        "runs": runs,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'median of ' + str(args.rounds):16s} {'import s':>9s} {'build s':>9s} {'process s':>10s} {'RSS MB':>8s}")
    for side, m in medians.items():
        print(
            f"{side:16s} {m['import_s']:9.3f} {m['build_s']:9.3f} {m['process_wall_s']:10.3f} {m['peak_rss_mb']:8.1f}"
        )
    print(f"\nbuild: megatron-core / corpusforge = {ratio}x (CPU {cpu_ratio}x, whole process {wall_ratio}x); "
          f"{report['files']:,} files, same names and bytes: {identical}")  # fmt: skip
    print(f"each round's build ratio: {rounds} (lowest {min(rounds)}x)")
    print(f"wrote {out}")
    if not identical:
        raise SystemExit("the cache files differ")


if __name__ == "__main__":
    main()
