"""A corrupt .idx is refused by every consumer, at open, with one line and nothing written (issue 21, class 2).

Each fault below corrupts one field of a copy of a small, real dataset (written by `corpusforge preprocess`, with its
P.preprocess.json; or a uint16 one by IndexedDatasetWriter); each consumer must refuse it with an IndexedFormatError
naming the file, or, on the command line, exit 1 with one `corpusforge: error:` line and no traceback. The consumers
are the ones a user reaches a dataset through: IndexedDataset itself, build_gpt_datasets (the loaders and `train`),
`merge`, `inspect` (which still prints what it found), `build-knn`, and `convert` for the legacy format.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from corpusforge import indexed
from corpusforge.cli import main
from corpusforge.indexed import HEADER_SIZE, IndexedDataset, IndexedDatasetWriter, IndexedFormatError
from corpusforge.preprocess import PreprocessConfig, preprocess

DOCS = 12  # documents (one sequence each) of the preprocessed base dataset: S = 12, D = 13


@pytest.fixture(scope="session")
def bases(tmp_path_factory) -> dict[str, Path]:
    """The two sound datasets every fault starts from, built once per session."""
    root = tmp_path_factory.mktemp("bases")
    corpus = root / "docs.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"Document {i}: " + "word " * (5 + 3 * i)}) + "\n" for i in range(DOCS))
    )
    preprocess(PreprocessConfig(inputs=(str(corpus),), output_prefix=str(root / "pre"), workers=1))
    u16 = root / "u16_text_document"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(u16, np.uint16) as w:  # GPT-2-sized ids: about a third are 32768 and up
        for n in (40, 50, 60, 70, 80, 90):
            w.add_document(rng.integers(0, 50257, n))
    bases = {"pre": root / "pre_text_document", "u16": u16}
    for prefix in bases.values():
        IndexedDataset(prefix)  # sound before any fault
    return bases


def copy_base(bases: dict[str, Path], base: str, where: Path) -> Path:
    """A fresh copy of a base dataset (and of its P.preprocess.json) under `where`."""
    src = bases[base]
    where.mkdir(parents=True, exist_ok=True)
    for path in src.parent.glob(f"{src.name}.*"):
        shutil.copy(path, where / path.name)
    if (summary := src.parent / "pre.preprocess.json").is_file() and base == "pre":
        shutil.copy(summary, where / summary.name)
    return where / src.name


# ---------------------------------------------------------------------------------------------------------------
# faults: each takes the dataset prefix and corrupts its copy in place


def patch(prefix: Path, offset: int, data: bytes) -> None:
    idx = Path(f"{prefix}.idx")
    raw = bytearray(idx.read_bytes())
    raw[offset : offset + len(data)] = data
    idx.write_bytes(bytes(raw))


def counts(prefix: Path) -> tuple[int, int]:
    h = indexed.read_header(f"{prefix}.idx")
    return h.sequence_count, h.document_count


def length_at(prefix: Path, i: int) -> int:
    return HEADER_SIZE + 4 * i


def pointer_at(prefix: Path, i: int) -> int:
    s, _ = counts(prefix)
    return HEADER_SIZE + 4 * s + 8 * i


def doc_at(prefix: Path, i: int) -> int:
    s, _ = counts(prefix)
    return HEADER_SIZE + 12 * s + 8 * i


def read_i32(prefix: Path, offset: int) -> int:
    return struct.unpack_from("<i", Path(f"{prefix}.idx").read_bytes(), offset)[0]


def read_i64(prefix: Path, offset: int) -> int:
    return struct.unpack_from("<q", Path(f"{prefix}.idx").read_bytes(), offset)[0]


def drop_summary(prefix: Path) -> None:
    (prefix.parent / "pre.preprocess.json").unlink()


def truncate(path: Path, nbytes: int) -> None:
    path.write_bytes(path.read_bytes()[:nbytes])


MID = DOCS // 2

FAULTS = {
    # the header, field by field
    "magic": ("pre", lambda p: patch(p, 0, b"XXIDIDX\x00\x00"), r"not a Megatron MMap index"),
    "version": ("pre", lambda p: patch(p, 9, struct.pack("<Q", 7)), r"index version 7, only version 1"),
    "dtype code invalid": ("pre", lambda p: patch(p, 17, bytes([11])), r"unknown dtype code 11"),
    "dtype code other width": ("pre", lambda p: patch(p, 17, bytes([8])), r"the index covers \d+ bytes of tokens"),
    "dtype same width, recorded": (
        "pre",
        lambda p: patch(p, 17, bytes([7])),  # int32 -> float32
        r"dtype code 7 \(float32\), but pre\.preprocess\.json records that preprocess wrote int32 tokens",
    ),
    "dtype same width, sampled int32 as float32": (
        "pre",
        lambda p: (patch(p, 17, bytes([7])), drop_summary(p)),
        r"token 0 of the \.bin reads as [0-9.e-]+ under the index's dtype float32, which is no token id",
    ),
    "dtype same width, sampled uint16 as int16": (
        "u16",
        lambda p: patch(p, 17, bytes([3])),
        r"reads as -\d+ under the index's dtype int16, which is no token id",
    ),
    "sequence count": ("pre", lambda p: patch(p, 18, struct.pack("<Q", DOCS + 1)), r"promises 13 sequences"),
    "document count": ("pre", lambda p: patch(p, 26, struct.pack("<Q", DOCS + 2)), r"and 14 document indices"),
    # the file sizes
    "idx truncated": ("pre", lambda p: truncate(Path(f"{p}.idx"), HEADER_SIZE + 50), r"truncated or corrupt"),
    "idx header truncated": ("pre", lambda p: truncate(Path(f"{p}.idx"), 20), r"truncated header \(20 of 34"),
    "idx longer": ("pre", lambda p: Path(f"{p}.idx").write_bytes(Path(f"{p}.idx").read_bytes() + b"\0"), r"corrupt"),
    "bin shorter": (
        "pre",
        lambda p: truncate(Path(f"{p}.bin"), 100),
        r"covers \d+ bytes of tokens but .*\.bin has 100",
    ),
    "bin longer": (
        "pre",
        lambda p: Path(f"{p}.bin").write_bytes(Path(f"{p}.bin").read_bytes() + b"\0" * 4),
        r"covers \d+ bytes of tokens but .*\.bin has \d+",
    ),
    # the arrays, in the middle where the O(1) checks do not look
    "first pointer": ("pre", lambda p: patch(p, pointer_at(p, 0), struct.pack("<q", 4)), r"first sequence pointer"),
    "middle pointer": (
        "pre",
        lambda p: patch(p, pointer_at(p, MID), struct.pack("<q", read_i64(p, pointer_at(p, MID)) + 4)),
        rf"sequence {MID} points at byte \d+, but the lengths before it put it at \d+",
    ),
    "middle length": (  # one token more in the middle: the next pointer no longer follows
        "pre",
        lambda p: patch(p, length_at(p, MID), struct.pack("<i", read_i32(p, length_at(p, MID)) + 1)),
        rf"sequence {MID + 1} points at byte \d+, but the lengths before it put it at \d+",
    ),
    "huge middle length": (
        "pre",
        lambda p: patch(p, length_at(p, MID), struct.pack("<i", 2**31 - 1)),
        rf"sequence {MID + 1} points at byte",
    ),
    "negative length": (
        "pre",
        lambda p: patch(p, length_at(p, MID), struct.pack("<i", -5)),
        rf"negative sequence length at {MID} \(-5 tokens\)",
    ),
    "document indices backwards": (
        "pre",
        lambda p: patch(p, doc_at(p, MID), struct.pack("<q", 2)),
        rf"document indices decrease at {MID - 1} \({MID - 1} then 2\)",
    ),
    "document indices not from 0": (
        "pre",
        lambda p: patch(p, doc_at(p, 0), struct.pack("<q", 1)),
        r"document indices must run from 0 to the sequence count 12, found \[1\]\.\.\[12\]",
    ),
    "document indices not to S": (
        "pre",
        lambda p: patch(p, doc_at(p, DOCS), struct.pack("<q", DOCS - 1)),
        r"document indices must run from 0 to the sequence count 12, found \[0\]\.\.\[11\]",
    ),
}
# Faults inspect can still summarise (header and file sizes sound): it prints what it found, then fails.
CONTENT_FAULTS = {
    "dtype same width, recorded",
    "dtype same width, sampled int32 as float32",
    "dtype same width, sampled uint16 as int16",
    "middle pointer",
    "middle length",
    "huge middle length",
    "negative length",
    "document indices backwards",
}


@pytest.fixture(params=list(FAULTS))
def fault(request, bases, tmp_path) -> tuple[Path, str, str]:
    """(corrupt dataset prefix, fault name, message regex)."""
    base, corrupt, message = FAULTS[request.param]
    prefix = copy_base(bases, base, tmp_path / "data")
    corrupt(prefix)
    return prefix, request.param, message


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def assert_one_line_refusal(result, prefix: Path, message: str) -> None:
    """Exit 1 through the CLI's one handler (SystemExit, not an exception escaping), one error line naming the
    dataset, no traceback."""
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert type(result.exception) is SystemExit, result.exception  # any other exception would be a traceback
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("corpusforge: error: ") and prefix.name in lines[0], lines[0]
    import re

    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------------------------
# the consumers


def test_open_refuses(fault):
    prefix, _, message = fault
    with pytest.raises(IndexedFormatError, match=message) as e:
        IndexedDataset(prefix)
    assert str(prefix.parent) in str(e.value) and "\n" not in str(e.value)


def test_gpt_dataset_build_refuses_before_any_work(fault, tmp_path):
    from corpusforge.data import build_gpt_datasets

    prefix, _, message = fault
    cache = tmp_path / "cache"
    with pytest.raises(IndexedFormatError, match=message):
        build_gpt_datasets(str(prefix), seq_length=8, split="100,0,0", num_samples=(4, None, None), cache_dir=cache)
    assert files_under(cache) == []


def test_merge_refuses_before_writing(fault, bases, tmp_path):
    prefix, _, message = fault
    good = copy_base(bases, "pre", tmp_path / "good")  # a sound input first: nothing of it may be copied either
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["merge", str(good), str(prefix), "--output-prefix", str(out / "m")])
    assert_one_line_refusal(result, prefix, message)
    assert files_under(out) == [] and not list(tmp_path.glob("out*.*"))


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_inspect_exits_1_and_still_reports(fault, as_json):
    prefix, name, message = fault
    result = CliRunner().invoke(main, ["inspect", str(prefix), *(["--json"] if as_json else [])])
    assert_one_line_refusal(result, prefix, message)
    if name in CONTENT_FAULTS:  # what it found, then the verdict
        if as_json:
            summary = json.loads(result.stdout)
            assert summary["valid"] is False and summary["sequences"] == counts(prefix)[0]
        else:
            assert "valid" in result.stdout and "no" in result.stdout.split("valid", 1)[1].split("\n")[0]


def test_build_knn_refuses_before_any_work(fault, tmp_path):
    pytest.importorskip("faiss")
    prefix, _, message = fault
    out = tmp_path / "db"
    result = CliRunner().invoke(main, ["build-knn", str(prefix), "--output", str(out), "--no-progress"])
    assert_one_line_refusal(result, prefix, message)
    assert not out.exists()


def test_remote_dataset_refuses(fault, request):
    """An fsspec URL (memory:// here, s3:// in use) goes through the same checks; of the dtype signals it has the
    token sample of the first 4096 tokens only (one small ranged GET; no P.preprocess.json beside an object)."""
    import fsspec

    from corpusforge.storage import open_dataset

    prefix, name, message = fault
    if name == "dtype same width, recorded":
        message = FAULTS["dtype same width, sampled int32 as float32"][2]
    fs, key = fsspec.filesystem("memory"), f"/{request.node.callspec.id}/x_text_document".replace(" ", "_")
    for ext in ("bin", "idx"):
        fs.pipe(f"{key}.{ext}", Path(f"{prefix}.{ext}").read_bytes())
    try:
        with pytest.raises(IndexedFormatError, match=message) as e:
            open_dataset(f"memory://{key}")
        assert f"memory://{key}" in str(e.value)
    finally:
        fs.rm(key.rsplit("/", 1)[0], recursive=True)


# ---------------------------------------------------------------------------------------------------------------
# convert reads the legacy format: its faults are the legacy fields (tests/test_legacy.py's table), through the CLI


def legacy_faults() -> dict:
    from test_legacy import FAULTS as LEGACY_FAULTS

    return LEGACY_FAULTS


@pytest.mark.parametrize("name", list(legacy_faults()))
def test_convert_cli_refuses_corrupt_legacy(tmp_path, name):
    from test_legacy import MEGATRON_BIN, MEGATRON_IDX

    idx, bin_ = tmp_path / "mg.idx", tmp_path / "mg.bin"
    idx.write_bytes(MEGATRON_IDX)
    bin_.write_bytes(MEGATRON_BIN)
    corrupt, message = legacy_faults()[name]
    corrupt(idx, bin_)
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "mg"), "--output-prefix", str(tmp_path / "out")])
    assert_one_line_refusal(result, tmp_path / "mg", message)
    assert not list(tmp_path.glob("out*"))


def test_convert_refuses_legacy_uint16_ids_under_an_int16_code(tmp_path):
    """The same-width dtype change in the legacy format: DeepSpeed/fairseq code 3 (int16) over uint16 ids."""
    from test_legacy import write_legacy

    write_legacy(tmp_path / "mg", [[40000, 5], [60000]], dtype=np.uint16, doc_idx=[0, 1, 2], code=3)
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "mg"), "--output-prefix", str(tmp_path / "out")])
    assert_one_line_refusal(result, tmp_path / "mg", r"reads as -25536 under the index's dtype int16")
    assert not list(tmp_path.glob("out*"))


# ---------------------------------------------------------------------------------------------------------------
# the real processes: exit status and stderr of `corpusforge`, and of the trainer


@pytest.mark.parametrize("verb", ["inspect", "merge", "build-knn"])
def test_commands_exit_1_with_one_line(bases, tmp_path, verb):
    prefix = copy_base(bases, "pre", tmp_path / "data")
    FAULTS["negative length"][1](prefix)
    args = {
        "inspect": [str(prefix)],
        "merge": [str(prefix), "--output-prefix", str(tmp_path / "m")],
        "build-knn": [str(prefix), "--output", str(tmp_path / "db")],
    }[verb]
    proc = subprocess.run(
        [sys.executable, "-m", "corpusforge.cli", verb, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("corpusforge: error: "), proc.stderr
    assert f"negative sequence length at {MID}" in proc.stderr and "rebuild the dataset" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing written beside the input


@pytest.mark.slow
@pytest.mark.parametrize("name", ["middle pointer", "negative length", "dtype same width, recorded"])
def test_train_refuses_before_compute(bases, tmp_path, name):
    base, corrupt, message = FAULTS[name]
    prefix = copy_base(bases, base, tmp_path / "data")
    corrupt(prefix)
    tiny = "model.vocab_size=100277 model.seq_length=8 schedule.micro_batch_size=2 schedule.global_batch_tokens=16"
    tiny += ' device="cpu" compile=false data.num_workers=0 schedule.max_steps=2 model.n_layer=1 model.n_head=2'
    tiny += ' model.n_embd=16 model.name="custom" metrics.tensorboard=false'
    overrides = [f'data.path="{prefix}"', f'out_dir="{tmp_path / "run"}"', *tiny.split()]
    result = CliRunner().invoke(main, ["train", *overrides])
    assert_one_line_refusal(result, prefix, message)
    assert files_under(tmp_path / "run") == []
