"""bench-io end to end through the library on local paths: every pattern, its figures, and nothing left behind."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from iobench_helpers import tiny

from corpusforge.iobench import patterns, report, runner
from corpusforge.iobench.config import KiB, MiB
from corpusforge.iobench.ranks import Ranks
from corpusforge.iobench.results import PathInfo, RunResults
from corpusforge.iobench.runner import BenchError, run_bench, run_case
from corpusforge.iobench.search import search_accelerators
from corpusforge.iobench.stats import CaseResult


def rows(run, pattern, phase=None):
    return [r for r in run.results if r.pattern == pattern and (phase is None or r.phase == phase)]


def test_every_pattern_reports_figures_and_cleans_up(tmp_path):
    # stall_s well above what a busy CI machine takes for one of these small operations (an fsync under load): a
    # stall verdict here would be the machine's, not the storage's
    config = tiny(tmp_path, patterns=("seq-write", "seq-read", "rand-read", "metadata", "checkpoint", "replay"),
                  stall_seconds=30.0, hang_seconds=120.0)  # fmt: skip
    run = run_bench(config)
    assert os.listdir(tmp_path) == []  # the run directory and everything in it are gone
    assert {r.pattern for r in run.results} == set(config.patterns)
    assert all(r.verdict == "ok" for r in run.results), [r.message for r in run.results]
    (read,) = rows(run, "seq-read")
    assert read.bytes == config.file_size and read.ops == config.file_size // (256 * KiB)
    assert set(read.latency_ms) == {"p50", "p90", "p99", "max"}
    assert read.latency_ms["p50"] <= read.latency_ms["p90"] <= read.latency_ms["p99"] <= read.latency_ms["max"]
    assert read.mb_s == pytest.approx(read.bytes / read.seconds / 1e6)
    (rand,) = rows(run, "rand-read")
    assert rand.ops == config.rand_ops and rand.bytes == config.rand_ops * config.sample_size
    assert [r.phase for r in rows(run, "metadata")] == ["create", "stat", "open", "delete"]
    assert all(r.ops == config.metadata_files for r in rows(run, "metadata"))
    assert [r.phase for r in rows(run, "checkpoint")] == ["write", "fsync", "read"]
    assert rows(run, "checkpoint", "write")[0].extra["durable_s"] > 0
    (replay,) = rows(run, "replay")
    samples = config.steps * config.micro_batch
    assert replay.ops == config.steps
    assert replay.extra["tokens_s"] == pytest.approx(replay.extra["samples_s"] * config.seq_length)
    assert replay.extra["samples_s"] == pytest.approx(samples / replay.seconds)
    assert run.paths[0].fs == "ext4" or run.paths[0].fs  # named, whatever it is


def test_json_report_round_trips_and_says_how_the_cache_was_handled(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = run_bench(tiny(out, patterns=("seq-read",)))
    report.write_json(run, str(tmp_path / "r.json"))
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["verdict"].startswith("OK") and doc["exit_status"] == 0
    assert doc["results"][0]["cache"] in ("O_DIRECT", "fadvise DONTNEED")
    assert doc["paths"][0]["direct_note"]
    again = report.load_results(str(tmp_path / "r.json"))
    assert again[0].mb_s == run.results[0].mb_s and again[0].latency_ms == run.results[0].latency_ms


def test_a_json_report_that_fails_midway_leaves_the_old_one_and_no_temporary(tmp_path):
    target = tmp_path / "r.json"
    target.write_text('{"old": 1}')
    run = RunResults(tiny(tmp_path), Ranks())
    run.paths.append(PathInfo(str(tmp_path), "ext4", True, "in effect", 1 << 30, notes=[object()]))  # not JSON
    with pytest.raises(TypeError):
        report.write_json(run, str(target))
    assert sorted(os.listdir(tmp_path)) == ["r.json"] and target.read_text() == '{"old": 1}'
    run.paths[0].notes = ["a note"]
    report.write_json(run, str(target))
    assert json.loads(target.read_text())["paths"][0]["notes"] == ["a note"]


def test_procs_sweep_and_shared_file(tmp_path):
    config = tiny(tmp_path, patterns=("seq-read", "seq-write"), procs=(1, 2), layout="shared")
    run = run_bench(config)
    reads = rows(run, "seq-read")
    assert [r.procs for r in reads] == [1, 2]
    assert [r.bytes for r in reads] == [config.file_size, 2 * config.file_size]
    assert [r.bytes for r in rows(run, "seq-write")] == [config.file_size, 2 * config.file_size]
    assert os.listdir(tmp_path) == []


def test_block_size_sweep_and_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is installed in CI")
    out = tmp_path / "out"
    out.mkdir()
    run = run_bench(tiny(out, patterns=("seq-read", "rand-read"), block_sizes=(64 * KiB, MiB)))
    assert [r.block_size for r in rows(run, "seq-read")] == [64 * KiB, MiB]
    report.plot(run.results, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tmpfs_is_reported_as_memory(tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm")
    where = os.path.join(shm, f"cf-iobench-{os.getpid()}")
    os.mkdir(where)
    try:
        run = run_bench(tiny(where, patterns=("seq-read",)))
        assert run.paths[0].fs == "tmpfs"
        assert "tmpfs: memory is the storage" in run.results[0].cache
        assert os.listdir(where) == []
    finally:
        os.rmdir(where)


def test_a_file_system_that_refuses_o_direct(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "direct_supported", lambda run_dir: False)  # as on some FUSE and older tmpfs
    run = run_bench(tiny(tmp_path, patterns=("seq-read",)))
    info = run.paths[0]
    assert not info.direct and "refused" in info.direct_note and "O_DIRECT is not supported" in info.notes[0]
    assert run.results[0].cache.startswith("fadvise DONTNEED")
    with pytest.raises(BenchError, match="refuses O_DIRECT"):
        run_bench(tiny(tmp_path, patterns=("seq-read",), direct="on"))
    assert os.listdir(tmp_path) == []


def test_train_emulation_finds_the_fed_accelerator_count(tmp_path):
    config = tiny(tmp_path, patterns=("train",), compute_time=0.05, steps=4, max_accelerators=2)
    run = run_bench(config)
    trains = rows(run, "train")
    assert [r.extra["accelerators"] for r in trains][:1] == [1]
    assert all(0 < r.extra["utilization"] <= 1.0 for r in trains)
    fed = trains[0].extra["fed_accelerators"]
    assert fed == max((r.extra["accelerators"] for r in trains if r.extra["utilization"] >= 0.9), default=0)
    assert run.summaries and "accelerator" in run.summaries[0][1]


def test_object_store_url_runs_the_read_and_write_patterns():
    config = tiny("memory://bench", patterns=("seq-write", "seq-read", "rand-read", "metadata", "checkpoint"))
    run = run_bench(config)
    assert all(r.verdict == "ok" for r in run.results), [r.message for r in run.results]
    assert rows(run, "seq-read")[0].bytes == config.file_size
    assert rows(run, "rand-read")[0].ops == config.rand_ops


def test_a_missing_dataset_url_is_refused_before_any_work():
    with pytest.raises(BenchError, match="dataset memory://nope/corpus: missing memory://nope/corpus.bin"):
        run_bench(tiny("memory://bench", patterns=("replay",), dataset="memory://nope/corpus"))


def _stuck(case, slot, beat):
    beat.times[beat.local] = time.perf_counter()  # an op that never returns, like a read on a dead mount
    time.sleep(3600)


def test_watchdog_declares_a_stuck_op_hung_and_kills_it(tmp_path, monkeypatch):
    monkeypatch.setitem(patterns.MEASURE, "seq-read", _stuck)
    config = tiny(tmp_path, stall_seconds=0.2, hang_seconds=1.0)
    case = patterns.Case("seq-read", str(tmp_path), str(tmp_path / "s"), 2, 1, 256 * KiB, False, config)
    events = []
    t0 = time.monotonic()
    outcome = run_case(case, 0, events.append)
    assert time.monotonic() - t0 < 10
    assert outcome.verdict == "hung" and "did not return within 1 s" in outcome.message
    assert any(e.startswith("stall: seq-read") for e in events)


def test_slow_ops_are_counted_as_stalls():
    case = patterns.Case("seq-read", "/x", "/x/s", 1, 1, MiB, False, tiny("/x", stall_seconds=0.1, hang_seconds=1.0))
    phase = patterns.Phase("read", bytes=3 * MiB, ops=3, start=0.0, end=1.0)
    phase.latencies.extend([0.01, 0.5, 0.02])
    from corpusforge.iobench.runner import CaseOutcome
    from corpusforge.iobench.stats import aggregate

    (row,) = aggregate(case, "/x", [CaseOutcome(phases=[[phase]])], "O_DIRECT")
    assert row.verdict == "stalls" and row.stalls == 1 and row.worst_s == 0.5
    assert isinstance(row, CaseResult) and np.isclose(row.latency_ms["max"], 500.0)


def test_replay_of_a_given_dataset_reads_what_the_loader_reads(tmp_path):
    from corpusforge.indexed import IndexedDatasetWriter

    prefix = tmp_path / "corpus_text_document"
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 500, 400)
    with IndexedDatasetWriter(prefix, np.int32) as w:  # int32 tokens: 4 bytes each
        w.add_documents(rng.integers(0, 1000, int(lengths.sum()), dtype=np.int32), lengths)
    out = tmp_path / "out"
    out.mkdir()
    config = tiny(out, patterns=("replay",), dataset=str(prefix), procs=(2,), seq_length=64, micro_batch=4, steps=5)
    (row,) = run_bench(config).results
    assert row.ops == 2 * 5 and row.bytes == 2 * 5 * 4 * (64 + 1) * 4
    assert os.listdir(out) == [] and prefix.with_suffix(".bin").exists()  # the user's dataset is left alone


def test_a_missing_dataset_is_refused_before_any_work(tmp_path):
    with pytest.raises(BenchError, match="missing"):
        run_bench(tiny(tmp_path, patterns=("replay",), dataset=str(tmp_path / "nope")))
    assert os.listdir(tmp_path) == []


def test_compared_paths_get_short_column_names():
    assert report.short_names(["/mnt/a/x", "/mnt/b/x", "s3://bucket"]) == ["a/x", "b/x", "s3://bucket"]
    assert report.short_names(["/only/one"]) == ["/only/one"]
    assert report.short_names(["/mnt/lustre/me", "/mnt/nvme/me"]) == ["lustre/me", "nvme/me"]


def test_the_accelerator_search_doubles_then_bisects_in_multiples_of_the_ranks():
    tried = []

    def trial(per_rank: int) -> float:
        tried.append(per_rank)
        return 0.95 if per_rank <= 5 else 0.5  # this path feeds 5 accelerators

    assert search_accelerators(trial, 1, 0.9, 64) == (5, "5 accelerator(s) fed at >= 90% utilisation")
    assert tried == [1, 2, 4, 8, 6, 5]
    fed, summary = search_accelerators(lambda per_rank: 0.95, 2, 0.9, 8)  # 2 ranks: 2, 4, 8 accelerators
    assert (fed, summary) == (8, "8 accelerator(s) fed at >= 90% utilisation (search stopped at --max-accelerators 8)")
    assert search_accelerators(lambda per_rank: None, 1, 0.9, 64) is None  # the path hung: no answer
