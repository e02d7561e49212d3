"""A package's public names imported on first use (PEP 562), so that importing one light module of the package (a
config the CLI reads to make its options) does not import the heavy ones its `__init__` re-exports (torch, numba).

Example, in a package's __init__.py:
    >>> __getattr__, __dir__, __all__ = lazy_exports(__name__, {"TrainConfig": "config", "train": "trainer"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The module-level `__getattr__`, `__dir__` and `__all__` of `package`, whose name N comes from its submodule
    `exports[N]`, imported when N is first asked for and then kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__, sorted(exports)
