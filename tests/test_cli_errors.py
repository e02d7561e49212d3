"""Every command, given bad input, says so in one line and exits non-zero; a bug still shows its traceback.

The class, not instances: every option whose type is a size, a count or seconds, in every command, gets each kind of
bad value (exit 2, click's usage line naming the option); every CorpusforgeError subclass in the package, and each
OSError a user causes, becomes one `corpusforge: error:` line with its exit code; the real CLI in real processes
(one per command, run side by side), and `python -m corpusforge.train` under a real torchrun with two ranks.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

import corpusforge
from corpusforge.cli import _report, main
from corpusforge.cli.types import CountList, Seconds, Size, SizeList
from corpusforge.errors import CorpusforgeError
from corpusforge.indexed import IndexedDatasetWriter

CLI = [sys.executable, "-m", "corpusforge.cli"]
ERROR = "corpusforge: error: "

# What each command needs besides the option under test, so that only that option can be wrong.
BASE_ARGS = {
    "preprocess": ["in.jsonl", "--output-prefix", "out/p"],
    "merge": ["a", "--output-prefix", "b"],
    "inspect": ["a"],
    "convert": ["a", "--output-prefix", "b"],
    "train-tokenizer": ["in.jsonl", "--vocab-size", "300", "--output", "t.json"],
    "build-knn": ["a", "--output", "db"],
    "query-knn": ["db", "text"],
    "bench-io": ["/nonexistent"],
    "train": [],
    "megatron-preprocess": [],
    "export-hf": ["run", "--output", "hf"],
    "prepare-cache": [],
}
BAD = {
    "size": ["-5", "1e400k", "inf", "nan", "-inf", "9e18", "12x", ""],
    "count": ["0", "-1", "x", "1.5"],
    "count or 0": ["-1", "x", "1.5"],
    "seconds": ["-1", "inf", "nan", "x"],
}


def _kind(param: click.Parameter) -> str | None:
    t = param.type
    if isinstance(t, Size | SizeList):
        return "size"
    if isinstance(t, CountList) or (isinstance(t, click.IntRange) and t.min is not None and t.min >= 1):
        return "count"
    if isinstance(t, click.IntRange) and t.min == 0:
        return "count or 0"
    if isinstance(t, Seconds):
        return "seconds"
    return None


def _typed_options() -> list[tuple[str, str, str]]:
    """(command, --option, kind) for every option of a checked type in every command of the group."""
    found = []
    for name, command in sorted(main.commands.items()):
        for p in command.params:
            kind = _kind(p)
            if isinstance(p, click.Option) and kind:
                found.append((name, max(p.opts, key=len), kind))
    return found


def test_every_size_count_and_seconds_option_refuses_bad_values_with_exit_2():
    options = _typed_options()
    # the class is all of them: guard against a refactor that drops the types and leaves this test empty
    names = {(c, o) for c, o, _ in options}
    assert {("preprocess", "--task-size"), ("build-knn", "--max-index-memory"), ("bench-io", "--procs")} <= names
    assert len(options) >= 25, options
    runner = CliRunner()
    for command, option, kind in options:
        for value in BAD[kind]:
            result = runner.invoke(main, [command, *BASE_ARGS[command], option, value])
            where = f"{command} {option} {value!r}: exit {result.exit_code}\n{result.output}"
            assert result.exit_code == 2, where
            assert "Invalid value for" in result.stderr and f"'{option}'" in result.stderr, where
            assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output, where


def test_good_sizes_are_read_as_bytes():
    assert Size().convert("64M", None, None) == 64 << 20
    assert Size(minimum=1, as_text=True).convert(" 16G ", None, None) == "16G"
    assert SizeList().convert("4k,1M", None, None) == (4096, 1 << 20)
    assert CountList().convert("1,2,4", None, None) == (1, 2, 4)


def _error_classes() -> list[type[CorpusforgeError]]:
    """Every subclass of CorpusforgeError in the package: the modules whose source names it are imported first."""
    root = Path(corpusforge.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if re.search(r"^class \w+\([^)]*CorpusforgeError", path.read_text(), re.M):
            importlib.import_module(".".join(("corpusforge", *path.relative_to(root).with_suffix("").parts)))
    found, todo = [], [CorpusforgeError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return sorted(set(found), key=lambda c: c.__qualname__)


def _raising(error: BaseException) -> click.Command:
    @click.command("boom", cls=_report.Command)
    def boom() -> None:
        raise error

    return boom


@pytest.mark.slow  # imports every module that defines an error class: torch, faiss...
def test_every_project_error_class_is_one_line_with_its_exit_code():
    classes = _error_classes()
    assert len(classes) >= 15, classes  # InputError, ConfigError, ... : the class, not a few instances
    runner = CliRunner()
    for cls in classes:
        message = f"data/x.jsonl:3: {cls.__name__} happened;\n  fix the record"
        result = runner.invoke(_raising(cls(message)))
        assert result.exit_code == cls.exit_code, (cls, result.output)
        lines = result.stderr.splitlines()
        assert lines == [f"{ERROR}data/x.jsonl:3: {cls.__name__} happened; fix the record"], (cls, result.stderr)


@pytest.mark.parametrize(
    "error, code, words",
    [
        (OSError(errno.ENOSPC, "No space left on device", "out/x.bin"), 1, "out/x.bin: no space left"),
        (OSError(errno.EDQUOT, "Disk quota exceeded", "out/x.bin"), 1, "out/x.bin: no space left"),
        (OSError(errno.EACCES, "Permission denied", "/x"), 1, "/x: Permission denied; check its permissions"),
        (OSError(errno.EROFS, "Read-only file system", "/ro/x"), 1, "/ro/x: Read-only file system"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "in.jsonl"), 1, "in.jsonl: no such file"),
        (FileNotFoundError("a.idx: no such file (a dataset is the pair a.bin/.idx)"), 1, "a.idx: no such file (a"),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "p/part-0.bin", None, "out.bin"), 1, "out.bin: Is a dir"),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory", "P.parts"), 1, "P.parts: Not a directory; move it"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ],
)
def test_os_errors_a_user_causes_and_ctrl_c_are_one_line(error, code, words):
    result = CliRunner().invoke(_raising(error))
    assert result.exit_code == code and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(ERROR) and words in result.stderr, result.stderr


@pytest.mark.parametrize("error", [ValueError("a bug"), OSError(errno.EIO, "Input/output error"), KeyError("k")])
def test_other_exceptions_propagate_as_bugs(error):
    result = CliRunner().invoke(_raising(error))
    assert result.exception is error and ERROR not in result.output


@pytest.mark.parametrize(
    "rank, world, prints", [("1", "2", False), ("0", "2", True), ("3", "1", True), ("3", "", True)]
)
def test_only_rank_0_of_a_torchrun_job_prints_and_the_others_tell_torchrun(monkeypatch, tmp_path, rank, world, prints):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(_report, "PEER_EXIT_DELAY_S", 0.0)

    @click.command("count", cls=_report.Command)
    @click.option("--n", type=click.IntRange(min=1))
    def count(n) -> None:
        raise CorpusforgeError("job.toml: n is odd; give an even n")

    project, usage = CliRunner().invoke(count, ["--n", "3"]), CliRunner().invoke(count, ["--n", "0"])
    assert (project.exit_code, usage.exit_code) == (1, 2)
    assert (project.stderr == f"{ERROR}job.toml: n is odd; give an even n\n") is prints, project.stderr
    assert ("Invalid value for '--n'" in usage.stderr) is prints and (usage.stderr == "") is not prints
    told = json.loads((tmp_path / "error.json").read_text())["message"] if not prints else None
    assert told == (None if prints else "job.toml: n is odd; give an even n")


def test_the_group_refuses_a_command_without_the_handler():
    with pytest.raises(TypeError, match="cls=_report.Command"):
        _report.Group().add_command(click.Command("plain"))


# ---------------------------------------------------------------------------------------------------------------
# the real CLI, in real processes


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    with IndexedDatasetWriter(d / "ds_text_document", np.uint16) as w:
        w.add_documents(np.arange(300) % 50, np.array([100, 100, 100]))
    (d / "fake.parquet").write_text("not parquet at all\n")
    (d / "c.jsonl").write_text('{"text": "hello"}\n')
    (d / "taken_text_document.bin").mkdir()  # an output name held by a directory
    (d / "blocked.parts").write_text("a file where preprocess keeps its parts\n")
    return d


def _cases(d: Path) -> list[tuple[list[str], str]]:
    """(argv, words the one line must hold): one or more per command, each a different kind of bad input."""
    ds = str(d / "ds_text_document")
    return [
        (["preprocess", str(d / "fake.parquet"), "--output-prefix", str(d / "o1")], "fake.parquet: not a parquet"),
        (["preprocess", str(d / "nope.jsonl"), "--output-prefix", str(d / "o2")], "nope.jsonl"),
        (["preprocess", str(d / "c.jsonl"), "--output-prefix", str(d / "taken")], "taken_text_document.bin"),
        (["preprocess", str(d / "c.jsonl"), "--output-prefix", str(d / "blocked")], "blocked.parts"),
        (["merge", ds, "--output-prefix", ds], "the output prefix is also an input"),
        (["merge", str(d / "nope"), "--output-prefix", str(d / "m")], "nope"),
        (["inspect", str(d / "nope")], "nope"),
        (["convert", str(d / "nope"), "--output-prefix", str(d / "cv")], "nope"),
        (["train-tokenizer", str(d / "nope.jsonl"), "--vocab-size", "300", "--output", str(d / "t.json")], "nope"),
        (["build-knn", str(d / "nope"), "--output", str(d / "db")], "nope"),
        (["build-knn", ds, "--output", str(d / "db2"), "--index-key", "Bogus123"], "could not parse index string"),
        (["query-knn", str(d / "nodb"), "text"], "nodb"),
        (["bench-io", str(d / "nodir"), "--pattern", "seq-read"], "nodir"),
        (["train", "bogus.key=1"], "unknown key 'bogus.key'"),
        (["export-hf", str(d / "norun"), "--output", str(d / "hf")], "norun"),
        (["prepare-cache", "--config", str(d / "noconfig.toml")], "noconfig.toml"),
        (
            ["megatron-preprocess", "--input", str(d / "nope.jsonl"), "--output-prefix", "o"]
            + ["--tokenizer-type", "GPT2BPETokenizer"],
            "nope.jsonl",
        ),
    ]


def _run_side_by_side(commands: list[list[str]], cwd: Path, timeout: float = 240) -> list[tuple[int, str]]:
    procs = [subprocess.Popen(c, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, err))
    return out


@pytest.mark.slow
def test_real_cli_every_command_bad_input_is_one_line_exit_1(workdir):
    cases = _cases(workdir)
    assert {argv[0] for argv, _ in cases} == set(main.commands)  # every command of the group
    commands = [[*CLI, *argv] for argv, _ in cases]
    commands.append([sys.executable, "-m", "corpusforge.train", "bogus.key=1"])  # torchrun's entry point, alone
    cases.append((["python -m corpusforge.train"], "unknown key 'bogus.key'"))
    for (argv, words), (code, err) in zip(cases, _run_side_by_side(commands, workdir)):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        where = f"{' '.join(argv)}: exit {code}\n{err}"
        assert code == 1 and "Traceback" not in err, where
        assert len(lines) == 1 and lines[0].startswith(ERROR) and words in lines[0], where


@pytest.mark.slow
def test_real_cli_a_bug_keeps_its_traceback(workdir):
    # the fault is injected by this wrapper process, not by a hook in the code: describe() hits a bug
    wrapper = (
        "import sys, corpusforge.describe as d\n"
        "def describe(prefix): return 1 / 0\n"
        "d.describe = describe\n"
        "from corpusforge.cli import main\n"
        "main(['inspect', sys.argv[1]], prog_name='corpusforge')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, str(workdir / "ds_text_document")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ZeroDivisionError" in proc.stderr, proc.stderr
    assert ERROR not in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Run by torchrun for the error of one rank alone: rank 1 fails in prepare(), rank 0 waits there as a rank waits
# in a collective. The fault is injected here, in the test's own wrapper, not by a hook in the trainer.
ONE_RANK_FAILS = """
import os, time
import corpusforge.train.trainer as trainer
from corpusforge.errors import CorpusforgeError
def prepare(*args, **kwargs):
    if os.environ["RANK"] == "1":
        raise CorpusforgeError("rank 1 alone: /scratch/rank1 is full")
    time.sleep(300)
