"""What a data curriculum (data.curriculum: corpusforge/data/curriculum.py) costs the loader and the training step,
against the same run without one, in the same process and rounds.

    python benchmarks/bench_curriculum.py [--tokens 4e6] [--seq-length 2048] [--units 1600] [--rounds 5]
                                          [--steps 12] [--step-rounds 2] [--out FILE.json]

(default --out benchmarks/results/curriculum-<date>.json)

Data: two of bench_loader's generated datasets (uint16, ~2,000-token documents), a 0.7/0.3 blend, warm page cache.

Loader (one process, no workers, micro-batches of 8 units of seq_length tokens, sequential units as the sampler
hands them out; us per unit = per seq_length tokens, median of the rounds, which alternate their order; wall and CPU
time of the Loader, CPU time of the dataset's __getitems__ alone; "paired": the median of the per-round ratios):
  blend                      the blend without a curriculum (build_gpt_datasets: BlendedDataset), the anchor
  curriculum same length     two phases of other weights at seq_length: the cost of the phase map, against blend
  blend quarter length       the blend at seq_length / 4, 4 samples a unit: what shorter samples cost by themselves
  curriculum quarter length  a phase of seq_length / 4, against blend quarter length

Step (the trainer in this process, a tiny GPT on CPU: tokens/s of train() over --steps steps, first interval out):
  none / weights / length: no curriculum; the weights changing half way; seq_length / 4 for the first half (its
  tokens/s per phase from metrics.jsonl). On CPU a tiny model says what the data side adds, not what shorter
  sequences save on a GPU (attention is a small part of a tiny model's step).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_loader as bench  # noqa: E402

from corpusforge.data import build_gpt_datasets, make_loader  # noqa: E402
from corpusforge.data.curriculum import Curriculum, build_curriculum_dataset  # noqa: E402

MICRO = 8  # units per micro-batch


def read_units(ds, units: int, per_unit: int = 1) -> tuple[float, float]:
    """(wall, CPU) us per unit of reading `units` units through a Loader (no workers), micro-batches of MICRO units;
    a dataset without a curriculum reads `per_unit` of its samples as one unit. The CPU time of this process is what
    the reading cost it; on a shared machine the wall time also holds the waits for a core."""
    loader = make_loader(ds, MICRO * per_unit, 0, 1, 0)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in zip(range(units // MICRO), loader):
        pass
    return (time.perf_counter() - t0) / units * 1e6, (time.process_time() - c0) / units * 1e6


def read_direct(ds, units: int, per_unit: int = 1) -> float:
    """CPU us per unit of `ds.__getitems__` over the same micro-batches (what the Loader calls, without it)."""
    batch = MICRO * per_unit
    c0 = time.process_time()
    for lo in range(0, units * per_unit, batch):
        ds.__getitems__(list(range(lo, lo + batch)))
    return (time.process_time() - c0) / units * 1e6


def loader_sets(prefixes: list[str], seq: int, units: int, cache: Path) -> dict[str, tuple]:
    """{name: (dataset, its samples per unit)}: the blends without a curriculum (at seq and seq / 4) and with one."""
    blend = [prefixes[0], 0.7, prefixes[1], 0.3]
    plain = build_gpt_datasets(blend, seq, bench.SPLIT, bench.SEED, (units, 0, 0), cache, eod_token_id=bench.EOD)[0]
    quarter = build_gpt_datasets(blend, seq // 4, bench.SPLIT, bench.SEED, (4 * units, 0, 0), cache,
                                 eod_token_id=bench.EOD)[0]  # fmt: skip
    steps = units // MICRO  # one micro-batch a step: a phase boundary half way
    same = [{"until_step": steps // 2, "weights": [0.9, 0.1]}, {}]
    short = [{"seq_length": seq // 4}]

    def build(phases: list) -> object:
        c = Curriculum.from_table(phases, steps, MICRO * seq, seq, blend)
        return build_curriculum_dataset(c, prefixes, bench.SPLIT, bench.SEED, cache, eod_token_id=bench.EOD)

    return {"blend": (plain, 1), "curriculum same length": (build(same), 1), "blend quarter length": (quarter, 4),
            "curriculum quarter length": (build(short), 1)}  # fmt: skip


def step_runs(prefixes: list[str], steps: int, work: Path) -> dict[str, list[float]]:
    from corpusforge.train import load_config, train
    from corpusforge.train.metrics import read_metrics

    seq = 256  # 2 x 256 tokens a step: the 50K-wide head of bench_loader's vocabulary is most of a CPU step
    base = [f'data.path=["{prefixes[0]}", 0.7, "{prefixes[1]}", 0.3]', 'model.name="custom"', "model.n_layer=1",
            "model.n_head=2", "model.n_embd=64", "model.vocab_size=50304", f"model.seq_length={seq}",
            "schedule.micro_batch_size=2", f"schedule.global_batch_tokens={2 * seq}", f"schedule.max_steps={steps}",
            "schedule.warmup_steps=2", "metrics.eval_interval=0", "metrics.log_interval=1", "checkpoint.interval=0",
            "checkpoint.resume=\"never\"", "data.num_workers=0", 'device="cpu"', "compile=false",
            "metrics.tensorboard=false", f'data.cache_dir="{work / "cache"}"']  # fmt: skip
    half = steps // 2
    kinds = {
        "none": [],
        "weights": [f"data.curriculum=[{{until_step={half}, weights=[0.9, 0.1]}}, {{}}]"],
        "length": [f"data.curriculum=[{{until_step={half}, seq_length={seq // 4}}}, {{}}]"],
    }
    out: dict[str, list[float]] = {}
    for name, extra in kinds.items():
        run = work / f"step-{name}"
        shutil.rmtree(run, ignore_errors=True)
        train(load_config(None, [*base, *extra, f'out_dir="{run}"']), log=lambda line: None)
        records = read_metrics(run / "metrics.jsonl", "train")
        first = [r["tokens_per_s"] for r in records if 2 <= r["step"] <= half]  # step 1 holds the warm-up
        second = [r["tokens_per_s"] for r in records if r["step"] > half + 1]
        out[f"{name} first half"], out[f"{name} second half"] = [statistics.median(first)], [statistics.median(second)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=4e6, help="tokens of each of the two datasets")
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--units", type=int, default=1600, help="loader units read per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12, help="training steps per step run (0: no step runs)")
    ap.add_argument("--step-rounds", type=int, default=2, help="rounds of the three step runs")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"curriculum-{date}.json"
    work = HERE / "work" / "curriculum"
    tokens = int(args.tokens)
    prefixes = []
    for d in range(2):
        prefix = HERE / "work" / "loader" / f"curriculum{d}_{tokens:.0e}tok_text_document".replace("+", "")
        bench.make_dataset(prefix, tokens, tokens // 2000, seed=d)
        bench.warm(f"{prefix}.bin")
        prefixes.append(str(prefix))
    sets = loader_sets(prefixes, args.seq_length, args.units, work / "cache")
    for ds, per_unit in sets.values():
        ds.load_kernels()
        read_units(ds, 4 * MICRO, per_unit)  # first calls are not throughput
    runs: dict[str, list[float]] = {k: [] for k in sets}
    cpu: dict[str, list[float]] = {k: [] for k in sets}
    direct: dict[str, list[float]] = {k: [] for k in sets}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name in list(sets) if r % 2 == 0 else list(sets)[::-1]:
            wall, used = read_units(sets[name][0], args.units, sets[name][1])
            runs[name].append(round(wall, 2))
            cpu[name].append(round(used, 2))
            direct[name].append(round(read_direct(sets[name][0], args.units, sets[name][1]), 2))
        load.append(os.getloadavg()[0])
        print(f"round {r + 1} (wall/cpu us): " + "  ".join(f"{k} {runs[k][-1]}/{cpu[k][-1]}" for k in runs), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    def costs(m: dict[str, float]) -> dict[str, float]:  # each curriculum against the blend of the same samples
        return {
            "curriculum same length": round(m["curriculum same length"] / m["blend"] - 1, 4),
            "curriculum quarter length": round(m["curriculum quarter length"] / m["blend quarter length"] - 1, 4),
            "blend quarter length": round(m["blend quarter length"] / m["blend"] - 1, 4),  # shorter samples alone
        }

    loader_cost, loader_cost_cpu = costs(med), costs(med_cpu)
    # the same comparisons round by round (each pair read back to back), then their median: on a shared machine the
    # CPU time of one series moves 2x between rounds, a pair much less
    pairs = {"curriculum same length": "blend", "curriculum quarter length": "blend quarter length",
             "blend quarter length": "blend"}  # fmt: skip
    paired_cpu = {
        k: round(statistics.median(a / b for a, b in zip(cpu[k], cpu[base])) - 1, 4) for k, base in pairs.items()
    }
    paired_direct = {
        k: round(statistics.median(a / b for a, b in zip(direct[k], direct[base])) - 1, 4) for k, base in pairs.items()
    }
    steps: dict[str, list[float]] = {}
    if args.steps:
        for r in range(args.step_rounds):
            for name, value in step_runs(prefixes, args.steps, work).items():
                steps.setdefault(name, []).extend(value)
            load.append(os.getloadavg()[0])
            print(f"step round {r + 1}: " + "  ".join(f"{k} {v[-1]:.0f}" for k, v in steps.items()), flush=True)
    step_med = {k: statistics.median(v) for k, v in steps.items()}
    report = {
        "benchmark": "curriculum",
        "machine": bench.machine_info(),
        "load_average_per_round": [round(x, 2) for x in load],
        "config": {"tokens_per_dataset": tokens, "seq_length": args.seq_length, "units": args.units,
                   "micro_batch_units": MICRO, "rounds": args.rounds, "weights": [0.7, 0.3], "steps": args.steps,
                   "step_rounds": args.step_rounds, "step_model": "GPT-2 1 layer, 2 heads, width 64, vocab 50304, "
                   "2 x 256 tokens a step, fp32, CPU"},
        "loader_median_us_per_unit": med,
        "loader_median_cpu_us_per_unit": med_cpu,
        "loader_extra_time_per_token": loader_cost,
        "loader_extra_cpu_time_per_token": loader_cost_cpu,
        "loader_extra_cpu_time_per_token_paired": paired_cpu,
        "getitems_median_cpu_us_per_unit": {k: statistics.median(v) for k, v in direct.items()},
        "getitems_extra_cpu_time_per_token_paired": paired_direct,
        "step_median_tokens_per_s": step_med,
        "loader_runs": runs,
        "loader_cpu_runs": cpu,
        "getitems_cpu_runs": direct,
        "step_runs": steps,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nloader, median of {args.rounds} rounds, us per unit of {args.seq_length} tokens (wall, CPU):")
    for k, v in med.items():
        extra = (
            f"   {loader_cost[k]:+.1%}, CPU {loader_cost_cpu[k]:+.1%} (paired {paired_cpu[k]:+.1%})"
            if k in pairs
            else ""
        )
        print(f"  {k:26s} {v:8.2f} {med_cpu[k]:8.2f}{extra}")
    print("  (curriculum: against the blend of the same samples without one; blend quarter length: against blend)")
    print("__getitems__ alone, CPU us per unit, paired against the same anchors:")
    for k, v in direct.items():
        print(f"  {k:26s} {statistics.median(v):8.2f}" + (f"   {paired_direct[k]:+.1%}" if k in pairs else ""))
    if step_med:
        print("step (tiny GPT on CPU), median tokens/s:")
        for k, v in step_med.items():
            print(f"  {k:22s} {v:10.0f}")
    print(f"wrote {out}  (load average {min(load):.1f}-{max(load):.1f})")


if __name__ == "__main__":
    main()
