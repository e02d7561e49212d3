"""`corpusforge bench-io`: the CLI face of corpusforge.iobench."""

from __future__ import annotations

import signal
import sys

import click

from corpusforge.cli import _report
from corpusforge.cli.config_options import Opt, config_options
from corpusforge.cli.types import COUNT, CountList, Seconds, Size, SizeList
from corpusforge.iobench.config import MLPERF_MODELS, PATTERNS, BenchConfig, BenchConfigError


def _options(pairs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise BenchConfigError(f"--storage-option {bad[0]!r}: write KEY=VALUE (e.g. endpoint_url=http://host:7480)")
    return tuple(tuple(p.split("=", 1)) for p in pairs)  # type: ignore[misc]


def _interrupt(signum, frame) -> None:  # SIGTERM (scancel, kill) cleans up like Ctrl-C
    raise KeyboardInterrupt


# How bench-io writes BenchConfig's fields where it differs from their name and type; help from their docstrings.
BENCH_OPTIONS = config_options(
    BenchConfig,
    Opt("patterns", "--pattern", choices=PATTERNS, multiple=True, default=(),
        help="Pattern to run; repeat [default: all but train]."),
    Opt("block_sizes", "--block-size", type=SizeList(), help="seq-read/seq-write request sizes: 4k,64k,1M,16M."),
    Opt("procs", type=CountList(), help="Processes per rank; a list sweeps: 1,2,4."),
    Opt("file_size", type=Size(minimum=1)),
    Opt("layout", choices=("file-per-process", "shared")),
    Opt("direct", choices=("auto", "on", "off")),
    Opt("drop_cache", "--keep-cache", clears=True, help="Do not evict the files from the page cache before reading."),
    Opt("sample_size", type=Size(minimum=1)),
    Opt("rand_ops", type=COUNT),
    Opt("duration", type=Seconds(positive=True)),
    Opt("metadata_files", type=COUNT),
    Opt("checkpoint_size", type=Size(minimum=1)),
    Opt("mlperf", choices=tuple(MLPERF_MODELS),
        help="The checkpoint pattern as MLPerf Storage v2.0's checkpointing workload of this model (its ranks, "
        "files, fsync, N writes, cache dropped, N reads; duration the max over ranks, throughput the min)."),
    Opt("scale", type=float, extra={"metavar": "F"}),
    Opt("mlperf_processes", type=click.IntRange(min=0)),
    Opt("mlperf_checkpoints", type=COUNT),
    Opt("mlperf_pause", type=Seconds()),
    Opt("dataset", help="Token dataset PREFIX (or s3://...) for replay/train [default: a synthetic one]."),
    Opt("synthetic_tokens", type=Size(minimum=1)),
    Opt("seq_length", type=COUNT),
    Opt("micro_batch", type=COUNT),
    Opt("loader_workers", type=click.IntRange(min=0)),
    Opt("remote_block_size", type=Size(minimum=1)),
    Opt("steps", type=COUNT),
    Opt("compute_time", type=Seconds()),
    Opt("max_accelerators", type=COUNT),
    Opt("stall_seconds", "--stall", type=Seconds(positive=True)),
    Opt("hang_seconds", "--hang", type=Seconds(positive=True)),
    Opt("storage_options", "--storage-option", multiple=True, default=(),
        help="fsspec option for URLs, KEY=VALUE; repeat."),
    Opt("check_space", "--no-space-check", clears=True, help="Start even if free space looks too small."),
    exclude=("paths", "metadata_file_size", "checkpoint_hidden", "seed", "target_utilization", "extra"),
)  # fmt: skip


@click.command("bench-io", cls=_report.Command)
@click.argument("paths", nargs=-1, required=True)
@click.option("--compare", multiple=True, help="More paths to run the same patterns on, shown side by side.")
@BENCH_OPTIONS
@click.option("--json", "json_out", default=None, help="Write the report as JSON to this file ('-': stdout).")
@click.option("--plot", "plot_out", default=None, help="Write throughput and latency-CDF plots to this PNG.")
def bench_io_cmd(paths, compare, json_out, plot_out, **options) -> None:
    """Measure what PATH (a directory on a mount, or s3://bucket/prefix) delivers to LLM training.

    Exit status: 0 ok, 4 stalls seen, 5 the storage hung, 1 an error (one line on stderr)."""
    from corpusforge.iobench import report
    from corpusforge.iobench.runner import run_bench

    options["patterns"] = options["patterns"] or BenchConfig.__dataclass_fields__["patterns"].default
    try:
        config = BenchConfig(
            paths=tuple(paths) + tuple(compare), **{**options, "storage_options": _options(options["storage_options"])}
        )
    except BenchConfigError as e:
        raise click.UsageError(str(e)) from None
    signal.signal(signal.SIGTERM, _interrupt)
    say = (lambda line: _report.err_console.print(f"[dim]{line}[/dim]")) if _report.show_progress(None) else None
    try:
        run = run_bench(config, on_event=say)
    except KeyboardInterrupt:  # the runner has removed its files by now; there is nothing to resume
        _report.fail("interrupted; every file the benchmark created was removed", _report.EXIT_INTERRUPTED)
    if run.ranks.rank != 0:
        return
    if json_out:
        if json_out == "-":
            import json

            click.echo(json.dumps(report.to_json(run), indent=1))
        else:
            report.write_json(run, json_out)
    if json_out != "-":
        report.print_table(run)
    if plot_out:
        report.plot(run.results, plot_out, run.config.target_utilization)
    line, status = report.verdict(run)
    click.echo(f"corpusforge bench-io: {line}", err=True)
    sys.exit(status)
