"""Part 6: how long a checkpoint of GPT-2 124M holds the training loop, asynchronous against synchronous saves.

Two runs of the bundled trainer, the same except `async_checkpoint`: synthetic tokens on the GPU, a checkpoint
every few steps (model and AdamW state, ~2 GB at vocabulary 100277). The trainer records, for every save, the
seconds the loop stood still (`checkpoint_stall` in metrics.jsonl: stage_s, the device-to-host copy into pinned
memory allocated at the first save and reused after; wait_s, for the previous write still in flight; the whole
write when synchronous) and the write's own seconds (`checkpoint`). Eager mode (no torch.compile): the stall does not
depend on how the step was compiled, and the part stays short. Smoke mode: a 2-layer toy on CPU.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Context, need_cuda, part_main, train_run  # noqa: E402

SIZES = {
    False: {"model": ["model.name=gpt2-124m"], "seq": 1024, "micro": 8, "steps": 40, "every": 10},
    True: {"model": ["model.name=custom", "model.n_layer=2", "model.n_head=2", "model.n_embd=64"], "seq": 32,
           "micro": 2, "steps": 4,
           "every": 2},
}  # fmt: skip


def staging_is_exact(ctx: Context, device: str) -> bool:
    """Save asynchronously, overwrite the weights at once, load the checkpoint back: the saved weights or not."""
    import torch

    from corpusforge.train import checkpoint as ckpt
    from corpusforge.train.model import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=256, vocab_size=4096, block_size=128)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saver = ckpt.Checkpointer(ctx.work / "exact", rank=0, keep=1, asynchronous=True)
    saver.save(1, ckpt.ShardedState.of(model, optimizer), {"step": 1}, {"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # the next step, while the write is in flight
    saver.close()
    loaded = ckpt.load_model(ckpt.latest_checkpoint(ctx.work / "exact"), GPT(cfg))
    return all(torch.equal(loaded.state_dict()[k].cpu(), v.cpu()) for k, v in before.items())


def run(ctx: Context) -> None:
    need_cuda(ctx)
    s = SIZES[ctx.smoke]
    hw = ["device=cpu", "model.vocab_size=512"] if ctx.smoke else ["device=cuda", "dtype=bfloat16"]
    r = ctx.result
    for mode in ("async", "sync"):
        flag = "true" if mode == "async" else "false"
        summary, metrics = train_run([
            *s["model"], "data.source=synthetic", f"model.seq_length={s['seq']}",
            f"schedule.micro_batch_size={s['micro']}",
            f"schedule.global_batch_tokens={s['micro'] * s['seq']}", f"schedule.max_steps={s['steps']}",
            f"metrics.log_interval={s['every']}",
            f"checkpoint.interval={s['every']}", "checkpoint.keep=1", f"checkpoint.async_write={flag}",
            "metrics.eval_interval=0", "metrics.tensorboard=false", "compile=false", "checkpoint.resume=never",
            f"out_dir={ctx.work / ('run-ckpt-' + mode)}", *hw,
        ])  # fmt: skip
        records = [m for m in metrics if m.get("kind") == "checkpoint_stall"]
        stalls = [m["stall_s"] for m in records]
        stages = [m["stage_s"] for m in records if "stage_s" in m]
        writes = [m["write_s"] for m in metrics if m.get("kind") == "checkpoint"]
        steps = [m["step_s"] for m in metrics if m.get("kind") == "train"]
        ckpt = Path(summary["checkpoint"]) if summary.get("checkpoint") else None
        r["runs"][mode] = {
            "saves": len(stalls),
            "stall_s": stalls,
            "stall_s_first": stalls[0] if stalls else None,  # no earlier write in flight: the save's own cost
            "stall_s_median": round(statistics.median(stalls), 4) if stalls else None,
            "stage_s": stages,  # the copy alone; the first save also allocates and pins the buffers
            "stage_s_reused": round(statistics.median(stages[1:]), 4) if len(stages) > 1 else None,
            "wait_s": [m.get("wait_s") for m in records],
            "write_s": writes,
            "step_s": steps,
            "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.iterdir()) if ckpt and ckpt.exists() else None,
        }
        ctx.save()
    r["figures"]["staging_exact"] = staging_is_exact(ctx, "cpu" if ctx.smoke else "cuda")
    ctx.save()
    if not r["figures"]["staging_exact"]:
        raise AssertionError("an async checkpoint did not hold the weights at its save (the staged copy raced)")
    a, b = r["runs"]["async"], r["runs"]["sync"]
    gb = round((a["checkpoint_bytes"] or 0) / 1e9, 3)
    reused = a["stage_s_reused"]
    r["figures"].update(blocked_s_async=a["stall_s_first"], blocked_s_sync=b["stall_s_first"], checkpoint_gb=gb,
                        stage_s_reused=reused,
                        stage_gb_per_s=round(gb / reused, 1) if reused else None)  # fmt: skip
    r["headline"] = (f"the loop blocks {a['stall_s_first']:.3f} s at the first save asynchronously (pins its buffers)"
                     + (f", {reused:.3f} s at later ones" if reused is not None else "")
                     + f", {b['stall_s_first']:.3f} s synchronously ({gb} GB)")  # fmt: skip


if __name__ == "__main__":
    part_main(run, part=6, name="async checkpoint")
