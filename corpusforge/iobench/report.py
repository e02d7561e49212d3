"""How a bench-io run is shown: a table (paths side by side), a JSON document, a PNG (throughput and latency CDF)."""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from typing import Any

import numpy as np

from corpusforge.errors import MissingExtraError
from corpusforge.fsutil import write_json_atomic
from corpusforge.iobench.results import RunResults
from corpusforge.iobench.stats import CaseResult
from corpusforge.sizes import human_bytes

REPORT_VERSION = 1


def verdict(run: RunResults) -> tuple[str, int]:
    """(one line, exit status): 0 all ok, 4 stalls, 5 a path hung, 1 an operation failed."""
    rows = run.results
    hung = [r for r in rows if r.verdict == "hung"]
    failed = [r for r in rows if r.verdict == "error"]
    stalls = [r for r in rows if r.verdict == "stalls"]
    if hung:
        r = hung[0]
        return f"HUNG: {r.path}: {r.pattern}: {r.message}", 5
    if failed:
        r = failed[0]
        return f"FAILED: {r.path}: {r.pattern}: {r.message}", 1
    if stalls:
        n = sum(r.stalls for r in stalls)
        worst = max(r.worst_s for r in stalls)
        return f"STALLS: {n} operation(s) slower than {run.config.stall_seconds:g} s (worst {worst:.2f} s)", 4
    return f"OK: no operation slower than {run.config.stall_seconds:g} s", 0


