"""`corpusforge bench-io`: the CLI face of corpusforge.iobench."""

from __future__ import annotations

import signal
import sys

import click

from corpusforge.cli import _report
from corpusforge.cli.types import COUNT, CountList, Seconds, Size, SizeList
from corpusforge.iobench.config import PATTERNS, BenchConfig, BenchConfigError


def _options(pairs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise BenchConfigError(f"--storage-option {bad[0]!r}: write KEY=VALUE (e.g. endpoint_url=http://host:7480)")
    return tuple(tuple(p.split("=", 1)) for p in pairs)  # type: ignore[misc]


def _interrupt(signum, frame) -> None:  # SIGTERM (scancel, kill) cleans up like Ctrl-C
    raise KeyboardInterrupt


@click.command("bench-io", cls=_report.Command)
@click.argument("paths", nargs=-1, required=True)
@click.option(
    "--pattern",
    "patterns",
    multiple=True,
    type=click.Choice(PATTERNS),
    help="Pattern to run; repeat [default: all but train].",
)
@click.option("--compare", multiple=True, help="More paths to run the same patterns on, shown side by side.")
@click.option(
    "--block-size",
    type=SizeList(),
    default="1M",
    show_default=True,
    help="seq-read/seq-write request sizes: 4k,64k,1M,16M.",
)
@click.option(
    "--procs", type=CountList(), default="1", show_default=True, help="Processes per rank; a list sweeps: 1,2,4."
)
@click.option(
    "--file-size",
    type=Size(minimum=1),
    default="64M",
    show_default=True,
    help="Bytes per process for seq/rand patterns.",
)
@click.option(
    "--layout", type=click.Choice(["file-per-process", "shared"]), default="file-per-process", show_default=True
)
@click.option(
    "--direct",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="O_DIRECT where the file system allows it.",
)
@click.option("--keep-cache", is_flag=True, help="Do not evict the files from the page cache before reading.")
@click.option(
    "--sample-size", type=Size(minimum=1), default="8k", show_default=True, help="Bytes per random read (one sample)."
)
@click.option("--rand-ops", type=COUNT, default=20000, show_default=True, help="Random reads per process.")
@click.option(
    "--duration", type=Seconds(positive=True), default=30.0, show_default=True, help="Max seconds per read pattern."
)
@click.option("--metadata-files", type=COUNT, default=1000, show_default=True, help="Small files per process.")
@click.option(
    "--checkpoint-size", type=Size(minimum=1), default="256M", show_default=True, help="Checkpoint bytes per process."
)
@click.option(
    "--dataset", default=None, help="Token dataset PREFIX (or s3://...) for replay/train [default: a synthetic one]."
)
@click.option(
    "--synthetic-tokens", type=Size(minimum=1), default="16M", show_default=True, help="Size of the synthetic dataset."
)
@click.option("--seq-length", type=COUNT, default=2048, show_default=True)
@click.option("--micro-batch", type=COUNT, default=8, show_default=True)
@click.option("--loader-workers", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--remote-block-size",
    type=Size(minimum=1),
    default="256M",
    show_default=True,
    help="Replay/train from s3://: bytes per ranged GET of the loader's block cache.",
)
@click.option("--steps", type=COUNT, default=50, show_default=True, help="Batches per process (replay, train).")
@click.option("--compute-time", type=Seconds(), default=0.1, show_default=True, help="Train: emulated compute s/step.")
@click.option("--max-accelerators", type=COUNT, default=64, show_default=True)
@click.option(
    "--stall",
    "stall_seconds",
    type=Seconds(positive=True),
    default=5.0,
    show_default=True,
    help="Flag any single op slower than this (s).",
)
@click.option(
    "--hang",
    "hang_seconds",
    type=Seconds(positive=True),
    default=60.0,
    show_default=True,
    help="Declare an op that has not returned after this (s) hung; kill its workers, end the run.",
)
@click.option("--storage-option", multiple=True, help="fsspec option for URLs, KEY=VALUE; repeat.")
@click.option("--no-space-check", is_flag=True, help="Start even if free space looks too small.")
@click.option("--json", "json_out", default=None, help="Write the report as JSON to this file ('-': stdout).")
@click.option("--plot", "plot_out", default=None, help="Write throughput and latency-CDF plots to this PNG.")
def bench_io_cmd(
    paths,
    patterns,
    compare,
    block_size,
    procs,
    file_size,
    layout,
    direct,
    keep_cache,
    sample_size,
    rand_ops,
    duration,
    metadata_files,
    checkpoint_size,
    dataset,
    synthetic_tokens,
    seq_length,
    micro_batch,
    loader_workers,
    remote_block_size,
    steps,
    compute_time,
    max_accelerators,
    stall_seconds,
    hang_seconds,
    storage_option,
    no_space_check,
    json_out,
    plot_out,
) -> None:
    """Measure what PATH (a directory on a mount, or s3://bucket/prefix) delivers to LLM training.

    Exit status: 0 ok, 4 stalls seen, 5 the storage hung, 1 an error (one line on stderr)."""
    from corpusforge.iobench import report
    from corpusforge.iobench.runner import run_bench

    try:
        config = BenchConfig(
            paths=tuple(paths) + tuple(compare),
            patterns=tuple(patterns) or BenchConfig.__dataclass_fields__["patterns"].default,
            block_sizes=block_size,
            procs=procs,
            file_size=file_size,
            layout=layout,
            direct=direct,
            drop_cache=not keep_cache,
            sample_size=sample_size,
            rand_ops=rand_ops,
            duration=duration,
            metadata_files=metadata_files,
            checkpoint_size=checkpoint_size,
            dataset=dataset,
            synthetic_tokens=synthetic_tokens,
            seq_length=seq_length,
            micro_batch=micro_batch,
            loader_workers=loader_workers,
            remote_block_size=remote_block_size,
            steps=steps,
            compute_time=compute_time,
            max_accelerators=max_accelerators,
            stall_seconds=stall_seconds,
            hang_seconds=hang_seconds,
            storage_options=_options(storage_option),
            check_space=not no_space_check,
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
