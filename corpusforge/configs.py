"""What every config dataclass shares: its field docstrings read as documentation, value checks against the
field types, and tables of values (TOML, JSON, options) turned into an instance with one-line errors.

A config here is a frozen dataclass with a docstring under each field (litgpt's and torchtitan's form); those
strings are the one documentation of each option: `corpusforge.cli.config_options` makes them the click help,
`corpusforge train --list-keys` prints them.

    >>> from corpusforge.iobench.config import BenchConfig
    >>> field_docs(BenchConfig)["rand_ops"]
    'Random reads per process (fewer if `duration` runs out first).'
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from functools import cache
from typing import Any, TypeVar

from corpusforge.errors import CorpusforgeError

T = TypeVar("T")


class ConfigError(CorpusforgeError, ValueError):
    """A configuration that cannot run: unknown key, wrong type, or values that do not fit together. `keys` names the
    keys (dotted: `schedule.min_lr`) whose values are wrong, so that a reader of several sources (a file, then the
    command line) can say which source gave them."""

    def __init__(self, message: str, keys: typing.Iterable[str] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The string right after each annotated field of a dataclass's source, cleaned of its indentation.

    Example:
        >>> from corpusforge.iobench.config import BenchConfig
        >>> field_docs(BenchConfig)["steps"]
        'Batches per process for replay and per emulated accelerator for train.'
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(after.value.value)  # type: ignore[attr-defined]
    return docs


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value (its factory called), or dataclasses.MISSING for a required field."""
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def accepts(annotation: Any, value: Any) -> bool:
    """Whether `value` fits a field annotation of the simple kinds configs use (int, float, bool, str, list, dict,
    tuple, unions); an int is a float, a bool is not a number.

    Example:
        >>> accepts(float, 3), accepts(int, True), accepts(str | None, None), accepts(list[int], [1])
        (True, False, True, True)
    """
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(accepts(a, value) for a in typing.get_args(annotation))
    if annotation is None or annotation is type(None):
        return value is None
    if annotation is Any:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(annotation))
    origin = typing.get_origin(annotation) or annotation
    if origin is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin)


# What a value of each plain type is called in an error, as a person who writes TOML or a command line reads it.
_TYPE_WORDS = {int: ("a whole number", "whole numbers"), float: ("a number", "numbers"),
               bool: ("true or false", "true or false values"), str: ("a string", "strings"),
               dict: ("a table", "tables"), collections.abc.Mapping: ("a table", "tables"), list: ("a list", "lists"),
               tuple: ("a list", "lists")}  # fmt: skip


def type_words(annotation: Any, plural: bool = False) -> str:
    """A field annotation in words: `int` is "a whole number", `float | None` "a number", `Literal["a", "b"]` "one
    of 'a', 'b'", `list[int]` "a list of whole numbers".

    Example:
        >>> type_words(int), type_words(bool | str), type_words(typing.Literal["mmap", "pread"]), type_words(list[int])
        ('a whole number', 'true or false or a string', "one of 'mmap', 'pread'", 'a list of whole numbers')
    """
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        parts = [a for a in typing.get_args(annotation) if a is not type(None)] or [type(None)]
        return " or ".join(dict.fromkeys(type_words(a, plural) for a in parts))
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if annotation is type(None) or annotation is None:
        return "nothing"
    if annotation is Any:
        return "values" if plural else "any value"
    if dataclasses.is_dataclass(annotation):
        return "tables" if plural else "a table"
    origin = typing.get_origin(annotation) or annotation
    if origin in (list, tuple):
        items = {a for a in typing.get_args(annotation) if a is not Ellipsis and a is not Any}
        if len(items) == 1 and not plural:
            return f"a list of {type_words(items.pop(), plural=True)}"
    words = _TYPE_WORDS.get(origin)
    if words is None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name} values" if plural else f"a {name}"
    return words[plural]


def type_problem(annotation: Any, value: Any) -> str | None:
    """None when `value` fits the field annotation, else what was expected in words: the one wording of a value of
    the wrong type, whichever config reads it.

    Example:
        >>> type_problem(int, "x"), type_problem(float, 3)
        ('expected a whole number', None)
    """
    return None if accepts(annotation, value) else f"expected {type_words(annotation)}"


def unknown_key_hint(key: str, names: typing.Iterable[str]) -> str:
    """'did you mean max_steps?' for a key close to a known one, else the list of known keys.

    Example:
        >>> unknown_key_hint("max_step", ["max_steps", "seed"])
        'did you mean max_steps?'
    """
    names = list(names)
    close = difflib.get_close_matches(key, names, n=3)
    return f"did you mean {', '.join(close)}?" if close else f"known keys: {', '.join(names)}"


def from_table(
    cls: type[T], values: dict[str, Any], where: str, error: type[CorpusforgeError], *, check_types: bool = True
) -> T:
    """An instance of the dataclass `cls` from a table of its fields' values: an unknown key, a value of the wrong
    type, or a value its __post_init__ refuses (ValueError) is an `error` whose one line starts with `where`.

    Example:
        >>> from corpusforge.iobench.config import BenchConfig
        >>> from_table(BenchConfig, {"paths": ("/tmp",), "steps": 5}, "bench.toml", CorpusforgeError).steps
        5
    """
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in names:
            raise error(f"{where}: unknown key {key!r}; {unknown_key_hint(key, names)}")
        problem = None if dataclasses.is_dataclass(hints[key]) else type_problem(hints[key], value)
        if check_types and problem:
            raise error(f"{where}: {key} = {value!r}: {problem}")
    try:
        return cls(**values)
    except CorpusforgeError as e:
        raise error(f"{where}: {e}") from None
    except ValueError as e:
        raise error(f"{where}: {e}") from None