def environment() -> dict[str, Any]:
    from corpusforge import __version__

    return {
        "host": socket.gethostname(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "corpusforge": __version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def to_json(run: RunResults) -> dict[str, Any]:
    line, status = verdict(run)
    return {
        "version": REPORT_VERSION,
        "verdict": line,
        "exit_status": status,
        "environment": environment(),
        "ranks": {"world": run.ranks.world, "launcher": run.ranks.launcher},
        "config": run.config.to_dict(),
        "paths": [p.to_dict() for p in run.paths],
        "summaries": [{"path": p, "summary": s} for p, s in run.summaries],
        "leftovers": run.leftovers,
        "results": [r.to_dict() for r in run.results],
    }


def write_json(run: RunResults, path: str) -> None:
    """The report as JSON at `path`, whole or not at all (a temporary file beside it, fsynced, renamed)."""
    write_json_atomic(path, to_json(run), indent=1)


def load_results(path: str) -> list[CaseResult]:
    with open(path) as f:
        return [CaseResult.from_dict(d) for d in json.load(f)["results"]]


def rate(r: CaseResult) -> str:
    """The figure that matters for the row's pattern."""
    if r.verdict in ("hung", "error"):
        return r.verdict.upper()
    if r.pattern == "metadata":
        return f"{r.iops:,.0f} ops/s"
    if r.pattern in ("replay", "train"):
        text = f"{r.extra.get('samples_s', 0):,.0f} smp/s {r.extra.get('tokens_s', 0) / 1e6:,.2f} Mtok/s"
        if "utilization" in r.extra:
            text += f" AU {r.extra['utilization']:.1%}"  # one decimal: 89.6% must not read as 90%
        return text
    text = f"{r.mb_s:,.1f} MB/s"
    if r.pattern == "rand-read":
        text += f" {r.iops:,.0f} IOPS"
    if r.pattern == "checkpoint" and "model" in r.extra:  # MLPerf: means over the checkpoints
        return f"{r.mb_s:,.1f} MB/s min-rank, {r.seconds:.2f} s max-rank, x{r.extra['checkpoints']}"
    if r.pattern == "checkpoint" and r.phase == "write" and "durable_s" in r.extra:
        text += f" durable {r.extra['durable_s']:.2f} s"
    return text


def row_key(r: CaseResult) -> tuple:
    return (r.pattern, r.phase, r.block_size, r.procs, r.extra.get("accelerators", 0))


def short_names(paths: list[str]) -> list[str]:
    """Column labels for compared paths: what differs after their common directory (URLs stay whole)."""
    local = [p for p in paths if "://" not in p]
    common = os.path.commonpath(local) if len(local) > 1 else ""
    return [p if "://" in p or not common else os.path.relpath(p, common) for p in paths]


def table_rows(results: list[CaseResult]) -> tuple[list[str], list[list[str]]]:
    """Header and rows. One path: throughput, p50/p90/p99/max, stalls, cache. Several paths (--compare): the
    throughput and p99 of each path side by side."""
    paths = list(dict.fromkeys(r.path for r in results))
    by_key: dict[tuple, dict[str, CaseResult]] = {}
    for r in results:
        by_key.setdefault(row_key(r), {})[r.path] = r
    header = ["pattern", "phase", "bs", "procs"]
    if len(paths) == 1:
        header += ["throughput", "p50 ms", "p90 ms", "p99 ms", "max ms", "stalls", "cache"]
    else:
        for name in short_names(paths):
            header += [name, f"{name} p99 ms"]
    rows = []
    for per_path in by_key.values():
        first = next(iter(per_path.values()))
        procs = f"{first.procs}x{first.ranks}" if first.ranks > 1 else str(first.procs)
        if "accelerators" in first.extra:
            procs = f"{first.extra['accelerators']} acc"
        sized = first.pattern in ("seq-read", "seq-write", "rand-read")
        line = [first.pattern, first.phase, human_bytes(first.block_size) if sized else "-", procs]
        if len(paths) == 1:
            lat = first.latency_ms
            line += [rate(first)] + [f"{lat[k]:.3f}" if k in lat else "-" for k in ("p50", "p90", "p99", "max")]
            line += [str(first.stalls), first.cache]
        else:
            for p in paths:
                r = per_path.get(p)
                line += [rate(r), f"{r.latency_ms['p99']:.3f}" if "p99" in r.latency_ms else "-"] if r else ["", ""]
        rows.append(line)
    return header, rows


def print_table(run: RunResults, console=None) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    header, rows = table_rows(run.results)
    table = Table(title="corpusforge bench-io", title_justify="left")
    for h in header:
        table.add_column(h, justify="right" if h.endswith("ms") or h == "stalls" else "left")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for info in run.paths:
        console.print(f"{info.path}: {info.fs}, O_DIRECT {info.direct_note}" + "".join(f"; {n}" for n in info.notes))
    for path, summary in run.summaries:
        console.print(f"{path}: train emulation: {summary}")
    for left in run.leftovers:
        console.print(f"left behind (storage not answering): {left}")


def _throughput_panel(ax, results: list[CaseResult]) -> None:
    """MB/s against block size (a block-size sweep) or process count, one line per path and pattern."""
    series: dict[tuple, list[CaseResult]] = {}
    for r in results:
        if r.verdict in ("ok", "stalls") and r.pattern in ("seq-read", "seq-write", "rand-read"):
            series.setdefault((r.path, r.pattern), []).append(r)
    sweep_bs = len({r.block_size for r in results if r.pattern in ("seq-read", "seq-write")}) > 1
    for (path, pattern), rows in series.items():
        x = [r.block_size / 1024 if sweep_bs else r.procs * r.ranks for r in rows]
        order = np.argsort(x)
        ax.plot(np.array(x)[order], np.array([r.mb_s for r in rows])[order], marker="o", label=f"{pattern} {path}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (KiB)" if sweep_bs else "processes")
    ax.set_ylabel("MB/s")
    ax.set_title("throughput")
    ax.legend(fontsize=7)


def _accelerator_panel(ax, trains: list[CaseResult], target: float) -> None:
    """Train emulation: accelerator utilisation against emulated accelerators, per path, with the target line and
    the largest count that met it (MLPerf Storage's answer to "how many GPUs does this path feed")."""
    paths = list(dict.fromkeys(r.path for r in trains))
    for path in paths:
        rows = sorted((r for r in trains if r.path == path), key=lambda r: r.extra["accelerators"])
        n = np.array([r.extra["accelerators"] for r in rows])
        au = np.array([r.extra["utilization"] for r in rows]) * 100
        (line,) = ax.plot(n, au, marker="o", label=path if len(paths) > 1 else "mean over accelerators")
        low = np.array([r.extra.get("utilization_min", r.extra["utilization"]) for r in rows]) * 100
        ax.fill_between(n, low, au, color=line.get_color(), alpha=0.15)  # the slowest accelerator's AU below
        fed = rows[0].extra.get("fed_accelerators", 0)
        if fed:
            ax.axvline(fed, color=line.get_color(), linestyle=":")
            last = fed == n.max()  # the label goes inside the axes, to the left of a line at the right edge
            ax.annotate(
                f"N = {fed}",
                (fed, target * 100),
                textcoords="offset points",
                xytext=(-4 if last else 4, -14),
                ha="right" if last else "left",
                color=line.get_color(),
            )
    ax.axhline(target * 100, color="red", linestyle="--", label=f"target {target:.0%}")
    ax.set_xscale("log", base=2)
    counts = sorted({r.extra["accelerators"] for r in trains})
    ax.set_xticks(counts, [str(k) for k in counts])  # 1, 2, 4, 6, 8 rather than 2^0, 2^1 ...
    ax.minorticks_off()
    ax.set_ylim(0, 105)
    ax.set_xlabel("emulated accelerators")
    ax.set_ylabel("accelerator utilisation (%)")
    ax.set_title("training emulation: accelerators fed")
    ax.legend(fontsize=7)


def _latency_panel(ax, results: list[CaseResult]) -> None:
    for r in results:
        if r.latencies is not None and len(r.latencies):
            lat = np.sort(r.latencies) * 1e3
            size = f" {human_bytes(r.block_size)}" if r.pattern in ("seq-read", "seq-write", "rand-read") else ""
            label = f"{r.pattern}/{r.phase}{size} x{r.procs * r.ranks} {r.path}"
            ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of operations")
    ax.set_title("latency CDF")
    if ax.get_legend_handles_labels()[0]:  # rows loaded from JSON carry no latencies
        ax.legend(fontsize=6)


def plot(results: list[CaseResult], out: str, target_utilization: float = 0.9) -> None:
    """A PNG for people: throughput against block size (or process count) when seq/rand patterns ran, accelerator
    utilisation against accelerators when train ran, and the latency CDF of every row.

    >>> plot(run.results, "bench.png", run.config.target_utilization)
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtraError("--plot needs matplotlib: pip install 'corpusforge[bench]'") from None
    ok = [r for r in results if r.verdict in ("ok", "stalls")]
    trains = [r for r in ok if r.pattern == "train" and "utilization" in r.extra]
    panels = []
    if any(r.pattern in ("seq-read", "seq-write", "rand-read") for r in ok) or not trains:
        panels.append(lambda ax: _throughput_panel(ax, results))
    if trains:
        panels.append(lambda ax: _accelerator_panel(ax, trains, target_utilization))
    panels.append(lambda ax: _latency_panel(ax, results))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for draw, ax in zip(panels, axes[0]):
        draw(ax)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
