"""Per-step CPU overhead of each parallel layout against one process, on the same tiny model and the same batch.

    python benchmarks/parallel_overhead.py [--family llama] [--steps 12] [--layouts tp2,pp2,...]
                                           [--out benchmarks/results/parallel-overhead-<date>.json]

Each layout trains `--steps` optimizer steps of the same model (4 layers, 4 heads, 64 wide, sequence 64, 16 samples
per step, synthetic tokens: no loader) under `torchrun --nproc-per-node N` on gloo, and the one-process run does the
same work. Reported: the median seconds per step over the steps after the first two (warm-up, shape inference),
and its ratio to one process. On a CPU the model is far too small for the split to pay: the ratio measures what
each layout adds per step (collectives, DTensor dispatch, pipeline bookkeeping), so that a regression shows. Ranks
share the machine's cores (OMP_NUM_THREADS=1 each): compare ratios from the same machine only.

Prints a table; writes the rows, with the machine, versions and git commit, as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# name -> (processes, overrides)
LAYOUTS = {
    "one": (1, []),
    "ddp2": (2, ["parallel.dp_replicate=2"]),
    "fsdp2": (2, ["parallel.dp_shard=2", "parallel.dp_replicate=1"]),
    "tp2": (2, ["parallel.tp=2", "parallel.dp_replicate=1"]),
    "pp2-1F1B": (2, ["parallel.pp=2", "parallel.dp_replicate=1"]),
    "pp2-Interleaved1F1B": (2, ["parallel.pp=2", "parallel.dp_replicate=1", 'parallel.pp_schedule="Interleaved1F1B"']),
    "hsdp2x2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "fsdp2xtp2": (4, ["parallel.dp_shard=2", "parallel.tp=2", "parallel.dp_replicate=1"]),
    "pp2xtp2": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.dp_replicate=1"]),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, family: str, steps: int, work: Path) -> dict:
    nproc, extra = LAYOUTS[name]
    out = work / name
    overrides = [f'out_dir="{out}"', 'data.source="synthetic"', "model.vocab_size=256", 'model.name="custom"',
                 f'model.family="{family}"', "model.n_layer=4", "model.n_head=4", "model.n_embd=64",
                 "model.seq_length=64",
                 "schedule.micro_batch_size=4", "schedule.global_batch_tokens=1024", f"schedule.max_steps={steps}",
                 "schedule.warmup_steps=2",
                 "metrics.eval_interval=0", "metrics.log_interval=1", "checkpoint.interval=0",
                 "schedule.stop_at_step=0", 'device="cpu"',
                 "compile=false", "metrics.tensorboard=false", "data.num_workers=0", 'checkpoint.resume="never"',
                 *extra]  # fmt: skip
    if family == "llama":
        overrides += ["model.n_kv_head=2", "model.ffn_hidden=128"]
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
                f"--master-port={free_port()}"]  # fmt: skip
    cmd = [*(launcher if nproc > 1 else [sys.executable]), "-m", "corpusforge.train", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode:
        return {"layout": name, "ranks": nproc, "error": done.stderr.strip().splitlines()[-1:]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["step_s"] for r in records if r.get("kind") == "train" or ("step_s" in r and "loss" in r)]
    steady = step_s[2:] or step_s
    return {"layout": name, "ranks": nproc, "step_s_median": statistics.median(steady), "steps_timed": len(steady),
            "final_loss": next((r["loss"] for r in reversed(records) if "loss" in r), None)}  # fmt: skip


def versions() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    return {"torch": torch.__version__, "python": platform.python_version(), "commit": commit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=["gpt2", "llama"], default="llama")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names: " + ", ".join(LAYOUTS))
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"parallel-overhead-{dt.date.today()}.json")
    args = ap.parse_args()
    names = ["one", *[n for n in args.layouts.split(",") if n != "one"]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = run_layout(name, args.family, args.steps, Path(tmp))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    base = rows[0].get("step_s_median")
    print(f"{'layout':<22}{'ranks':>6}{'s/step':>10}{'x one':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['layout']:<22}{row['ranks']:>6}  error: {row['error']}")
            continue
        row["ratio_to_one"] = row["step_s_median"] / base if base else None
        print(f"{row['layout']:<22}{row['ranks']:>6}{row['step_s_median']:>10.4f}{row['ratio_to_one']:>8.2f}")
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()}
    result = {"date": str(dt.date.today()), "family": args.family, "steps": args.steps, "machine": machine,
              "versions": versions(), "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