trainer.prepare = prepare
from corpusforge.cli.train import train_cmd
train_cmd(prog_name="python -m corpusforge.train")
"""


def _torchrun(tmp_path: Path, *target: str) -> tuple[int, str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    command += [*target, f'out_dir="{tmp_path / "run"}"', 'device="cpu"']
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        proc.communicate()
        raise
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, start, words",
    [(["bogus.key=1"], ERROR, "unknown key 'bogus.key'"), (["--config", "."], "Error: ", "'--config'")],
    ids=["config-error", "usage-error"],
)
def test_torchrun_error_is_printed_once_by_rank_0(tmp_path, args, start, words):
    code, out = _torchrun(tmp_path, "-m", "corpusforge.train", *args)
    lines = [ln for ln in out.splitlines() if ln.startswith(start)]
    assert code != 0, out
    assert len(lines) == 1 and words in lines[0], out
    assert not re.search(r"^\s*File .*corpusforge", out, re.M), out  # no traceback from our code, in any rank


@pytest.mark.slow
def test_torchrun_error_of_one_rank_alone_reaches_torchruns_report(tmp_path):
    (tmp_path / "one_rank_fails.py").write_text(ONE_RANK_FAILS)
    code, out = _torchrun(tmp_path, str(tmp_path / "one_rank_fails.py"))
    assert code != 0 and out.count("rank 1 alone: /scratch/rank1 is full") == 1, out
    assert re.search(r"traceback : rank 1 alone: /scratch/rank1 is full", out), out  # torchrun's root cause
    assert not re.search(r"^\s*File .*corpusforge", out, re.M), out


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["export-hf", "--help"], ["train", "--help"], ["build-knn", "--help"], ["preprocess", "--help"]],
)
def test_help_does_not_import_torch_or_numba(argv):
    # `corpusforge --help` lists every command, so every command module is imported: torch took 2 s, numba 0.4
    probe = "\n".join(
        [
            "import sys",
            "from corpusforge.cli import main",
            "try: main()",
            "except SystemExit: pass",
            "print(sorted({'torch', 'numba', 'faiss'} & set(sys.modules)))",
        ]
    )
    proc = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------------------------------------------------------
# a failed write names the path the user gave (real tmpfs mounts: a full one, a read-only one; the suite runs as root)

from iobench import iobench_helpers  # noqa: E402 - tests/iobench's helpers: a tmpfs mounted for a test

mount_tmpfs = iobench_helpers.tmpfs  # the fixture: mount(size, options) -> a fresh tmpfs, unmounted after the test


@pytest.mark.slow  # CLI processes, side by side
def test_real_cli_a_full_or_read_only_place_is_named_as_given(workdir, mount_tmpfs, tmp_path):
    full, ro = mount_tmpfs("1m"), mount_tmpfs("1m", ",ro")
    big = tmp_path / "big_text_document"  # 1.6 MB of tokens: more than the full mount holds
    with IndexedDatasetWriter(big, np.uint16) as w:
        w.add_documents(np.arange(800_000) % 50_000, np.full(800, 1000))
    cases = [
        (["merge", str(big), "--output-prefix", f"{full}/m"], rf"{full}/m\.(bin|idx): no space left \("),
        (["merge", str(big), "--output-prefix", f"{ro}/m"], rf"{ro}/m\.bin: Read-only file system; choose a path"),
        (["merge", str(big), "--output-prefix", f"{ro}/sub/m"], rf"{ro}/sub/m\.bin: Read-only file system; choose"),
        (
            ["train-tokenizer", str(workdir / "c.jsonl"), "--vocab-size", "300", "--output", f"{ro}/t.json"],
            rf"{ro}/t\.json: Read-only file system; choose a path you can write$",
        ),
        (
            ["preprocess", str(workdir / "c.jsonl"), "--output-prefix", f"{ro}/p"],
            rf"{ro}/p: Read-only file system; choose a path you can write$",
        ),
    ]
    for (argv, pattern), (code, err) in zip(cases, _run_side_by_side([[*CLI, *a] for a, _ in cases], tmp_path)):
        lines = err.splitlines()
        assert code == 1 and len(lines) == 1 and re.match(ERROR + pattern, lines[0]), (argv, err)
        assert ".tmp" not in err and "output:" not in err, (argv, err)
    assert list(full.iterdir()) == []  # the failed merge left nothing behind


def test_count_options_refuse_0_and_say_x_at_least_1():
    """--workers 0 was accepted (its help said x>=0), while a count must be positive: every count-like option of
    every command is of the shared type, so 0 is a usage error; the test above runs each with 0, -1, x, 1.5."""
    counts = {(c, o) for c, o, kind in _typed_options() if kind == "count"}
    assert {("preprocess", "--workers"), ("build-knn", "--workers"), ("query-knn", "-k")} <= counts, counts
    result = CliRunner().invoke(main, ["preprocess", "in.jsonl", "--output-prefix", "o", "--workers", "0"])
    assert result.exit_code == 2 and "Invalid value for '--workers': 0 is not in the range x>=1." in result.stderr
    help_text = CliRunner().invoke(main, ["preprocess", "--help"]).output
    assert "x>=1" in help_text and "x>=0" not in help_text.split("--retries")[0]


# ---------------------------------------------------------------------------------------------------------------
# a failure quoted inside a one-line error never brings its traceback (`[<FrameSummary ...>]`) along


@pytest.mark.slow  # imports torch
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: DCP says so on each call
@pytest.mark.parametrize("cut", [0, 64, "half", -1], ids=["empty", "in-header", "half", "one-byte-short"])
def test_a_damaged_checkpoint_shard_is_quoted_without_its_traceback(tmp_path, cut):
    """DCP's CheckpointException holds, per rank, (the exception, its StackSummary): str() of that pair printed
    `[<FrameSummary file ...>]` into the trainer's one line. first_line quotes the failure itself."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from corpusforge.errors import first_line

    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=tmp_path)
    shard = next(tmp_path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: {"half": len(data) // 2, -1: len(data) - 1}.get(cut, cut)])
    with pytest.raises(CheckpointException) as err:
        dcp.load({"w": torch.zeros(4096)}, checkpoint_id=tmp_path)
    for carrier in (err.value, next(iter(err.value.failures.values()))):  # the exception, and one rank's pair
        line = first_line(carrier)
        assert "FrameSummary" not in line and "\n" not in line and line, line
        assert "CheckpointException" not in line  # the failure's own words, not the wrapper's
    assert "FrameSummary" in str(next(iter(err.value.failures.values())))  # what str() alone gave


def test_first_line_of_failures_carried_with_a_traceback():
    import traceback

    from corpusforge.errors import first_line

    stack = traceback.extract_stack()
    assert first_line((OSError("short read\nmore"), stack)) == "short read"
    assert first_line(RuntimeError("it failed", stack)) == "it failed"
    assert first_line(ExceptionGroup("two", [ValueError("the first"), KeyError("k")])) == "the first"
    assert first_line(ValueError("")) == "ValueError"
    assert first_line(OSError(errno.ENOSPC, "No space left on device", "out/x")) == (
        "[Errno 28] No space left on device: 'out/x'"
    )
