"""What the parts of the GPU kit share: the result file each writes, the corpus they make, the published figures.

Each part is a script run by run.py in its own process (`python part1_gpt2.py --out OUT/part1.json --work DIR
[--smoke] [--deadline EPOCH]`); `part_main` turns its function into that script. A part fills `ctx.result` and
calls `ctx.save()` as figures arrive, so a part killed at its time limit still leaves what it had measured.

Result file (one per part, JSON):

    {"part": 1, "name": "gpt2-124m", "status": "ok" | "skip" | "error" | "timeout" | "running",
     "reason": "why skipped or failed (one line)", "smoke": false, "device": "NVIDIA H100 80GB HBM3",
     "seconds": 93.1, "headline": "one line for the summary table", "figures": {...}, "runs": {...}}

Example:
    >>> def run(ctx): ctx.result["figures"]["answer"] = 42; ctx.result["headline"] = "42"
    >>> part_main(run, part=0, name="example")    # as the last line of a part script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# ---------------------------------------------------------------------------------------------------------------
# published figures for GPT-2 124M (vocabulary 50257 padded to 50304, sequence 1024, bf16), per GPU


@dataclass(frozen=True)
class Published:
    gpu_class: str  # matched against torch.cuda.get_device_name() through GPU_CLASSES
    who: str
    tokens_per_s_per_gpu: float
    how: str  # how the per-GPU figure follows from what the source says
    source: str


PUBLISHED: tuple[Published, ...] = (
    Published(
        "H100",
        "llm.c train_gpt2cu (bf16, cuDNN attention), 8x H100 80GB HBM3, 2024-10-13",
        524_288 / 0.139 / 8,
        "median step 139 ms for a 524,288-token batch on 8 GPUs",
        "https://github.com/KellerJordan/modded-nanogpt/blob/master/records/101324_llmc/README.md",
    ),
    Published(
        "A100",
        "llm.c train_gpt2cu, 8x A100 80GB SXM, 2024-05-28",
        19_073 * 524_288 / (90 * 60) / 8,
        "10B tokens (19,073 steps of 524,288) in about 90 minutes on 8 GPUs",
        "https://github.com/karpathy/llm.c/discussions/481",
    ),
    Published(
        "A100",
        "nanoGPT train.py (PyTorch 2.0, torch.compile), 8x A100 40GB",
        600_000 * 491_520 / (4 * 86_400) / 8,
        "600,000 iterations of 491,520 tokens (config/train_gpt2.py) in about 4 days on 8 GPUs",
        "https://github.com/karpathy/nanoGPT (README: 'about 4 days of training')",
    ),
)

# Devices whose published class is another's: the same tensor-core peak (corpusforge.train.metrics's table).
GPU_CLASSES = {"H100": ("H100", "H200", "H800", "GH200"), "A100": ("A100", "A800")}


def gpu_class(device_name: str) -> str | None:
    """The class of published figures that fits this device, or None.

    Example:
        >>> gpu_class("NVIDIA H200")
        'H100'
    """
    for cls, names in GPU_CLASSES.items():
        if any(n.lower() in device_name.lower() for n in names):
            return cls
    return None


def gpt2_params(n_layer: int, n_embd: int, padded_vocab: int) -> int:
    """Parameters of a GPT-2 without its position embedding (nanoGPT's N): the tied (V, C) matrix, per block
    12C² + 13C (q, k, v, proj: 4C² + 4C; MLP: 8C² + 5C; two LayerNorms: 4C), the final LayerNorm's 2C.

    Example:
        >>> gpt2_params(12, 768, 50304)    # nanoGPT prints "number of parameters: 123.69M"
        123689472
    """
    c = n_embd
    return padded_vocab * c + n_layer * (12 * c * c + 13 * c) + 2 * c


def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq_length: int) -> int:
    """nanoGPT's estimate (model.py estimate_mfu, after PaLM appendix B): 6N + 12·L·C·T training FLOPs a token."""
    return 6 * n_params + 12 * n_layer * n_embd * seq_length


GPT2_124M_FLOPS_PER_TOKEN = flops_per_token(gpt2_params(12, 768, 50304), 12, 768, 1024)


# ---------------------------------------------------------------------------------------------------------------
# a corpus made here, fast and deterministic (benchmarks/make_corpus.py reads the machine's files: minutes)

_SYLLABLES = (
    "ka ri to na me su lo pa de vi an el or is un th er in ou ed st ch qu ar en at ing ion ly al pro con com ex "
    "pre re de ment ness able ful ward"
).split()


def make_corpus(path: Path, size_bytes: int, seed: int = 1234) -> Path:
    """Write a JSONL corpus of about `size_bytes`: documents of pseudo-words, sentences and numbers, log-normal
    lengths (median ~2 KB), the same bytes for the same seed. Tokenizes at ~3-4 bytes a token, like web text.

    Example: make_corpus(Path("work/corpus.jsonl"), 20_000_000)"""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(_SYLLABLES, size=rng.integers(1, 4))) for _ in range(6000)]
    zipf = 1.0 / np.arange(1, len(words) + 1)  # frequent words frequent, as in text
    zipf /= zipf.sum()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w") as f:
        doc = 0
        while written < size_bytes:
            n_words = int(np.clip(rng.lognormal(np.log(350), 0.8), 20, 20_000))
            picks = rng.choice(len(words), size=n_words, p=zipf)
            ends = rng.random(n_words) < 0.08
            parts = [words[w] + (". " if e else " ") for w, e in zip(picks, ends)]
            text = "".join(parts).strip() + f" ({doc}, {rng.integers(0, 10**6)})"
            line = json.dumps({"id": doc, "text": text.capitalize()}) + "\n"
            f.write(line)
            written += len(line)
            doc += 1
    os.replace(tmp, path)
    return path


