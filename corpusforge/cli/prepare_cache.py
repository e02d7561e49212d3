"""`corpusforge prepare-cache`: the loaders' index caches built once, offline; with --megatron, megatron-core's own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import click

from corpusforge.cli import _report
from corpusforge.cli.config_options import Opt, config_options
from corpusforge.data.prepare_cache import MegatronCacheConfig
from corpusforge.errors import ArgumentError

MEGATRON = "Megatron-LM's data arguments (with --megatron)"


class PrepareCacheCommand(_report.Command):
    """Reads `--data-path A B C` as Megatron-LM does (one flag, several values) by repeating the flag for click."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out, values = [], False
        for arg in args:
            if arg == "--data-path":
                values = True
                continue
            if values and not arg.startswith("--"):
                out += ["--data-path", arg]
                continue
            values = False
            out.append(arg)
        return super().parse_args(ctx, out)


@click.command(
    "prepare-cache", cls=PrepareCacheCommand,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)  # fmt: skip
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="The training config (TOML) of `corpusforge train`: build the caches it maps at start.")  # fmt: skip
@click.argument("overrides", nargs=-1)
@click.option("--dp-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --config: data-parallel ranks of the run (they size the validation split).")  # fmt: skip
@click.option("--megatron", is_flag=True, help="Write megatron-core's own cache files for Megatron-LM's arguments.")
@config_options(
    MegatronCacheConfig,
    Opt("data_path", multiple=True, default=(), help="--data-path of Megatron-LM: PREFIX..., or WEIGHT PREFIX ...",
        extra={"metavar": "..."}),
    Opt("data_cache_path", default=None, help="--data-cache-path of Megatron-LM: where the cache files go."),
    Opt("seq_length", default=None),
    Opt("durable", "--fsync/--no-fsync"),
)  # fmt: skip
@click.option("--progress/--no-progress", "progress", default=None, help="Progress on stderr [default: on a terminal].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def prepare_cache_cmd(config_path, overrides, dp_size, megatron, progress, as_json, **options) -> None:
    """Build every split's document, sample and shuffle indices of a blend once, offline, so that a job starts by
    mapping them (no rank waits while rank 0 builds).

    \b
    corpusforge prepare-cache --config run.toml [key=value ...]
    corpusforge prepare-cache --megatron --data-path 0.7 a_text_document 0.3 b_text_document --split 99,1,0 \\
        --seq-length 4096 --seed 1234 --train-samples 1000000 --global-batch-size 512 --data-cache-path cache/
    """
    from corpusforge.data import prepare_cache as lib

    if megatron == (config_path is not None):
        raise ArgumentError("--config: give a training config, or --megatron with Megatron-LM's data arguments")
    if megatron:
        if overrides:
            raise ArgumentError(f"{overrides[0]}: unexpected argument; key=value overrides go with --config")
        for name in ("data_path", "data_cache_path", "seq_length"):
            if not options[name]:
                raise ArgumentError(f"--{name.replace('_', '-')}: required with --megatron (as in Megatron-LM)")
        config = MegatronCacheConfig(**{**options, "data_path": tuple(options["data_path"])})
        with _progress_bar(_report.show_progress(progress)) as advance:
            stats = lib.prepare_megatron_cache(config, advance)
        title = "corpusforge prepare-cache --megatron"
    else:
        from corpusforge.train.config import load_config

        cfg = load_config(config_path, list(overrides))
        stats = lib.prepare_train_cache(cfg, dp_size)
        title = "corpusforge prepare-cache"
    data = stats.summary()
    rows = [(k, v) for k, v in data.items() if k != "samples"]
    rows += [(f"samples.{k}", "-" if v is None else v) for k, v in data["samples"].items()]
    _report.print_summary(title, rows, data if as_json else None)


@contextlib.contextmanager
def _progress_bar(enabled: bool) -> Iterator:
    """A bar over the cache files on a terminal (files written, ETA); nothing in a pipe."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
                   TimeRemainingColumn(), console=_report.err_console, transient=True)  # fmt: skip
    task = bar.add_task("writing", total=None)

    def advance(stage: str, done: int, total: int) -> None:
        if not bar.live.is_started:
            bar.start()
        bar.update(task, description=stage, completed=done, total=total)

    try:
        yield advance
    finally:
        bar.stop()
