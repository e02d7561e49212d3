"""`corpusforge train-tokenizer`: a BPE tokenizer trained offline on the same inputs preprocess reads."""

from __future__ import annotations

from pathlib import Path

import click

from corpusforge.cli import _report


@click.command("train-tokenizer", cls=_report.Command)
@click.argument("inputs", nargs=-1, required=True)
@click.option("--vocab-size", type=click.IntRange(min=1), required=True)
@click.option(
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="tokenizer.json (kind bpe) or .model (kind sentencepiece); --tokenizer then accepts it.",
)
@click.option("--kind", type=click.Choice(["bpe", "sentencepiece"]), default="bpe", show_default=True)
@click.option("--json-keys", multiple=True, default=("text",), show_default=True)
@click.option("--max-mb", type=click.IntRange(min=1), default=None, help="Train on the first N MB of text only.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def train_tokenizer_cmd(inputs, vocab_size, output, kind, json_keys, max_mb, as_json) -> None:
    """Train a byte-level BPE (HF tokenizers) or sentencepiece BPE tokenizer from INPUT files."""
    from dataclasses import asdict

    from corpusforge.sources import expand_inputs, iter_texts
    from corpusforge.tokenizers.training import train_tokenizer

    texts = iter_texts(expand_inputs(inputs), json_keys, max_bytes=max_mb << 20 if max_mb else None)
    stats = train_tokenizer(texts, vocab_size, output, kind=kind)
    data = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(stats).items()}
    _report.print_summary("corpusforge train-tokenizer", list(data.items()), data if as_json else None)
