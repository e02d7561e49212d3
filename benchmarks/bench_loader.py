"""corpusforge's GPT loader against megatron-core's GPTDataset on the same generated token dataset, in one run.

    python benchmarks/bench_loader.py [--tokens 1e9] [--docs 1e6] [--seq-length 2048] [--samples 16000]
                                      [--cold-samples 2000] [--out benchmarks/results/loader-<date>.json]

The dataset (uint16 tokens, GPT-2's vocabulary size; document lengths uniform in [1, 2 * tokens/docs)) is written
once under benchmarks/work/loader/ and reused. Then, for both implementations:

  build    train/valid/test indices with split 969,30,1 and one epoch of train samples, each into an emptied
           cache directory (megatron-core: BlendedMegatronDatasetBuilder with its compiled helpers_cpp, which
           always writes its .npy caches, without fsync; corpusforge: build_gpt_datasets with cache_dir, which
           returns while a background thread writes, fsyncs and completes the caches, and without cache_dir);
           seconds until the datasets are returned, best and median of --build-repeats interleaved rounds (each
           cache directory emptied outside the timing); for corpusforge also the seconds until its cache files are
           written and complete (wait_for_index_files: the same work as megatron-core's np.save, the fair
           comparison) and until they are durable (wait_for_index_caches: fsyncs, which megatron-core skips).
  warm     the .bin read into the page cache first; samples/s over the first --samples samples of train (shuffled
           order), one process (megatron: ds[i] per sample; corpusforge: __getitems__ of micro-batches of 8, torch
           int32 tensors) and through a torch DataLoader with 2 workers (batch 8; corpusforge's make_loader, whose
           workers send the samples' raw text for the main process to assemble).
  cold     the .bin evicted (posix_fadvise DONTNEED) before each run; --cold-samples samples; bytes read from the
           block device by this process and its reaped workers (getrusage ru_inblock, 512-byte units), against
           the bytes of the samples read (samples * (seq_length + 1) * itemsize). corpusforge in each read mode,
           and in the default "auto" twice: as it decides on this machine, and with auto_direct_above_bytes=0, as
           it decides for a .bin larger than the page cache (the row records the mode chosen and why).
  memory   bytes of the document, sample and shuffle index at this size (measured) and at 1e12 tokens (formula).

Prints a table; writes everything, with the machine, versions and git commit, as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from corpusforge.data import StorageConfig, build_gpt_datasets, make_loader  # noqa: E402
from corpusforge.data.cache import wait_for_index_caches, wait_for_index_files  # noqa: E402
from corpusforge.indexed import IndexedDatasetWriter  # noqa: E402
from corpusforge.storage.pagecache import drop_page_cache  # noqa: E402

VOCAB = 50257
EOD = 50256
SPLIT = "969,30,1"
SEED = 1234


# ---------------------------------------------------------------------------------------------------------------
# data


def make_dataset(prefix: Path, tokens: int, docs: int, seed: int = 0) -> float:
    """Write `docs` documents totalling exactly `tokens` uint16 tokens; returns seconds (0 when it existed)."""
    if Path(f"{prefix}.idx").exists() and Path(f"{prefix}.bin").exists():
        return 0.0
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    mean = tokens / docs
    lengths = rng.integers(1, int(2 * mean), size=docs, dtype=np.int64)
    lengths = np.maximum(1, np.round(lengths * (tokens / lengths.sum()))).astype(np.int64)
    diff = int(tokens - lengths.sum())  # rounding leaves ~1e-4 of the total: one token more or less for some docs
    lengths[rng.choice(np.flatnonzero(lengths > 1), abs(diff), replace=False)] += np.sign(diff)
    assert lengths.min() >= 1 and lengths.sum() == tokens
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        step = 50_000
        for lo in range(0, docs, step):
            part = lengths[lo : lo + step]
            values = rng.integers(0, EOD, size=int(part.sum()), dtype=np.uint16)
            values[np.cumsum(part) - 1] = EOD
            w.add_documents(values, part)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------
# the two implementations


class StandInTokenizer:
    """What megatron-core's GPTDataset reads from a tokenizer, and nothing else."""

    eod = EOD
    vocab_size = VOCAB
    unique_identifiers = {"class": "StandInTokenizer"}


