"""The `corpusforge` command: one click group; each verb parses options, calls the library, prints.

Errors are handled once, at the top of every command (`_report.Command`, which the group insists on): the
project's own errors become one line on stderr, anything else keeps its traceback.

Exit status: 0 done; 1 error (one line on stderr naming the file and the fix); 2 bad usage (an option value
that is not a size, count or number of seconds, say); 3 done, but bad records were skipped (`--on-bad-line
skip`), so scripts notice that data was left out; 130 interrupted (Ctrl-C). bench-io adds 4 and 5 (stalls, hang).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping

import click

from corpusforge import __version__
from corpusforge.cli import _report

# Where each command lives: a command's module is imported when the command is asked for, so `corpusforge
# preprocess` starts without build-knn's numba and faiss helpers or the trainer's torch. `--help` imports them all:
# their options come from config dataclasses in modules that import neither (retro/config.py, train/config.py).
COMMANDS = {
    "preprocess": "corpusforge.cli.preprocess:preprocess_cmd",
    "megatron-preprocess": "corpusforge.cli.megatron_preprocess:megatron_preprocess_cmd",
    "merge": "corpusforge.cli.datasets:merge_cmd",
    "inspect": "corpusforge.cli.datasets:inspect_cmd",
    "convert": "corpusforge.cli.datasets:convert_cmd",
    "train-tokenizer": "corpusforge.cli.tokenizer:train_tokenizer_cmd",
    "build-knn": "corpusforge.cli.retro:build_knn_cmd",
    "query-knn": "corpusforge.cli.retro:query_knn_cmd",
    "bench-io": "corpusforge.cli.bench_io:bench_io_cmd",
    "train": "corpusforge.cli.train:train_cmd",
    "export-hf": "corpusforge.cli.export_hf:export_hf_cmd",
    "prepare-cache": "corpusforge.cli.prepare_cache:prepare_cache_cmd",
}


class LazyCommands(MutableMapping):
    """The group's name -> command table, each command imported on first use (click's Group reads it as a dict).

    Example:
        >>> LazyCommands({"merge": "corpusforge.cli.datasets:merge_cmd"})["merge"].name
        'merge'
    """

    def __init__(self, where: dict[str, str]) -> None:
        self._where, self._loaded = dict(where), {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            module, _, attr = self._where[name].partition(":")  # KeyError: no such command
            command = getattr(importlib.import_module(module), attr)
            if not isinstance(command, _report.Command):  # the group insists on the one error handler
                raise TypeError(f"{name}: declare it with @click.command(..., cls=_report.Command)")
            self._loaded[name] = command
        return self._loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._loaded[name] = command
        self._where.setdefault(name, "")

    def __delitem__(self, name: str) -> None:
        del self._where[name]
        self._loaded.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


@click.group(cls=_report.Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="corpusforge")
def main() -> None:
    """corpusforge: Megatron-format token datasets, fast, resumable, and honest about bad input."""


main.commands = LazyCommands(COMMANDS)
