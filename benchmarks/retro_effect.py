"""Does retrieval help? RETRO against a GPT of the same decoder, and against itself with random neighbours.

The corpus (made here, written with corpusforge's writer, seeded): token sequences from a Markov chain over V
tokens (after token a comes NEXT[a] with probability `follow`, else a uniform token: what a GPT can learn). Half of
the sequences are written twice, in two documents at random places of the corpus, the second copy a "paraphrase"
with `noise` of its tokens replaced at random; the other half once. A chunk of a twinned document has its twin's
chunk among the database's chunks (build-knn excludes same-document neighbours, so a chunk never retrieves
itself), and its twin's continuation predicts the chunk after it: retrieval is informative there, and only there.

Three models, the same decoder (GPT-2 blocks, n_layer x n_embd), the same seed, the same batches in the same
order (the trainer's RETRO loaders; the GPT reads their tokens and ignores the neighbours), the same optimizer
and schedule (corpusforge.train.optim):

    gpt            the decoder alone (corpusforge.train.model.GPT)
    retro          RETRO (corpusforge.train.retro_model), validation with the real neighbours
    retro-random   the same trained RETRO, validation with each neighbour replaced by a random database chunk

Validation: the last samples by position (`split`), which share no chunk with the training samples; their twins
may be anywhere in the database, as in RETRO's own evaluation (the database holds the training data).

    python benchmarks/retro_effect.py --steps 300 --out benchmarks/results/retro-effect-DATE.json

Also reported: training tokens/s of each model on this machine (the cost of retrieval per step) and the step's
p50/p99 wait for its batch.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from corpusforge.indexed import IndexedDatasetWriter
from corpusforge.retro import BuildConfig, build_knn
from corpusforge.train.config import load_config
from corpusforge.train.data import build_retro_data
from corpusforge.train.model import GPT, GPTConfig, loss_fn
from corpusforge.train.optim import lr_at, make_optimizer
from corpusforge.train.retro_model import RetroModel
from corpusforge.train.trainer import batch_to_device, retro_config


def make_corpus(prefix: Path, n_sequences: int, vocab: int, follow: float, noise: float, seed: int) -> dict:
    """Markov-chain sequences, half of them twinned with a noisy copy in another document; documents shuffled."""
    rng = np.random.default_rng(seed)
    nxt = rng.permutation(vocab)
    docs = []
    for i in range(n_sequences):
        n = int(rng.integers(256, 768))
        seq = np.empty(n, dtype=np.int64)
        seq[0] = rng.integers(vocab)
        jumps, randoms = rng.random(n) >= follow, rng.integers(0, vocab, n)
        for t in range(1, n):
            seq[t] = randoms[t] if jumps[t] else nxt[seq[t - 1]]
        docs.append(seq)
        if i % 2 == 0:  # the paraphrase: the same sequence with `noise` of its tokens replaced
            twin = seq.copy()
            hit = rng.random(n) < noise
            twin[hit] = rng.integers(0, vocab, int(hit.sum()))
            docs.append(twin)
    order = rng.permutation(len(docs))
    docs = [docs[i] for i in order]
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(np.concatenate(docs), np.array([len(d) for d in docs]))
    return {"documents": len(docs), "tokens": int(sum(len(d) for d in docs)), "sequences": n_sequences,
            "twinned": (n_sequences + 1) // 2, "vocab": vocab, "follow": follow, "noise": noise}  # fmt: skip


def informative_fraction(valid: list[dict], chunk_length: int) -> float:
    """Of the validation chunks, the fraction with a neighbour equal to it in at least 80% of positions (a twin's
    chunk): how often retrieval can help at all."""
    hits, total = 0, 0
    for b in valid:
        B, T = b["tokens"].shape
        q = b["tokens"].view(B, T // chunk_length, 1, chunk_length)
        nb = b["neighbours"][..., :chunk_length]  # (B, L, K, m): the neighbour chunk without its continuation
        same = ((nb == q) & b["neighbour_mask"][..., :chunk_length]).float().mean(-1).amax(-1)  # (B, L)
        hits, total = hits + int((same >= 0.8).sum()), total + same.numel()
    return hits / total


def batches(loader, n: int) -> list[dict]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def logits(model, b: dict, retro: bool) -> torch.Tensor:
    if retro:
        return model(b["tokens"], b["neighbours"], b["neighbour_mask"], b["position_ids"])
    return model(b["tokens"], b["position_ids"])


@torch.no_grad()
def evaluate(model, valid: list[dict], retro: bool) -> float:
    model.eval()
    losses = [float(loss_fn(logits(model, b, retro), b["labels"], b["loss_mask"])) for b in valid]
    model.train()
    return sum(losses) / len(losses)


def train_one(
    name: str, model, cfg, loader, steps: int, eval_every: int, valid: dict, retro: bool, device: torch.device
) -> dict:
    torch.manual_seed(cfg.seed)
    model.to(device)
    opt = make_optimizer(model, cfg, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    it = iter(loader)
    waits, curve = [], []
    t_train = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        b = batch_to_device(next(it), device)
        t1 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg) * g.get("lr_scale", 1.0)  # RETRO's encoder group: a fraction
        loss = loss_fn(logits(model, b, retro), b["labels"], b["loss_mask"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            sync()  # the timed span ends with the GPU's work, not its queue (cheap: once per evaluation)
        t2 = time.perf_counter()
        waits.append(t1 - t0)
        t_train += t2 - t0
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            point = {"step": step + 1, "train_loss": float(loss.detach())}
            for key, batches_ in valid.items():
                point[key] = evaluate(model, batches_, retro)
            curve.append(point)
            print(f"{name:>6} step {step + 1:>5} " + " ".join(f"{k} {v:.4f}" for k, v in point.items() if k != "step"),
                  flush=True)  # fmt: skip
    tokens = steps * cfg.schedule.micro_batch_size * cfg.model.seq_length
    ms = sorted(w * 1e3 for w in waits)
    return {"curve": curve, "tokens_per_s": tokens / t_train, "seconds": t_train,
            "data_wait_ms_p50": statistics.median(ms), "data_wait_ms_p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "params": sum(p.numel() for p in model.parameters())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="benchmarks/work/retro-effect")
    ap.add_argument("--sequences", type=int, default=1200)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--follow", type=float, default=0.5)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--n-embd", type=int, default=64, help="decoder (and encoder) width; 6 layers, 4 heads")
    ap.add_argument("--seq-length", type=int, default=128, help="a multiple of the chunk length, 64")
    ap.add_argument("--batch", type=int, default=8, help="samples per step")
    ap.add_argument("--workers", type=int, default=1, help="loader worker processes")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (fp32 either way: a tiny model, same numerics)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prefix = work / "twins_text_document"
    db = work / "db"
    corpus = make_corpus(prefix, args.sequences, args.vocab, args.follow, args.noise, args.seed)
    if not (db / "neighbours.bin").exists():
        t0 = time.perf_counter()
        build_knn(BuildConfig(prefix=str(prefix), output=str(db), recall_queries=200))
        corpus["build_knn_s"] = round(time.perf_counter() - t0, 1)
    overrides = [f'retro.db="{db}"', f"model.vocab_size={args.vocab}", "model.name=\"retro\"", "model.n_layer=6",
                 "model.n_head=4",
                 f"model.n_embd={args.n_embd}", "retro.encoder_n_embd=0", f"model.seq_length={args.seq_length}",
                 f"schedule.micro_batch_size={args.batch}",
                 f"schedule.global_batch_tokens={args.batch * args.seq_length}",
                 f"schedule.max_steps={args.steps}",
                 f"schedule.warmup_steps={max(1, args.steps // 20)}", "optimizer.lr=3e-3", "schedule.min_lr=3e-4",
                 "metrics.eval_batches=8",
                 "metrics.eval_interval=1", f"data.num_workers={args.workers}", f'device="{args.device}"',
                 "compile=false",
                 'data.split="95,5,0"',
                 f"seed={args.seed}", 'data.path=""']  # fmt: skip
    cfg = load_config("configs/retro-tiny-cpu.toml", overrides)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both machines, so the figures compare
    rc = retro_config(cfg)
    data = build_retro_data(cfg, 0, 1)
    valid = {"val_loss": [batch_to_device(b, device) for b in batches(data.valid, cfg.metrics.eval_batches)]}
    valid_random = [batch_to_device(b, device) for b in batches(data.valid_random, cfg.metrics.eval_batches)]
    results = {}
    torch.manual_seed(cfg.seed)
    gpt = GPT(GPTConfig(rc.n_layer, rc.n_head, rc.n_embd, rc.vocab_size, rc.block_size, 0.0, rc.bias))
    results["gpt"] = train_one("gpt", gpt, cfg, build_retro_data(cfg, 0, 1).train, args.steps, args.eval_every,
                               valid, retro=False, device=device)  # fmt: skip
    torch.manual_seed(cfg.seed)
    retro = RetroModel(rc)
    results["retro"] = train_one("retro", retro, cfg, build_retro_data(cfg, 0, 1).train, args.steps,
                                 args.eval_every, {**valid, "val_loss_random": valid_random}, retro=True,
                                 device=device)  # fmt: skip
    final_gpt = results["gpt"]["curve"][-1]["val_loss"]
    final = results["retro"]["curve"][-1]
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        },
        "date": time.strftime("%Y-%m-%d"),
        "corpus": corpus,
        "model": {
            "decoder": [rc.n_layer, rc.n_head, rc.n_embd],
            "cca_layers": list(rc.cca_layer_indices),
            "chunk_length": rc.chunk_length,
            "K": rc.num_neighbours,
            "seq_length": cfg.model.seq_length,
            "encoder_lr_scale": rc.encoder_lr_scale,  # and a LayerNorm on the encoder's input (retro_model.Encoder)
        },  # fmt: skip
        "batch": cfg.schedule.micro_batch_size,
        "tokens_trained": args.steps * cfg.schedule.micro_batch_size * cfg.model.seq_length,
        "val_loss": {"gpt": final_gpt, "retro": final["val_loss"], "retro_random_neighbours": final["val_loss_random"]},
        "unigram_entropy": math.log(args.vocab),
        "valid_chunks_with_a_twin_neighbour": round(informative_fraction(valid["val_loss"], rc.chunk_length), 4),
        "tokens_per_s": {k: round(v["tokens_per_s"], 1) for k, v in results.items()},
        "retro_over_gpt_tokens_per_s": round(results["retro"]["tokens_per_s"] / results["gpt"]["tokens_per_s"], 3),
        "data_wait_ms": {
            k: [round(v["data_wait_ms_p50"], 3), round(v["data_wait_ms_p99"], 3)] for k, v in results.items()
        },  # fmt: skip
        "runs": results,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
