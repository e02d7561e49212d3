"""Megatron-LM's own tools/preprocess_data.py against `corpusforge megatron-preprocess`: bytes and time.

    python benchmarks/megatron_compat.py MEGATRON_LM_CHECKOUT [--mb 8] [--workers 2] [--repeats 3]

For each flag line, runs Megatron's script (from the checkout, under the Python of this venv) and the compat mode
with the same arguments, checks that every .bin/.idx is byte-identical, and times both. Then times the compat mode
against native `corpusforge preprocess` on the same input and tokenizer (alternating runs, medians). Writes
benchmarks/results/megatron_compat-DATE.json with the Megatron-LM commit, the machine and the versions.

Megatron runs with the shims of benchmarks/megatron_shims.py (on its PYTHONPATH, never in its tree), with this
run's vocab.json/merges.txt as the Hub's "gpt2" repository.
Megatron with --split-sentences and --partitions 1 only writes the split file on its first run and encodes on a
second one (the `continue` in its main loop): it is run twice, and both runs are timed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from megatron_shims import checkout_commit, megatron_env  # noqa: E402


def _corpus(path: Path, mb: float) -> None:
    import numpy as np

    words = (
        "the of and to in a is that for it as was with be by on not he I this are or his from at which but have an "
        "they you were her she there been one all we their has would when if so no will more Mr. Dr. U.S. 3.5 p.m."
    ).split()
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        size, i = 0, 0
        while size < mb * 1e6:
            sents = [
                " ".join(rng.choice(words, rng.integers(4, 25))).capitalize() + "." for _ in range(rng.integers(1, 12))
            ]
            line = json.dumps({"text": ("\n" if i % 3 == 0 else " ").join(sents), "title": f"Title {i}."}) + "\n"
            f.write(line)
            size, i = size + len(line), i + 1


def _tokenizer_files(d: Path, corpus: Path) -> dict[str, Path]:
    import sentencepiece as spm
    import tokenizers

    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[:5000]]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(d / "sp"), vocab_size=500, model_type="bpe",
        byte_fallback=True, minloglevel=2,
    )  # fmt: skip
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator(texts, trainer)
    bpe.model.save(str(d))
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the", b"he", b"in", b"an", b" a", b"er", b"re"]
    rows = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": ""} for i, t in enumerate(ranks)]
    (d / "tik.json").write_text(json.dumps(rows))
    return {"sp": d / "sp.model", "vocab": d / "vocab.json", "merges": d / "merges.txt", "tik": d / "tik.json"}


def _lines(files: dict[str, Path], workers: int) -> dict[str, list[str]]:
    w = ["--workers", str(workers)]
    return {
        "gpt2bpe_eod": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(files["vocab"]),
                        "--merge-file", str(files["merges"]), "--append-eod", *w],
        "sentencepiece_eod_2keys": ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                                    str(files["sp"]), "--append-eod", "--json-keys", "text", "title", *w],
        "llama2_split_keepnl": ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(files["sp"]),
                                "--split-sentences", "--keep-newlines", "--append-eod", *w],
        "tiktoken": ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(files["tik"]),
                     "--vocab-size", "1265", "--tiktoken-pattern", "v2", *w],
    }  # fmt: skip


def _run(cmd: list[str], env: dict, cwd: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def _outputs(prefix: Path) -> dict[str, bytes]:
    return {
        p.name.removeprefix(prefix.name): p.read_bytes()
        for p in sorted(prefix.parent.glob(f"{prefix.name}_*"))
        if p.suffix in (".bin", ".idx")
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", type=Path)
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/megatron_compat"))
    a = ap.parse_args()
    script = a.checkout / "tools" / "preprocess_data.py"
    commit_id = checkout_commit(a.checkout)
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    corpus = a.work / "corpus.jsonl"
    _corpus(corpus, a.mb)
    files = _tokenizer_files(a.work, corpus)
    env = megatron_env(a.checkout, a.work, files["vocab"], files["merges"])
    cf_env = dict(os.environ, PYTHONPATH=str(ROOT))

    results = []
    for name, flags in _lines(files, a.workers).items():
        out = a.work / name
        out.mkdir()
        base = ["--input", str(corpus)]
        mg = [sys.executable, str(script), *base, "--output-prefix", str(out / "mg"), *flags]
        t_mg = _run(mg, env, a.work)
        if "--split-sentences" in flags:  # Megatron's first run only writes corpus_ss.jsonl
            t_mg += _run(mg, env, a.work)
            (a.work / "corpus_ss.jsonl").unlink()
        cf = [
            sys.executable,
            "-m",
            "corpusforge.megatron_preprocess",
            *base,
            "--output-prefix",
            str(out / "cf"),
            *flags,
        ]
        t_cf = _run(cf, cf_env, a.work)
        mine, theirs = _outputs(out / "cf"), _outputs(out / "mg")
        same = bool(theirs) and mine == theirs
        results.append({"line": name, "flags": flags, "identical": same, "files": sorted(theirs),
                        "megatron_s": round(t_mg, 2), "corpusforge_s": round(t_cf, 2)})  # fmt: skip
        print(f"{name:28s} identical={same!s:5s} megatron {t_mg:7.2f} s   corpusforge {t_cf:6.2f} s", flush=True)

    # compat vs native: the same input and tokenizer (sentencepiece, EOD), alternating, medians
    native = [sys.executable, "-m", "corpusforge.cli", "preprocess", str(corpus), "--tokenizer", str(files["sp"]),
              "--workers", str(a.workers), "--no-progress"]  # fmt: skip
    compat = [sys.executable, "-m", "corpusforge.megatron_preprocess", "--input", str(corpus), "--tokenizer-type",
              "SentencePieceTokenizer", "--tokenizer-model", str(files["sp"]), "--append-eod",
              "--workers", str(a.workers)]  # fmt: skip
    times: dict[str, list[float]] = {"native": [], "compat": []}
    for i in range(a.repeats):
        for kind, cmd in (
            (("native", native), ("compat", compat)) if i % 2 == 0 else (("compat", compat), ("native", native))
        ):
            prefix = a.work / f"{kind}{i}"
            times[kind].append(_run([*cmd, "--output-prefix", str(prefix)], cf_env, a.work))
    same_native = _outputs(a.work / "native0") == _outputs(a.work / "compat0")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"native {med['native']:.2f} s, compat {med['compat']:.2f} s (medians of {a.repeats}); same: {same_native}")

    import importlib.metadata as md

    record = {
        "date": date.today().isoformat(),
        "megatron_lm_commit": commit_id,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {
            p: md.version(p)
            for p in ("nltk", "transformers", "tokenizers", "sentencepiece", "tiktoken", "gigatoken", "torch")
        },  # fmt: skip
        "corpus_mb": round(corpus.stat().st_size / 1e6, 2),
        "workers": a.workers,
        "lines": results,
        "compat_vs_native": {"seconds": times, "median_s": med, "identical": same_native},
    }
    out = ROOT / "benchmarks" / "results" / f"megatron_compat-{date.today().isoformat()}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
