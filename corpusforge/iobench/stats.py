"""From the phases the workers measured to one result row per (pattern, phase): throughput, IOPS, percentiles."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from corpusforge.iobench.patterns import Case, Phase

PERCENTILES = (50, 90, 99)


@dataclass
class CaseResult:
    """One row of the report: a phase of a pattern at one block size and process count on one path."""

    path: str
    pattern: str
    phase: str
    block_size: int
    procs: int  # per rank
    ranks: int
    bytes: int
    ops: int
    seconds: float  # wall time of the phase, slowest rank
    mb_s: float  # 1e6 bytes per second, all processes together
    iops: float
    latency_ms: dict[str, float]  # p50, p90, p99, max
    stalls: int  # ops slower than stall_seconds
    worst_s: float
    cache: str  # how the page cache was handled: O_DIRECT / fadvise DONTNEED / ...
    verdict: str = "ok"  # ok | stalls | hung | error
    message: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # samples_s, tokens_s, utilization, durable_s, ...
    latencies: np.ndarray | None = field(default=None, repr=False)  # seconds, every op (for the CDF plot)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("latencies")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CaseResult:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @classmethod
    def failed(cls, case: Case, path: str, verdict: str, message: str) -> CaseResult:
        """The row of a case that hung or failed: no figures, the verdict and the one-line reason."""
        zero = {"bytes": 0, "ops": 0, "seconds": 0.0, "mb_s": 0.0, "iops": 0.0, "stalls": 0, "worst_s": 0.0}
        return cls(
            path=path,
            pattern=case.pattern,
            phase="-",
            block_size=case.block_size,
            procs=case.procs,
            ranks=case.world,
            latency_ms={},
            cache="-",
            verdict=verdict,
            message=message,
            **zero,
        )


def percentiles(latencies: np.ndarray) -> dict[str, float]:
    if len(latencies) == 0:
        return {}
    ms = np.percentile(latencies, PERCENTILES) * 1e3
    return {**{f"p{p}": float(v) for p, v in zip(PERCENTILES, ms)}, "max": float(latencies.max() * 1e3)}


def _merge(case: Case, path: str, name: str, per_rank: list[list[Phase]], cache: str) -> CaseResult:
    """Phases of the same name from every worker of every rank: bytes and ops add up, time is the slowest rank's
    span from its first start to its last end (ranks start together after a barrier; clocks of different machines
    are never compared)."""
    spans = [max(p.end for p in ps) - min(p.start for p in ps) for ps in per_rank if ps]
    seconds = max(spans) if spans else 0.0
    phases = [p for ps in per_rank for p in ps]
    lat = np.concatenate([np.frombuffer(p.latencies, dtype=np.float64) for p in phases]) if phases else np.zeros(0)
    total, ops = sum(p.bytes for p in phases), sum(p.ops for p in phases)
    stall = case.config.stall_seconds
    extra: dict[str, Any] = {}
    for key in ("samples", "tokens"):
        if any(key in p.extra for p in phases):
            extra[f"{key}_s"] = sum(p.extra.get(key, 0) for p in phases) / max(seconds, 1e-12)
    for key in ("fetched_bytes", "requests"):  # what a remote dataset's loader fetched over the network
        if any(key in p.extra for p in phases):
            extra[key] = sum(p.extra.get(key, 0) for p in phases)
    if any("utilization" in p.extra for p in phases):
        utils = [p.extra["utilization"] for p in phases]
        extra.update(utilization=float(np.mean(utils)), utilization_min=float(np.min(utils)), accelerators=len(utils))
    for key in ("durable_s", "fsync_s"):
        if any(key in p.extra for p in phases):
            extra[key] = max(p.extra.get(key, 0.0) for p in phases)
    slow = lat[lat > stall]
    return CaseResult(
        path=path,
        pattern=case.pattern,
        phase=name,
        block_size=case.block_size,
        procs=case.procs,
        ranks=case.world,
        bytes=total,
        ops=ops,
        seconds=seconds,
        mb_s=total / seconds / 1e6 if seconds else 0.0,
        iops=ops / seconds if seconds else 0.0,
        latency_ms=percentiles(lat),
        stalls=len(slow),
        worst_s=float(lat.max()) if len(lat) else 0.0,
        cache=cache,
        verdict="stalls" if len(slow) else "ok",
        message=f"{len(slow)} op(s) slower than {stall:g} s, worst {lat.max():.2f} s" if len(slow) else "",
        extra=extra,
        latencies=lat,
    )


def _merge_checkpoints(case: Case, path: str, name: str, per_rank: list[list[Phase]], cache: str) -> CaseResult:
    """MLPerf Storage's checkpoint metric over the phases of every process (one per checkpoint each): per
    checkpoint, the duration is the maximum over ranks of each one's own span, the throughput the minimum over
    ranks, i.e. the whole checkpoint's bytes over that maximum (DLIO's statscounter); the row has their means over
    the checkpoints (what a submission reports), and every checkpoint's figures in `extra`."""
    phases = [p for ps in per_rank for p in ps]
    n = 1 + max(p.extra["checkpoint"] for p in phases)
    durations, rates, sizes = [], [], []
    for i in range(n):
        mine = [p for p in phases if p.extra["checkpoint"] == i]
        durations.append(max(p.end - p.start for p in mine))
        sizes.append(sum(p.bytes for p in mine))
        rates.append(sizes[-1] / max(durations[-1], 1e-12) / 1e6)
    row = _merge(case, path, name, per_rank, cache)  # the latencies, stalls and totals
    row.seconds = float(np.mean(durations))
    row.mb_s = float(np.mean(rates))
    row.iops = row.ops / max(sum(durations), 1e-12)
    row.extra.update(
        model=case.config.mlperf,
        scale=case.config.scale,
        processes=case.slots,
        checkpoints=n,
        checkpoint_bytes=sizes[0],
        duration_max_s=durations,  # per checkpoint: the slowest rank
        throughput_min_mb_s=rates,  # per checkpoint: the slowest rank's (MLPerf: checkpoint size / its duration)
        throughput_min_gib_s_mean=float(np.mean(rates)) * 1e6 / 2**30,  # DLIO's unit, "GB/s" = GiB/s
    )
    return row


def aggregate(case: Case, path: str, outcomes: list, cache: str) -> list[CaseResult]:
    """Rows for `case` from every rank's CaseOutcome; a hung or failed case gives one row saying so."""
    bad = [o for o in outcomes if o.verdict != "ok"]
    if bad:
        worst = next((o for o in bad if o.verdict == "hung"), bad[0])
        row = CaseResult.failed(case, path, worst.verdict, worst.message)
        row.extra["errno"] = worst.errno
        if worst.in_flight:
            row.worst_s = max(s for _, s in worst.in_flight)
            row.stalls = len(worst.in_flight)
        return [row]
    names: list[str] = []
    for per_worker in (o.phases for o in outcomes):
        for phases in per_worker:
            names += [name for name in dict.fromkeys(p.name for p in phases) if name not in names]
    rows = []
    for name in names:
        per_rank = [[p for phases in o.phases for p in phases if p.name == name] for o in outcomes]
        merge = _merge_checkpoints if any("checkpoint" in p.extra for ps in per_rank for p in ps) else _merge
        rows.append(merge(case, path, name, per_rank, cache))
    return rows