def preprocess(corpus: Path, prefix: Path, workers: int) -> Path:
    """`corpusforge preprocess` through its CLI (the user's command), cl100k_base; returns the dataset prefix."""
    import subprocess

    prefix.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "corpusforge.cli", "preprocess", str(corpus), "--output-prefix", str(prefix),
           "--workers", str(workers), "--no-progress"]  # fmt: skip
    # cwd: not the repo root, where `-m` would import the tree's corpusforge ahead of an installed wheel
    subprocess.run(cmd, check=True, cwd=prefix.parent)
    return Path(f"{prefix}_text_document")


# ---------------------------------------------------------------------------------------------------------------
# the trainer, as a user calls it


def train_run(overrides: list[str], log_lines: list[str] | None = None) -> tuple[dict[str, Any], list[dict]]:
    """corpusforge.train.train of `load_config(None, overrides)`: (summary, the records of its metrics.jsonl)."""
    from corpusforge.train import load_config, train
    from corpusforge.train.metrics import read_metrics

    cfg = load_config(None, overrides)

    def log(line: str) -> None:
        print(line, flush=True)
        if log_lines is not None:
            log_lines.append(line)

    summary = train(cfg, log=log)
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    return summary, read_metrics(metrics) if metrics.exists() else []


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def need_cuda(ctx: Context) -> None:
    """Full mode measures GPUs only: without one, the part is skipped (run.py refuses earlier anyway)."""
    import torch

    if not ctx.smoke and not torch.cuda.is_available():
        raise Skip("no CUDA device: full mode measures a GPU; use --smoke on a CPU machine")


# ---------------------------------------------------------------------------------------------------------------
# the part's process


class Skip(Exception):
    """The part cannot run here (a missing package, model or GPU); its message is the reason."""


@dataclass
class Context:
    out: Path
    work: Path
    smoke: bool
    deadline: float  # time.time() by which the part must be done (run.py kills it then)
    result: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str) + "\n")
        os.replace(tmp, self.out)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def part_main(fn: Callable[[Context], None], part: int, name: str) -> None:
    """Run `fn` as a part: parse the arguments run.py gives, write the result file whatever happens."""
    p = argparse.ArgumentParser(description=f"GPU kit part {part}: {name}")
    p.add_argument("--out", type=Path, required=True, help="the result JSON to write")
    p.add_argument("--work", type=Path, required=True, help="scratch directory (datasets, runs)")
    p.add_argument("--smoke", action="store_true", help="toy sizes on CPU")
    p.add_argument("--deadline", type=float, default=0.0, help="epoch seconds by which to be done")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    deadline = args.deadline or time.time() + 3600
    ctx = Context(args.out, args.work, args.smoke, deadline)
    ctx.result = {"part": part, "name": name, "status": "running", "smoke": args.smoke, "device": None,
                  "seconds": None, "headline": "", "figures": {}, "runs": {}}  # fmt: skip
    t0 = time.perf_counter()
    ctx.save()
    code = 0
    try:
        ctx.result["device"] = device_name()
        fn(ctx)
        ctx.result["status"] = "ok"
    except Skip as e:
        ctx.result.update(status="skip", reason=str(e))
    except BaseException as e:  # noqa: BLE001 - any failure is this part's result, not the kit's end
        traceback.print_exc()
        ctx.result.update(status="error", reason=first_line(e), traceback=traceback.format_exc()[-4000:])
        code = 1
    ctx.result["seconds"] = round(time.perf_counter() - t0, 2)
    ctx.save()
    print(f"part {part} ({name}): {ctx.result['status']} {ctx.result.get('reason') or ctx.result['headline']}")
    sys.exit(code)
