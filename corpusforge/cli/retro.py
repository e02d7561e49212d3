"""`corpusforge build-knn` and `query-knn`: a RETRO retrieval database from a token dataset, and a look inside it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from corpusforge.cli import _report
from corpusforge.cli.config_options import Opt, config_options, executor_opts
from corpusforge.cli.types import COUNT, Size
from corpusforge.retro.config import BuildConfig

# what each stage's bar counts
_UNITS = {"chunks": "chunks", "embedding": "chunks", "index": "vectors", "recall": "settings", "neighbours": "chunks"}


# How build-knn writes BuildConfig's fields where it differs from their name and type; help from their docstrings.
BUILD_OPTIONS = config_options(
    BuildConfig,
    Opt("output", help="Database directory (created if missing)."),
    Opt("chunk_length", type=click.IntRange(1, 32767)),
    Opt("dim", type=COUNT),
    Opt("tokenizer", help="Tokenizer of the dataset [default: from PREFIX.preprocess.json]."),
    Opt("max_index_memory", type=Size(minimum=1, as_text=True)),
    Opt("train_per_list", type=click.IntRange(39, 256)),
    Opt("kmeans", choices=("auto", "flat", "two-level")),
    Opt("shard_size", type=COUNT),
    Opt("k", ("-k", "--neighbours-k"), type=COUNT),
    Opt("candidates", type=COUNT),
    Opt("query_prefix", help="Training dataset to fetch neighbours for [default: PREFIX itself]."),
    Opt("recall_queries", type=COUNT),
    Opt("recall_target", type=click.FloatRange(0, 1)),
    Opt("seed", type=click.IntRange(min=0)),
    Opt("gpu", choices=("auto", "on", "off"),
        help="Run the index's k-means and list assignment on the GPUs faiss-gpu sees (auto: when there are any)."),
    Opt("index_on_disk", "--index-on-disk/--index-in-ram",
        help="Merge an IVF index's lists into index/index.ivfdata (searched memory-mapped) [default: when the "
        "planned index needs more than half of this machine's RAM]."),
    *executor_opts("Shard tasks (chunking, embedding, index add, neighbours)"),
    exclude=("prefix",),
)  # fmt: skip


@click.command("build-knn", cls=_report.Command)
@click.argument("prefix")
@BUILD_OPTIONS
@click.option(
    "--resume",
    is_flag=True,
    help="Finish an interrupted build in --output: same data; an option may change until the stage it shapes has "
    "begun (--max-index-memory before the index is trained, -k before the neighbours stage).",
)
@click.option("--dry-run", is_flag=True, help="Print the plan (index key, RAM, disk, time) and write nothing.")
@click.option("--progress/--no-progress", default=None, help="Progress bars [default: on a terminal].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def build_knn_cmd(prefix, resume, dry_run, progress, as_json, **options) -> None:
    """Build a retrieval database: chunks, embeddings, Faiss index, recall@10, neighbours; every stage resumable."""
    from corpusforge.retro import build_knn
    from corpusforge.sizes import human_bytes

    if options["ray_address"] and options["executor"] != "ray":
        raise click.UsageError("--ray-address needs --executor ray")
    config = BuildConfig(prefix=prefix, **options)
    with stage_progress(_report.show_progress(progress) and not dry_run) as on_stage:
        result = build_knn(config, dry_run=dry_run, resume=resume, progress=on_stage)
    data = result.to_dict()
    if dry_run:
        est = result.estimates
        rows = [("chunks", est["chunks"]), *_plan_rows(result.plan)]
        rows += [(f"disk: {k}", human_bytes(v)) for k, v in est["disk_bytes"].items()]
        rows += [(f"hours on 2 cores: {k}", _hours(v)) for k, v in est["hours_2_cores"].items()]
        _report.print_summary(f"corpusforge build-knn --dry-run {prefix}", rows, data if as_json else None)
        return
    st, rec = result.stages, result.recall
    rows = [
        ("output", config.output),
        ("chunks", st["chunks"]["chunks"]),
        *_plan_rows(result.plan),
        ("embeddings", f"{st['embeddings']['dim']}-d float16, {st['embeddings']['shards']} shard(s)"),
        ("train / add", f"{st['index']['train_s']:,.1f} s / {st['index']['add_s']:,.1f} s" + _tasks(st["index"])),
        (
            "recall@10",
            f"{rec['recall@10']:.4f} (without re-ranking {rec['recall_without_rerank']:.4f}), "
            f"{rec['queries']} chunks, {rec.get('held_out', rec['queries'])} of them held out from training",
        ),
        ("search", f"{rec['search_params']}, {rec['candidates']} candidates, {rec['qps']:,} queries/s"),
        (
            "embedding",
            f"{st['embeddings']['chunks_per_s'] or 0:,} chunks/s on {st['embeddings'].get('workers', 1)} "
            f"{st['embeddings'].get('executor', 'local')} worker(s)",
        ),
    ]
    if "neighbours" in st:
        rows.append(
            (
                "neighbours",
                f"{st['neighbours']['queries']:,} x {st['neighbours']['k']} in {st['neighbours']['seconds']:,.1f} s"
                + _tasks(st["neighbours"]),
            )
        )
    _report.print_summary(f"corpusforge build-knn {prefix}", rows, data if as_json else None)


@contextmanager
def stage_progress(enabled: bool) -> Iterator[Callable[[str, int], Callable[[int], None]] | None]:
    """What build_knn's `progress` wants: `on_stage(name, total)` → `advance(n)`. A bar per stage with its rate and
    ETA on a terminal; with --progress into a file (a Slurm log), a line per 10 s and one when a stage ends. The
    bar's thread starts at the first event, so local workers forked before it inherit no thread."""
    if not enabled:
        yield None
        return
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    terminal = _report.err_console.is_terminal
    columns = (
        TextColumn("[bold]{task.description:<10}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    bar = Progress(*columns, console=_report.err_console)

    def on_stage(name: str, total: int) -> Callable[[int], None]:
        task = bar.add_task(name, total=total, rate="")
        logged = [time.monotonic()]

        def advance(n: int) -> None:
            if terminal and not bar.live.is_started:
                bar.start()
            bar.advance(task, n)
            state = next(t for t in bar.tasks if t.id == task)
            rate = f"{state.completed / (state.elapsed or 1e-9):,.0f} {_UNITS.get(name, 'items')}/s"
            bar.update(task, rate=rate)
            done = state.total is not None and state.completed >= state.total
            if not terminal and (done or time.monotonic() - logged[0] >= 10):
                logged[0] = time.monotonic()
                share = f"{state.completed / state.total:.0%}" if state.total else "?"
                click.echo(f"corpusforge build-knn: {name} {share}  {rate}  {state.elapsed or 0:,.0f} s", err=True)

        return advance

    try:
        yield on_stage
    finally:
        bar.stop()


def _tasks(stats: dict) -> str:
    """' (4 task(s) on 2 local worker(s))', or nothing for a stage recorded before it ran as tasks."""
    if "workers" not in stats:
        return ""
    tasks = stats.get("add_tasks", stats.get("tasks"))
    if stats.get("gpus"):  # add tasks assigning on GPUs, one after another in the process that holds them
        return f" ({tasks} task(s) in this process, on {stats['gpus']} GPU(s))"
    if stats["executor"] == "driver":  # an HNSW graph (which cannot be merged), or a model embedding queries
        return " (one task, in this process)"
    return f" ({tasks} task(s) on {stats['workers']} {stats['executor']} worker(s))"


def _hours(value) -> str:
    """A figure, or a [low, high] range (the neighbours stage: see retro.index.neighbour_seconds)."""
    low, high = value if isinstance(value, list) else (value, value)
    figure = lambda h: f"{h:,.0f}" if h >= 100 else f"{h:.3g}"  # noqa: E731
    return figure(low) if figure(low) == figure(high) else f"{figure(low)} to {figure(high)}"


def _plan_rows(plan: dict) -> list[tuple[str, object]]:
    from corpusforge.sizes import human_bytes

    kmeans = [("k-means", plan["kmeans"])] if plan.get("kmeans") else []
    return [("index", plan["key"]), *kmeans, ("index RAM (est.)", human_bytes(plan["ram_bytes"]))]


@click.command("query-knn", cls=_report.Command)
@click.argument("db")
@click.argument("text")
@click.option("-k", default=5, show_default=True, type=COUNT, help="Nearest chunks per query chunk.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
def query_knn_cmd(db, text, k, as_json) -> None:
    """Show the database chunks nearest to TEXT (tokenised and chunked like the database), as text."""
    import json

    from corpusforge.retro import query_knn

    results = query_knn(db, text, k=k)
    if as_json:
        click.echo(json.dumps(results, indent=1, ensure_ascii=False))
        return
    for r in results:
        if r["rank"] == 0:
            click.echo(click.style(f"query chunk {r['query_chunk']}: {r['query_text'][:100]!r}", bold=True))
        click.echo(f"  {r['rank'] + 1}. score {r['score']:.4f}  chunk {r['chunk']}  document {r['document']}")
        click.echo("     " + r["text"].replace("\n", " ")[:300])
