"""The `corpusforge` command: one click group; each verb parses options, calls the library, prints.

Errors are handled once, at the top of every command (`_report.Command`, which the group insists on): the
project's own errors become one line on stderr, anything else keeps its traceback.

Exit status: 0 done; 1 error (one line on stderr naming the file and the fix); 2 bad usage (an option value
that is not a size, count or number of seconds, say); 3 done, but bad records were skipped (`--on-bad-line
skip`), so scripts notice that data was left out; 130 interrupted (Ctrl-C). bench-io adds 4 and 5 (stalls, hang).
"""

from __future__ import annotations

import click

from corpusforge import __version__
from corpusforge.cli import _report
from corpusforge.cli.bench_io import bench_io_cmd
from corpusforge.cli.datasets import convert_cmd, inspect_cmd, merge_cmd
from corpusforge.cli.export_hf import export_hf_cmd
from corpusforge.cli.megatron_preprocess import megatron_preprocess_cmd
from corpusforge.cli.preprocess import preprocess_cmd
from corpusforge.cli.retro import build_knn_cmd, query_knn_cmd
from corpusforge.cli.tokenizer import train_tokenizer_cmd
from corpusforge.cli.train import train_cmd


@click.group(cls=_report.Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="corpusforge")
def main() -> None:
    """corpusforge: Megatron-format token datasets, fast, resumable, and honest about bad input."""


COMMANDS = (
    preprocess_cmd,
    megatron_preprocess_cmd,
    merge_cmd,
    inspect_cmd,
    convert_cmd,
    train_tokenizer_cmd,
    build_knn_cmd,
    query_knn_cmd,
    bench_io_cmd,
    train_cmd,
    export_hf_cmd,
)
for command in COMMANDS:
    main.add_command(command)
