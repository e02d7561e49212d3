"""How the CLI talks to people: progress on a terminal, one error line, a closing summary (or JSON)."""

from __future__ import annotations

import errno
import json
import sys
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
def byte_progress(enabled: bool) -> Iterator[Callable | None]:
    """A bar over input bytes with docs/s, MB/s, tokens/s and ETA; yields the callback that advances it
    (a consumer of corpusforge.preprocess.Progress events: the first one sets the total).

    The bar, and rich's refresh thread, start at the first event, so that the library can fork its workers
    before any thread exists."""
    if not enabled:
        yield None
        return
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
    task = bar.add_task("tokenizing", total=None, rates="", start=False)
    counts = {"docs": 0, "tokens": 0}

    def advance(update) -> None:
        if not bar.live.is_started:
            bar.start()
            bar.start_task(task)
        if update.planned_bytes:
            bar.update(task, total=update.planned_bytes)
        counts["docs"] += update.documents
        counts["tokens"] += update.tokens
        bar.advance(task, update.file_bytes)
        elapsed = bar.tasks[0].elapsed or 1e-9
        rates = (
            f"{counts['docs'] / elapsed:,.0f} docs/s  {bar.tasks[0].completed / elapsed / 1e6:,.1f} MB/s  "
            f"{counts['tokens'] / elapsed:,.0f} tok/s"
        )
        bar.update(task, rates=rates)

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
