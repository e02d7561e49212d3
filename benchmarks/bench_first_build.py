"""The index build as a training job meets it: in a fresh process, corpusforge against megatron-core.

    python benchmarks/bench_first_build.py [--rounds 3] [--out benchmarks/results/loader-first-build-<date>.json]

bench_loader.py times the build once each side has warmed up in its process (repeated rounds); a job builds once,
in a new process. Here each round starts a new interpreter per side, alternating, on bench_loader's dataset (1e9
tokens, 1e6 documents: run bench_loader.py once first) and measures: importing the side's dataset modules
(megatron-core: its GPTDataset and builder, torch with them; corpusforge: corpusforge.data), the first build of
train/valid/test into an empty cache directory (until the cache files are written), and a second build in the same
process (bench_loader's steady state). Medians of the rounds; prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENS, DOCS, SEQ = int(1e9), int(1e6), 2048


def child(side: str) -> dict:
    t0 = time.perf_counter()
    if side == "megatron":
        import torch.distributed

        torch.distributed.get_rank = lambda *a, **k: 0  # megatron-core asks even without a process group
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
        import megatron.core.datasets.gpt_dataset  # noqa: F401
    else:
        import corpusforge.data  # noqa: F401
    imported = time.perf_counter() - t0
    sys.path.insert(0, str(HERE))
    import bench_loader as bench  # the same build calls as bench_loader (its imports are done by now or untimed)

    prefix = str(HERE / "work" / "loader" / f"gen_{TOKENS:.0e}tok_{DOCS:.0e}doc_text_document".replace("+", ""))
    train = TOKENS * 969 // 1000
    sizes = [train // SEQ - 1, TOKENS * 30 // 1000 // SEQ - 1, max(1, TOKENS // 1000 // SEQ - 1)]
    seconds = []
    for _ in range(2):
        cache = Path(tempfile.mkdtemp(prefix="first-build-"))
        t0 = time.perf_counter()
        if side == "megatron":
            bench.megatron_build(prefix, SEQ, sizes, cache)
        else:
            from corpusforge.data.cache import wait_for_index_caches, wait_for_index_files

            bench.ours_build(prefix, SEQ, sizes, cache=cache)
            wait_for_index_files()  # as megatron-core leaves its caches: np.save, no fsync
        seconds.append(time.perf_counter() - t0)
        if side != "megatron":
            wait_for_index_caches()
        shutil.rmtree(cache)
    return {"import_s": imported, "first_build_s": seconds[0], "second_build_s": seconds[1]}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from bench_preprocess import machine_info

    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"loader-first-build-{date}.json"
    runs: dict[str, list[dict]] = {"megatron": [], "corpusforge": []}
    for r in range(args.rounds):
        for side in ("megatron", "corpusforge") if r % 2 == 0 else ("corpusforge", "megatron"):
            proc = subprocess.run([sys.executable, __file__, "--child", side], capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
            runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            x = runs[side][-1]
            print(f"round {r + 1} {side:12s} " + "  ".join(f"{k} {v:.3f}" for k, v in x.items()), flush=True)
    medians = {
        side: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]} for side, rs in runs.items()
    }  # fmt: skip
    for m in medians.values():
        m["import_and_first_build_s"] = round(m["import_s"] + m["first_build_s"], 3)
    report = {
        "benchmark": "loader-first-build",
        "machine": machine_info(None),
        "dataset": {"tokens": TOKENS, "documents": DOCS, "seq_length": SEQ},
        "medians": medians,
        "runs": runs,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    head = f"{'import s':>9s} {'1st build s':>12s} {'2nd build s':>12s} {'sum':>7s}"
    print(f"\n{'median of ' + str(args.rounds):16s} {head}")
    for side, m in medians.items():
        row = f"{m['import_s']:9.3f} {m['first_build_s']:12.3f} {m['second_build_s']:12.3f}"
        print(f"{side:16s} {row} {m['import_and_first_build_s']:7.3f}")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
