"""Click options made from a config dataclass: one option per field, its docstring the help, its default the
default, its type from the annotation (or a checked type from corpusforge.cli.types), bools as flags.

Every command that has a config binds its options here, so that the CLI and the Python API cannot drift apart
(litgpt's rule): a field added to the dataclass with a docstring is an option with help, and the command hands
click's values to the dataclass unchanged (`BenchConfig(paths=..., **options)`). An `Opt` says what the CLI
writes differently: the option's name (`--stall` for stall_seconds), a checked type (sizes, counts, seconds),
a flag that clears a field that is on by default (`--keep-cache` for drop_cache), a shorter help.

    >>> @click.command()
    ... @config_options(BenchConfig, Opt("rand_ops", type=COUNT), only=("rand_ops", "drop_cache"))
    ... def bench(**options): ...
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable
from typing import Any

import click

from corpusforge.cli.types import COUNT, CountList, Seconds, Size, SizeList
from corpusforge.configs import field_default, field_docs
from corpusforge.executors import EXECUTORS
from corpusforge.sizes import human_bytes


@dataclasses.dataclass(frozen=True)
class Opt:
    """How one field of a config appears on the command line, where it differs from what its type gives."""

    field: str
    """The dataclass field; the option's value is passed to the command under this name."""

    name: str | tuple[str, ...] | None = None
    """The option (`--stall`, or several names: ("-k", "--neighbours-k"), or a flag pair "--x/--no-x"); default:
    --field-name."""

    type: Any = None
    """A click type; default: from the annotation (int, float, str, a Choice from `choices`)."""

    help: str | None = None
    """Help text; default: the field's docstring."""

    choices: tuple[str, ...] | None = None
    """Allowed values (a click.Choice)."""

    clears: bool = False
    """A flag that sets the field to False (the field is on by default): `--keep-cache` for drop_cache."""

    multiple: bool = False
    """The option may be repeated; the command gets a tuple (empty when not given)."""

    default: Any = "<the field's>"
    """The option's default when not the field's (e.g. () for a repeated option the command fills in)."""

    show_default: bool | None = None
    """Whether --help shows the default; default: unless it is None or empty. Sizes show as '64 MiB'."""

    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """More keyword arguments for click.option (metavar, required)."""


def config_options(
    cls: type, *specs: Opt, only: Iterable[str] | None = None, exclude: Iterable[str] = ()
) -> Callable[[Callable], Callable]:
    """A decorator adding one click option per field of the dataclass `cls` (in field order), `specs` changing
    how some look; `only` limits them to some fields, `exclude` leaves some out (those the command fills itself).

    Example:
        >>> @click.command()
        ... @config_options(BenchConfig, Opt("stall_seconds", "--stall", type=Seconds()), only=["stall_seconds"])
        ... def bench(stall_seconds): ...
    """
    by_field = {s.field: s for s in specs}
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = set(by_field) - set(names) | (set(only or ()) | set(exclude)) - set(names)
    if unknown:  # a renamed field must not leave an option silently unbound
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
    chosen = [n for n in (only if only is not None else names) if n not in set(exclude)]
    options = [_option(cls, by_field.get(n, Opt(n))) for n in chosen]

    def apply(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


def _option(cls: type, spec: Opt) -> Callable:
    f = next(f for f in dataclasses.fields(cls) if f.name == spec.field)
    annotation = typing.get_type_hints(cls)[f.name]
    default = field_default(f) if spec.default == Opt.default else spec.default
    names = spec.name if isinstance(spec.name, tuple) else (spec.name or "--" + f.name.replace("_", "-"),)
    help_text = spec.help if spec.help is not None else " ".join(field_docs(cls).get(f.name, "").split())
    kwargs: dict[str, Any] = {"help": help_text, **spec.extra}
    if spec.clears:
        return click.option(*names, f.name, flag_value=False, default=True, **kwargs)
    if "/" in names[-1]:  # an on/off pair given in full (--index-on-disk/--index-in-ram), default None or a bool
        return click.option(*names, f.name, default=default, show_default=default is not None, **kwargs)
    if annotation is bool and spec.type is None:
        if default is True:
            names = (f"{names[-1]}/--no-{names[-1][2:]}",)
            kwargs["show_default"] = True
        if "/" not in names[0]:
            kwargs["is_flag"] = True
        return click.option(*names, f.name, default=default, **kwargs)
    kwargs["type"] = spec.type or (click.Choice(spec.choices) if spec.choices else _click_type(annotation))
    if spec.multiple:
        kwargs["multiple"] = True
    if default is not dataclasses.MISSING:
        kwargs["default"] = _as_text(default, kwargs["type"])
        kwargs["show_default"] = spec.show_default if spec.show_default is not None else default not in (None, ())
    elif "required" not in kwargs:
        kwargs["required"] = True
    return click.option(*names, f.name, **kwargs)


def _click_type(annotation: Any) -> Any:
    """click's type for a plain annotation; `str | None` is a str that may be left out."""
    plain = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return plain[0] if plain[0] in (int, float, str) else None


def _as_text(default: Any, kind: Any) -> Any:
    """A default of a size or list type as a person would type it ('64 MiB', '1,2,4'), which --help then shows;
    the type reads it back to the field's value."""
    if isinstance(kind, Size) and isinstance(default, int):
        return human_bytes(default)
    if isinstance(kind, SizeList):
        return ",".join(human_bytes(b) for b in default)
    if isinstance(kind, CountList):
        return ",".join(str(v) for v in default)
    return default


def executor_opts(tasks: str) -> tuple[Opt, ...]:
    """How --executor, --workers, --ray-address and --ray-keep-workers look in every command whose config has the
    fields executor, workers, ray_address and ray_keep_workers (preprocess, build-knn); `tasks` names what runs.

    Example:
        >>> @config_options(BuildConfig, *executor_opts("Shard tasks"), only=EXECUTOR_FIELDS)
        ... def build(executor, workers, ray_address, ray_keep_workers): ...
    """
    return (
        Opt("executor", choices=EXECUTORS,
            help="local: worker processes here; ray: Ray tasks on a cluster whose nodes share the file system."),
        Opt("workers", type=COUNT, show_default=False,
            help=f"{tasks} at once [default: one per core; with --executor ray, every CPU of the cluster]."),
        Opt("ray_address", help="Ray cluster to join, e.g. auto (the one `ray start` made here) [default: a new one "
            "on this machine]."),
        Opt("ray_keep_workers", type=Seconds(), extra={"metavar": "SECONDS"},
            help="Ray: idle seconds the worker processes wait for the next job, which then starts at once (tokenizer "
            "loaded); 0 ends them with the job."),
    )  # fmt: skip


EXECUTOR_FIELDS = ("executor", "workers", "ray_address", "ray_keep_workers")
