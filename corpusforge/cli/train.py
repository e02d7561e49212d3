"""`corpusforge train`: the bundled GPT trainer (also `torchrun ... -m corpusforge.train`)."""

from __future__ import annotations

import os
import warnings

import click

from corpusforge.cli import _report


@click.command(
    "train", cls=_report.Command, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML config (see configs/); keys not given keep their defaults.",
)
@click.argument("overrides", nargs=-1)
@click.option(
    "--dry-run", is_flag=True, help="Build the data, the model (on the meta device) and the plan, print it, stop."
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=None,
    help="With --dry-run: plan for this many ranks without launching them (default: torchrun's, or 1).",
)
@click.option("--list-keys", is_flag=True, help="Print every config key with its default and meaning, and stop.")
@click.option("--json", "as_json", is_flag=True, help="Print the closing summary (or the dry-run plan) as JSON.")
def train_cmd(config_path, overrides, dry_run, world_size, list_keys, as_json) -> None:
    """Train a GPT-2-style model on corpusforge token datasets: one process, or one per device under torchrun.

    OVERRIDES are key=value pairs applied after the config file, e.g. schedule.max_steps=100 optimizer.lr=3e-4
    compile=false.
    """
    from corpusforge.train.config import ConfigDeprecationWarning, describe_keys, load_config

    if list_keys:
        click.echo(describe_keys())
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigDeprecationWarning)
        cfg = load_config(config_path, list(overrides))
    for w in caught:  # an old flat key: one line each, from rank 0 (every rank reads the same config)
        if not issubclass(w.category, ConfigDeprecationWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elif int(os.environ.get("RANK", "0")) == 0:
            click.echo(f"corpusforge: warning: {w.message}", err=True)
    from corpusforge.train.trainer import train

    log = lambda line: click.echo(line, err=as_json)  # noqa: E731 - with --json, stdout holds only the JSON
    summary = train(cfg, dry_run=dry_run, log=log, world_size=world_size if dry_run else None)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if dry_run or as_json:
        rows = [(k, v) for k, v in summary.items() if not isinstance(v, dict) and k != "ranks"]
        rows += [(f"{k}.{kk}", vv) for k, v in summary.items() if isinstance(v, dict) for kk, vv in v.items()]
        _report.print_summary("corpusforge train --dry-run" if dry_run else "", rows, summary if as_json else None)
