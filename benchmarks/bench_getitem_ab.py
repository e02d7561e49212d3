"""GPTDataset's sample reads, this checkout against another (an older commit, checked out with `git worktree add`),
in one process, alternating: what a change to the gathers costs, resolved to ~1% on a machine others share.

    git worktree add --detach /tmp/before <commit>
    python benchmarks/bench_getitem_ab.py /tmp/before [--tokens 2e7] [--docs 9600] [--ids 20000] [--rounds 9]
                                          [--out benchmarks/results/getitem-ab-<date>.json]

bench_getitem's data and calls (bench_loader's generated uint16 dataset, warm; train split, samples of 2048 tokens;
the same seeded random ids): `ds[i]` per sample, `ds.__getitems__` of 8 (the DataLoader's batched call) and
`ds.read_raw` of 8 (what a loader worker sends). The other checkout's corpusforge/data/gpt_dataset.py is loaded as a
module of its own over the same IndexedDataset and indices (the rest of corpusforge is this checkout's), so the two
differ only by that file; bench_getitem's separate processes, one per side, varied by 20-40% here under the other
jobs' load, more than the difference to resolve. Each round times every call of both sides chunk by chunk (--chunk
ids), alternating which side goes first; reported: the median of the rounds' totals per side, the median of the
paired chunks' ratios (this / other), and the ratio of the sums of each chunk's best time, with the load average.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_getitem  # noqa: E402
import bench_loader as bench  # noqa: E402

BATCH = bench_getitem.BATCH


def raw_batched(ds, ids: list[int]) -> None:
    for lo in range(0, len(ids), BATCH):
        ds.read_raw(ids[lo : lo + BATCH])


CALLS = {
    "ds[i]": bench_getitem.per_sample,
    "__getitems__ of 8": bench_getitem.ours_batched,
    "read_raw of 8": raw_batched,
}


def other_module(tree: Path):
    """The other checkout's corpusforge/data/gpt_dataset.py, as a module of its own."""
    spec = importlib.util.spec_from_file_location("other_gpt_dataset", tree / "corpusforge/data/gpt_dataset.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def other_dataset(module, ours):
    """`ours` as the other checkout's GPTDataset: the same indexed dataset, indices and config."""
    other = object.__new__(module.GPTDataset)
    other.__dict__.update({k: v for k, v in ours.__dict__.items() if k not in ("_direct", "_mapped_path")})
    return other


def blend_sides(module, n: int, tokens: int, docs: int, seq: int) -> dict:
    """A blend of `n` datasets of tokens / n each, equal weights, on both sides: a batch of 8 reads from up to 8 of
    them, one call of each GPTDataset per dataset (as a blend of thousands does)."""
    from corpusforge.data.blended import BlendedDataset

    parts = []
    for d in range(n):
        prefix = HERE / "work" / "loader" / f"blend{n}_{d}_{tokens // n:.0e}tok_text_document".replace("+", "")
        bench.make_dataset(prefix, tokens // n, docs // n, seed=d)
        bench.warm(f"{prefix}.bin")
        parts.append(bench.ours_build(str(prefix), seq, [tokens // n * 969 // 1000 // seq - 1, 1, 1])[0])
    size = sum(len(p) for p in parts) // 2
    return {
        "this": BlendedDataset(parts, [1.0] * n, size),
        "other": BlendedDataset([other_dataset(module, p) for p in parts], [1.0] * n, size),
    }


def commit(tree: Path) -> str:
    run = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout (its corpusforge/data/gpt_dataset.py is read)")
    ap.add_argument("--tokens", type=float, default=2e7)
    ap.add_argument("--docs", type=float, default=9600)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--ids", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--blend", type=int, default=0, help="read a blend of this many datasets (tokens split evenly)")
    ap.add_argument("--chunk", type=int, default=500, help="ids per timed call sequence; the sides alternate per chunk")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"getitem-ab-{date}.json"
    tokens, docs, seq = int(args.tokens), int(args.docs), args.seq_length
    prefix = HERE / "work" / "loader" / f"gen_{tokens:.0e}tok_{docs}doc_text_document".replace("+", "")
    bench.make_dataset(prefix, tokens, docs)
    bench.warm(f"{prefix}.bin")
    train = tokens * 969 // 1000
    sizes = [train // seq - 1, tokens * 30 // 1000 // seq - 1, max(1, tokens // 1000 // seq - 1)]
    module = other_module(args.other)
    if args.blend:
        sides = blend_sides(module, args.blend, tokens, docs, seq)
    else:
        ours = bench.ours_build(str(prefix), seq, sizes)[0]
        sides = {"this": ours, "other": other_dataset(module, ours)}
    this = sides["this"]
    read_mode = (this.datasets[0] if args.blend else this).indexed.read_mode
    ids = np.random.default_rng(0).integers(0, len(this), args.ids).tolist()
    for i in ids[:200]:  # the same samples
        a, b = sides["this"][i], sides["other"][i]
        for key in a:
            np.testing.assert_array_equal(a[key].numpy(), b[key].numpy(), err_msg=f"sample {i} {key}")
    for ds in sides.values():  # first calls (numba loading) are not throughput
        for fn in CALLS.values():
            fn(ds, ids[:500])
    chunks = [ids[lo : lo + args.chunk] for lo in range(0, len(ids), args.chunk)]
    # seconds[call][side][round, chunk]: the two sides alternate chunk by chunk (~10-30 ms each), so that the load of
    # other jobs, which changes over seconds, falls on both alike
    seconds = {c: {s: np.zeros((args.rounds, len(chunks))) for s in sides} for c in CALLS}
    loads = []
    for r in range(args.rounds):
        loads.append(round(os.getloadavg()[0], 2))
        for call, fn in CALLS.items():
            for k, chunk in enumerate(chunks):
                for side in list(sides) if (r + k) % 2 == 0 else list(sides)[::-1]:
                    t0 = time.perf_counter()
                    fn(sides[side], chunk)
                    seconds[call][side][r, k] = time.perf_counter() - t0
        print(f"round {r + 1} (load {loads[-1]}): " + "  ".join(
            f"{c} {v['this'][r].sum() / len(ids) * 1e6:.2f}/{v['other'][r].sum() / len(ids) * 1e6:.2f}"
            for c, v in seconds.items()), flush=True)  # fmt: skip
    summary = {}
    for call, by_side in seconds.items():
        this_s, other_s = by_side["this"], by_side["other"]
        summary[call] = {
            "this_us": round(float(np.median(this_s.sum(axis=1))) / len(ids) * 1e6, 3),
            "other_us": round(float(np.median(other_s.sum(axis=1))) / len(ids) * 1e6, 3),
            # the same chunk, back to back: the median of their ratios, over every chunk of every round
            "ratio_paired_median": round(float(np.median(this_s / other_s)), 4),
            # the fastest each chunk went on each side (other jobs only ever add time), summed
            "ratio_of_best": round(float(this_s.min(axis=0).sum() / other_s.min(axis=0).sum()), 4),
        }
    report = {
        "benchmark": "getitem-ab",
        "machine": bench.machine_info(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "this": commit(HERE.parent),
        "other": commit(args.other),
        "config": {
            "tokens": tokens,
            "documents": docs,
            "seq_length": seq,
            "ids": args.ids,
            "rounds": args.rounds,
            "batch": BATCH,
            "blend": args.blend,
            "read_mode": read_mode,
        },
        "median": summary,
        "load_average_per_round": loads,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    what = f"read mode {read_mode}" + (f", a blend of {args.blend}" if args.blend else "")
    print(f"\nmedian of {args.rounds} rounds, us per sample ({args.ids} random ids, warm page cache, {what}); "
          f"this {report['this']}, other {report['other']}:")  # fmt: skip
    for call, row in summary.items():
        print(f"  {call:20s} this {row['this_us']:7.2f}  other {row['other_us']:7.2f}  this/other: paired median "
              f"{row['ratio_paired_median']:.3f}, of best {row['ratio_of_best']:.3f}")  # fmt: skip
    print(f"load average at end: {report['load_average_at_end']}\nwrote {out}")


if __name__ == "__main__":
    main()
