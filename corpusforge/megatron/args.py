"""The command line of Megatron-LM's `tools/preprocess_data.py` (and `preprocess_data_fast.py`), parsed as they do.

Every flag of HEAD (d98e8a6, 2026-08-22), core_v0.19.0 and core_v0.18.2 (the three have the same
preprocess_data.py; `--use-gigatoken` is new in HEAD), with Megatron's names, defaults and meanings, plus
corpusforge's own options under their own names. `to_config` maps them onto `PreprocessConfig`; a flag that cannot
be honoured ends the run with one line saying which and why (exit 2), never silently.

How the flags that tune Megatron's process model map:

    --workers N            worker processes (corpusforge's --workers); optional here (default: every core)
    --partitions N         Megatron reads glob.glob(--input) in glob's order and cuts the lines into N files
                           that it tokenizes alone and merges; corpusforge cuts the input into tasks itself and
                           writes Megatron's document order: lines dealt round-robin, so partition 0's documents
                           (lines 0, N, 2N, ...) first (corpusforge.megatron.partitions)
    --keep-sequential-samples  Megatron's partitions become contiguous runs of lines: input order, glob's file order
    --log-interval N       Megatron prints every N documents; corpusforge's progress is --progress
    --find-optimal-num-workers, --workers-to-check N..., --max-documents N
                           Megatron's search over worker counts, timed on the first N documents, with Megatron's
                           report (corpusforge.megatron.optimal); no dataset is written

Every flag of HEAD's parser is taken (tests/test_megatron_preprocess.py compares the two parsers). What no flag
changes in the data (--padded-vocab-size, --vocab-extra-ids, --chat-template, ...) is accepted and has no effect,
as in Megatron's preprocessing. --tokenizer-metadata is read and checked: its library must be the one
--tokenizer-type reads, and a class it names must be megatron.core's own (Megatron would import any module it
names). The tokenizer types that Megatron's preprocess_data.py itself cannot build (MultimodalTokenizer,
SFTTokenizer: its parser lacks their flags) are refused in one line.

Example:
    >>> args = parse_args(["--input", "c.jsonl", "--output-prefix", "out/c", "--tokenizer-type",
    ...                    "SentencePieceTokenizer", "--tokenizer-model", "sp.model", "--workers", "4"])
    >>> to_config(args).output_prefixes()
    ['out/c_text_document']
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from corpusforge.errors import CorpusforgeError
from corpusforge.megatron import files
from corpusforge.megatron.partitions import megatron_inputs
from corpusforge.megatron.tokenizers import (
    LIBRARY,
    SUPPORTED_TYPES,
    UNSUPPORTED_TYPES,
    MegatronTokenizerError,
    MegatronTokenizerSpec,
)
from corpusforge.preprocess import PreprocessConfig

PROG = "corpusforge megatron-preprocess"

# --tokenizer-type choices of megatron.training.arguments (HEAD): argparse refuses any other name, as there.
TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
)


class UnsupportedFlagError(CorpusforgeError):
    """A Megatron flag that corpusforge cannot honour; exit 2 like any usage error."""

    exit_code = 2


def build_parser() -> argparse.ArgumentParser:
    """Megatron's parser (same groups, names, defaults), then corpusforge's options."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Megatron-LM's tools/preprocess_data.py flags, run by corpusforge: the same output files.",
    )
    _tokenizer_group(p)
    g = p.add_argument_group(title="input data")
    g.add_argument("--input", type=str, required=True, help="Path to input JSON")
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="space separate listed of keys to extract from json"
    )
    g.add_argument("--split-sentences", action="store_true", help="Split documents into sentences.")
    g.add_argument("--keep-newlines", action="store_true", help="Keep newlines between sentences when splitting.")
    g = p.add_argument_group(title="tokenization process")
    g.add_argument("--append-eod", action="store_true", help="Append an <eod> token to the end of a document.")
    g.add_argument("--lang", type=str, default="english", help="Language to use for NLTK-powered sentence splitting.")
    g = p.add_argument_group(title="output data")
    g.add_argument("--output-prefix", type=str, required=True, help="Path to binary output file without suffix")
    g = p.add_argument_group(title="runtime")
    # Required in preprocess_data.py, absent from preprocess_data_fast.py: optional here, so both lines run.
    g.add_argument("--workers", type=int, default=0, help="Worker processes [default: one per core].")
    g.add_argument(
        "--find-optimal-num-workers",
        action="store_true",
        help="Time each of --workers-to-check on the first --max-documents documents and print the fastest "
        "(Megatron's report); writes no dataset.",
    )
    g.add_argument(
        "--workers-to-check", nargs="+", type=int, default=[16, 32, 64], help="Worker counts to time [16 32 64]."
    )
    g.add_argument("--max-documents", type=int, default=100_000, help="Documents to time each count on [100000].")
    g.add_argument("--partitions", type=int, default=1, help="Number of file partitions (see the document order).")
    g.add_argument("--log-interval", type=int, default=1000, help="Accepted; progress is --progress here.")
    g.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="Ensure ordering of samples in .jsonl files is preserved when using partitions>1.",
    )
    _corpusforge_group(p)
    return p


