"""Part 2: the Llama-style model of the parallel trainer (corpusforge/train/llama.py) on one GPU: tokens/s and MFU.

Optional: the kit checks that the trainer really builds the llama family (a dry run of `llama3-tiny` must plan the
parameter count of corpusforge.train.llama.Llama of that shape) and is skipped with the reason otherwise. Full mode
trains llama3-1b (Llama 3.2 1B: 16 layers, 2048 wide, GQA 32:8), sequence 2048, bf16, torch.compile, on synthetic
tokens already on the GPU; smoke mode llama3-tiny on CPU. MFU uses the trainer's own FLOPs per token.

Then packed documents (issue 30): the same model at sequence 8,192 on a generated token dataset whose documents
average 2,048 tokens (about 4 to a sample), trained with `data.document_mask=true` (flex attention with a block
mask, compiled) and as plain causal sequences, in alternating order; the cost of the masks is the ratio of their
tokens/s (target: at most 5% slower). Smoke mode: llama3-tiny at sequence 128 on CPU (SDPA with a boolean mask).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Context, Skip, first_line, need_cuda, part_main, train_run  # noqa: E402

SIZES = {
    False: {"model": "llama3-1b", "seq": 2048, "micro": 4, "accum": 4, "steps": 15, "log": 5},
    True: {"model": "llama3-tiny", "seq": 64, "micro": 2, "accum": 1, "steps": 4, "log": 2},
}
# Packed documents: (seq, micro-batch, accumulation, steps, log interval, mean document length)
DOCUMENTS = {False: (8192, 1, 4, 12, 4, 2048), True: (128, 2, 1, 4, 2, 32)}


def llama_support() -> str | None:
    """None when the trainer builds the llama family, else the reason to skip."""
    try:
        import torch

        from corpusforge.train import config, load_config, train
        from corpusforge.train.llama import Llama, LlamaConfig
    except ImportError as e:
        return f"no Llama model in corpusforge.train yet ({first_line(e)})"
    if "llama3-tiny" not in getattr(config, "LLAMA_PRESETS", {}):
        return "corpusforge.train.config has no llama3-tiny preset"
    try:
        cfg = load_config(None, ["model.name=llama3-tiny", "data.source=synthetic", "device=cpu", "model.seq_length=64",
                                 "schedule.micro_batch_size=1", "schedule.global_batch_tokens=64",
                                 "metrics.eval_interval=0"])  # fmt: skip
        planned = train(cfg, dry_run=True, log=lambda line: None)["params"]
        n_layer, n_head, n_embd = cfg.model_shape()
        shape = cfg.llama_shape()
        with torch.device("meta"):
            llama = Llama(LlamaConfig(n_layer=n_layer, n_head=n_head, n_kv_head=shape["n_kv_head"], n_embd=n_embd,
                                      ffn_hidden=shape["ffn_hidden"], vocab_size=cfg.model.vocab_size, block_size=64,
                                      tie_embeddings=shape["tie_embeddings"]))  # fmt: skip
        expected = sum(p.numel() for p in llama.parameters())
    except Exception as e:  # noqa: BLE001 - any failure here means: not usable yet
        return f"the trainer cannot plan llama3-tiny yet ({first_line(e)})"
    if planned != expected:
        return (
            f"the trainer does not build the llama family yet (llama3-tiny planned {planned:,} parameters, a "
            f"Llama of that shape has {expected:,})"
        )
    return None


def run(ctx: Context) -> None:
    need_cuda(ctx)
    reason = llama_support()
    if reason:
        raise Skip(reason)
    s = SIZES[ctx.smoke]
    hw = (
        ["device=cpu", "compile=false", "model.vocab_size=512"]
        if ctx.smoke
        else ["device=cuda", "dtype=bfloat16", "compile=true"]
    )
    summary, metrics = train_run([
        f"model.name={s['model']}", "data.source=synthetic", f"model.seq_length={s['seq']}",
        f"schedule.micro_batch_size={s['micro']}",
        f"schedule.global_batch_tokens={s['micro'] * s['seq'] * s['accum']}", f"schedule.max_steps={s['steps']}",
        f"metrics.log_interval={s['log']}", f"schedule.warmup_steps={s['log']}", "metrics.eval_interval=0",
        "checkpoint.interval=0",
        "checkpoint.keep=1", "metrics.tensorboard=false", f"out_dir={ctx.work / 'run-llama'}",
        "checkpoint.resume=never", *hw,
    ])  # fmt: skip
    plan = next((m for m in metrics if m.get("kind") == "plan"), {})
    ctx.result["runs"]["synthetic"] = {
        "model": s["model"],
        "params": plan.get("params"),
        "flops_per_token": plan.get("flops_per_token"),
        "seq_length": s["seq"],
        "tokens_per_s": summary.get("tokens_per_s"),
        "mfu": summary.get("mfu"),
        "seconds": summary.get("seconds"),
        "final_loss": summary.get("final_loss"),
    }
    mfu = f", MFU {100 * summary['mfu']:.1f}%" if summary.get("mfu") else ""
    ctx.result["headline"] = f"{s['model']} seq {s['seq']}: {summary['tokens_per_s']:,.0f} tok/s{mfu}"
    ratio = packed_documents(ctx, s["model"], hw)
    ctx.result["headline"] += f"; document masks at seq {DOCUMENTS[ctx.smoke][0]}: {ratio:.3f}x causal tok/s"


def packed_documents(ctx: Context, model: str, hw: list[str]) -> float:
    """Document-masked against plain causal training on the same packed samples; tokens/s of masked / causal."""
    import numpy as np

    from corpusforge.indexed import IndexedDatasetWriter

    seq, micro, accum, steps, log, mean_doc = DOCUMENTS[ctx.smoke]
    vocab = 512 if ctx.smoke else 128256
    tokens = seq * micro * accum * (steps + 2) * 2  # the train split holds every step's samples, with room
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2 * mean_doc, size=tokens // mean_doc + 1)
    prefix = ctx.work / "documents" / "packed_text_document"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_documents(rng.integers(0, vocab, size=int(lengths.sum()), dtype=np.int32), lengths)
    runs: dict[str, list[dict]] = {"document_mask": [], "causal": []}
    order = ("document_mask", "causal") if ctx.smoke else ("document_mask", "causal", "causal", "document_mask")
    for name in order:  # on a GPU alternated, each first once
        summary, _ = train_run([
            f"model.name={model}", f'data.path="{prefix}"', 'data.split="100,0,0"', "data.num_workers=2",
            f"data.document_mask={'true' if name == 'document_mask' else 'false'}", f"model.seq_length={seq}",
            f"model.vocab_size={vocab}", f"schedule.micro_batch_size={micro}",
            f"schedule.global_batch_tokens={micro * seq * accum}", f"schedule.max_steps={steps}",
            f"metrics.log_interval={log}", f"schedule.warmup_steps={log}", "metrics.eval_interval=0",
            "checkpoint.interval=0", "metrics.tensorboard=false", "checkpoint.resume=never",
            f"out_dir={ctx.work / f'run-{name}-{len(runs[name])}'}",
            *[h for h in hw if not h.startswith("model.vocab_size")],
        ])  # fmt: skip
        runs[name].append({k: summary.get(k) for k in ("tokens_per_s", "mfu", "seconds", "final_loss")})
    best = {name: max(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    ratio = best["document_mask"] / best["causal"]
    ctx.result["runs"]["packed_documents"] = {
        "seq_length": seq, "mean_document_tokens": mean_doc, "runs": runs, "best_tokens_per_s": best,
        "masked_over_causal": round(ratio, 4),
    }  # fmt: skip
    return ratio


if __name__ == "__main__":
    part_main(run, part=2, name="llama")
