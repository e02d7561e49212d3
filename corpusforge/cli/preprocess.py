"""`corpusforge preprocess`: the CLI face of corpusforge.preprocess."""

from __future__ import annotations

import sys

import click

from corpusforge.cli import _report
from corpusforge.cli.config_options import Opt, config_options, executor_opts
from corpusforge.cli.types import Size
from corpusforge.preprocess import PreprocessConfig, preprocess
from corpusforge.tokenizers import ENGINES

# How preprocess writes PreprocessConfig's fields where it differs from their name and type; help from their docstrings.
PREPROCESS_OPTIONS = config_options(
    PreprocessConfig,
    Opt("output_prefix", help="Writes PREFIX_{key}_document.bin/.idx (Megatron's naming)."),
    Opt("json_keys", multiple=True, help="Field(s) to tokenize; repeat."),
    Opt("tokenizer", help="cl100k_base (default, offline), o200k_base, gpt2, or a .tiktoken / tokenizer.json / "
        "sentencepiece .model path."),
    Opt("engine", choices=ENGINES, help="Tokenizer engine; auto = gigatoken where it supports the tokenizer."),
    Opt("on_bad_line", choices=("fail", "skip"),
        help="A bad record (malformed JSON, invalid UTF-8, missing key, not a string, empty): 'fail' stops at the "
        "first with FILE:LINE and exit 1; 'skip' leaves it out, counts each kind, and exits 3. A truncated or "
        "unreadable file is an error either way."),
    Opt("resume", help="Continue an interrupted run from its finished parts."),
    Opt("task_bytes", "--task-size", type=Size(), show_default=False,
        help="Input bytes per task, e.g. 64M [default: ~8 tasks per worker, 1-64 MiB]."),
    *executor_opts("Tasks"),
    Opt("retries", type=click.IntRange(min=0)),
    exclude=("inputs", "merge_on_workers", "level", "tokenizer_factory", "keep_empty"),
)  # fmt: skip


@click.command("preprocess", cls=_report.Command)
@click.argument("inputs", nargs=-1, required=True)
@PREPROCESS_OPTIONS
@click.option("--progress/--no-progress", default=None, help="Progress bar [default: on a terminal].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def preprocess_cmd(inputs, progress, as_json, **options) -> None:
    """Tokenize INPUT files (.jsonl/.json, .gz/.zst, .parquet, directories, globs, HF save_to_disk dirs)."""
    config = PreprocessConfig(inputs=tuple(inputs), **options)
    if config.ray_address and config.executor != "ray":
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
