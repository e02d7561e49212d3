"""Training emulation: the largest number of emulated accelerators that the path keeps at the target utilisation.

MLPerf Storage (and DLIO under it) emulates accelerators as processes that read a batch and then sleep for the
compute time of a step; accelerator utilisation AU = compute time / wall time, the first step left out, and a
storage system "supports" N accelerators when AU >= 90%. Here each emulated accelerator reads through
corpusforge's own loader. The count doubles from 1 until AU falls below the target (or max_accelerators), then
bisects between the last count that passed and the first that failed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from corpusforge.iobench import patterns

if TYPE_CHECKING:
    from corpusforge.iobench.runner import PathInfo, Run


def search_accelerators(run: Run, path: str, run_dir: str, info: PathInfo) -> bool:
    """Add one row per tried count and a summary row; False if the path hung or failed."""
    c = run.config
    tried: dict[int, float] = {}

    def trial(n: int) -> bool | None:
        per_rank = max(1, -(-n // run.ranks.world))
        scratch = os.path.join(run_dir, f"train-{per_rank}")
        case = patterns.Case("train", run_dir, scratch, per_rank, run.ranks.world, c.sample_size, False, c)
        row = run.run_one(case, path, info)
        if row.verdict in ("hung", "error"):
            return None
        tried[per_rank * run.ranks.world] = row.extra.get("utilization", 0.0)
        return tried[per_rank * run.ranks.world] >= c.target_utilization

    good, bad, n = 0, None, run.ranks.world
    while n <= c.max_accelerators:
        ok = trial(n)
        if ok is None:
            return False
        if not ok:
            bad = n
            break
        good, n = n, n * 2
    while bad is not None and bad - good > run.ranks.world:
        mid = (good + bad) // 2
        ok = trial(mid)
        if ok is None:
            return False
        good, bad = (mid, bad) if ok else (good, mid)
    fed = max((k for k, u in tried.items() if u >= c.target_utilization), default=0)
    summary = f"{fed} accelerator(s) fed at >= {c.target_utilization:.0%} utilisation"
    if bad is None and fed >= c.max_accelerators // 2:
        summary += f" (search stopped at --max-accelerators {c.max_accelerators})"
    for row in run.results:
        if row.pattern == "train" and row.path == path:
            row.extra["fed_accelerators"] = fed
    run.event(summary)
    run.summaries.append((path, summary))
    return True
