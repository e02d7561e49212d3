"""Part 7: parallel.offload on one GPU: tokens/s and MFU of Llama-3-family models with the optimizer state in GPU
memory ("none"), in host memory ("cpu": FSDP2's CPUOffloadPolicy, on a process group of one) and in files on the
machine's disk ("nvme": fp32 master weights and AdamW's moments streamed through host buffers by each step), and the
losses, which must be equal on CPU and within rounding on a GPU (the offloaded steps run torch's fused CPU AdamW, the
in-memory one the CUDA kernel).

Full mode, sized to the lent machine (one H200 of 141 GB, 128 GB of host memory, 64 GB of disk): llama3-1b with
none, cpu and nvme (it fits every way: the overheads), then llama3-3b with cpu (51 GB of fp32 parameters, gradients
and moments in host memory) and with nvme (38.5 GB of state files). llama3-8b fits neither: 128 GB in host memory,
96 GB of files. Synthetic tokens, seq 2048, bf16, eager. Smoke mode: a 2-layer toy Llama on CPU, none, cpu and nvme,
whose losses must be bit-identical.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Context, need_cuda, part_main, train_run  # noqa: E402

SIZES = {
    False: {"runs": [("llama3-1b", "none"), ("llama3-1b", "cpu"), ("llama3-1b", "nvme"), ("llama3-3b", "cpu"),
                     ("llama3-3b", "nvme")], "seq": 2048, "micro": 4, "steps": 8},
    True: {"runs": [("llama3-tiny", "none"), ("llama3-tiny", "cpu"), ("llama3-tiny", "nvme")], "seq": 64, "micro": 2,
           "steps": 6},
}  # fmt: skip


def run(ctx: Context) -> None:
    need_cuda(ctx)
    s = SIZES[ctx.smoke]
    hw = ["device=cpu", "model.vocab_size=512"] if ctx.smoke else ["device=cuda", "dtype=bfloat16", "compile=false"]
    r = ctx.result
    losses = {}
    for model, offload in s["runs"]:
        key = f"{model}-{offload}"
        try:
            summary, metrics = train_run([
                f"model.name={model}", "data.source=synthetic", f"model.seq_length={s['seq']}",
                f"schedule.micro_batch_size={s['micro']}", f"schedule.global_batch_tokens={s['micro'] * s['seq']}",
                f"schedule.max_steps={s['steps']}", "schedule.warmup_steps=2", "metrics.log_interval=1",
                "checkpoint.interval=0", "checkpoint.keep=1", "metrics.eval_interval=0", "metrics.tensorboard=false",
                "compile=false", "checkpoint.resume=never", f"parallel.offload={offload}",
                f"parallel.offload_dir={ctx.work / 'offload'}", f"out_dir={ctx.work / ('run-' + key)}", *hw,
            ])  # fmt: skip
        except Exception as e:  # out of memory or disk: recorded, the next model still runs
            r["runs"][key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            ctx.save()
            continue
        train = [m for m in metrics if m.get("kind") == "train"]
        steady = train[2:] or train  # the first steps allocate (and nvme writes its master file)
        losses[key] = [m["loss"] for m in train]
        r["runs"][key] = {
            "params": next((m["params"] for m in metrics if m.get("kind") == "plan"), None),
            "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in steady), 1),
            "mfu": round(statistics.median(m["mfu"] for m in steady), 4) if steady[0].get("mfu") is not None else None,
            "step_s": round(statistics.median(m["step_s"] for m in steady), 4),
            "losses": losses[key],
        }
        ctx.save()
    first = s["runs"][0][0]
    none = losses.get(f"{first}-none")
    for offload in ("cpu", "nvme"):
        other = losses.get(f"{first}-{offload}")
        if none and other:
            r["figures"][f"{offload}_losses_equal"] = none == other
            r["figures"][f"{offload}_max_loss_diff"] = max(abs(a - b) for a, b in zip(none, other))
            a, b = r["runs"][f"{first}-none"], r["runs"][f"{first}-{offload}"]
            r["figures"][f"{offload}_step_overhead_x"] = round(b["step_s"] / a["step_s"], 3)
        if ctx.smoke and not r["figures"].get(f"{offload}_losses_equal"):
            raise AssertionError(f"{offload}'s losses differ from the in-memory run's on CPU: {none} vs {other}")
    done = {k: v for k, v in r["runs"].items() if "tokens_per_s" in v}
    for offload in ("cpu", "nvme"):
        r["figures"][f"largest_{offload}"] = next((k for k in reversed(done) if k.endswith(f"-{offload}")), None)
    r["headline"] = ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s" + (f" MFU {v['mfu']:.1%}" if v["mfu"] else "")
                              for k, v in done.items())  # fmt: skip
    ctx.save()


if __name__ == "__main__":
    part_main(run, part=7, name="offload")
