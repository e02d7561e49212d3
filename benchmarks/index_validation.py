"""What refusing a corrupt .idx costs: opening a dataset of 1e8 documents with the full validation, against without.

    python benchmarks/index_validation.py [--documents 100000000] [--repeats 3] [--cold/--no-cold]
                                          [--out benchmarks/results/index-validation-<date>.json]

Builds one uint16 dataset of `--documents` one-sequence documents of 1..2047 tokens synthetically under
benchmarks/work/: the .idx written by corpusforge.indexed.write_index (2.0 GB at 1e8: int32 lengths, int64 pointers,
int64 document indices), the .bin a sparse file of the size the lengths give (about 200 GB that takes no disk space;
the validation reads only 24 KiB of it). Then times, in alternating rounds:

  megatron-core   megatron.core.datasets.indexed_dataset.IndexedDataset(prefix): memory-maps the .idx and reads
                  nothing (the anchor: it checks nothing either)
  open            corpusforge IndexedDataset(prefix, check=False): the header, the file sizes, the ends of the
                  arrays against the .bin, O(1)
  open+validate   IndexedDataset(prefix), what every consumer does: every length, pointer and document index
                  (check_index, chunked numpy), a 3-window token sample and the P.preprocess.json lookup

each with the .idx in the page cache ("warm": a dataset opened before, or just written) and, with --cold, after
dropping the .idx's pages (posix_fadvise DONTNEED on that file only), where the validation reads the whole .idx
from the disk. Also times check_index alone, and reading the whole .idx cold (the I/O floor). The median of the
rounds is reported; every round is in the JSON, with the machine, versions and git commit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_preprocess import machine_info  # noqa: E402

from corpusforge import indexed  # noqa: E402
from corpusforge.storage.pagecache import drop_page_cache  # noqa: E402

WORK = HERE / "work" / "index-validation"


def make_dataset(directory: Path, documents: int, seed: int = 0) -> Path:
    """A uint16 dataset of `documents` one-sequence documents: a real .idx, a sparse .bin of the matching size."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = directory / f"synthetic{documents}_text_document"
    if indexed.exists(prefix):
        try:
            indexed.IndexedDataset(prefix).close()
            return prefix  # built by an earlier run and still sound
        except indexed.IndexedFormatError:
            pass
    lengths = np.random.default_rng(seed).integers(1, 2048, documents, dtype=np.int32)
    nbytes = int(lengths.sum(dtype=np.int64)) * 2
    indexed.write_index(f"{prefix}.idx", np.uint16, lengths, np.arange(documents + 1, dtype=np.int64), durable=False)
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(nbytes)  # sparse: no blocks allocated, reads give zeros (token id 0)
    return prefix


def megatron_open(prefix: Path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


VARIANTS = {
    "megatron-core": megatron_open,
    "open": lambda p: indexed.IndexedDataset(p, check=False),
    "open+validate": lambda p: indexed.IndexedDataset(p),
}


def time_call(fn, prefix: Path, cold: bool) -> float:
    gc.collect()  # the last round's maps are gone, so their pages can be dropped
    if cold:
        drop_page_cache(Path(f"{prefix}.idx"))
    t0 = time.perf_counter()
    ds = fn(prefix)
    seconds = time.perf_counter() - t0
    del ds
    return seconds


def check_only(prefix: Path) -> float:
    """check_index over the three arrays of an open (warm) dataset, without the open."""
    ds = indexed.IndexedDataset(prefix, check=False)
    t0 = time.perf_counter()
    indexed.check_index(
        str(ds.idx_path), ds.dtype, ds.sequence_lengths, ds.sequence_pointers, ds.document_indices,
        ds.bin_path.stat().st_size, ds.bin_path.name,
    )  # fmt: skip
    return time.perf_counter() - t0


def read_cold(prefix: Path) -> float:
    """The I/O floor: read the whole .idx from the disk, sequentially, 64 MiB at a time."""
    path = Path(f"{prefix}.idx")
    drop_page_cache(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--documents", type=int, default=100_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--keep", action="store_true", help="Keep the synthetic dataset under benchmarks/work/.")
    ap.add_argument("--out", default=str(HERE / "results" / f"index-validation-{dt.date.today()}.json"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    prefix = make_dataset(WORK, args.documents)
    build_s = time.perf_counter() - t0
    idx_bytes = Path(f"{prefix}.idx").stat().st_size
    print(f"{prefix}: {args.documents:,} documents, .idx {idx_bytes / 1e9:.2f} GB (built in {build_s:.1f} s)")
    VARIANTS["megatron-core"](prefix)  # import megatron (torch) outside the timings

    modes = ("warm", "cold") if args.cold else ("warm",)
    rounds: dict[str, dict[str, list[float]]] = {m: {v: [] for v in VARIANTS} for m in modes}
    rounds["warm"]["check_index"] = []
    if args.cold:
        rounds["cold"]["read .idx"] = []
    for r in range(args.repeats):
        for mode in modes:
            names = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))  # alternate the order
            if mode == "warm":
                VARIANTS["open+validate"](prefix)  # pages in
            for name in names:
                rounds[mode][name].append(time_call(VARIANTS[name], prefix, cold=mode == "cold"))
            if mode == "warm":
                rounds["warm"]["check_index"].append(check_only(prefix))
            else:
                rounds["cold"]["read .idx"].append(read_cold(prefix))

    medians = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in rounds.items()}
    per_1e8 = 1e8 / args.documents
    print(f"\n{'':>16} " + " ".join(f"{m + ' s':>10}" for m in modes) + "   (median of rounds; per 1e8 documents)")
    for name in (*VARIANTS, "check_index", "read .idx"):
        cells = [f"{medians[m][name] * per_1e8:>10.3f}" if name in medians[m] else f"{'':>10}" for m in modes]
        print(f"{name:>16} " + " ".join(cells))
    cost = {m: medians[m]["open+validate"] - medians[m]["open"] for m in modes}
    print("\nvalidation adds " + ", ".join(f"{cost[m] * per_1e8:.2f} s {m}" for m in modes) + " per 1e8 documents")

    result = {
        "benchmark": "index_validation",
        "machine": machine_info(None),
        "documents": args.documents,
        "idx_bytes": idx_bytes,
        "repeats": args.repeats,
        "check_chunk": indexed.CHECK_CHUNK,
        "sample_tokens": indexed.SAMPLE_TOKENS,
        "seconds": rounds,
        "median_seconds": medians,
        "validation_cost_seconds": cost,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not args.keep:
        for ext in ("bin", "idx"):
            Path(f"{prefix}.{ext}").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
