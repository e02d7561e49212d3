"""Click types for the values options take (sizes, counts, seconds): a bad value is a usage error, exit 2, with
the option's name, before any work starts.

    >>> @click.option("--task-size", type=Size(), default="64M")
"""

from __future__ import annotations

import math

import click

from corpusforge.sizes import parse_size


class Size(click.ParamType):
    """A byte size ('64M', '16G', '512k'), as an int; `minimum` bytes at least (1: zero is refused too).
    `as_text` hands the command the text as written (checked), for a library option that records it as given.

    Example:
        >>> Size(minimum=1).convert("4k", None, None)
        4096
    """

    name = "size"

    def __init__(self, minimum: int = 0, as_text: bool = False) -> None:
        self.minimum, self.as_text = minimum, as_text

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):  # a default given as a number
            value = str(value)
        try:
            size = parse_size(value, minimum=self.minimum)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return str(value).strip() if self.as_text else size


class SizeList(click.ParamType):
    """Comma-separated sizes ('4k,1M,16M') as a tuple of ints, each at least `minimum`."""

    name = "sizes"

    def __init__(self, minimum: int = 1) -> None:
        self.minimum = minimum

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        items = [t.strip() for t in str(value).split(",") if t.strip()]
        if not items:
            self.fail(f"{value!r}: give a size or a comma-separated list (4k,1M,16M)", param, ctx)
        try:
            return tuple(parse_size(t, minimum=self.minimum) for t in items)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class CountList(click.ParamType):
    """Comma-separated positive whole numbers ('1,2,4') as a tuple of ints."""

    name = "counts"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        items = [t.strip() for t in str(value).split(",") if t.strip()]
        try:
            counts = tuple(int(t) for t in items)
        except ValueError:
            counts = ()
        if not counts or min(counts) < 1:
            self.fail(f"{value!r}: give a positive whole number or a comma-separated list (1,2,4)", param, ctx)
        return counts


class Seconds(click.ParamType):
    """A finite number of seconds, at least 0 (`positive`: above 0); click's FloatRange lets inf and nan through."""

    name = "seconds"

    def __init__(self, positive: bool = False) -> None:
        self.positive = positive

    def convert(self, value, param, ctx):
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 0 or (self.positive and seconds == 0):
            self.fail(
                f"{value!r}: give a finite number of seconds {'above' if self.positive else 'of at least'} 0",
                param,
                ctx,
            )
        return seconds


class Count(click.IntRange):
    """A positive whole number (workers, chunks, steps, files): 0 and below are a usage error (exit 2) naming the
    option, and --help says x>=1. A default a config field gives in code passes as it is (workers=0 there means
    "one per core", which the option's help says in words); typed on the command line, 0 is refused.

    Example:
        >>> Count().convert("0", None, None)
        click.exceptions.BadParameter: 0 is not in the range x>=1.
    """

    def __init__(self) -> None:
        super().__init__(min=1)

    def convert(self, value, param, ctx):
        if param is not None and type(value) is int and value == param.default:  # the field's, not a person's
            return value
        return super().convert(value, param, ctx)


COUNT = Count()
"""A positive whole number (workers, chunks, steps, files, processes)."""
