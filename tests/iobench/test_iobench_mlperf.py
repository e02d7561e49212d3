"""bench-io --pattern checkpoint --mlperf: MLPerf Storage v2.0's checkpointing workload. The models' sizes and ranks
against the rules' Table 2 (mlcommons/storage Submission_guidelines.md 2.2, mlpstorage/config.py), DLIO's per-rank
files, the --scale arithmetic, a real run that writes, fsyncs, drops the cache, reads back and reports the maximum
duration and minimum throughput over ranks, and the usage errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from iobench_helpers import cli, tiny

from corpusforge.cli.bench_io import bench_io_cmd
from corpusforge.iobench import mlperf, patterns
from corpusforge.iobench.config import BenchConfigError, KiB
from corpusforge.iobench.mlperf import MODELS, scaled
from corpusforge.iobench.runner import CaseOutcome, run_bench
from corpusforge.iobench.stats import aggregate

GiB = 1 << 30

# Table 2 of the rules: TPxPPxDP, ZeRO, checkpoint size in GiB ("GB" there is DLIO's /1024**3); the processes of a
# CLOSED run ("8, 64, 512, and 1024"); mlpstorage/config.py's LLM_SIZE_BY_RANK (model GB, optimizer GB).
TABLE = {
    "llama3-8b": ((1, 1, 8), 3, 105, 8, (15, 90)),
    "llama3-70b": ((8, 1, 8), 3, 912, 64, (130, 781)),
    "llama3-405b": ((8, 32, 2), 1, 5290, 512, (755, 4533)),
    "llama3-1t": ((8, 64, 2), 1, 18 * 1000, 1024, (2571, 15426)),
}


def split_gib(model: mlperf.LlamaCheckpoint) -> tuple[float, float]:
    files = [f for r in range(model.ranks) for f in model.rank_files_full(r)]
    weights = sum(size for name, size in files if not name.endswith("optim_states"))
    optimizer = sum(size for name, size in files if name.endswith("optim_states"))
    return weights / GiB, optimizer / GiB


@pytest.mark.parametrize("name", list(TABLE))
def test_models_have_the_rules_ranks_and_sizes(name):
    (tp, pp, dp), zero, table_gib, processes, (weights_gib, optimizer_gib) = TABLE[name]
    m = MODELS[name]
    assert (m.tp, m.pp, m.dp, m.zero, m.ranks) == (tp, pp, dp, zero, processes)
    weights, optimizer = split_gib(m)
    if name == "llama3-1t":
        # DLIO writes 2,204 + 13,223 GiB for the 1T configuration: the sum is LLM_SIZE_BY_RANK's optimizer figure;
        # Table 2's 18 TB (2571 + 15426) is not what the configuration writes (see mlperf.py's docstring).
        assert m.total_bytes() / GiB == pytest.approx(optimizer_gib, abs=1)
        assert optimizer / weights == pytest.approx(6, rel=1e-3)  # 12 bytes of Adam state per 2 of fp16 weight
        return
    assert m.total_bytes() / GiB == pytest.approx(table_gib, rel=3e-3)
    near = [pytest.approx(v, abs=0.5, rel=2e-3) for v in (weights_gib, optimizer_gib)]  # config.py rounds to 1 GB
    assert [weights, optimizer] == near


def test_files_per_rank_follow_dlios_layout():
    m8 = MODELS["llama3-8b"]  # ZeRO-3, PP 1: every rank one weights shard and one optimizer shard, all equal
    assert [n for n, _ in m8.rank_files_full(5)] == [
        "zero_pp_rank_5_mp_rank_0_model_states",
        "zero_pp_rank_5_mp_rank_0_optim_states",
    ]
    assert len({m8.rank_files_full(r)[0][1] for r in range(8)}) == 1
    m405 = MODELS["llama3-405b"]  # ZeRO-1, PP 32: DP rank 0 writes a file per layer of its stage, DP rank 1 none
    first = [n for n, _ in m405.rank_files_full(0)]
    assert first == [f"layer_{i}-model_0_model_states" for i in range(5)] + ["zero_pp_rank_0_mp_rank_0_optim_states"]
    assert [n for n, _ in m405.rank_files_full(256)] == ["zero_pp_rank_1_mp_rank_0_optim_states"]
    last = [n for n, _ in m405.rank_files_full(255)]  # the last stage ends with lm_head and the final norm
    assert last[-3:] == ["layer_127-model_255_model_states", "layer_128-model_255_model_states", last[-1]]
    assert m405.parameters() == pytest.approx(405e9, rel=3e-3) and MODELS["llama3-8b"].parameters() > 8e9


def test_scale_is_a_fraction_in_whole_4k_blocks():
    assert scaled(10 * GiB, 1.0) == 10 * GiB
    assert scaled(10 * GiB, 0.001) == int(10 * GiB * 0.001) // 4096 * 4096
    assert scaled(100, 0.5) == 4096  # never an empty file
    m = MODELS["llama3-70b"]
    files = sum(len(m.rank_files_full(r)) for r in range(m.ranks))
    for f in (0.5, 0.01, 1e-4):
        total = m.total_bytes(f)
        assert all(size % 4096 == 0 for r in range(m.ranks) for _, size in m.rank_files(r, f))
        assert m.total_bytes() * f - files * 4096 <= total <= m.total_bytes() * f + files * 4096
    assert m.total_bytes(0.01, processes=8) == sum(s for r in range(8) for _, s in m.rank_files(r, 0.01))
    config = tiny("/x", patterns=("checkpoint",), mlperf="llama3-8b", scale=0.001, mlperf_checkpoints=3)
    assert config.bytes_needed() == 3 * MODELS["llama3-8b"].total_bytes(0.001)


def logged(monkeypatch, log):
    """Record every fsync and page-cache drop of the forked workers, in order, in `log` (O_APPEND: one line is
    one write, whole, whichever process writes it)."""
    real_fsync, real_drop = os.fsync, patterns.drop_page_cache

    def note(what: str) -> None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{os.getpid()} {what}\n".encode())
        os.close(fd)

    def fsync(fd):
        real_fsync(fd)
        note(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}")

    def drop(path):
        real_drop(path)
        note(f"drop {path}")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(patterns, "drop_page_cache", drop)


def test_real_run_writes_fsyncs_drops_reads_back_and_reports_the_rules_metric(tmp_path, monkeypatch):
    where, log = tmp_path / "mnt", tmp_path / "log"
    where.mkdir()
    logged(monkeypatch, log)
    scale, n = 0.0002, 2
    config = tiny(
        where, patterns=("checkpoint",), mlperf="llama3-8b", scale=scale, mlperf_checkpoints=n, mlperf_pause=0
    )
    run = run_bench(config)
    assert os.listdir(where) == []  # every checkpoint removed with the run directory
    write, read = run.results
    assert (write.phase, read.phase, write.verdict, read.verdict) == ("write", "read", "ok", "ok")
    model = MODELS["llama3-8b"]
    one = model.total_bytes(scale)
    bs = config.block_sizes[0]
    for row in (write, read):
        assert row.procs == 8 and row.extra["processes"] == 8 and row.extra["checkpoints"] == n
        assert row.extra["checkpoint_bytes"] == one and row.bytes == n * one
        durations, rates = row.extra["duration_max_s"], row.extra["throughput_min_mb_s"]
        assert len(durations) == n and rates == pytest.approx([one / d / 1e6 for d in durations])
        assert row.seconds == pytest.approx(np.mean(durations)) and row.mb_s == pytest.approx(np.mean(rates))
    requests = sum(-(-size // bs) for r in range(8) for _, size in model.rank_files(r, scale))
    assert write.ops == n * (requests + 16)  # every request, and the fsync of each of 8 x 2 files, per checkpoint
    assert read.ops == n * requests
    events = [line.split(" ", 2) for line in log.read_text().splitlines()]
    synced = [p for _, what, p in events if what == "fsync" and "global_epoch1_step" in p]
    dropped = [p for _, what, p in events if what == "drop"]
    assert len(synced) == len(set(synced)) == n * 16 and sorted(dropped) == sorted(synced)
    for pid in {pid for pid, _, _ in events}:  # each process: all its fsyncs, then its drops (then its reads)
        mine = [what for p, what, _ in events if p == pid]
        assert mine == ["fsync"] * (2 * n) + ["drop"] * (2 * n)
    assert sorted({os.path.basename(p) for p in synced})[:2] == [
        "zero_pp_rank_0_mp_rank_0_model_states.pt",
        "zero_pp_rank_0_mp_rank_0_optim_states.pt",
    ]


def test_a_checkpoint_that_reads_back_different_bytes_fails_naming_the_file(tmp_path, monkeypatch):
    """A real change on disk between the writes and the reads (the last byte of every file flipped where the page
    cache is dropped): the run ends in an error row naming a checkpoint file, not in a throughput."""
    real_drop = patterns.drop_page_cache

    def flip_last_byte(path):
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        real_drop(path)

    monkeypatch.setattr(patterns, "drop_page_cache", flip_last_byte)  # forked workers inherit it
    config = tiny(tmp_path, patterns=("checkpoint",), mlperf="llama3-8b", scale=0.0001, mlperf_processes=2,
                  mlperf_checkpoints=1, mlperf_pause=0)  # fmt: skip
    (row,) = run_bench(config).results[-1:]
    assert row.verdict == "error" and "_states.pt: the checkpoint read back differs from what was written" in (
        row.message
    )
    assert os.listdir(tmp_path) == []


def sessions_of_writers(where, monkeypatch) -> set[tuple[int, int]]:
    """(pid, session id) of every process that fsyncs a checkpoint file in a tiny --mlperf run under `where`."""
    log = where.parent / "sessions"
    real_fsync = os.fsync

    def fsync(fd):
        real_fsync(fd)
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(out, f"{os.getpid()} {os.getsid(0)}\n".encode())
        os.close(out)

    monkeypatch.setattr(os, "fsync", fsync)
    config = tiny(where, patterns=("checkpoint",), mlperf="llama3-8b", scale=0.0001, mlperf_processes=2,
                  mlperf_checkpoints=1, mlperf_pause=0)  # fmt: skip
    assert run_bench(config).results[0].verdict == "ok"
    monkeypatch.setattr(os, "fsync", real_fsync)
    pairs = {tuple(int(v) for v in line.split()) for line in log.read_text().splitlines()}
    log.unlink()
    return pairs


def test_checkpoint_writers_are_sessions_of_their_own_as_fio_jobs_are(tmp_path, monkeypatch):
    """fio's job processes call setsid(); under autogroup scheduling each session gets its own share of a busy
    CPU, so 8 writers in one session lose to 8 fio jobs what the copy into the page cache needs (docs/bench-io.md).
    Every checkpoint writer (as every worker of every pattern: runner._worker) must be its own session; without
    own_session() they would share the test's, which this test sees too (so it can fail)."""
    where = tmp_path / "mnt"
    where.mkdir()
    pairs = sessions_of_writers(where, monkeypatch)
    assert len(pairs) == 2 and all(pid == sid for pid, sid in pairs) and os.getsid(0) not in {s for _, s in pairs}
    monkeypatch.setattr(patterns, "own_session", lambda: None)  # forked workers inherit the patched module
    assert {sid for _, sid in sessions_of_writers(where, monkeypatch)} == {os.getsid(0)}