def _tokenizer_group(p: argparse.ArgumentParser) -> None:
    """megatron.training.arguments._add_tokenizer_args (TokenizerConfig), HEAD."""
    g = p.add_argument_group(title="tokenizer")
    g.add_argument("--vocab-size", type=int, default=None, help="Size of vocab before EOD or padding.")
    g.add_argument("--padded-vocab-size", type=int, default=None, help="Model vocabulary size: no effect on the data.")
    g.add_argument(
        "--no-pad-vocab-size", "--disable-pad-vocab-size", dest="pad_vocab_size", action="store_false",
        help="No effect on the data.",
    )  # fmt: skip
    g.add_argument("--vocab-file", type=str, default=None, help="Path to the vocab file.")
    g.add_argument("--merge-file", type=str, default=None, help="Path to the BPE merge file.")
    g.add_argument(
        "--vocab-extra-ids", type=int, default=0, help="preprocess_data.py resets it to 0: no effect on the data."
    )
    g.add_argument("--tokenizer-type", type=str, default=None, choices=TOKENIZER_TYPES, help="What type of tokenizer.")
    g.add_argument("--tokenizer-model", type=str, default=None, help="Path to the tokenizer model.")
    g.add_argument(
        "--tokenizer-metadata", dest="metadata_path", type=str, default=None,
        help="megatron.core tokenizer metadata JSON; its library must be the one --tokenizer-type reads.",
    )  # fmt: skip
    g.add_argument("--tokenizer-special-tokens", dest="special_tokens", nargs="+", type=str, default=None)
    g.add_argument("--tiktoken-pattern", type=str, default=None, choices=["v1", "v2"])
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument(
        "--tokenizer-sentencepiece-legacy", action="store_true",
        help="Sentencepiece legacy mode: --tokenizer-special-tokens are split out of the text.",
    )  # fmt: skip
    g.add_argument(
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
        dest="tokenizer_sentencepiece_ignore_extra_whitespaces",
        action="store_false",
        help="Not supported for models that drop extra whitespace.",
    )
    g.add_argument("--tokenizer-hf-no-use-fast", action="store_true", help="HF: the slow (Python) tokenizer.")
    g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true", help="HF: no BOS/EOS per text.")
    g.add_argument("--trust-remote-code", action="store_true", help="HF: let the tokenizer directory run its code.")
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None, help="NullTokenizer EOD [vocab size - 1].")
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1, help="No effect on the data.")
    g.add_argument("--chat-template", type=str, default=None, help="No effect on the data (chat formatting only).")
    g.add_argument("--use-gigatoken", action="store_true", help="Accepted: corpusforge picks gigatoken where exact.")


