"""Byte sizes as people write them: '64M', '16G', '512k', '1.5GiB', '1e9'. One parser for every option that takes one,
and one printer for every message and table that shows one.

Units are powers of 1024 (k, M, G, T, P; an optional trailing B or iB changes nothing), as dd, fio and Megatron's
own size options read them. A plain number is bytes.

    >>> parse_size("64M"), human_bytes(parse_size("1.5G"))
    (67108864, '1.5 GiB')
"""

from __future__ import annotations

import math

from corpusforge.errors import ArgumentError

UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
LARGEST = 1 << 62  # 4 EiB: more than any disk or RAM, and far from int64's edge where numpy offsets live


def parse_size(text: str | int, *, minimum: int = 0) -> int:
    """Bytes in `text`; ArgumentError (a ValueError) for anything that is not a finite size of at least `minimum`.

    Refused: negative numbers, inf and nan (float() accepts them), numbers that overflow ('1e400k'), and sizes past
    LARGEST, which would only fail later, deep inside numpy or the allocator.

    Example:
        >>> parse_size("1.5k"), parse_size("16GiB"), parse_size(4096)
        (1536, 17179869184, 4096)
    """
    examples = "write it like 64M, 512k, 16G or 1000000"
    raw = str(text).strip()
    number = raw.lower().removesuffix("b").removesuffix("i")
    scale = UNITS.get(number[-1:], 1)
    if scale > 1:
        number = number[:-1]
    try:
        value = float(number) * scale
    except ValueError:
        raise ArgumentError(f"{raw!r} is not a size; {examples}") from None
    if not math.isfinite(value) or value > LARGEST:
        raise ArgumentError(f"{raw!r} is not a finite size below 4 EiB; {examples}")
    if value < minimum:
        least = {0: "not be negative", 1: "be positive"}.get(minimum, f"be at least {minimum} bytes")
        raise ArgumentError(f"{raw!r}: a size must {least}; {examples}")
    return int(value)


def human_bytes(n: float) -> str:
    """`n` bytes as a person reads them: whole units without a decimal, others with one; binary units up to GiB.

    Example:
        >>> human_bytes(64 << 20), human_bytes(1.5 * (1 << 30)), human_bytes(512), human_bytes(4 << 40)
        ('64 MiB', '1.5 GiB', '512 B', '4096 GiB')
    """
    for unit, size in (("GiB", UNITS["g"]), ("MiB", UNITS["m"]), ("KiB", UNITS["k"])):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(n)} B"
