"""`corpusforge merge`, `inspect` and `convert`: verbs over existing token datasets."""

from __future__ import annotations

import click

from corpusforge.cli import _report


@click.command("merge", cls=_report.Command)
@click.argument("prefixes", nargs=-1, required=True)
@click.option("--output-prefix", required=True, help="Writes PREFIX.bin/.idx (give the full dataset prefix).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def merge_cmd(prefixes, output_prefix, as_json) -> None:
    """Concatenate datasets (PREFIX.bin/.idx pairs) into one, without re-tokenizing, at disk speed."""
    from dataclasses import asdict

    from corpusforge.indexed import merge

    stats = merge(prefixes, output_prefix)
    rows = [
        ("output", f"{output_prefix}.bin/.idx"),
        ("datasets", stats.datasets),
        ("documents", stats.documents),
        ("tokens", stats.tokens),
        ("time", f"{stats.seconds:,.2f} s ({stats.gb_per_s:,.2f} GB/s)"),
    ]
    _report.print_summary("corpusforge merge", rows, {**asdict(stats), "gb_per_s": stats.gb_per_s} if as_json else None)


@click.command("inspect", cls=_report.Command)
@click.argument("prefix")
@click.option("--decode", "decode_n", type=click.IntRange(min=0), default=0, help="Show the first N documents as text.")
@click.option(
    "--tokenizer",
    default=None,
    help="Tokenizer for --decode [default: the one P.preprocess.json recorded when preprocess wrote the dataset].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def inspect_cmd(prefix, decode_n, tokenizer, as_json) -> None:
    """Counts, dtype, document-length statistics and validity of a dataset; --decode N shows documents."""
    from corpusforge.describe import decode_documents, describe, load_recorded_tokenizer

    summary = describe(prefix)
    texts = []
    if decode_n and summary.valid:  # an index that failed validation describes no documents to decode
        from corpusforge.tokenizers import load_tokenizer

        decoder = load_tokenizer(tokenizer) if tokenizer else load_recorded_tokenizer(prefix)
        texts = decode_documents(prefix, decode_n, decoder)
    data = summary.to_dict()
    if as_json:
        _report.print_summary("", [], {**data, "decoded": texts} if decode_n else data)
        return _exit_if_invalid(summary)
    _report.print_summary("corpusforge inspect", [(k, v) for k, v in data.items() if k != "histogram"], None)
    if data.get("histogram"):
        click.echo("document length histogram (tokens: documents)")
        for bucket, count in data["histogram"].items():
            click.echo(f"  {bucket:>16}: {count:,}")
    for i, text in enumerate(texts):
        click.echo(click.style(f"--- document {i} ---", bold=True))
        click.echo(text)
    _exit_if_invalid(summary)


def _exit_if_invalid(summary) -> None:
    """After printing what was found: an invalid dataset is an error (exit 1, its fault as the one line), so that
    `corpusforge inspect P && train ...` stops where a loader would refuse the data."""
    if not summary.valid:
        _report.fail(summary.problem)


@click.command("convert", cls=_report.Command)
@click.argument("prefix")
@click.option("--output-prefix", required=True, help="Writes PREFIX.bin/.idx in the MMap format.")
@click.option(
    "--lua-shift/--no-lua-shift",
    default=None,
    help="Subtract 1 from every id, undoing fairseq's +1 [default: on for fairseq's layout, off for Megatron's].",
)
@click.option("--one-document-per-item", is_flag=True, help="Every legacy item a document (when doc_idx is missing).")
@click.option(
    "--dtype",
    type=click.Choice(["uint8", "int8", "uint16", "int16", "int32", "int64"]),  # the integer Megatron dtype codes
    default=None,
    help="Token dtype of the output [default: the source's].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def convert_cmd(prefix, output_prefix, lua_shift, one_document_per_item, dtype, as_json) -> None:
    """Convert a legacy (TNTIDX, lazy/cached) indexed dataset of older Megatron/fairseq to the MMap format."""
    from dataclasses import asdict

    from corpusforge.legacy import convert

    stats = convert(
        prefix, output_prefix, dtype=dtype, lua_shift=lua_shift, one_document_per_item=one_document_per_item
    )
    data = asdict(stats)
    data["seconds"] = round(data["seconds"], 3)
    _report.print_summary("corpusforge convert", list(data.items()), data if as_json else None)