def fresh(directory: Path) -> Path:
    """An empty directory: each timed build writes its index caches anew."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def megatron_build(prefix: str, seq_length: int, sizes: list[int], cache: Path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=SPLIT,
        path_to_cache=str(cache),  # None would cache next to the dataset, and reload instead of building
        tokenizer=StandInTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def ours_build(
    prefix: str,
    seq_length: int,
    sizes: list[int],
    read_mode: str = "auto",
    cache: Path | None = None,
    auto_direct_above_bytes: int | None = None,
):
    storage = StorageConfig(read_mode=read_mode, auto_direct_above_bytes=auto_direct_above_bytes)
    return build_gpt_datasets(prefix, seq_length, SPLIT, SEED, sizes, cache, storage, eod_token_id=EOD)


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        out = None
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


# ---------------------------------------------------------------------------------------------------------------
# reading


def read_single(ds, n: int, ours: bool, batch: int = 8) -> None:
    if ours:
        for lo in range(0, n, batch):
            ds.__getitems__(list(range(lo, min(n, lo + batch))))
    else:
        for i in range(n):
            ds[i]


def read_loader(ds, n: int, ours: bool, batch: int = 8, workers: int = 2) -> None:
    import torch

    if ours:
        loader = make_loader(ds, micro_batch_size=batch, dp_rank=0, dp_world_size=1, num_workers=workers)
    else:
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, sampler=range(n), num_workers=workers)
    seen = 0
    for b in loader:
        seen += len(b["tokens"])
        if seen >= n:
            break
    del loader


def block_read_bytes() -> int:
    """Bytes read from block devices by this process and its reaped children (ru_inblock counts 512-byte units)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_inblock
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    return (own + children) * 512


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def measure(run, n: int, sample_bytes: int, cold_path: str | None = None, repeats: int = 1) -> dict:
    """samples/s of run(n) (best of repeats); with cold_path, evicted first and bytes read counted."""
    best = None
    for _ in range(repeats if cold_path is None else 1):
        if cold_path:
            drop_page_cache(cold_path)
        before = block_read_bytes()
        t0 = time.perf_counter()
        run(n)
        seconds = time.perf_counter() - t0
        read = block_read_bytes() - before
        result = {"samples": n, "seconds": round(seconds, 3), "samples_per_s": round(n / seconds, 1)}
        if cold_path:
            result["bytes_read"] = read
            result["read_amplification"] = round(read / (n * sample_bytes), 2)
        if best is None or result["samples_per_s"] > best["samples_per_s"]:
            best = result
    return best


# ---------------------------------------------------------------------------------------------------------------
# memory


def index_bytes(ds) -> dict[str, int]:
    return {name: int(getattr(ds, name).nbytes) for name in ("document_index", "sample_index", "shuffle_index")}


def index_bytes_formula(tokens: float, docs: float, seq_length: int, epochs: int = 1) -> dict[str, int]:
    """Bytes of each index for one split of `tokens` tokens in `docs` documents (Megatron's dtypes, which are ours):
    document index int32 per document per epoch; sample index (S + 1) x 2 of int32, int64 once the document index
    or a document passes 2^31; shuffle index uint32 per sample, int64 past 2^32 - 2 samples."""
    samples = int(epochs * tokens // seq_length)
    doc_entries = int(docs * epochs)
    sample_item = 4 if doc_entries <= 2**31 - 1 else 8
    shuffle_item = 4 if samples < 2**32 - 2 else 8
    return {
        "document_index": 4 * doc_entries,
        "sample_index": 2 * sample_item * (samples + 1),
        "shuffle_index": shuffle_item * samples,
        "idx_file_mapped": int(34 + 12 * docs + 8 * (docs + 1)),
    }


# ---------------------------------------------------------------------------------------------------------------
# the run


def machine_info() -> dict:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    versions = {}
    for name in ("corpusforge", "megatron-core", "numpy", "torch"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout)
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu,
        "cpus_available": len(os.sched_getaffinity(0)),
        "ram_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
        "git": {"commit": git, "dirty": dirty},
    }