def test_subset_mode_runs_the_first_ranks_of_the_layout(tmp_path):
    config = tiny(tmp_path, patterns=("checkpoint",), mlperf="llama3-405b", scale=1e-5, mlperf_processes=2,
                  mlperf_checkpoints=1, mlperf_pause=0)  # fmt: skip
    write, read = run_bench(config).results
    assert write.procs == 2 and write.extra["checkpoint_bytes"] == MODELS["llama3-405b"].total_bytes(1e-5, 2)
    assert read.bytes == write.bytes and os.listdir(tmp_path) == []


def phase(name, i, start, end, nbytes):
    p = patterns.Phase(name, bytes=nbytes, ops=1, start=start, end=end, extra={"checkpoint": i})
    p.latencies.append(end - start)
    return p


def test_duration_is_the_slowest_rank_and_throughput_the_checkpoint_over_it():
    """Two bench-io ranks of two processes each, two checkpoints; each process's clock is its own."""
    config = tiny("/x", patterns=("checkpoint",), mlperf="llama3-8b", scale=0.001, mlperf_checkpoints=2)
    case = patterns.Case("checkpoint", "/x", "/x/s", 2, 2, 256 * KiB, False, config)
    spans = {0: [(0, 1), (5, 7)], 1: [(100, 104), (200, 201)], 2: [(0, 2), (3, 4)], 3: [(50, 51), (60, 63)]}
    outcomes = [CaseOutcome(), CaseOutcome()]
    for slot, (a, b) in spans.items():
        outcomes[slot // 2].phases.append([phase("write", 0, *a, 1_000_000), phase("write", 1, *b, 1_000_000)])
    (row,) = aggregate(case, "/x", outcomes, "-")
    assert row.extra["duration_max_s"] == [4, 3]  # slot 1's 4 s; slot 3's 3 s
    assert row.extra["throughput_min_mb_s"] == pytest.approx([4 / 4, 4 / 3])  # 4 MB per checkpoint
    assert row.seconds == pytest.approx(3.5) and row.mb_s == pytest.approx((1 + 4 / 3) / 2)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--mlperf", "llama3-7b"], "'--mlperf'"),
        (["--mlperf", "llama3-8b", "--scale", "0"], "--scale 0: not a fraction"),
        (["--mlperf", "llama3-8b", "--scale", "-0.5"], "--scale -0.5"),
        (["--mlperf", "llama3-8b", "--scale", "1.5"], "--scale 1.5"),
        (["--mlperf", "llama3-8b", "--mlperf-processes", "9"], "--mlperf-processes 9: llama3-8b has 8 ranks"),
        (["--scale", "0.5"], "--scale 0.5: applies to --mlperf only"),
        (["--mlperf", "llama3-8b", "--mlperf-pause", "-1"], "'--mlperf-pause'"),
    ],
)
def test_bad_values_are_one_line_usage_errors(tmp_path, args, words):
    result = CliRunner().invoke(bench_io_cmd, [str(tmp_path), "--pattern", "checkpoint", *args])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and words in errors[0], result.output
    assert os.listdir(tmp_path) == []


def test_library_refuses_the_same_values():
    with pytest.raises(BenchConfigError, match=r"^--mlperf gpt-3: unknown model; choose llama3-8b, "):
        tiny("/x", patterns=("checkpoint",), mlperf="gpt-3")
    with pytest.raises(BenchConfigError, match="add --pattern checkpoint"):
        tiny("/x", patterns=("seq-read",), mlperf="llama3-8b")


def test_cli_run_writes_the_metric_to_json(tmp_path):
    where = tmp_path / "mnt"
    where.mkdir()
    out = tmp_path / "r.json"
    proc = cli(str(where), "--pattern", "checkpoint", "--mlperf", "llama3-8b", "--scale", "0.0001",
               "--mlperf-checkpoints", "2", "--mlperf-pause", "0.1", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "min-rank" in proc.stdout and "max-rank" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["config"]["mlperf"] == "llama3-8b" and doc["config"]["scale"] == 0.0001
    assert [r["phase"] for r in doc["results"]] == ["write", "read"]
    assert all(len(r["extra"]["duration_max_s"]) == 2 for r in doc["results"])
    assert os.listdir(where) == []
