"""What a bench-io run found, as plain data: the rows, a note per measured path, the summaries, what was left behind.

The runner fills it (runner.Run is one, with the machinery that runs the cases); report.py shows it. Neither the
patterns nor the report need the runner for it, so the modules' imports stay a tree.

Example:
    >>> run = RunResults(BenchConfig(paths=("/tmp",)), Ranks())
    >>> run.paths.append(PathInfo("/tmp", "tmpfs", False, "refused by the file system", 8 << 30))
    >>> report.to_json(run)["paths"][0]["fs"]
    'tmpfs'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from corpusforge.iobench.config import BenchConfig
from corpusforge.iobench.ranks import Ranks
from corpusforge.iobench.stats import CaseResult


@dataclass
class PathInfo:
    """What the report says about the measured path and how the page cache was handled."""

    path: str
    fs: str
    direct: bool  # O_DIRECT in effect for seq/rand patterns
    direct_note: str
    memory: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass
class RunResults:
    """One run's findings over its paths; rank 0 holds the aggregate rows."""

    config: BenchConfig
    ranks: Ranks
    results: list[CaseResult] = field(default_factory=list)
    paths: list[PathInfo] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)  # run directories the storage did not let us remove
    summaries: list[tuple[str, str]] = field(default_factory=list)  # (path, one line): e.g. accelerators fed
