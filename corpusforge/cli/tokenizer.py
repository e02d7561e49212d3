"""`corpusforge train-tokenizer`: a BPE tokenizer trained offline on the same inputs preprocess reads."""

from __future__ import annotations

from pathlib import Path

import click

from corpusforge.cli import _report
from corpusforge.cli.config_options import Opt, config_options
from corpusforge.cli.types import COUNT
from corpusforge.tokenizers.training import KINDS, TrainTokenizerConfig

# How train-tokenizer writes TrainTokenizerConfig's fields where it differs from their name and type.
TRAIN_TOKENIZER_OPTIONS = config_options(
    TrainTokenizerConfig,
    Opt("vocab_size", type=COUNT),
    Opt("output", type=click.Path(dir_okay=False, path_type=Path)),
    Opt("kind", choices=tuple(KINDS)),
    Opt("json_keys", multiple=True),
    Opt("max_mb", type=COUNT),
    exclude=("inputs",),
)


@click.command("train-tokenizer", cls=_report.Command)
@click.argument("inputs", nargs=-1, required=True)
@TRAIN_TOKENIZER_OPTIONS
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def train_tokenizer_cmd(inputs, as_json, **options) -> None:
    """Train a byte-level BPE (HF tokenizers) or sentencepiece BPE tokenizer from INPUT files."""
    from dataclasses import asdict

    from corpusforge.tokenizers.training import train_tokenizer_on

    stats = train_tokenizer_on(TrainTokenizerConfig(inputs=tuple(inputs), **options))
    data = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(stats).items()}
    _report.print_summary("corpusforge train-tokenizer", list(data.items()), data if as_json else None)
