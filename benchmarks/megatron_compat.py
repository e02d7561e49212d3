"""Megatron-LM's own tools/preprocess_data.py against `corpusforge megatron-preprocess`: bytes and time.

    python benchmarks/megatron_compat.py MEGATRON_LM_CHECKOUT [--mb 8] [--workers 2] [--repeats 3] [--only LINE...]
                                         [--skip-megatron] [--tag TAG]

For each flag line, runs Megatron's script (from the checkout, under the Python of this venv) and the compat mode
with the same arguments, checks that every .bin/.idx is byte-identical, and times both. Two lines read the corpus
cut into three files through a glob with `--partitions 2` (round-robin, and `--keep-sequential-samples`): Megatron's
glob order and partition order. Then times the compat mode against native `corpusforge preprocess` on the same
input and tokenizer, and the compat mode with `--partitions 2` (the documents dealt into Megatron's order after
tokenizing): runs in rotation, each with the load average before it, medians. Writes
benchmarks/results/megatron_compat-DATE[-TAG].json with the Megatron-LM commit, the machine and the versions.

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


def _split_corpus(corpus: Path, directory: Path) -> str:
    """The corpus cut into three files (sizes 1/2, 1/3, 1/6; named so that sorted is not their order of creation),
    for the glob lines; returns the glob."""
    directory.mkdir()
    lines = corpus.read_text().splitlines(keepends=True)
    cuts = [0, len(lines) // 2, len(lines) * 5 // 6, len(lines)]
    for name, a, b in zip(("m.jsonl", "b.jsonl", "x.jsonl"), cuts, cuts[1:]):
        (directory / name).write_text("".join(lines[a:b]))
    return str(directory / "*.jsonl")


def _lines(files: dict[str, Path], workers: int, pattern: str) -> dict[str, list[str]]:
    w = ["--workers", str(workers)]
    sp = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", str(files["sp"]), "--append-eod"]
    return {
        "gpt2bpe_eod": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(files["vocab"]),
                        "--merge-file", str(files["merges"]), "--append-eod", *w],
        "sentencepiece_eod_2keys": ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                                    str(files["sp"]), "--append-eod", "--json-keys", "text", "title", *w],
        "llama2_split_keepnl": ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(files["sp"]),
                                "--split-sentences", "--keep-newlines", "--append-eod", *w],
        "tiktoken": ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(files["tik"]),
                     "--vocab-size", "1265", "--tiktoken-pattern", "v2", *w],
        "sentencepiece_glob_partitions2": ["--input", pattern, *sp, "--partitions", "2", *w],
        "sentencepiece_glob_partitions2_sequential": ["--input", pattern, *sp, "--partitions", "2",
                                                      "--keep-sequential-samples", *w],
    }  # fmt: skip


def _run(cmd: list[str], env: dict, cwd: Path) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def _outputs(prefix: Path) -> dict[str, bytes]:
    """The datasets `{prefix}_{key}_{level}.bin/.idx`; not Megatron's partitions' (`{prefix}_{i}_...`)."""
    return {
        p.name.removeprefix(prefix.name): p.read_bytes()
        for p in sorted(prefix.parent.glob(f"{prefix.name}_*"))
        if p.suffix in (".bin", ".idx") and not p.name.removeprefix(prefix.name)[1:2].isdigit()
    }


def _time_deal(source: Path, dest: Path, repeats: int) -> dict[str, object]:
    """The step --partitions N adds, alone, in this process: one dataset written again in Megatron's order (fsynced)."""
    from corpusforge.indexed import IndexedDataset
    from corpusforge.megatron.partitions import deal

    seconds = []
    for _ in range(repeats):
        load = _loadavg()
        t0 = time.perf_counter()
        deal(source, dest, 2)
        seconds.append((round(time.perf_counter() - t0, 3), load))
    ds = IndexedDataset(dest)
    return {"tokens": ds.num_tokens, "documents": ds.num_documents, "seconds_and_load_before": seconds}


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", type=Path)
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/megatron_compat"))
    ap.add_argument("--only", nargs="+", default=None, help="Flag lines to run (names as in the JSON)")
    ap.add_argument("--skip-megatron", action="store_true", help="Only compat vs native (no checkout run)")
    ap.add_argument("--tag", default="", help="Suffix of the result file name")
    a = ap.parse_args()
    script = a.checkout / "tools" / "preprocess_data.py"
    commit_id = checkout_commit(a.checkout)
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    corpus = a.work / "corpus.jsonl"
    _corpus(corpus, a.mb)
    files = _tokenizer_files(a.work, corpus)
    pattern = _split_corpus(corpus, a.work / "split")
    env = megatron_env(a.checkout, a.work, files["vocab"], files["merges"])
    cf_env = dict(os.environ, PYTHONPATH=str(ROOT))

    results = []
    lines = {} if a.skip_megatron else _lines(files, a.workers, pattern)
    for name, flags in lines.items():
        if a.only and name not in a.only:
            continue
        out = a.work / name
        out.mkdir()
        base = [] if "--input" in flags else ["--input", str(corpus)]
        mg = [sys.executable, str(script), *base, "--output-prefix", str(out / "mg"), *flags]
        load = _loadavg()
        t_mg = _run(mg, env, a.work)
        if "--split-sentences" in flags:  # Megatron's first run only writes corpus_ss.jsonl
            t_mg += _run(mg, env, a.work)
            (a.work / "corpus_ss.jsonl").unlink()
        for leftover in (a.work / "split").glob("[*]_*.jsonl"):  # Megatron's partition files, named from the glob
            leftover.unlink()
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
                        "megatron_s": round(t_mg, 2), "corpusforge_s": round(t_cf, 2), "load": load})  # fmt: skip
        print(f"{name:28s} identical={same!s:5s} megatron {t_mg:7.2f} s   corpusforge {t_cf:6.2f} s", flush=True)

    # compat vs native: the same input and tokenizer (sentencepiece, EOD), alternating, medians
    native = [sys.executable, "-m", "corpusforge.cli", "preprocess", str(corpus), "--tokenizer", str(files["sp"]),
              "--workers", str(a.workers), "--no-progress"]  # fmt: skip
    compat = [sys.executable, "-m", "corpusforge.megatron_preprocess", "--input", str(corpus), "--tokenizer-type",
              "SentencePieceTokenizer", "--tokenizer-model", str(files["sp"]), "--append-eod",
              "--workers", str(a.workers)]  # fmt: skip
    commands = {"native": native, "compat": compat, "compat_partitions2": [*compat, "--partitions", "2"]}
    times: dict[str, list[float]] = {k: [] for k in commands}
    loads: dict[str, list[float]] = {k: [] for k in commands}
    kinds = list(commands)
    for i in range(a.repeats):
        for kind in kinds[i % 3 :] + kinds[: i % 3]:  # rotated: each kind goes first, second and third in turn
            prefix = a.work / f"{kind}{i}"
            loads[kind].append(_loadavg())
            times[kind].append(_run([*commands[kind], "--output-prefix", str(prefix)], cf_env, a.work))
            if i:  # keep the first run's outputs for the comparison; the disk holds the corpus many times over
                for p in a.work.glob(f"{kind}{i}*"):
                    p.unlink()
    same_native = _outputs(a.work / "native0") == _outputs(a.work / "compat0")
    med = {k: statistics.median(v) for k, v in times.items()}
    deal_s = _time_deal(a.work / "compat0_text_document", a.work / "dealt_text_document", a.repeats)
    print(f"deal alone (tokens {deal_s['tokens']:,}): {deal_s['seconds_and_load_before']}")
    print(
        f"native {med['native']:.2f} s, compat {med['compat']:.2f} s, compat --partitions 2 "
        f"{med['compat_partitions2']:.2f} s (medians of {a.repeats}); compat = native bytes: {same_native}"
    )

    import importlib.metadata as md

    record = {
        "date": date.today().isoformat(),
        "megatron_lm_commit": commit_id,
        "corpusforge_commit": checkout_commit(ROOT),  # git, or a COMMIT file in a tree exported with git archive
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {
            p: md.version(p)
            for p in ("nltk", "transformers", "tokenizers", "sentencepiece", "tiktoken", "gigatoken", "torch")
        },  # fmt: skip
        "corpus_mb": round(corpus.stat().st_size / 1e6, 2),
        "workers": a.workers,
        "lines": results,
        "compat_vs_native": {
            "seconds": times,
            "load_before": loads,
            "median_s": med,
            "compat_over_native": round(med["compat"] / med["native"], 3),
            "partitions2_over_compat": round(med["compat_partitions2"] / med["compat"], 3),
            "identical": same_native,
            "deal_s": deal_s,
        },
    }
    tag = f"-{a.tag}" if a.tag else ""
    out = ROOT / "benchmarks" / "results" / f"megatron_compat-{date.today().isoformat()}{tag}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
