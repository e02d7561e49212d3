"""`corpusforge megatron-preprocess ARGS`: Megatron-LM's tools/preprocess_data.py command line, run by corpusforge.

The arguments pass through untouched to Megatron's own argparse parser (corpusforge.megatron.args), so a job
script changes one word. Exit status as `corpusforge preprocess`: 0 done, 1 error (one line), 2 bad usage or a
flag that cannot be honoured (one line saying which and why), 3 done with skipped bad records.
"""

from __future__ import annotations

import json
import sys

import click

from corpusforge.cli import _report
from corpusforge.megatron import args as margs
from corpusforge.megatron import preprocess_plan
from corpusforge.megatron.outputs import record_path
from corpusforge.preprocess import PreprocessStats


@click.command(
    "megatron-preprocess",
    cls=_report.Command,
    add_help_option=False,  # -h/--help go to Megatron's parser, which lists every flag
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def megatron_preprocess_cmd(argv: tuple[str, ...]) -> None:
    """Megatron-LM preprocess_data.py flags (--input, --tokenizer-type, ...); -h lists them."""
    run(list(argv))


def run(argv: list[str]) -> None:
    """Parse, preprocess, print the summary; exits non-zero as the module docstring says."""
    args = margs.parse_args(argv)
    plan = margs.plan(args)
    for note in plan.notes:
        click.echo(f"corpusforge: note: {note}", err=True)
    if plan.search is not None:
        _search(plan, args.as_json)
        return
    with _report.task_progress(_report.show_progress(args.progress)) as advance:
        stats = preprocess_plan(plan, on_progress=advance)
    summary = stats.to_dict() | {"megatron": _megatron_facts(plan)}
    _report.print_summary("corpusforge megatron-preprocess", _rows(stats), summary if args.as_json else None)
    for warning in getattr(stats, "warnings", []):
        click.echo(f"corpusforge: warning: {warning}", err=True)
    if stats.bad_records:
        click.echo(f"corpusforge: skipped {stats.bad_records:,} bad records; first: {stats.first_bad}", err=True)
        sys.exit(_report.EXIT_SKIPPED)


def _search(plan: margs.Plan, as_json: bool) -> None:
    """--find-optimal-num-workers: Megatron's lines on stdout (or the trials as JSON with --json)."""
    from corpusforge.megatron.optimal import find_optimal_workers

    workers, max_documents = plan.search
    say = None if as_json else click.echo
    search = find_optimal_workers(plan.config, plan.deal, list(workers), max_documents, announce=say)
    if as_json:
        click.echo(json.dumps(search.to_dict(), indent=1))
    else:
        for line in search.report():
            click.echo(line)


def _megatron_facts(plan: margs.Plan) -> dict:
    spec = plan.config.tokenizer_factory
    facts = {"tokenizer_type": spec.tokenizer_type, "level": plan.config.level, "notes": list(plan.notes)}
    facts["partitions_dealt"] = plan.deal
    facts["run_record"] = str(record_path(plan.config.output_prefix))
    if spec.split_language is not None:
        from corpusforge.megatron.sentences import load_splitter

        facts["punkt"] = load_splitter(spec.split_language, spec.keep_newlines).source
    return facts


def _rows(stats: PreprocessStats) -> list[tuple[str, object]]:
    bad = f"{stats.bad_records:,} skipped ({', '.join(f'{n:,} {k}' for k, n in stats.bad.items())})"
    return [
        ("outputs", ", ".join(f"{p}.bin/.idx" for p in stats.outputs)),
        ("documents", stats.documents),
        ("tokens", stats.tokens),
        ("input", f"{stats.input_bytes / 1e6:,.1f} MB"),
        ("bad records", bad if stats.bad_records else "0"),
        ("time", f"{stats.seconds:,.1f} s"),
        ("speed", f"{stats.mb_per_s:,.1f} MB/s, {stats.tokens_per_s:,.0f} tokens/s"),
        ("tokenizer", f"{stats.tokenizer} ({stats.engine}), dtype {stats.dtype}"),
        ("tasks", f"{stats.tasks} on {stats.workers} workers ({stats.executor})"),
    ]


def main(argv: list[str] | None = None) -> None:
    """`python -m corpusforge.megatron_preprocess ARGS`: the same command, with the same one-line errors."""
    with _report.one_line_errors("preprocess"):
        run(sys.argv[1:] if argv is None else argv)
