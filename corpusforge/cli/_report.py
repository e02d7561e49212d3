"""How the CLI talks to people: progress on a terminal, one error line, a closing summary (or JSON)."""

from __future__ import annotations

import errno
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

# Errors the library raises on purpose: their message is already the one line a person needs.
EXIT_ERROR, EXIT_SKIPPED = 1, 3
err_console = Console(stderr=True, highlight=False)


def fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"corpusforge: error: {message}", err=True)
    sys.exit(code)


@contextmanager
def clear_errors(also: tuple[type[Exception], ...] = ()):
    """Turn the library's expected failures into one line and exit 1; anything else is a bug and shows a traceback.
    `also` adds exception types that a verb's library call raises only for bad arguments."""
    from corpusforge.indexed import IndexedFormatError
    from corpusforge.preprocess import PreprocessError
    from corpusforge.sources import BadRecordError, InputError
    from corpusforge.tokenizers import TokenizerError

    try:
        yield
    except (IndexedFormatError, PreprocessError, BadRecordError, InputError, TokenizerError, FileNotFoundError) as e:
        fail(str(e))
    except also as e:
        fail(str(e))
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            fail(f"{e.filename or 'output'}: no space left ({e.strerror}); free space or choose another output path")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fail(f"{e.filename}: {e.strerror}; choose a path you can write")
        raise
    except KeyboardInterrupt:
        fail("interrupted; finished parts are kept, rerun with --resume to continue", 130)


def show_progress(enabled: bool | None) -> bool:
    """Progress bars on a terminal by default, never in a pipe unless asked with --progress."""
    return sys.stderr.isatty() if enabled is None else enabled


@contextmanager
def task_progress(enabled: bool) -> Iterator[Callable | None]:
    """Progress over input bytes and tasks (shards), with docs/s, MB/s, tokens/s, ETA: a bar on a terminal; with
    --progress into a file (a Slurm log), a line per 10 s of shards finishing. Yields the consumer of preprocess's
    Progress events. No thread (rich's refresh) starts before the first event: the local workers fork before it."""
    if not enabled:
        yield None
        return
    terminal = err_console.is_terminal
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rates]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    bar = Progress(*columns, console=err_console, transient=True)
    # The clock starts now, not at the first event: on Ray that comes with the first finished shard, and the
    # rates are overall rates of the run.
    task = bar.add_task("tokenizing", total=None, rates="")
    counts = {"docs": 0, "tokens": 0, "tasks": 0, "planned_tasks": 0, "logged": 0.0}

    def advance(update) -> None:
        if terminal and not bar.live.is_started:
            bar.start()
        if update.planned_bytes:
            bar.update(task, total=update.planned_bytes)
            counts["planned_tasks"] = update.planned_tasks
        for key, n in (("docs", update.documents), ("tokens", update.tokens), ("tasks", update.tasks)):
            counts[key] += n
        bar.advance(task, update.file_bytes)
        state = bar.tasks[0]
        elapsed = state.elapsed or 1e-9
        rates = (
            f"{counts['tasks']}/{counts['planned_tasks']} shards  {counts['docs'] / elapsed:,.0f} docs/s  "
            f"{state.completed / elapsed / 1e6:,.1f} MB/s  {counts['tokens'] / elapsed:,.0f} tok/s"
        )
        bar.update(task, rates=rates)
        last = counts["tasks"] == counts["planned_tasks"] and update.tasks
        if not terminal and (last or (update.tasks and time.monotonic() - counts["logged"] >= 10)):
            counts["logged"] = time.monotonic()
            done = f"{state.completed / state.total:.0%}" if state.total else "?"
            click.echo(f"corpusforge preprocess: {done}  {rates}  {elapsed:,.0f} s", err=True)

    try:
        yield advance
    finally:
        bar.stop()


def print_summary(title: str, rows: list[tuple[str, object]], as_json: dict | None) -> None:
    """A one-screen summary on stdout, or the JSON object alone when `as_json` is given."""
    if as_json is not None:
        click.echo(json.dumps(as_json, indent=1))
        return
    console = Console(highlight=False)
    if title:
        console.print(f"[bold]{title}[/bold]")
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        if value is not None:  # an absent value (no problem found, say) is not worth a row
            table.add_row(name, _cell(value))
    console.print(table)


def _cell(value: object) -> str:
    if isinstance(value, bool):  # before int: bool is an int
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3f}"
    return str(value)