def _corpusforge_group(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(title="corpusforge (not Megatron's)")
    g.add_argument("--resume", action="store_true", help="Continue an interrupted run from its finished parts.")
    g.add_argument("--on-bad-line", choices=["fail", "skip"], default="fail", help="Bad records: stop, or skip/count.")
    g.add_argument("--json", dest="as_json", action="store_true", help="Print the summary as JSON on stdout.")
    g.add_argument("--progress", dest="progress", action="store_true", default=None, help="Progress bar.")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="No progress bar.")
    g.add_argument("--engine", choices=["auto", "gigatoken", "reference"], default="auto", help="sentencepiece engine.")
    g.add_argument("--executor", choices=["local", "ray"], default="local", help="Where tasks run.")
    g.add_argument("--ray-address", default=None, help="Ray cluster to join (with --executor ray).")
    g.add_argument("--retries", type=int, default=2, help="Reruns of a task whose worker died.")
    g.add_argument("--task-size", type=int, default=0, help="Input bytes per task [default: ~8 tasks per worker].")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse as Megatron does (argparse errors exit 2), then refuse what cannot be honoured (UnsupportedFlagError)."""
    args = build_parser().parse_args(argv)
    _refuse_unsupported(args)
    return args


def _refuse_unsupported(args: argparse.Namespace) -> None:
    def refuse(flag: str, why: str) -> None:
        raise UnsupportedFlagError(f"megatron-preprocess: {flag} is not supported: {why}")

    if args.tokenizer_type is None:
        refuse("no --tokenizer-type", "name one; Megatron fails without it too")
    if args.tokenizer_type in UNSUPPORTED_TYPES:
        refuse(f"--tokenizer-type {args.tokenizer_type}", UNSUPPORTED_TYPES[args.tokenizer_type])
    assert args.tokenizer_type in SUPPORTED_TYPES
    if args.tokenizer_sentencepiece_legacy and args.append_eod and args.tokenizer_type in LIBRARY_SP:
        refuse(
            "--tokenizer-sentencepiece-legacy with --append-eod",
            "Megatron's legacy sentencepiece tokenizer has no EOD (its eos_id reads an eos_token that a list of "
            "special tokens never sets: AttributeError); drop one of the two",
        )
    if args.keep_newlines and not args.split_sentences:
        pass  # Megatron ignores it without --split-sentences, and so does this
    if args.workers < 0 or args.partitions < 1:
        refuse("--workers below 0 or --partitions below 1", "give a positive count")
    if args.executor != "ray" and args.ray_address:
        refuse("--ray-address without --executor ray", "add --executor ray")


LIBRARY_SP = tuple(t for t, library in LIBRARY.items() if library == "sentencepiece")


def check_metadata(path: str, tokenizer_type: str) -> None:
    """--tokenizer-metadata: megatron.core builds the tokenizer of the file's library (and class, if it names one)
    from --tokenizer-type's arguments. Honoured where that is the type's own library and a class of megatron.core's
    (whose ids are the library's); anything else raises one line."""
    meta = files.metadata(path)
    library, expected = meta["library"], LIBRARY[tokenizer_type]
    if library != expected:
        raise MegatronTokenizerError(
            f"--tokenizer-metadata {path}: library {library!r}, but --tokenizer-type {tokenizer_type} reads "
            f"{expected!r} (Megatron would build a {library!r} tokenizer from {tokenizer_type}'s flags); make them "
            "agree, or drop --tokenizer-metadata"
        )
    module = meta.get("class_path")
    if module is not None and not str(module).startswith("megatron.core.tokenizers."):
        raise MegatronTokenizerError(
            f"--tokenizer-metadata {path}: names class {meta.get('class_name')} of module {module}, which Megatron "
            "would import and run; corpusforge builds megatron.core's own tokenizers only: remove class_name and "
            "class_path"
        )


@dataclass(frozen=True)
class Plan:
    """What a Megatron command line asks for: corpusforge's config, and notes on what differs from Megatron."""

    config: PreprocessConfig
    notes: tuple[str, ...] = ()
    deal: int = 1
    """--partitions N without --keep-sequential-samples: the documents go in Megatron's round-robin order over N
    partitions (corpusforge.megatron.partitions); 1: input order."""
    search: tuple[tuple[int, ...], int] | None = None
    """--find-optimal-num-workers: (--workers-to-check, --max-documents); None: preprocess."""


def to_config(args: argparse.Namespace) -> PreprocessConfig:
    return plan(args).config


def plan(args: argparse.Namespace) -> Plan:
    """Map parsed Megatron flags onto corpusforge's PreprocessConfig."""
    if args.metadata_path:
        check_metadata(args.metadata_path, args.tokenizer_type)
    spec = MegatronTokenizerSpec(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        special_tokens=tuple(args.special_tokens) if args.special_tokens else None,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        hf_use_fast=not args.tokenizer_hf_no_use_fast,
        hf_include_special_tokens=not args.tokenizer_hf_no_include_special_tokens,
        trust_remote_code=args.trust_remote_code,
        null_eod_id=args.null_tokenizer_eod_id,
        sp_ignore_extra_whitespaces=args.tokenizer_sentencepiece_ignore_extra_whitespaces,
        sp_legacy=args.tokenizer_sentencepiece_legacy,
        engine=args.engine,
        split_language=args.lang if args.split_sentences else None,
        keep_newlines=args.keep_newlines,
    )
    config = PreprocessConfig(
        inputs=megatron_inputs(args.input, args.partitions),
        output_prefix=args.output_prefix,
        json_keys=tuple(args.json_keys),
        tokenizer=args.tokenizer_model or args.vocab_file,
        engine=args.engine,
        append_eod=args.append_eod,
        workers=args.workers,
        on_bad_line=args.on_bad_line,
        resume=args.resume,
        task_bytes=args.task_size,
        executor=args.executor,
        ray_address=args.ray_address,
        retries=args.retries,
        level="sentence" if args.split_sentences else "document",
        tokenizer_factory=spec,
        keep_empty=True,  # Megatron tokenizes an empty text: a document of no sequence, or its tokenizer's BOS
    )
    deal = args.partitions if args.partitions > 1 and not args.keep_sequential_samples else 1
    search = (tuple(args.workers_to_check), args.max_documents) if args.find_optimal_num_workers else None
    return Plan(config, deal=deal, search=search)
