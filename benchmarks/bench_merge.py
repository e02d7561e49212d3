"""How fast finished parts become one dataset: the parallel merge (1, 2, 4 streams) against the old single stream.

    python benchmarks/bench_merge.py [--size-mb 1000] [--parts 16] [--repeats 3] [--where disk shm]
                                     [--out benchmarks/results/merge-<date>.json]

Writes `--parts` token datasets of `--size-mb` MB of int32 tokens in all (random ids, ~1000-token documents;
the bytes do not matter to a copy), onto the disk under benchmarks/work/ and onto /dev/shm, then times, in
alternating rounds on each:

  writer    the merge as it was: IndexedDatasetWriter.add_dataset of each part in turn, one stream appending
            to the end of the output (the anchor)
  streams=N corpusforge.indexed.merge(parts, out, streams=N): each part copied straight to its offset in the
            output (copy_file_range), N at once, the .idx built from the parts' lengths

Every timing runs to the final fsync and rename, so on disk it includes writing the output back; the parts are
in the page cache, as they are when preprocess merges parts it just wrote. The output of every variant must be
byte-identical to the anchor's (sha256) or the run fails. GB/s = bytes of the output .bin per second; the
median of the rounds is reported.

Prints a table; writes everything, with the machine, versions and git commit, as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_preprocess import machine_info  # noqa: E402

from corpusforge import indexed  # noqa: E402

MB = 10**6
PLACES = {"disk": HERE / "work" / "bench-merge", "shm": Path("/dev/shm/corpusforge-bench-merge")}
STREAMS = (1, 2, 4)


def make_parts(directory: Path, size_mb: float, parts: int, seed: int = 7) -> list[Path]:
    """`parts` int32 datasets of `size_mb` MB of tokens in all, documents of 1..2000 tokens."""
    rng = np.random.default_rng(seed)
    prefixes = []
    per_part = int(size_mb * MB / 4 / parts)
    for k in range(parts):
        lengths = rng.integers(1, 2000, per_part // 1000 + 1)
        lengths[-1] = max(0, per_part - int(lengths[:-1].sum()))
        tokens = rng.integers(0, 100_000, int(lengths.sum()), dtype=np.int32)
        prefix = directory / f"part-{k:05d}_text_document"
        with indexed.IndexedDatasetWriter(prefix, np.int32) as w:
            w.add_documents(tokens, lengths)
        prefixes.append(prefix)
    return prefixes


def merge_with_writer(parts: list[Path], out: Path) -> None:
    """The old merge: one stream, each part appended in turn to the end of the output."""
    with indexed.IndexedDatasetWriter(out, np.int32) as w:
        for p in parts:
            w.add_dataset(p)


def time_variant(name: str, parts: list[Path], out: Path) -> float:
    t0 = time.perf_counter()
    if name == "writer":
        merge_with_writer(parts, out)
    else:
        indexed.merge(parts, out, streams=int(name.split("=")[1]))
    return time.perf_counter() - t0


def digest(prefix: Path) -> str:
    h = hashlib.sha256()
    for path in (indexed.bin_path(prefix), indexed.idx_path(prefix)):
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def bench_place(place: str, directory: Path, args) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    try:
        parts = make_parts(directory, args.size_mb, args.parts)
        nbytes = sum(indexed.bin_path(p).stat().st_size for p in parts)
        names = ["writer", *(f"streams={n}" for n in STREAMS)]
        seconds: dict[str, list[float]] = {n: [] for n in names}
        hashes: dict[str, str] = {}
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else names[::-1]:  # alternate the order: no variant always goes first
                out = directory / "merged_text_document"
                seconds[name].append(time_variant(name, parts, out))
                if name not in hashes:
                    hashes[name] = digest(out)
                for path_of in (indexed.bin_path, indexed.idx_path):
                    path_of(out).unlink()
                print(f"{place:5s} round {r + 1}: {name:10s} {seconds[name][-1]:7.3f} s", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    anchor = statistics.median(seconds["writer"])
    variants = {
        name: {
            "seconds": round(statistics.median(s), 3),
            "gb_s": round(nbytes / 1e9 / statistics.median(s), 3),
            "vs_writer": round(anchor / statistics.median(s), 3),
            "runs_seconds": [round(x, 3) for x in s],
            "gb_s_range": [round(nbytes / 1e9 / max(s), 3), round(nbytes / 1e9 / min(s), 3)],
        }
        for name, s in seconds.items()
    }
    return {"path": str(directory), "bytes": nbytes, "variants": variants, "identical": len(set(hashes.values())) == 1}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=1000)
    ap.add_argument("--parts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--where", nargs="+", choices=sorted(PLACES), default=["disk", "shm"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out_json = args.out or HERE / "results" / f"merge-{date}.json"
    machine = machine_info(None)
    results = {place: bench_place(place, PLACES[place], args) for place in args.where}
    report = {
        "benchmark": "merge",
        "command": ["bench_merge.py", *sys.argv[1:]],
        "machine": machine,
        "parts": args.parts,
        "size_mb": args.size_mb,
        "results": results,
        "notes": [
            "GB = 10^9 bytes of the output .bin; seconds from the first part's check to the final rename, fsync "
            "included; median of the rounds, rounds alternating the order of the variants",
            f"load average at start {machine['load_average_at_start']}: other work on the machine adds noise",
        ],
    }
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    print(f"\nwrote {out_json}")
    if not all(r["identical"] for r in results.values()):
        raise SystemExit("merged outputs differ between variants: see the JSON")


def print_table(report: dict) -> None:
    print(f"\nmerge of {report['parts']} parts, {report['size_mb']:g} MB of tokens, median of rounds")
    print(f"{'where':6s} {'variant':10s} {'seconds':>8s} {'GB/s':>7s} {'range GB/s':>13s} {'vs writer':>10s}")
    for place, r in report["results"].items():
        for name, v in r["variants"].items():
            lo, hi = v["gb_s_range"]
            rate = f"{v['seconds']:8.3f} {v['gb_s']:7.2f} {lo:6.2f}-{hi:<6.2f}"
            print(f"{place:6s} {name:10s} {rate} {v['vs_writer']:9.2f}x")


if __name__ == "__main__":
    main()