def run_reads(spec: dict) -> dict:
    """One read run in this (fresh) process: warm or evict the .bin, open the cached indices, read, measure."""
    import torch.distributed

    torch.distributed.get_rank = lambda *a, **k: 0
    caches = Path(spec["caches"])
    chosen = {}
    bin_path = spec["prefix"] + ".bin"
    # Cached or evicted before the dataset is opened, as at the start of a job: read_mode "auto" looks at how much
    # of the .bin is cached when it opens it.
    if spec["temp"] == "warm":
        warm(bin_path)
    else:
        drop_page_cache(bin_path)
    if spec["impl"] == "megatron":
        ds = megatron_build(spec["prefix"], spec["seq"], spec["sizes"], caches / "m")[0]
    else:
        ds = ours_build(spec["prefix"], spec["seq"], spec["sizes"], spec["mode"], caches / "o", spec.get("budget"))[0]
        chosen = {"read_mode": ds.indexed.read_mode, "why": ds.indexed.read_mode_reason}
    ours = spec["impl"] == "corpusforge"
    read_single(ds, 64, ours)  # first-call costs (numba loading, torch imports) are not throughput
    if spec["how"] == "single":
        run = lambda k: read_single(ds, k, ours)  # noqa: E731
    else:
        run = lambda k: read_loader(ds, k, ours)  # noqa: E731
    if spec["temp"] == "warm":
        warm(bin_path)
        return {**measure(run, spec["n"], spec["sample_bytes"], None, spec["repeats"]), **chosen}
    return {**measure(run, spec["n"], spec["sample_bytes"], bin_path), **chosen}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--run":
        print(json.dumps(run_reads(json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=1e9)
    ap.add_argument("--docs", type=float, default=1e6)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=16000, help="samples per warm throughput run")
    ap.add_argument("--cold-samples", type=int, default=2000, help="samples per cold run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--build-repeats", type=int, default=15, help="interleaved rounds of the (~0.1 s) index builds")
    ap.add_argument("--work", type=Path, default=HERE / "work" / "loader")
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"loader-{dt.date.today().isoformat()}.json")
    args = ap.parse_args()
    import torch.distributed

    torch.distributed.get_rank = lambda *a, **k: 0  # megatron-core asks even without a process group
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401  (imports outside the timings)
    import megatron.core.datasets.gpt_dataset  # noqa: F401

    tokens, docs, seq = int(args.tokens), int(args.docs), args.seq_length
    prefix = args.work / f"gen_{tokens:.0e}tok_{docs:.0e}doc_text_document".replace("+", "")
    gen_s = make_dataset(prefix, tokens, docs)
    prefix_s, bin_path = str(prefix), f"{prefix}.bin"
    train_tokens = tokens * 969 // 1000
    sizes = [train_tokens // seq - 1, tokens * 30 // 1000 // seq - 1, max(1, tokens // 1000 // seq - 1)]
    report: dict = {"machine": machine_info(), "config": {**vars(args), "work": str(args.work), "out": str(args.out)}}
    report["dataset"] = {
        "prefix": prefix_s,
        "tokens": tokens,
        "documents": docs,
        "dtype": "uint16",
        "bin_bytes": os.path.getsize(bin_path),
        "generate_s": round(gen_s, 1),
        "num_samples": sizes,
    }

    # build
    caches = args.work / "index-caches"
    t0 = time.perf_counter()
    ours_build(prefix_s, seq, sizes)  # numba compiles, or loads its cached machine code: once per process
    first_call_s = time.perf_counter() - t0
    # Builds take ~0.1 s: interleave and repeat them more than the reads, so that a busy neighbour hurts both.
    times: dict[str, list[float]] = {"megatron": [], "corpusforge": [], "files": [], "durable": [], "memory": []}
    for _ in range(args.build_repeats):
        fresh(caches / "m")
        t, m_sets = best_time(lambda: megatron_build(prefix_s, seq, sizes, caches / "m"), 1)
        times["megatron"].append(t)
        fresh(caches / "o")
        t0 = time.perf_counter()
        o_sets = ours_build(prefix_s, seq, sizes, cache=caches / "o")
        t1 = time.perf_counter()
        wait_for_index_files()  # the .npy files complete, as megatron-core leaves its own (np.save, no fsync)
        t2 = time.perf_counter()
        wait_for_index_caches()  # outside the next timings: its fsyncs would slow whichever build comes next
        times["corpusforge"].append(t1 - t0)
        times["files"].append(t2 - t0)
        times["durable"].append(time.perf_counter() - t0)
        times["memory"].append(best_time(lambda: ours_build(prefix_s, seq, sizes), 1)[0])
    m_build, o_build, o_files, o_durable, o_build_mem = (
        min(times[k]) for k in ("megatron", "corpusforge", "files", "durable", "memory")
    )
    m_train, o_train = m_sets[0], o_sets[0]
    check = o_train.get_batch([0, 1, 2, len(o_train) - 1])["tokens"]
    for row, i in enumerate([0, 1, 2, len(o_train) - 1]):  # same samples, or the comparison means nothing
        np.testing.assert_array_equal(check[row], m_train[i]["tokens"].numpy())
    report["build_s"] = {
        "megatron": round(m_build, 3),
        "corpusforge": round(o_build, 3),
        "corpusforge_until_cache_files_written": round(o_files, 3),
        "corpusforge_until_caches_durable": round(o_durable, 3),
        "corpusforge_no_cache_files": round(o_build_mem, 3),
        "corpusforge_first_build_in_process": round(first_call_s, 3),
        "median": {k: round(float(np.median(v)), 3) for k, v in times.items()},
        "rounds": args.build_repeats,
    }

    # memory
    report["index_bytes"] = {
        "measured": {"megatron": index_bytes(m_train), "corpusforge": index_bytes(o_train)},
        "formula_this_size": index_bytes_formula(train_tokens, docs * 0.969, seq),
        "formula_1e12_tokens": index_bytes_formula(1e12, 1e12 / (tokens / docs), seq),
    }

    sample_bytes = (seq + 1) * 2
    n, nc = min(args.samples, len(o_train)), min(args.cold_samples, len(o_train))
    del m_sets, o_sets, m_train, o_train, check  # unmap: pages mapped here could not be evicted for the cold runs
    gc.collect()
    plan = [  # (label, implementation, read mode, single or loader, warm or cold, samples, auto's budget override)
        ("warm megatron ds[i]", "megatron", "mmap", "single", "warm", n, None),
        ("warm corpusforge batch (auto, default)", "corpusforge", "auto", "single", "warm", n, None),
        ("warm corpusforge batch (pread)", "corpusforge", "pread", "single", "warm", n, None),
        ("warm megatron DataLoader(2)", "megatron", "mmap", "loader", "warm", n, None),
        ("warm corpusforge loader(2) (auto, default)", "corpusforge", "auto", "loader", "warm", n, None),
        ("cold megatron ds[i] (mmap)", "megatron", "mmap", "single", "cold", nc, None),
        ("cold corpusforge batch (auto, default)", "corpusforge", "auto", "single", "cold", nc, None),
        ("cold corpusforge batch (auto, .bin > budget)", "corpusforge", "auto", "single", "cold", nc, 0),
        ("cold corpusforge batch (mmap-random)", "corpusforge", "mmap-random", "single", "cold", nc, None),
        ("cold corpusforge batch (pread)", "corpusforge", "pread", "single", "cold", nc, None),
        ("cold corpusforge batch (direct)", "corpusforge", "direct", "single", "cold", nc, None),
        ("cold corpusforge batch (mmap)", "corpusforge", "mmap", "single", "cold", nc, None),
        ("cold megatron DataLoader(2)", "megatron", "mmap", "loader", "cold", nc, None),
        ("cold corpusforge loader(2) (auto, default)", "corpusforge", "auto", "loader", "cold", nc, None),
        ("cold corpusforge loader(2) (auto, .bin > budget)", "corpusforge", "auto", "loader", "cold", nc, 0),
    ]
    runs: dict = {}
    for label, impl, mode, how, temp, count, budget in plan:
        spec = {
            "budget": budget,
            "prefix": prefix_s,
            "seq": seq,
            "sizes": sizes,
            "caches": str(caches),
            "impl": impl,
            "mode": mode,
            "how": how,
            "temp": temp,
            "n": count,
            "repeats": args.repeats,
            "sample_bytes": sample_bytes,
        }
        # Each run in a fresh process: the cold ones must start with nothing of the file mapped or cached.
        done = subprocess.run([sys.executable, __file__, "--run", json.dumps(spec)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{label}: {done.stderr[-3000:]}")
        runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{label:48} {json.dumps(runs[label])}", flush=True)
    report["runs"] = runs

    def ratio(a: str, b: str) -> float:
        return round(runs[a]["samples_per_s"] / runs[b]["samples_per_s"], 2)

    report["ratios"] = {
        "build megatron/corpusforge": round(m_build / o_build, 2),
        "build megatron/corpusforge, cache files written": round(m_build / o_files, 2),
        "build median megatron/corpusforge": round(
            float(np.median(times["megatron"]) / np.median(times["corpusforge"])), 2
        ),
        "build median megatron/corpusforge, cache files written": round(
            float(np.median(times["megatron"]) / np.median(times["files"])), 2
        ),
        # Batched against per sample (the README's old 7.7x): bench_getitem.py compares like with like.
        "warm corpusforge __getitems__(8) / megatron ds[i]": ratio(
            "warm corpusforge batch (auto, default)", "warm megatron ds[i]"
        ),
        "warm corpusforge __getitems__(8) pread / megatron ds[i]": ratio(
            "warm corpusforge batch (pread)", "warm megatron ds[i]"
        ),
        "warm loader(2) corpusforge/megatron": ratio(
            "warm corpusforge loader(2) (auto, default)", "warm megatron DataLoader(2)"
        ),
        "cold single corpusforge/megatron": ratio(
            "cold corpusforge batch (auto, default)", "cold megatron ds[i] (mmap)"
        ),
        "cold single corpusforge auto > budget/megatron": ratio(
            "cold corpusforge batch (auto, .bin > budget)", "cold megatron ds[i] (mmap)"
        ),
        "cold loader(2) corpusforge auto > budget/megatron": ratio(
            "cold corpusforge loader(2) (auto, .bin > budget)", "cold megatron DataLoader(2)"
        ),
    }
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwritten {args.out}")


def print_table(report: dict) -> None:
    d = report["dataset"]
    print(
        f"\n{d['tokens']:.3g} tokens, {d['documents']:.3g} documents, {d['bin_bytes'] / 2**30:.2f} GiB .bin; "
        f"seq_length {report['config']['seq_length']}; {report['machine']['cpu_model']}, "
        f"{report['machine']['cpus_available']} CPUs, load {report['machine']['load_average_at_start']}"
    )
    b = report["build_s"]
    print(
        f"\nindex build, caches written (s): megatron-core {b['megatron']:.3f}   corpusforge {b['corpusforge']:.3f}"
        f"   (until its cache files are written: {b['corpusforge_until_cache_files_written']:.3f}; durable: "
        f"{b['corpusforge_until_caches_durable']:.3f}; in memory only: "
        f"{b['corpusforge_no_cache_files']:.3f}); best of {b['rounds']}, medians {json.dumps(b['median'])}"
    )
    print(f"\n{'run':48} {'samples':>8} {'samples/s':>10} {'read MB':>9} {'amplif.':>8}  mode")
    for name, r in report["runs"].items():
        mb = f"{r['bytes_read'] / 1e6:9.1f}" if "bytes_read" in r else " " * 9
        amp = f"{r['read_amplification']:8.2f}" if "read_amplification" in r else " " * 8
        print(f"{name:48} {r['samples']:8d} {r['samples_per_s']:10.1f} {mb} {amp}  {r.get('read_mode', '')}")
    for name, r in report["runs"].items():
        if "(auto" in name:
            print(f"  {name}: {r['why']}")
    print("\nratios:", json.dumps(report["ratios"]))
    mem = report["index_bytes"]
    print("\nindex bytes measured:", json.dumps(mem["measured"]))
    print("index bytes at 1e12 tokens (formula):", json.dumps(mem["formula_1e12_tokens"]))


if __name__ == "__main__":
    main()
