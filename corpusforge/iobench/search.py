"""Training emulation: the largest number of emulated accelerators that the path keeps at the target utilisation.

MLPerf Storage (and DLIO under it) emulates accelerators as processes that read a batch and then sleep for the
compute time of a step; accelerator utilisation AU = compute time / wall time, the first step left out, and a
storage system "supports" N accelerators when AU >= 90%. Here each emulated accelerator reads through
corpusforge's own loader. The count doubles from 1 until AU falls below the target (or max_accelerators), then
bisects between the last count that passed and the first that failed. The runner runs each trial as a case (one
row each); this module is only the search.

Example (a path whose accelerators each get 95% when alone, 20 points less at every doubling):
    >>> search_accelerators(lambda per_rank: 0.95 - 0.2 * (per_rank.bit_length() - 1), 1, 0.9, 64)
    (1, '1 accelerator(s) fed at >= 90% utilisation')
"""

from __future__ import annotations

from collections.abc import Callable


def search_accelerators(
    trial: Callable[[int], float | None], world: int, target: float, most: int
) -> tuple[int, str] | None:
    """(accelerators fed, a one-line summary), or None when a trial hung or failed. `trial(per_rank)` runs
    `per_rank` emulated accelerators on each of the `world` ranks and returns their utilisation (None: the path
    hung or failed); counts are multiples of `world`, from `world` up to `most`."""
    tried: dict[int, float] = {}

    def passes(n: int) -> bool | None:
        per_rank = max(1, -(-n // world))
        utilization = trial(per_rank)
        if utilization is None:
            return None
        tried[per_rank * world] = utilization
        return utilization >= target

    good, bad, n = 0, None, world
    while n <= most:
        ok = passes(n)
        if ok is None:
            return None
        if not ok:
            bad = n
            break
        good, n = n, n * 2
    while bad is not None and bad - good > world:
        mid = (good + bad) // 2
        ok = passes(mid)
        if ok is None:
            return None
        good, bad = (mid, bad) if ok else (good, mid)
    fed = max((k for k, u in tried.items() if u >= target), default=0)
    summary = f"{fed} accelerator(s) fed at >= {target:.0%} utilisation"
    if bad is None and fed >= most // 2:
        summary += f" (search stopped at --max-accelerators {most})"
    return fed, summary
