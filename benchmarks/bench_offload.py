"""parallel.offload = "nvme": the optimizer step's disk traffic against what bench-io measures for sequential reads
and writes on the same disk (target: at least 80%), and the step's cost against the in-memory AdamW's.

    python benchmarks/bench_offload.py [--path DIR] [--values 64e6] [--repeats 3] [--train]

Three measurements, alternated `repeats` times, medians reported:
  disk    bench-io seq-write, seq-read and offload on DIR, measured as the step moves its bytes: requests of the
          step's chunk size (CHUNK), one at a time per direction (the step's reader and writer are one thread each),
          O_DIRECT where the file system takes it (the run stops if bench-io and the step did not make the same
          choice), the same number of bytes (one file of 3 x 4 bytes per value; the step has three);
  step    NvmeAdamW.step() over `values` fp32 parameter values in DIR (3 x 4 bytes each read and written per step) and
          torch.optim.AdamW(fused=True).step() over the same values in memory; the disk's share of the nvme step is
          compared with the time bench-io's sequential figures give for the same bytes:
              efficiency = (read_bytes / seq_read + written_bytes / seq_write) / step_seconds
          and, in the same repeat, the nvme step with its update on all of torch's threads (as before commit 9f5afd9,
          where the update starved the reader and writer threads of a small machine);
  train   (--train) corpusforge train step time of a small Llama with offload none and nvme (metrics step_s).
Writes benchmarks/results/offload-<date>.json with the machine, versions, commit and load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from corpusforge.iobench.config import BenchConfig, MiB
from corpusforge.iobench.runner import run_bench
from corpusforge.train.offload import NvmeAdamW

HERE = Path(__file__).resolve().parent
CHUNK = 8 * MiB  # the step's chunk of each file (NvmeAdamW's default) and bench-io's request size


def disk_figures(path: Path, file_size: int) -> dict[str, float]:
    """MB/s of bench-io's seq-write, seq-read and the offload pattern's read, write and combined rows."""
    config = BenchConfig(paths=(str(path),), patterns=("seq-write", "seq-read", "offload"), block_sizes=(CHUNK,),
                         file_size=file_size, duration=120.0)  # fmt: skip
    rows = run_bench(config).results
    return {f"{r.pattern}:{r.phase}": r.mb_s for r in rows} | {"cache": rows[-1].cache}


def params(values: int) -> list[torch.nn.Parameter]:
    """Parameters of `values` fp32 values in LLM-like shapes (8 matrices and their norms), with gradients."""
    torch.manual_seed(0)
    n = values // 8
    out = []
    for _ in range(8):
        p = torch.nn.Parameter(torch.randn(n // 4096, 4096) * 0.02)
        p.grad = torch.randn_like(p) * 1e-3
        out.append(p)
        norm = torch.nn.Parameter(torch.ones(4096))
        norm.grad = torch.randn_like(norm) * 1e-3
        out.append(norm)
    return out


def time_steps(opt: torch.optim.Optimizer, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def nvme_step(ps: list[torch.nn.Parameter], directory: Path, steps: int, update_threads: int | None) -> tuple:
    """(median step seconds, NvmeAdamW's io counters, its O_DIRECT note, bytes of one file, its update threads)."""
    nvme = NvmeAdamW([{"params": ps}], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, directory=directory,
                     chunk_bytes=CHUNK, update_threads=update_threads)  # fmt: skip
    times = time_steps(nvme, steps + 1)[1:]  # the first writes the master file from the parameters
    out = (statistics.median(times), dict(nvme.io), nvme.direct_note, nvme.files["master"].nbytes, nvme.update_threads)
    nvme.close()
    shutil.rmtree(directory, ignore_errors=True)
    return out


def step_figures(path: Path, values: int, steps: int, repeat: int) -> dict[str, float]:
    """Median seconds of an nvme step with its update on NvmeAdamW's default threads and on all of torch's ("all_s";
    the two in turn, which first alternating with `repeat`) and of an in-memory step over the same parameters, and
    the nvme step's bytes."""
    ps = params(values)
    memory = torch.optim.AdamW(ps, lr=1e-4, fused=True)
    memory_s = statistics.median(time_steps(memory, steps + 1)[1:])  # the first allocates the moments
    del memory
    variants = [None, torch.get_num_threads()][:: 1 if repeat % 2 == 0 else -1]
    got = {v: nvme_step(ps, path / "offload-bench", steps, v) for v in variants}
    nvme_s, io, note, nbytes, threads = got[None]
    per_step = 3 * nbytes
    return {"nvme_step_s": nvme_s, "memory_step_s": memory_s, "all_s": got[torch.get_num_threads()][0],
            "update_threads": threads, "torch_threads": torch.get_num_threads(), "read_bytes": per_step,
            "write_bytes": per_step, "io": note, "io_total": io}  # fmt: skip


def train_figures(path: Path) -> dict[str, float]:
    """Median step_s of a small Llama (1 layer, width 1024, 32k vocabulary: 70M parameters) with none and nvme."""
    sys.path.insert(0, str(HERE.parent / "tests" / "train"))
    from trainkit import tiny_overrides, write_markov_corpus

    corpus = write_markov_corpus(path / "markov", num_docs=200)
    out = {}
    for offload in ("none", "nvme"):
        run_dir = path / f"train-{offload}"
        args = tiny_overrides(corpus, run_dir, **{
            "model.family": '"llama"', "model.n_embd": 1024, "model.n_head": 8, "model.vocab_size": 32000,
            "schedule.micro_batch_size": 4, "schedule.global_batch_tokens": 128, "schedule.max_steps": 6,
            "checkpoint.interval": 0, "metrics.eval_interval": 0, "parallel.offload": f'"{offload}"',
            "parallel.offload_dir": f'"{path / "offload-train"}"'})  # fmt: skip
        code = "import sys; from corpusforge.train import load_config, train; train(load_config(None, sys.argv[1:]))"
        subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, timeout=1200)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step_s"] for r in records if r.get("kind") == "train" and r["step"] > 1]
        out[f"train_{offload}_step_s"] = statistics.median(steps)
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def machine() -> dict[str, str]:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    return {"cpu": cpu, "cores": str(os.cpu_count()), "kernel": platform.release(), "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit.strip()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", type=Path, default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--values", type=float, default=64e6, help="parameter values of the step benchmark")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train", action="store_true", help="also time training steps of a small Llama")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-offload-", dir=args.path))
    values = int(args.values)
    runs = []
    try:
        for k in range(args.repeats):
            load_before = os.getloadavg()
            disk = disk_figures(root, file_size=(3 * values * 4) // (8 * MiB) * (8 * MiB))
            step = step_figures(root, values, args.steps, k)
            if (disk["cache"] == "O_DIRECT") != (step["io"] == "O_DIRECT"):
                sys.exit(f"{root}: bench-io measured {disk['cache']} but the step ran {step['io']}: not comparable")
            runs.append({"repeat": k, "disk": disk, "step": step, "load_before": load_before,
                         "load_after": os.getloadavg()})  # fmt: skip
            expected = step["read_bytes"] / (disk["seq-read:read"] * 1e6) + step["write_bytes"] / (
                disk["seq-write:write"] * 1e6
            )
            runs[-1]["efficiency"] = expected / step["nvme_step_s"]
            d, st = disk, step
            print(f"repeat {k}: seq-read {d['seq-read:read']:.0f} MB/s, seq-write {d['seq-write:write']:.0f} MB/s, "
                  f"offload pattern {d['offload:step']:.0f} MB/s | nvme step {st['nvme_step_s']:.3f} s (update on "
                  f"all threads {st['all_s']:.3f} s, in memory {st['memory_step_s']:.3f} s), "
                  f"efficiency {runs[-1]['efficiency']:.0%} | load "
                  f"{load_before[0]:.2f}->{os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        train = train_figures(root) if args.train else {}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(f):
        return statistics.median(f(r) for r in runs)

    summary = {
        "seq_read_mb_s": med(lambda r: r["disk"]["seq-read:read"]),
        "seq_write_mb_s": med(lambda r: r["disk"]["seq-write:write"]),
        "offload_pattern_mb_s": med(lambda r: r["disk"]["offload:step"]),
        "nvme_step_s": med(lambda r: r["step"]["nvme_step_s"]),
        "memory_step_s": med(lambda r: r["step"]["memory_step_s"]),
        "nvme_step_disk_mb_s": med(lambda r: 2 * r["step"]["read_bytes"] / r["step"]["nvme_step_s"] / 1e6),
        "efficiency_vs_bench_io_seq": med(lambda r: r["efficiency"]),
        "nvme_all_threads_step_s": med(lambda r: r["step"]["all_s"]),
        "efficiency_all_threads": med(lambda r: r["efficiency"] * r["step"]["nvme_step_s"] / r["step"]["all_s"]),
        "load_1min": med(lambda r: r["load_before"][0]),
        "state_bytes_per_step": runs[0]["step"]["read_bytes"],
        **train,
    }
    summary["optimizer_step_overhead_x"] = summary["nvme_step_s"] / summary["memory_step_s"]
    # the I/O engine alone against the disk's sequential figures (the time they give for equal reads and writes)
    seq = 2 / (1 / summary["seq_read_mb_s"] + 1 / summary["seq_write_mb_s"])
    summary["offload_pattern_vs_seq"] = summary["offload_pattern_mb_s"] / seq
    if train:
        summary["train_step_overhead_x"] = train["train_nvme_step_s"] / train["train_none_step_s"]
    for k, v in summary.items():
        print(f"  {k:<30} {v:.4g}" if isinstance(v, float) else f"  {k:<30} {v}")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "io": runs[0]["disk"]["cache"],
              "values": values, "steps": args.steps, "repeats": args.repeats, "summary": summary,
              "runs": runs}  # fmt: skip
    out = HERE / "results" / f"offload-{time.strftime('%Y-%m-%d')}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
