"""The options that pick where a command's shard tasks run (preprocess, build-knn): one definition for both."""

from __future__ import annotations

from collections.abc import Callable

import click

from corpusforge.cli.types import Seconds
from corpusforge.executors import EXECUTORS


def executor_options(tasks: str) -> Callable:
    """--executor, --workers, --ray-address and --ray-keep-workers; `tasks` names what runs (e.g. "Shard tasks").

    Example:
        >>> @click.command()
        ... @executor_options("Tasks")
        ... def run(executor, workers, ray_address, ray_keep_workers): ...
    """

    def apply(command: Callable) -> Callable:
        for option in reversed(
            [
                click.option(
                    "--executor",
                    type=click.Choice(EXECUTORS),
                    default="local",
                    show_default=True,
                    help="local: worker processes here; ray: Ray tasks on a cluster whose nodes share the file system.",
                ),
                click.option(
                    "--workers",
                    type=click.IntRange(min=0),
                    default=0,
                    help=f"{tasks} at once [default: one per core; with --executor ray, every CPU of the cluster].",
                ),
                click.option(
                    "--ray-address",
                    default=None,
                    help="Ray cluster to join, e.g. auto (the one `ray start` made here) [default: a new one on "
                    "this machine].",
                ),
                click.option(
                    "--ray-keep-workers",
                    type=Seconds(),
                    default=60.0,
                    show_default=True,
                    metavar="SECONDS",
                    help="Ray: idle seconds the worker processes wait for the next job, which then starts at once "
                    "(tokenizer loaded); 0 ends them with the job.",
                ),
            ]
        ):
            command = option(command)
        return command

    return apply
