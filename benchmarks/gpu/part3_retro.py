"""Part 3: a RETRO model training step on one GPU (corpusforge/train/retro_model.py): tokens/s and MFU.

Optional: skipped with the reason while corpusforge.train has no RETRO model. The step is written here as the trainer
writes its own (bf16 autocast, fp32 loss, AdamW, grad clipping) rather than run through `train`, because a retrieval
database needs faiss, which the GPU machine lacks (part 4): random tokens and random neighbours already on the GPU,
K = 2 neighbours of R = 128 tokens per 64-token chunk. Full mode: retro-172m (the paper's smallest decoder with
retrieval), sequence 2048, eager and then, with time left, torch.compile; smoke mode: retro-tiny-cpu on CPU. FLOPs
per token from retro_model.flops_per_token (encoder and cross-attention counted).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Context, Skip, first_line, need_cuda, part_main  # noqa: E402

SIZES = {
    False: {"preset": "retro-172m", "seq": 2048, "batch": 8, "warmup": 3, "steps": 10},
    True: {"preset": "retro-tiny-cpu", "seq": 128, "batch": 1, "warmup": 1, "steps": 2},
}


def measure(model, opt, batch, steps: int, warmup: int, device) -> dict:
    """Seconds per optimizer step over `steps` after `warmup` untimed ones (compilation happens there)."""
    import torch

    from corpusforge.train.model import loss_fn

    tokens, labels, neighbours, mask = batch
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(model(tokens, neighbours, mask), labels, torch.ones_like(labels, dtype=torch.float32))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    elapsed = time.perf_counter() - t0
    return {"step_s": elapsed / steps, "tokens_per_s": tokens.numel() * steps / elapsed, "loss": float(loss)}


def run(ctx: Context) -> None:
    need_cuda(ctx)
    if importlib.util.find_spec("corpusforge.train.retro_model") is None:
        raise Skip("no RETRO model in corpusforge.train yet (corpusforge/train/retro_model.py)")
    import torch

    from corpusforge.train.metrics import peak_flops
    from corpusforge.train.retro_model import RetroModel, flops_per_token, retro_preset

    s = SIZES[ctx.smoke]
    device = torch.device("cpu" if ctx.smoke else "cuda")
    vocab = 512 if ctx.smoke else 100277  # cl100k_base, corpusforge preprocess's default; smoke: a toy's
    cfg = retro_preset(s["preset"], vocab, block_size=s["seq"])
    torch.manual_seed(0)
    model = RetroModel(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    B, T, L = s["batch"], s["seq"], s["seq"] // cfg.chunk_length
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, vocab, (B, T + 1), generator=g)
    neighbours = torch.randint(0, vocab, (B, L, cfg.num_neighbours, cfg.retrieved_length), generator=g)
    batch = tuple(t.contiguous().to(device) for t in (text[:, :-1], text[:, 1:], neighbours, neighbours >= 0))
    fpt = flops_per_token(cfg, T)
    peak = peak_flops(torch.cuda.get_device_name()) if device.type == "cuda" else None
    r = ctx.result
    r["figures"].update(preset=s["preset"], params=model.num_params(), flops_per_token=fpt, seq_length=T,
                        batch=B, neighbours=list(neighbours.shape[2:]), peak_flops=peak)  # fmt: skip
    for name in ("eager", "compiled"):
        if name == "compiled":
            if ctx.smoke or ctx.left() < 150:
                r["runs"]["compiled"] = {"skipped": "smoke" if ctx.smoke else "under 150 s left"}
                break
            model.compile()
        try:
            fig = measure(model, opt, batch, s["steps"], s["warmup"], device)
        except Exception as e:  # noqa: BLE001 - a compile failure is a finding; the eager figures stand
            if name == "eager":
                raise
            r["runs"][name] = {"error": first_line(e)}
            break
        fig["mfu"] = round(fig["tokens_per_s"] * fpt / peak, 4) if peak else None
        r["runs"][name] = fig
        ctx.save()
    best = max((v for v in r["runs"].values() if "tokens_per_s" in v), key=lambda v: v["tokens_per_s"])
    mfu = f", MFU {100 * best['mfu']:.1f}%" if best.get("mfu") else ""
    which = [k for k, v in r["runs"].items() if v is best][0]
    r["headline"] = f"{s['preset']} seq {T}: {best['tokens_per_s']:,.0f} tok/s ({which}){mfu}"
    if not torch.isfinite(torch.tensor(best["loss"])):
        raise RuntimeError(f"the RETRO step's loss is {best['loss']}")


if __name__ == "__main__":
    part_main(run, part=3, name="retro step")
