"""How the CLI talks to people: progress on a terminal, one error line, one line per warning, a closing summary (or
JSON)."""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from corpusforge.errors import CorpusforgeError

EXIT_ERROR, EXIT_SKIPPED, EXIT_INTERRUPTED = 1, 3, 130
err_console = Console(stderr=True, highlight=False)

# What a Ctrl-C leaves, by command; the rest say only that they were interrupted.
_INTERRUPTED = {
    "preprocess": "interrupted; finished parts are kept, rerun with --resume to continue",
    "build-knn": "interrupted; finished stages and shards are kept, rerun with --resume to continue",
    "train": "interrupted; rerun the same command to resume from the latest checkpoint",
}


# Under torchrun, how long a rank other than 0 waits before exiting on an error: torchrun stops every rank as soon
# as one exits, and rank 0, which meets the same bad config or data within milliseconds, must live to print it
# (seen: 2 s were not enough for rank 0 to exit, with torch loaded, on a loaded 2-core machine). It costs nothing
# when rank 0 fails too: its exit ends the job.
PEER_EXIT_DELAY_S = 5.0


def fail(message: str, code: int = EXIT_ERROR) -> None:
    """Print `corpusforge: error: MESSAGE` as one line on stderr and exit with `code`.

    Under torchrun only rank 0 prints. Another rank waits PEER_EXIT_DELAY_S, then leaves the line in torchrun's
    error file and exits: when rank 0 met the same error it has printed it and exited by then, and torchrun has
    stopped this rank (its report says SIGTERM, not the message again); when the error was this rank's alone,
    torchrun's failure report shows it instead of a link to its docs."""
    line = " ".join(str(message).split())
    if is_rank_zero():
        click.echo(f"corpusforge: error: {line}", err=True)
    elif code != EXIT_INTERRUPTED:  # a Ctrl-C reaches every rank at once: nothing to wait for
        time.sleep(PEER_EXIT_DELAY_S)
        _tell_torchrun(line)
    sys.exit(code)


def _tell_torchrun(line: str) -> None:
    """Write torchelastic's per-rank error file (the format its ProcessFailure reads), where torchrun set one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:  # the report is a courtesy; the exit code carries the failure
        pass


def is_rank_zero() -> bool:
    """False only in a rank other than 0 of a torchrun job (RANK and WORLD_SIZE set, as the trainer reads them):
    every rank meets the same bad config or dataset, and one line says it, not one per rank."""
    rank, world = os.environ.get("RANK", "0").strip(), os.environ.get("WORLD_SIZE", "1").strip()
    return rank in ("", "0") or world in ("", "1")


@contextmanager
def one_line_errors(command: str = "") -> Iterator[None]:
    """The one handler at the top of every command: a CorpusforgeError (the user's problem, its message already
    the line a person needs), a missing file, a full disk, a path one cannot write or a Ctrl-C becomes one line
    and an exit code; anything else is a bug and keeps its traceback.

    Example:
        >>> with one_line_errors("preprocess"):
        ...     preprocess(config)      # InputError("x.parquet: not a parquet file ...") -> one line, exit 1
    """
    try:
        with one_line_warnings():
            yield
    except CorpusforgeError as e:
        fail(str(e), e.exit_code)
    except OSError as e:
        line = _os_error_line(e)
        if line is None:
            raise
        fail(line)
    except KeyboardInterrupt:
        fail(_INTERRUPTED.get(command, "interrupted"), EXIT_INTERRUPTED)


@contextmanager
def one_line_warnings() -> Iterator[None]:
    """While a command runs, corpusforge's own warnings (a category defined in the package: ShortSplitWarning, ...)
    print as one line on stderr, `corpusforge: warning: MESSAGE`, by rank 0 only (every rank meets the same data),
    instead of Python's `file:line: Category: message` and the source line under it. Other libraries' warnings
    keep Python's format. The filters decide as always whether a warning shows (once per place by default); a
    library user, outside any command, gets ordinary Python warnings to filter or record.

    Example:
        >>> with one_line_warnings():
        ...     warnings.warn("a_text_document: the valid split holds 12 tokens ...", ShortSplitWarning)
        corpusforge: warning: a_text_document: the valid split holds 12 tokens ...
    """
    with warnings.catch_warnings():  # restores Python's showwarning when the command ends
        python_format = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            if not category.__module__.startswith("corpusforge"):
                python_format(message, category, filename, lineno, file, line)
            elif is_rank_zero():
                click.echo(f"corpusforge: warning: {' '.join(str(message).split())}", err=True)

        warnings.showwarning = show
        yield


def _os_error_line(e: OSError) -> str | None:
    """One line for the OSErrors a user causes (a path that is missing, in the way, full or read-only), naming the
    path; None for the others, which are bugs or broken storage and keep their traceback."""
    # a rename names its source first; what is in the way (a directory where a file goes) is its target
    path = e.filename2 if e.errno in (errno.EISDIR, errno.EEXIST, errno.ENOTEMPTY) and e.filename2 else e.filename
    path = path if path is not None else "output"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{path}: no space left ({e.strerror}); free space or choose another output path"
    if e.errno == errno.EROFS:
        return f"{path}: {e.strerror}; choose a path you can write"
    if e.errno in (errno.EACCES, errno.EPERM):  # reading an input or writing an output
        return f"{path}: {e.strerror}; check its permissions or choose another path"
    if isinstance(e, FileNotFoundError):  # the library's own ones carry a message and no errno
        return f"{path}: no such file or directory" if e.filename is not None else str(e)
    if e.errno in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY):
        return f"{path}: {e.strerror}; move it out of the way or choose another path"
    return None


class Command(click.Command):
    """Every corpusforge command: one_line_errors on top of it, whichever way it is started (the group, `python -m
    corpusforge.train` under torchrun, a test's CliRunner or a script's `bench_io_cmd()`)."""

    def invoke(self, ctx: click.Context) -> object:
        with one_line_errors(self.name or ""):
            return super().invoke(ctx)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Under torchrun a usage error (exit 2) is shown by rank 0 alone, like the errors above."""
        try:
            return super().parse_args(ctx, args)
        except click.ClickException as e:
            if is_rank_zero():
                raise
            time.sleep(PEER_EXIT_DELAY_S)
            sys.exit(e.exit_code)


class Group(click.Group):
    """The `corpusforge` group: refuses a command that is not a `Command`, so none can lose the handler."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        if not isinstance(cmd, Command):
            raise TypeError(f"{cmd.name}: declare it with @click.command(..., cls=_report.Command)")
        super().add_command(cmd, name)


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
