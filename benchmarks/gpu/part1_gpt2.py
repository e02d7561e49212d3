"""Part 1: GPT-2 124M, sequence 1024, one GPU, bf16, torch.compile: what corpusforge's data path costs the trainer.

Two runs of the bundled trainer (`corpusforge.train.train`) in this process, same model and batch:
  synthetic  random tokens made once on the GPU (data_source = "synthetic"): the model's own speed
  loader     a real dataset, made here by `corpusforge preprocess` from a generated corpus (cl100k_base), read by
             corpusforge's loaders with worker processes, as a user trains
The gap between their tokens/s is the data path's cost (the issue's target: under 2%). Each run's first log
interval (compilation, warm-up) is left out of its tokens/s by the trainer itself.

MFU = tokens/s x FLOPs per token / the GPU's dense bf16 peak (corpusforge.train.metrics.PEAK_BF16_FLOPS), with
nanoGPT's FLOPs per token 6N + 12·L·C·T (N: parameters without the position embedding). The dataset's tokenizer is
cl100k_base (vocabulary 100277, padded to 100352), so the model holds 163M parameters, not GPT-2's 124M: its
tokens/s are not the published ones, its MFU is comparable. When time is left, a third run (synthetic, vocabulary
50257 as GPT-2's) gives tokens/s like for like with the published llm.c / nanoGPT figures (common.PUBLISHED).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GPT2_124M_FLOPS_PER_TOKEN,
    PUBLISHED,
    Context,
    flops_per_token,
    gpt2_params,
    gpu_class,
    make_corpus,
    need_cuda,
    part_main,
    preprocess,
    train_run,
)

# (full, smoke): full is the GPT-2 124M at 1024 tokens; smoke a 2-layer toy of the same code on CPU.
SIZES = {
    False: {"corpus_bytes": 20_000_000, "model": ["model.name=gpt2-124m"], "seq": 1024, "micro": 16, "accum": 8,
            "steps": 30, "log": 5, "workers": 2},
    True: {"corpus_bytes": 150_000, "model": ["model.name=custom", "model.n_layer=2", "model.n_head=2",
                                              "model.n_embd=64"], "seq": 32,
           "micro": 2, "accum": 1, "steps": 4, "log": 2, "workers": 1},
}  # fmt: skip


def overrides(ctx: Context, name: str, s: dict, extra: list[str]) -> list[str]:
    return [
        *s["model"],
        f"model.seq_length={s['seq']}",
        f"schedule.micro_batch_size={s['micro']}",
        f"schedule.global_batch_tokens={s['micro'] * s['seq'] * s['accum']}",
        f"schedule.max_steps={s['steps']}",
        f"metrics.log_interval={s['log']}",
        f"schedule.warmup_steps={s['log']}",
        "metrics.eval_interval=0",
        "checkpoint.interval=0",  # the trainer still saves once after the last step, outside the timed intervals
        "checkpoint.keep=1",
        "metrics.tensorboard=false",
        f"data.num_workers={s['workers']}",
        f"out_dir={ctx.work / ('run-' + name)}",
        "checkpoint.resume=never",
        *(["device=cpu", "compile=false"] if ctx.smoke else ["device=cuda", "dtype=bfloat16", "compile=true"]),
        *extra,
    ]


def figures_of(summary: dict, metrics: list[dict]) -> dict:
    plan = next((m for m in metrics if m.get("kind") == "plan"), {})
    return {
        "tokens_per_s": summary.get("tokens_per_s"),
        "mfu": summary.get("mfu"),
        "data_wait_fraction": summary.get("data_wait_fraction"),
        "data_wait_ms_p99_max": summary.get("data_wait_ms_p99_max"),
        "steps": summary.get("steps"),
        "seconds": summary.get("seconds"),
        "final_loss": summary.get("final_loss"),
        "params": plan.get("params"),
        "flops_per_token": plan.get("flops_per_token"),
        "shape": plan.get("shape"),
        "intervals": [
            {"step": m["step"], "tokens_per_s": round(m["tokens_per_s"], 1), "mfu": m.get("mfu")}
            for m in metrics
            if m.get("kind") == "train"
        ],
    }


def check_flops(fig: dict, seq: int) -> dict:
    """The trainer's FLOPs per token against nanoGPT's formula computed here from the shape alone."""
    shape = fig.get("shape") or {}
    if not shape:
        return {}
    n = gpt2_params(shape["n_layer"], shape["n_embd"], shape["padded_vocab"])
    mine = flops_per_token(n, shape["n_layer"], shape["n_embd"], seq)
    return {"formula": "6N + 12*L*C*T (nanoGPT estimate_mfu)", "N": n, "flops_per_token": mine,
            "matches_trainer": mine == fig.get("flops_per_token")}  # fmt: skip


def run(ctx: Context) -> None:
    from corpusforge.train.metrics import peak_flops

    need_cuda(ctx)
    s = SIZES[ctx.smoke]
    r = ctx.result
    t0 = time.perf_counter()
    corpus = make_corpus(ctx.work / "corpus.jsonl", s["corpus_bytes"])
    prefix = preprocess(corpus, ctx.work / "data" / "corpus", workers=2 if ctx.smoke else 8)
    r["figures"]["dataset"] = {"prefix": str(prefix), "bytes_json": corpus.stat().st_size,
                               "prepare_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    ctx.save()

    runs = {
        "synthetic": ["data.source=synthetic"],
        "loader": ["data.source=loader", f"data.path={prefix}"],
    }
    for name, extra in runs.items():
        summary, metrics = train_run(overrides(ctx, name, s, extra))
        r["runs"][name] = figures_of(summary, metrics)
        ctx.save()
    syn, load = r["runs"]["synthetic"], r["runs"]["loader"]
    gap = 1 - load["tokens_per_s"] / syn["tokens_per_s"] if syn["tokens_per_s"] and load["tokens_per_s"] else None
    r["figures"].update(
        data_path_gap=round(gap, 4) if gap is not None else None,
        target_gap="under 0.02",
        flops=check_flops(syn, s["seq"]),
        peak_flops=peak_flops(r["device"]) if r["device"] != "cpu" else None,
    )
    like_for_like(ctx, s)
    mfu = f", MFU {100 * syn['mfu']:.1f}%" if syn["mfu"] else ""
    wait = load.get("data_wait_fraction") or 0.0  # the trainer's own count: time in next(loader) over step time
    r["headline"] = (f"synthetic {syn['tokens_per_s']:,.0f} tok/s, loader {load['tokens_per_s']:,.0f} tok/s: "
                     f"gap {100 * gap:.2f}% (waits {100 * wait:.2f}% of steps){mfu}")  # fmt: skip


def like_for_like(ctx: Context, s: dict) -> None:
    """GPT-2's own vocabulary (50257), synthetic tokens: tokens/s to set beside the published figures."""
    r = ctx.result
    device = r["device"] or ""
    cls = gpu_class(device)
    r["figures"]["published"] = [
        {
            **p.__dict__,
            "tokens_per_s_per_gpu": round(p.tokens_per_s_per_gpu),
            "same_class": p.gpu_class == cls,
            "mfu_at_peak_of_class": None,
        }  # fmt: skip
        for p in PUBLISHED
    ]
    peak = r["figures"].get("peak_flops")
    if peak:
        for p in r["figures"]["published"]:
            if p["same_class"]:
                p["mfu_at_peak_of_class"] = round(p["tokens_per_s_per_gpu"] * GPT2_124M_FLOPS_PER_TOKEN / peak, 4)
    if ctx.smoke or ctx.left() < 120:  # a third compile: only with time to spare
        r["figures"]["gpt2_vocab_run"] = "skipped: smoke" if ctx.smoke else "skipped: under 120 s left"
        return
    summary, metrics = train_run(overrides(ctx, "gpt2-vocab", s, ["data.source=synthetic", "model.vocab_size=50257"]))
    r["runs"]["synthetic_vocab50257"] = figures_of(summary, metrics)


if __name__ == "__main__":
    part_main(run, part=1, name="gpt2-124m data path")
