"""The index build of a blend of many small datasets: corpusforge against megatron-core, one process each.

    python benchmarks/bench_blend.py [--datasets 2500] [--docs 200] [--samples 2000000] [--seq-length 2048]
                                     [--rounds 3] [--out benchmarks/results/blend-<date>.json]

Users report Megatron-style index builds of 2,000 s for 2,400 Dolma files. Here: --datasets token datasets of
--docs documents each (uint16, lengths uniform in [1, 2000), written once under benchmarks/work/blend/), blended
with seeded random weights in [0.5, 1.5) into --samples train samples of --seq-length tokens (split "1": train
only, as a pretraining blend is usually given). Each round starts a fresh interpreter per side, alternating which
goes first, and times the build of the blend from the list of prefixes into an empty cache directory until the
datasets are returned with their index caches written (megatron-core: BlendedMegatronDatasetBuilder, which writes
its .npy caches with np.save, no fsync; corpusforge: build_gpt_datasets, then wait_for_index_files, the same
state) and the peak resident memory of the process (ru_maxrss; imports included). Module imports are outside the
timing and reported apart. Then the samples are compared: 2,000 seeded ids of the blend, every field, both sides.

Prints a table (medians of the rounds, load average before and after each run) and writes JSON.
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

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

EOD = 50256
SEED = 1234


def make_datasets(work: Path, count: int, docs: int, seed: int = 0) -> list[str]:
    """`count` token datasets of `docs` documents (lengths uniform in [1, 2000)); reused when present."""
    from corpusforge.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    prefixes = []
    work.mkdir(parents=True, exist_ok=True)
    for k in range(count):
        prefix = work / f"d{k:05d}_{docs}_text_document"
        prefixes.append(str(prefix))
        lengths = rng.integers(1, 2000, size=docs)
        if Path(f"{prefix}.idx").exists():
            continue
        tokens = rng.integers(0, EOD, size=int(lengths.sum()), dtype=np.uint16)
        tokens[np.cumsum(lengths) - 1] = EOD
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_documents(tokens, lengths)
    return prefixes


def blend_list(prefixes: list[str], seed: int = 1) -> list:
    weights = np.random.default_rng(seed).uniform(0.5, 1.5, size=len(prefixes))
    return [x for p, w in zip(prefixes, weights) for x in (p, float(w))]


class StandInTokenizer:
    """What megatron-core's GPTDataset reads from a tokenizer, and nothing else."""

    eod = EOD
    vocab_size = 50257
    unique_identifiers = {"class": "StandInTokenizer"}


def megatron_build(blend: list, seq_length: int, samples: int, cache: Path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=seq_length,
        blend=(blend[0::2], blend[1::2]),
        split="1",
        path_to_cache=str(cache),
        tokenizer=StandInTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config).build()


def ours_build(blend: list, seq_length: int, samples: int, cache: Path):
    from corpusforge.data import build_gpt_datasets
    from corpusforge.data.cache import wait_for_index_files

    out = build_gpt_datasets(blend, seq_length, "1", SEED, (samples, 0, 0), cache, eod_token_id=EOD)
    wait_for_index_files()  # the .npy files complete, as megatron-core leaves its own (np.save, no fsync)
    return out


def child(side: str, spec: dict) -> dict:
    """One build in this fresh process; with spec["compare"], also read spec["ids"] and save their tokens."""
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    if side == "megatron":
        import torch.distributed

        torch.distributed.get_rank = lambda *a, **k: 0  # megatron-core asks even without a process group
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
        import megatron.core.datasets.gpt_dataset  # noqa: F401
    else:
        import corpusforge.data  # noqa: F401
    imported = time.perf_counter() - t0
    prefixes = make_datasets(Path(spec["work"]), spec["datasets"], spec["docs"])
    blend = blend_list(prefixes)
    cache = Path(tempfile.mkdtemp(prefix=f"blend-{side}-", dir=spec["work"]))
    build = megatron_build if side == "megatron" else ours_build
    t0 = time.perf_counter()
    train = build(blend, spec["seq_length"], spec["samples"], cache)[0]
    seconds = time.perf_counter() - t0
    result = {
        "import_s": round(imported, 3),
        "build_s": round(seconds, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "samples": len(train),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    if spec.get("compare"):
        ids = np.random.default_rng(0).choice(len(train), size=2000, replace=False)
        ids = np.r_[0, 1, len(train) - 1, ids]
        if side == "megatron":
            rows = [train[int(i)] for i in ids]
            fields = {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}  # dataset_id: numpy int16
        else:
            fields = train.get_batch(ids)
        np.savez(spec["compare"], **{k: np.asarray(v) for k, v in fields.items()})
    if side != "megatron":
        from corpusforge.data.cache import wait_for_index_caches

        wait_for_index_caches()  # its fsyncs, outside the timing (megatron-core does none)
    shutil.rmtree(cache)
    return result


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], json.loads(sys.argv[3]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", type=int, default=2500)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--samples", type=int, default=2_000_000)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=HERE / "work" / "blend")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from bench_loader import machine_info

    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"blend-{args.datasets}x{args.docs}-{date}.json"
    t0 = time.perf_counter()
    make_datasets(args.work, args.datasets, args.docs)
    generate_s = time.perf_counter() - t0
    spec = {
        "work": str(args.work),
        "datasets": args.datasets,
        "docs": args.docs,
        "samples": args.samples,
        "seq_length": args.seq_length,
    }
    runs: dict[str, list[dict]] = {"megatron": [], "corpusforge": []}
    compare = {}
    for r in range(args.rounds):
        for side in ("megatron", "corpusforge") if r % 2 == 0 else ("corpusforge", "megatron"):
            extra = {}
            if r == args.rounds - 1:  # the last round also saves the samples of both for the comparison
                compare[side] = extra["compare"] = str(args.work / f"compare-{side}.npz")
            proc = subprocess.run(
                [sys.executable, __file__, "--child", side, json.dumps({**spec, **extra})],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
            runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            x = runs[side][-1]
            print(f"round {r + 1} {side:12s} " + "  ".join(f"{k} {v}" for k, v in x.items()), flush=True)
    theirs, ours = np.load(compare["megatron"]), np.load(compare["corpusforge"])
    same = all(np.array_equal(theirs[k], ours[k]) for k in theirs.files)
    medians = {
        side: {k: round(statistics.median(x[k] for x in rs), 3) for k in ("import_s", "build_s", "peak_rss_mb")}
        for side, rs in runs.items()
    }
    ratio = round(medians["megatron"]["build_s"] / medians["corpusforge"]["build_s"], 2)
    report = {
        "benchmark": "blend-index-build",
        "machine": machine_info(),
        "config": {**spec, "rounds": args.rounds, "weights": "uniform [0.5, 1.5), seed 1", "split": "1"},
        "generate_s": round(generate_s, 1),
        "medians": medians,
        "build_ratio_megatron_over_corpusforge": ratio,
        "same_samples": {"ids": 2003, "fields": sorted(theirs.files), "equal": same},
        "runs": runs,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'median of ' + str(args.rounds):16s} {'import s':>9s} {'build s':>9s} {'peak RSS MB':>12s}")
    for side, m in medians.items():
        print(f"{side:16s} {m['import_s']:9.3f} {m['build_s']:9.3f} {m['peak_rss_mb']:12.1f}")
    print(f"\nbuild: megatron-core / corpusforge = {ratio}x; same samples (2,003 ids, every field): {same}")
    print(f"wrote {out}")
    if not same:
        raise SystemExit("the samples differ")


if __name__ == "__main__":
    main()
