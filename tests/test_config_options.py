"""corpusforge.cli.config_options: a config dataclass becomes click options (docstrings as help, defaults, types,
flags), and click's values become the same dataclass again; every command with a config is bound this way."""

from __future__ import annotations

import dataclasses

import click
import pytest
from click.testing import CliRunner

from corpusforge.cli import main
from corpusforge.cli.config_options import Opt, config_options
from corpusforge.cli.types import COUNT, Size, SizeList
from corpusforge.configs import field_docs
from corpusforge.iobench.config import BenchConfig
from corpusforge.preprocess import PreprocessConfig
from corpusforge.retro.config import BuildConfig
from corpusforge.tokenizers.training import TrainTokenizerConfig
from corpusforge.train.config import ExportConfig


@dataclasses.dataclass(frozen=True)
class Toy:
    """A config of every kind of field the mechanism handles."""

    name: str
    """What to call it."""

    count: int = 3
    """How many."""

    size: int = 64 << 20
    """Bytes per thing."""

    sizes: tuple[int, ...] = (4096,)
    """Request sizes."""

    fast: bool = False
    """Go fast."""

    cache: bool = True
    """Keep a cache."""

    drop: bool = True
    """Drop the page cache first."""

    note: str | None = None
    """A free-form note."""


def _command() -> click.Command:
    @click.command()
    @config_options(
        Toy,
        Opt("count", type=COUNT),
        Opt("size", type=Size(minimum=1)),
        Opt("sizes", "--block-size", type=SizeList()),
        Opt("drop", "--keep", clears=True, help="Keep the page cache."),
    )
    def toy(**options):
        click.echo(repr(Toy(**options)))

    return toy


def test_defaults_round_trip_and_values_reach_the_fields():
    runner = CliRunner()
    assert runner.invoke(_command(), ["--name", "a"]).output.strip() == repr(Toy("a"))
    given = ["--name", "b", "--count", "7", "--size", "1M", "--block-size", "4k,1M", "--fast", "--no-cache", "--keep"]
    result = runner.invoke(_command(), [*given, "--note", "x"])
    assert result.output.strip() == repr(Toy("b", 7, 1 << 20, (4096, 1 << 20), True, False, False, "x"))


def test_help_is_the_docstring_and_shows_sizes_as_people_write_them():
    text = CliRunner().invoke(_command(), ["--help"], terminal_width=200).output
    for doc in ("What to call it.", "How many.", "Go fast.", "Keep the page cache."):
        assert doc in text
    assert "[default: 64 MiB]" in text and "[default: 4 KiB]" in text and "--cache / --no-cache" in text
    assert "--name TEXT" in text and "[required]" in text


def test_a_spec_for_a_field_that_does_not_exist_is_refused():
    with pytest.raises(TypeError, match="Toy has no field"):
        config_options(Toy, Opt("colour"))


@pytest.mark.parametrize(
    "command, config, left_out",
    [
        ("bench-io", BenchConfig, {"paths", "metadata_file_size", "checkpoint_hidden", "seed", "target_utilization",
                                   "extra"}),
        ("preprocess", PreprocessConfig, {"inputs", "merge_on_workers", "level", "tokenizer_factory", "keep_empty"}),
        ("build-knn", BuildConfig, {"prefix"}),
        ("train-tokenizer", TrainTokenizerConfig, {"inputs"}),
        ("export-hf", ExportConfig, {"run_dir"}),
    ],
)  # fmt: skip
def test_every_command_with_a_config_has_an_option_per_field(command, config, left_out):
    """The class, not a sample: each field is an option of its command unless named as left out (the command
    fills it itself, or the library sets it), so a new field cannot be forgotten by the CLI."""
    params = {p.name: p for p in main.commands[command].params}
    fields = {f.name for f in dataclasses.fields(config)}
    assert fields - left_out <= set(params), fields - left_out - set(params)
    documented = [n for n in fields - left_out if field_docs(config).get(n)]
    assert all(params[n].help for n in documented)
