"""`corpusforge preprocess`: the CLI face of corpusforge.preprocess."""

from __future__ import annotations

import sys

import click

from corpusforge.cli import _report
from corpusforge.cli._executor_options import executor_options
from corpusforge.cli.types import Size
from corpusforge.preprocess import PreprocessConfig, preprocess


@click.command("preprocess", cls=_report.Command)
@click.argument("inputs", nargs=-1, required=True)
@click.option("--output-prefix", required=True, help="Writes PREFIX_{key}_document.bin/.idx (Megatron's naming).")
@click.option("--json-keys", multiple=True, default=("text",), show_default=True, help="Field(s) to tokenize; repeat.")
@click.option(
    "--tokenizer",
    default=None,
    help="cl100k_base (default, offline), o200k_base, gpt2, or a "
    ".tiktoken / tokenizer.json / sentencepiece .model path.",
)
@click.option(
    "--engine",
    type=click.Choice(["auto", "gigatoken", "reference"]),
    default="auto",
    show_default=True,
    help="Tokenizer engine; auto = gigatoken where it supports the tokenizer.",
)
@click.option(
    "--append-eod/--no-append-eod",
    default=True,
    show_default=True,
    help="End every document with the end-of-document token.",
)
@executor_options("Tasks")
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Times a task runs again when its worker process or node dies.",
)
@click.option(
    "--on-bad-line",
    type=click.Choice(["fail", "skip"]),
    default="fail",
    show_default=True,
    help="A bad record (malformed JSON, invalid UTF-8, missing key, not a string, empty): 'fail' stops at the first "
    "with FILE:LINE and exit 1; 'skip' leaves it out, counts each kind, and exits 3. A truncated or unreadable file is "
    "an error either way.",
)
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its finished parts.")
@click.option(
    "--task-size",
    type=Size(),
    default="0",
    help="Input bytes per task, e.g. 64M [default: ~8 tasks per worker, 1-64 MiB].",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar [default: on a terminal].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def preprocess_cmd(
    inputs,
    output_prefix,
    json_keys,
    tokenizer,
    engine,
    append_eod,
    workers,
    executor,
    ray_address,
    ray_keep_workers,
    retries,
    on_bad_line,
    resume,
    task_size,
    progress,
    as_json,
) -> None:
    """Tokenize INPUT files (.jsonl/.json, .gz/.zst, .parquet, directories, globs, HF save_to_disk dirs)."""
    config = PreprocessConfig(
        inputs=tuple(inputs),
        output_prefix=output_prefix,
        json_keys=tuple(json_keys),
        tokenizer=tokenizer,
        engine=engine,
        append_eod=append_eod,
        workers=workers,
        on_bad_line=on_bad_line,
        resume=resume,
        task_bytes=task_size,
        executor=executor,
        ray_address=ray_address,
        ray_keep_workers=ray_keep_workers,
        retries=retries,
    )
    if ray_address and executor != "ray":
        raise click.UsageError("--ray-address needs --executor ray")
    with _report.task_progress(_report.show_progress(progress)) as advance:
        stats = preprocess(config, on_progress=advance)
    rows = [
        ("outputs", ", ".join(f"{p}.bin/.idx" for p in stats.outputs)),
        ("documents", stats.documents),
        ("tokens", stats.tokens),
        ("input", f"{stats.input_bytes / 1e6:,.1f} MB"),
        ("bad records", _bad_text(stats)),
        ("time", f"{stats.seconds:,.1f} s"),
        ("speed", f"{stats.mb_per_s:,.1f} MB/s, {stats.tokens_per_s:,.0f} tokens/s"),
        ("tokenizer", f"{stats.tokenizer} ({stats.engine}), dtype {stats.dtype}"),
        (
            "tasks",
            f"{stats.tasks} on {stats.workers} workers ({stats.executor})"
            + (f", {stats.tasks_resumed} resumed" if stats.tasks_resumed else ""),
        ),
    ]
    if stats.already_complete:
        rows.insert(0, ("resume", "already complete; nothing to do"))
    _report.print_summary("corpusforge preprocess", rows, stats.to_dict() if as_json else None)
    for warning in stats.warnings:  # an input named twice, an empty input: said, not fatal
        click.echo(f"corpusforge: warning: {warning}", err=True)
    if stats.bad_records:
        click.echo(f"corpusforge: skipped {stats.bad_records:,} bad records; first: {stats.first_bad}", err=True)
        sys.exit(_report.EXIT_SKIPPED)


def _bad_text(stats) -> str:
    if not stats.bad_records:
        return "0"
    kinds = ", ".join(f"{n:,} {kind.replace('_', ' ')}" for kind, n in stats.bad.items())
    return f"{stats.bad_records:,} skipped ({kinds})"
