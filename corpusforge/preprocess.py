"""read → tokenize → write shards → merge: turn text corpora into Megatron token datasets, resumably.

The input is cut into tasks (see `sources`); each task is tokenized by a worker process into its own part,
`{prefix}.parts/part-NNNNN_{key}_document.bin/.idx`, finished atomically and then marked done by
`part-NNNNN.done.json` (its statistics). A part's place in the whole dataset is the sum of the sizes of the parts
before it, so as soon as those are done it is copied straight there (`{prefix}.parts/all_{key}_document.bin`),
several at once, while the other tasks tokenize (by threads here, or by the nodes of a multi-node Ray cluster);
at the end the .idx is built from the parts' lengths and both files are fsynced once. Then the commit (see
`_commit`): a record of what to rename, the renames to `{prefix}_{key}_document.bin/.idx`, the resolved
configuration and statistics to `{prefix}.preprocess.json`, and the parts directory is removed.

A killed run leaves finished parts, and the final names hold the old pair, the new pair or a .bin without an
.idx (which readers refuse), never a mismatched pair; `resume=True` finishes an interrupted commit from its record,
or checks that the parts were made from the same inputs, keys and tokenizer (the manifest) and tokenizes only
the missing tasks. Because the output is the concatenation of per-task results, it is byte-identical for any
number of workers, on either executor (`corpusforge.executors`: local processes, or Ray across machines that
share a file system), and whether or not the run was interrupted.

Inputs that are cut short (.gz/.zst) or damaged fail the run whatever `on_bad_line` says; an input named twice
is read once, and it and an input without records are reported in `PreprocessStats.warnings`; a run whose inputs
hold no document at all fails rather than write an empty dataset.

Example:
    >>> stats = preprocess(PreprocessConfig(inputs=("corpus.jsonl",), output_prefix="out/corpus"))
    >>> stats.documents, stats.tokens, stats.outputs
    (1000, 512345, ['out/corpus_text_document'])
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path

import numpy as np

from corpusforge import indexed, sources
from corpusforge.errors import CorpusforgeError, first_line
from corpusforge.executors import Executor, TaskContext, make_executor
from corpusforge.fsutil import TMP_SUFFIX, check_writable, remove_leftovers, write_json_atomic
from corpusforge.stages import TaskRun, run_tasks
from corpusforge.tokenizers import Tokenizer, load_tokenizer

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class PreprocessConfig:
    """Everything that decides what `preprocess` writes; the CLI options are bound to these fields."""

    inputs: tuple[str, ...]
    """Input files, directories or globs (.jsonl/.json/.ndjson, .gz/.zst of those, .parquet, HF dataset dirs)."""
    output_prefix: str
    """Outputs are `{output_prefix}_{key}_document.bin/.idx`, as Megatron names them."""
    json_keys: tuple[str, ...] = ("text",)
    """Fields to tokenize; one output dataset per key. A record missing any of them is a bad record."""
    tokenizer: str | None = None
    """Encoding name (cl100k_base, o200k_base, gpt2), or a .tiktoken, tokenizer.json or sentencepiece .model path.
    None: cl100k_base, shipped offline."""
    engine: str = "auto"
    """'auto' (gigatoken where it supports the tokenizer), 'gigatoken', or 'reference' (the tokenizer's own library)."""
    append_eod: bool = True
    """Append the tokenizer's end-of-document token to every document, so documents stay apart when packed."""
    workers: int = 0
    """Worker processes; 0 means one per available core."""
    on_bad_line: str = "fail"
    """'fail': stop at the first bad record with file:line; 'skip': skip bad records, count them by kind. Either way
    a truncated or damaged file fails the run: what it lost are not records that can be counted."""
    resume: bool = False
    """Reuse the finished parts of an interrupted run with the same inputs, keys and tokenizer."""
    task_bytes: int = 0
    """Input bytes per task; 0 picks about eight tasks per worker, between 1 and 64 MiB."""
    executor: str = "local"
    """'local': worker processes on this machine; 'ray': Ray tasks on a cluster (`pip install 'corpusforge[ray]'`),
    whose nodes all see the inputs and the output directory at the same paths."""
    ray_address: str | None = None
    """Ray cluster to join ('auto': the one `ray start` made on this node); None: a new one on this machine
    with `workers` CPUs (or every core)."""
    ray_keep_workers: float = 60.0
    """Idle seconds Ray's worker processes wait for the next job (corpusforge.executors.pool); 0 ends them with
    this one."""
    retries: int = 2
    """Times a task is run again when its worker process (or Ray node) dies; a task that raises is not retried."""
    merge_on_workers: bool | None = None
    level: str = "document"
    """The last word of the output names, `{prefix}_{key}_{level}`: Megatron writes "sentence" when it splits
    documents into sentences (corpusforge.megatron); "document" otherwise."""
    tokenizer_factory: Callable[[bool], Tokenizer] | None = None
    """Builds the tokenizer (given `threads`) instead of `load_tokenizer(tokenizer)`: a picklable, hashable callable
    (corpusforge.megatron's tokenizers with Megatron's semantics). A tokenizer with `encode_documents` may write
    several sequences, or none, per document (see `_add_segmented`)."""
    """Copy finished parts into the final .bin from the executor's nodes (each at its offset, in parallel) rather
    than from this process. None: when the executor spans more than one machine."""
    keep_empty: bool = False
    """An empty or whitespace-only text of a JSON line is a document for the tokenizer, not a bad record
    (Megatron's preprocess_data.py tokenizes it: corpusforge.megatron sets this)."""

    def output_prefixes(self) -> list[str]:
        return [f"{self.output_prefix}_{key}_{self.level}" for key in self.json_keys]


@dataclass
class Counts:
    """What was read and written: the counts a task, and a whole run, report. They add up with `+`; added in input
    order, `first_bad` is the input's first bad record.

    Example:
        >>> (Counts(documents=2, bad={"not_json": 1}) + Counts(documents=3, bad={"not_json": 2})).bad
        {'not_json': 3}
    """

    documents: int = 0
    tokens: int = 0
    input_bytes: int = 0
    records: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    """Bad records skipped, by kind (sources.BAD_KINDS)."""
    first_bad: str | None = None

    def __add__(self, other: Counts) -> Counts:
        return replace(
            self,
            documents=self.documents + other.documents,
            tokens=self.tokens + other.tokens,
            input_bytes=self.input_bytes + other.input_bytes,
            records=self.records + other.records,
            bad=dict(Counter(self.bad) + Counter(other.bad)),
            first_bad=self.first_bad or other.first_bad,
        )

    @classmethod
    def from_dict(cls, saved: dict) -> Counts:
        """Read back from JSON that `asdict` or `to_dict` wrote (derived fields and unknown keys dropped)."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})


@dataclass
class TaskStats(Counts):
    """One task's counts (or one batch's); its done marker, `part-NNNNN.done.json`, is `asdict` of them."""

    file_bytes: int = 0
    """Progress units: bytes of the input files as stored (compressed for .gz/.zst), for executors whose workers
    cannot stream progress."""

    def __add__(self, other: TaskStats) -> TaskStats:
        return replace(super().__add__(other), file_bytes=self.file_bytes + other.file_bytes)


@dataclass
class PreprocessStats(Counts):
    """What a run did, as data: its tasks' counts summed, and how it ran; `to_dict()` is the `--json` summary."""

    seconds: float = 0.0
    tasks: int = 0
    tasks_resumed: int = 0
    workers: int = 1
    executor: str = "local"
    dtype: str = ""
    tokenizer: str = ""
    engine: str = ""
    outputs: list[str] = field(default_factory=list)
    already_complete: bool = False
    warnings: list[str] = field(default_factory=list)
    """One line each: an input named twice (read once), an input with no records. The CLI prints them."""

    @property
    def bad_records(self) -> int:
        return sum(self.bad.values())

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(bad_records=self.bad_records, mb_per_s=round(self.mb_per_s, 3), tokens_per_s=round(self.tokens_per_s))
        d["seconds"] = round(self.seconds, 3)
        return d

    @classmethod
    def of_tasks(cls, total: Counts, **run) -> PreprocessStats:
        """The run's stats from the sum of its tasks' and what describes the run (`tasks`, `workers`, ...).

        Example: PreprocessStats.of_tasks(sum(task_stats, TaskStats()), tasks=len(task_stats)).documents -> 869"""
        bad = {kind: total.bad[kind] for kind in sources.BAD_KINDS if total.bad.get(kind)}  # the summary's order
        counts = {f.name: getattr(total, f.name) for f in fields(Counts)}
        return cls(**{**counts, "bad": bad}, **run)


@dataclass(frozen=True)
class Progress:
    """An increment of work, sent from workers to whoever watches (the CLI's progress bar).

    The first event of a run carries `planned_bytes`, the total in the unit of `file_bytes` (bytes of the
    input files; compressed bytes for .gz/.zst), `planned_tasks`, and what resumed parts had already done.
    Local workers send events as they read; on Ray each finished task sends one, with all its counts."""

    documents: int
    tokens: int
    file_bytes: int
    planned_bytes: int = 0
    tasks: int = 0
    """Tasks (shards) finished."""
    planned_tasks: int = 0


class PreprocessError(CorpusforgeError, RuntimeError):
    """A run that cannot go on; the message is one line naming the file and the fix."""


# ---------------------------------------------------------------------------------------------------------------
# the run


def preprocess(config: PreprocessConfig, on_progress: Callable[[Progress], None] | None = None) -> PreprocessStats:
    """Tokenize `config.inputs` into Megatron datasets; see the module docstring for the guarantees."""
    t0 = time.perf_counter()
    found = sources.find_inputs(config.inputs)
    _prepare_output(config)
    # Ray connects here, so that its workers start and load the tokenizer while this process loads its own;
    # the local executor starts nothing (its workers fork later, from a process that has started no thread).
    warm_up = partial(_warm_worker, config)
    executor = make_executor(
        config.executor, config.workers, config.ray_address, config.retries, warm_up, config.ray_keep_workers
    )
    with executor:
        return _preprocess(config, found, executor, on_progress, t0)


@dataclass(frozen=True)
class _TokenizerFacts:
    """What this process needs of the tokenizer when its workers tokenize: a warm Ray worker sends them."""

    name: str
    backend: str
    fingerprint: str
    vocab_size: int


def _warm_worker(config: PreprocessConfig) -> _TokenizerFacts:
    """Load the tokenizer a task of `config` will use (and its engine's lazy imports) in this worker process."""
    tokenizer = _tokenizer(config, threads=False)
    tokenizer.encode_batch(["warm up"])
    return _TokenizerFacts(tokenizer.name, tokenizer.backend, tokenizer.fingerprint, tokenizer.vocab_size)


def _preprocess(
    config: PreprocessConfig, found: sources.FoundInputs, executor: Executor, on_progress, t0: float
) -> PreprocessStats:
    # A Ray worker kept warm from the last job has the tokenizer loaded: its facts spare this process loading it
    # (0.2 s, serial). Otherwise load it here, and do what the engine does lazily on its first call (gigatoken
    # sets up its encoder state: 0.05 s) once, rather than in every forked worker; on this thread, so no thread
    # pool exists at the fork (the one extracting texts meanwhile, on the core the load leaves idle, has ended).
    tokenizer = executor.warm_result(timeout=0.05)
    if tokenizer is None:
        with _extracting_ahead(config, found.files, executor):
            tokenizer = _tokenizer(config, threads=False)
            tokenizer.encode_batch(["warm up"])
    workers = executor.workers
    files = found.files
    fingerprint = _fingerprint(config, files, tokenizer)
    summary_path = Path(f"{config.output_prefix}.preprocess.json")
    parts = Path(f"{config.output_prefix}.parts")
    _remove_debris(parts, summary_path)
    if config.resume:
        finished = _finish_commit(parts, fingerprint, t0)
        if finished is not None:
            return finished
        if _already_complete(config, summary_path, fingerprint):
            _remove_stale_parts(parts, fingerprint)  # a run killed after its commit, before its cleanup
            stats = PreprocessStats.from_dict(json.loads(summary_path.read_text())["stats"])
            stats.already_complete, stats.seconds = True, time.perf_counter() - t0
            return stats

    damaged: list[str] = []  # what a resume found damaged and does again, said as warnings
    tasks = _prepare_parts(config, parts, files, workers, fingerprint, damaged)
    dtype = indexed.best_dtype(tokenizer.vocab_size)
    done = {t.index: _read_done(parts, t.index, config.json_keys, damaged) for t in tasks}
    job = _Job(config, os.path.abspath(parts), np.dtype(dtype).str)
    if on_progress:
        resumed = [t for t in tasks if done[t.index] is not None]
        plan = Progress(0, 0, sum(t.size for t in resumed), sum(t.size for t in tasks), len(resumed), len(tasks))
        on_progress = _with_plan(on_progress, plan)
    merger = _PartMerger(config, parts, tasks, dtype, executor)
    try:
        for index in (i for i, r in done.items() if r is not None):
            merger.part_done(index)
        run = _run_tasks(job, tasks, done, executor, on_progress, merger)
        _check_not_empty(sum(run.results, TaskStats()), files)
        staged = merger.finish()
    except BaseException as e:
        merger.discard()
        reported = _failure(e, parts)
        if reported is e:
            raise
        raise reported from e

    stats = PreprocessStats.of_tasks(
        sum(run.results, TaskStats()),  # in task order: first_bad is the input's first bad record
        tasks=len(tasks),
        tasks_resumed=run.resumed,
        workers=workers,
        executor=executor.name,
        dtype=np.dtype(dtype).name,
        tokenizer=tokenizer.name,
        engine=tokenizer.backend,
        outputs=config.output_prefixes(),
        warnings=_input_warnings(found, run.results, tasks) + damaged,
    )
    stats.seconds = time.perf_counter() - t0
    summary = {"config": asdict(config), "fingerprint": fingerprint, "stats": stats.to_dict()}
    _commit(parts, _commit_record(staged, config, summary))
    return stats


def _prepare_output(config: PreprocessConfig) -> None:
    """Create the output directory (as mkdir -p), and refuse what would stop the run only at its end: a final
    name or the parts directory taken by something of another kind."""
    prefix = config.output_prefix
    if prefix.endswith(("/", os.sep)):
        raise PreprocessError(f"--output-prefix {prefix} names a directory; add a file name, e.g. {prefix}corpus")
    parent = Path(prefix).parent
    try:
        check_writable(prefix)  # a read-only or forbidden place: the OSError names the prefix given
    except (FileExistsError, NotADirectoryError):
        raise PreprocessError(
            f"output directory {parent}: a part of that path is a file; choose another path"
        ) from None
    finals = [path_of(p) for p in config.output_prefixes() for path_of in (indexed.bin_path, indexed.idx_path)]
    for path in [*finals, Path(f"{prefix}.preprocess.json")]:
        if path.exists() and not path.is_file():
            raise PreprocessError(f"{path} exists and is not a file; move it away or choose another --output-prefix")
    parts = Path(f"{prefix}.parts")
    if parts.exists() and not parts.is_dir():
        raise PreprocessError(
            f"{parts} exists and is not a directory (preprocess keeps its unfinished parts there); "
            "move it away or choose another --output-prefix"
        )


def _failure(error: BaseException, parts: Path) -> BaseException:
    """What a failed run leaves, and the error that says so.

    Bad input is fixed by changing the input (or --json-keys): that changes the fingerprint, so no part of this
    run could be reused and the parts directory goes. The one exception is a bad record: a rerun with
    `--on-bad-line skip --resume` reuses the finished parts (they hold no bad record, and skipping is not in the
    fingerprint), so they stay and the line says so. A full disk, a dead worker or an interrupt keep everything
    for --resume."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return PreprocessError(
            f"{parts}: {error.strerror.lower()} while writing tokens; finished parts are kept there: free space and "
            "rerun with --resume, or delete that directory"
        )
    if not isinstance(error, (sources.InputError, sources.BadRecordError, PreprocessError)):
        return error
    finished = len(list(parts.glob("part-*.done.json"))) if parts.is_dir() else 0
    if isinstance(error, sources.BadRecordError) and finished:
        return sources.BadRecordError(
            f"{error}; {'the finished part is' if finished == 1 else f'the {finished} finished parts are'} kept in "
            f"{parts} for a rerun with --on-bad-line skip --resume (a fixed input starts over)"
        )
    _remove_parts(parts)
    return error


def _check_not_empty(total: TaskStats, files: Sequence[Path]) -> None:
    """An empty dataset is never what was meant: refuse it before anything gets a final name."""
    if total.documents:
        return
    records, first_bad = total.records, total.first_bad
    shown = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    if records:
        raise PreprocessError(
            f"no documents: all {records} records of {shown} were bad and skipped (first: {first_bad}); fix the input"
        )
    raise PreprocessError(f"no documents: no input holds a record ({shown}: empty); check the input paths")


def _input_warnings(found: sources.FoundInputs, results: list[TaskStats], tasks: list) -> list[str]:
    warnings = [f"{again}: given more than once (as {first}); read once" for again, first in found.repeated]
    records: Counter = Counter()
    for task, result in zip(tasks, results):
        records[task.path] += result.records
    for path in found.files:
        if not records[os.fspath(path)]:
            warnings.append(f"{path}: no records (an empty input); it adds nothing to the dataset")
    return warnings


def _remove_parts(parts: Path) -> None:
    """Remove the parts directory once the outputs are final. A Ray worker process outlives its task and may
    still be writing a done marker in the background, so the directory is renamed away first: a late writer
    then fails on the old path instead of refilling it, and a retry catches one caught between rename and rmtree.
    """
    if not parts.is_dir():
        return
    doomed = parts.with_name(f"{parts.name}.removing-{os.getpid()}")
    os.replace(parts, doomed)
    for _ in range(5):
        shutil.rmtree(doomed, ignore_errors=True)
        if not doomed.exists():
            return
        time.sleep(0.2)


def _remove_debris(parts: Path, summary_path: Path) -> None:
    """What a killed run leaves outside its parts directory, of no use to anyone: `{parts}.removing-PID` (killed
    inside `_remove_parts`, when its outputs were final) and a summary's temporary file (killed writing it)."""
    for doomed in parts.parent.glob(f"{glob.escape(parts.name)}.removing-*"):
        shutil.rmtree(doomed, ignore_errors=True)
    remove_leftovers(summary_path.parent, f"{glob.escape(summary_path.name)}.*{TMP_SUFFIX}")


def _remove_stale_parts(parts: Path, fingerprint: dict) -> None:
    """Remove the parts of a finished run (a full copy of its tokens), not those of another, unfinished run."""
    manifest = parts / "manifest.json"
    if parts.is_dir() and (not manifest.is_file() or _read_json(manifest).get("fingerprint") == fingerprint):
        _remove_parts(parts)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}


# ---------------------------------------------------------------------------------------------------------------
# committing: from complete datasets in the parts directory to the final names
#
# The outputs are complete, fsynced pairs inside `{prefix}.parts/` before anything gets a final name (the part
# itself for a one-task input, the concatenation of the parts otherwise). Then `commit.json` records what to
# rename and the summary to write, and the commit runs: unlink the old summary; for each key, the pair's commit
# (indexed.publish_pair, as every writer of a pair: unlink the final .idx, rename the .bin, rename the .idx); write
# the summary; remove the parts directory. Each step can be done again, so a run killed at any point is finished by
# `--resume` from the record. The final .idx goes first and comes last: a reader finds the old pair, a .bin without
# an .idx (refused, naming the interrupted commit: indexed.require_pair), or the new pair; never a .bin beside an
# .idx that was not written with it. Between keys, one dataset may be new and the next still old: no summary
# exists then, so none vouches for the set.


def _commit_record(staged: list[Path], config: PreprocessConfig, summary: dict) -> dict:
    finals = config.output_prefixes()
    return {
        "fingerprint": summary["fingerprint"],
        "datasets": [[s.name, Path(f).name] for s, f in zip(staged, finals)],  # in the parts / the output dir
        "summary": summary,
    }


def _commit(parts: Path, record: dict) -> None:
    """Write the record, then give the staged datasets their final names (see above); idempotent."""
    record_path = parts / "commit.json"
    if not record_path.is_file():
        write_json_atomic(record_path, record)
    out_dir = parts.parent
    summary_path = out_dir / f"{parts.name.removesuffix('.parts')}.preprocess.json"
    summary_path.unlink(missing_ok=True)  # while keys are half old, half new, no summary vouches for them
    for staged, final in record["datasets"]:
        staged, final = parts / staged, out_dir / final
        if not indexed.idx_path(staged).exists():
            continue  # committed already: its .idx is the last step
        indexed.publish_pair(indexed.bin_path(staged), indexed.idx_path(staged), final)  # (repeatable)
    write_json_atomic(summary_path, record["summary"])  # (and fsyncs the directory)
    _remove_parts(parts)


def _finish_commit(parts: Path, fingerprint: dict, t0: float) -> PreprocessStats | None:
    """Finish the commit of a run killed while committing (its record is in the parts directory); its stats."""
    record_path = parts / "commit.json"
    if not record_path.is_file():
        return None
    record = _read_json(record_path)
    if record.get("fingerprint") != fingerprint:
        return None  # another run's: the manifest check refuses it in words
    _commit(parts, record)
    stats = PreprocessStats.from_dict(record["summary"]["stats"])
    stats.tasks_resumed, stats.seconds = stats.tasks, time.perf_counter() - t0
    return stats


# ---------------------------------------------------------------------------------------------------------------
# the manifest: what the parts were made from


def run_fingerprint(config: PreprocessConfig) -> dict:
    """What a finished run of `config` recorded as its `fingerprint` in `{prefix}.preprocess.json` (inputs with
    size and mtime, keys, tokenizer, EOD): equal means a rerun would write the same outputs. Loads the tokenizer.

    Example:
        >>> run_fingerprint(cfg) == json.loads(Path("out/c.preprocess.json").read_text())["fingerprint"]
        True
    """
    files = sources.find_inputs(config.inputs).files
    return _fingerprint(config, files, _tokenizer(config, threads=False))


def _fingerprint(config: PreprocessConfig, files: Sequence[Path], tokenizer: Tokenizer) -> dict:
    """What must match for finished parts to be reused: inputs (name, size, mtime), keys, tokenizer, EOD."""
    return {
        "version": MANIFEST_VERSION,
        "inputs": [[os.fspath(f.resolve()), *_stat(f)] for f in files],
        "json_keys": list(config.json_keys),
        "tokenizer": tokenizer.fingerprint,
        "append_eod": config.append_eod,
    }


def _stat(path: Path) -> list[int]:
    if path.is_dir():  # an HF dataset: its arrow files are the data
        files = sorted(path.glob("*.arrow"))
        return [sum(f.stat().st_size for f in files), max((f.stat().st_mtime_ns for f in files), default=0)]
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _already_complete(config: PreprocessConfig, summary_path: Path, fingerprint: dict) -> bool:
    if not summary_path.is_file():
        return False
    previous = json.loads(summary_path.read_text())
    return previous.get("fingerprint") == fingerprint and all(indexed.exists(p) for p in config.output_prefixes())


def _prepare_parts(
    config: PreprocessConfig, parts: Path, files, workers: int, fingerprint: dict, damaged: list[str]
) -> list:
    """Reuse the task plan of an interrupted run (resume), or start a fresh parts directory. A manifest that cannot
    be read (damaged on disk: it is written atomically) cannot say what its parts hold: the run starts over, and
    `damaged` says so."""
    manifest_path = parts / "manifest.json"
    saved = _read_manifest(manifest_path, damaged) if config.resume and manifest_path.is_file() else None
    if saved is not None:
        made_with, tasks = saved
        if made_with != fingerprint:
            differs = ", ".join(k for k in fingerprint if made_with.get(k) != fingerprint[k])
            raise PreprocessError(
                f"{parts}: the unfinished run was made with other {differs}; run without --resume to start over"
            )
        remove_leftovers(parts)  # a killed worker's unfinished part, or its done marker's temporary file
        return tasks
    if parts.exists():
        shutil.rmtree(parts)
    parts.mkdir()
    tasks = _plan_tasks(config, files, workers)
    write_json_atomic(manifest_path, {"fingerprint": fingerprint, "tasks": [t.to_dict() for t in tasks]})
    return tasks


def _plan_tasks(config: PreprocessConfig, files: Sequence[Path], workers: int) -> list:
    """The tasks of a fresh run: the same for the same inputs, configuration and worker count."""
    total = sum(_stat(f)[0] for f in files)
    # About eight tasks per worker: fewer leave a core idle while the last task runs; each costs two fsyncs.
    task_bytes = config.task_bytes or int(np.clip(total // (8 * workers), 1 << 20, 64 << 20))
    # The last `workers` tasks are cut smaller, so that no core idles long while another finishes a big last task.
    return sources.plan_tasks(files, task_bytes, taper=workers if not config.task_bytes else 0)


EXTRACT_AHEAD_MAX_FILES = 64


@contextlib.contextmanager
def _extracting_ahead(config: PreprocessConfig, files: Sequence[Path], executor: Executor) -> Iterator[None]:
    """Extract the first tasks' texts (sources.prefetch_blocks) on a thread while inside, then stop it and wait.

    Inside, this process loads the tokenizer: 0.1-0.15 s during which gigatoken holds the GIL and the other cores
    have nothing to do, since the workers fork only once it is loaded (they inherit it). The extraction is one
    call without the GIL, so it runs beside the load, and the forked workers find those texts ready (100 MB:
    0.06 s sooner of 0.76). Local runs of one JSON key over at most EXTRACT_AHEAD_MAX_FILES inputs (planning the
    tasks here, again, costs a stat and a few reads per file); a resumed run plans its tasks from its manifest.
    A plan that differs anyway only loses the work: blocks are matched by their byte range in the file.
    """
    local_one_key = executor.name == "local" and not config.resume and len(config.json_keys) == 1
    if not local_one_key or not files or len(files) > EXTRACT_AHEAD_MAX_FILES:
        yield
        return
    stop, scanning = bytearray(1), threading.Event()

    def extract() -> None:
        try:
            # The lowest priority: it only uses a core the load leaves idle. Where a core is busy with another job,
            # it would otherwise share the load's core and slow the load, which every worker waits for (one core
            # busy, 100 MB: 1.08 s a run at the same priority, 0.95 s at this one; quiet: 0.68 and 0.67 s).
            if sys.platform.startswith("linux"):  # a thread's id is a task id there: this thread only
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            tasks = _plan_tasks(config, files, executor.workers)
            sources.prefetch_blocks(tasks, config.json_keys[0], stop, before_scan=scanning.set)
        except Exception:  # noqa: BLE001 - an optimisation only: every task reads its input itself then
            sources.drop_prefetched()
        finally:
            scanning.set()

    thread = threading.Thread(target=extract, name="corpusforge-extract-ahead", daemon=True)
    thread.start()
    # The load holds the GIL for its whole length: the thread must be inside the scan, which has let go of the
    # GIL, before the load starts, or it would wait for the load to end.
    scanning.wait(timeout=0.05)
    try:
        yield
    finally:
        stop[0] = 1  # the scan ends after its current block: the workers must not wait for it
        thread.join()


def _read_manifest(path: Path, damaged: list[str]) -> tuple[dict, list] | None:
    """(the fingerprint, the tasks) an interrupted run recorded; None, said in `damaged`, where they cannot be read."""
    try:
        manifest = json.loads(path.read_text())
        made_with = dict(manifest["fingerprint"])
        return made_with, [sources.Task(**t) for t in manifest["tasks"]]
    except (ValueError, TypeError, KeyError) as e:
        damaged.append(f"{path}: damaged ({first_line(e)}); its finished parts cannot be trusted: started over")
        return None


def _read_done(parts: Path, index: int, keys: Sequence[str], damaged: list[str]) -> TaskStats | None:
    """A finished task's stats, from its done marker; None while it has none.

    A resume trusts a part only if its marker reads back and its datasets validate and hold what the marker
    counts: a part damaged on disk (a truncated or foreign file, a marker cut short) would otherwise stop the run
    with a verdict about a file the user never made, or worse, end up in the output. Its files are removed, the
    task runs again, and `damaged` says so (a warning of the run)."""
    marker = parts / f"part-{index:05d}.done.json"
    if not marker.is_file():
        return None
    prefixes = [parts / f"part-{index:05d}_{key}_document" for key in keys]
    try:
        try:
            stats = TaskStats.from_dict(json.loads(marker.read_text()))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{marker.name}: {first_line(e)}") from None
        _check_part(prefixes, stats)
        return stats
    except (ValueError, FileNotFoundError) as e:  # and IndexedFormatError, DatasetNotFoundError
        what = first_line(e).split("; ")[0]  # the fault, not the fix a dataset's reader suggests
        damaged.append(f"{parts / marker.name.removesuffix('.done.json')}: a finished part is damaged ({what}); "
                       "tokenized again")  # fmt: skip
    for path in [marker, *(f(p) for p in prefixes for f in (indexed.bin_path, indexed.idx_path))]:
        path.unlink(missing_ok=True)
    return None


def _check_part(prefixes: list[Path], stats: TaskStats) -> None:
    """Every dataset of a part validates and holds the documents and tokens its done marker counts."""
    tokens = 0
    for prefix in prefixes:
        ds = indexed.IndexedDataset(prefix)
        documents, tokens = ds.num_documents, tokens + ds.num_tokens
        ds.close()
        if documents != stats.documents:
            raise ValueError(f"{prefix.name} holds {documents} documents, its done marker counts {stats.documents}")
    if tokens != stats.tokens:
        raise ValueError(f"the part holds {tokens} tokens, its done marker counts {stats.tokens}")


# ---------------------------------------------------------------------------------------------------------------
# running tasks


@dataclass(frozen=True)
class _Job:
    """What a worker needs to run a task: picklable, small."""

    config: PreprocessConfig
    parts: str
    dtype: str


def _run_tasks(
    job: _Job, tasks: list, done: dict[int, TaskStats | None], executor: Executor, on_progress, merger: _PartMerger
) -> TaskRun[TaskStats]:
    """Run the tasks without a done marker on `executor`; place each part in the final files once the parts before
    it are done."""
    if executor.remote:  # tasks may run on other machines: name the inputs the same way on every node
        tasks = [replace(t, path=os.path.abspath(t.path)) for t in tasks]

    def task_done(task, result: TaskStats) -> None:
        sources.drop_prefetched(upto=task.index)  # forked workers have their own copy of what was extracted ahead
        merger.part_done(task.index)  # parts are copied into place while the workers tokenize
        if on_progress:
            on_progress(_task_finished(result, streamed=executor.streams_progress))

    def finished(task) -> TaskStats | None:
        return done[task.index]

    try:
        return run_tasks(
            partial(_run_task, job), tasks, executor, finished=finished, progress=on_progress, on_result=task_done
        )
    finally:
        sources.drop_prefetched()
        _wait_for_syncs()  # an in-process run's fsyncs, before the parts directory can be removed


def _task_finished(result: TaskStats, streamed: bool) -> Progress:
    """The progress event for a finished task: one more shard, and its counts unless its worker streamed them."""
    if streamed:
        return Progress(0, 0, 0, tasks=1)
    return Progress(result.documents, result.tokens, result.file_bytes, tasks=1)


_tokenizer_cache: dict = {}


def _tokenizer(config: PreprocessConfig, threads: bool) -> Tokenizer:
    """Load once per process; forked workers find the parent's copy here."""
    # A file's size and mtime are in the key: a long-lived (Ray pool) worker must not keep a tokenizer that changed.
    key = (config.tokenizer, config.engine, threads, _stamp(config.tokenizer), config.tokenizer_factory)
    if key not in _tokenizer_cache:
        if config.tokenizer_factory is not None:
            _tokenizer_cache[key] = config.tokenizer_factory(threads)
        else:
            _tokenizer_cache[key] = load_tokenizer(config.tokenizer, engine=config.engine, threads=threads)
    return _tokenizer_cache[key]


def _stamp(spec: str | None) -> tuple[int, int] | None:
    try:
        st = os.stat(spec)
    except (OSError, ValueError, TypeError):  # a named encoding (or the default: None), not a path
        return None
    return st.st_size, st.st_mtime_ns


def _with_plan(on_progress: Callable[[Progress], None], plan: Progress) -> Callable[[Progress], None]:
    """Send the plan with the first real event: until then the watcher starts nothing (no thread before fork)."""
    sent = False

    def forward(update: Progress) -> None:
        nonlocal sent
        if not sent:
            sent = True
            on_progress(plan)
        on_progress(update)

    return forward


def _run_task(job: _Job, task, ctx: TaskContext) -> TaskStats:
    """Tokenize one task into its part files, then write its done marker; returns the task's statistics.

    Example (what an executor calls): _run_task(job, tasks[0], TaskContext(report=print)).documents -> 812
    """
    cfg, on_progress = job.config, ctx.report
    tokenizer = _tokenizer(cfg, threads=ctx.threads > 1)
    eod = tokenizer.eod_id if cfg.append_eod else None
    if cfg.append_eod and eod is None:
        raise PreprocessError(f"tokenizer {tokenizer.name} has no end-of-document token; pass --no-append-eod")
    prefix = Path(job.parts) / f"part-{task.index:05d}"
    writers = [indexed.IndexedDatasetWriter(f"{prefix}_{k}_document", job.dtype) for k in cfg.json_keys]
    stats = TaskStats()
    try:
        for batch in sources.read_task(task, cfg.json_keys, cfg.on_bad_line, cfg.keep_empty):
            tokens = 0
            for writer, texts in zip(writers, batch.texts):
                if hasattr(tokenizer, "encode_documents"):  # Megatron's semantics: sentences, empty documents
                    flat, lengths, counts = tokenizer.encode_documents(texts, eod)
                    _add_segmented(writer, flat, lengths, counts)
                else:
                    flat, lengths = tokenizer.encode_batch(texts)
                    if eod is not None:
                        flat, lengths = append_eod(flat, lengths, eod)
                    writer.add_documents(flat, lengths)
                tokens += len(flat)
            docs = len(batch.texts[0]) if batch.texts else 0
            read = dict(input_bytes=batch.input_bytes, records=batch.records, file_bytes=batch.file_bytes)
            stats += TaskStats(docs, tokens, bad=dict(batch.bad), first_bad=batch.first_bad, **read)
            if on_progress:
                on_progress(Progress(docs, tokens, batch.file_bytes))
        for writer in writers:
            writer.finalize(durable=False)
    except BaseException:
        for writer in writers:
            writer.discard()
        raise
    # The done marker promises a durable part, so it follows the fsyncs; those run on a thread while this
    # process tokenizes its next task (an fsync here left the core idle for a sixth of the run). The thread
    # outlives the task: local pools join it when their workers exit; Ray workers may not (see _remove_parts).
    _syncer().submit(_sync_and_mark, [w.prefix for w in writers], Path(f"{prefix}.done.json"), stats)
    _return_freed_memory()
    return stats


TRIM_ABOVE_BYTES = 48 << 20
"""A worker hands its heap's free memory back to the system only once this much of it is free (see below)."""

_glibc: object | bool | None = None  # the C library's malloc_trim and mallinfo2; False where there are none


def _return_freed_memory(keep: int = TRIM_ABOVE_BYTES) -> bool:
    """Hand the heap's free pages back to the system after a task, once more than `keep` bytes of it are free;
    whether it did. glibc keeps freed memory for reuse, and the blocks' buffers (4 MB of text, their tokens) come
    in changing sizes, so a worker's RSS kept growing with the tasks it ran: by 64 MB over a 400 MB input, and 8%
    more PSS at 10 GB than at 1 GB. A trim after every task fixed that, but every next task then faulted its
    buffers back in page by page (about 0.1 CPU-s of 1.8 over a 100 MB run); below `keep` the free memory is
    simply reused, so the heap stays bounded by `keep` plus one task's buffers, whatever the input size.

    Example: _return_freed_memory(keep=0) -> True (on glibc: trims whatever is free)"""
    global _glibc
    if _glibc is None:
        _glibc = _load_glibc()
    if not _glibc:
        return False
    if keep > 0 and _glibc.mallinfo2().fordblks <= keep:
        return False
    _glibc.malloc_trim(0)
    return True


def _load_glibc():
    """glibc's malloc_trim and mallinfo2 (2.33+); False elsewhere (musl, macOS): nothing to trim then."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                         "fordblks", "keepcost")
        ]  # fmt: skip

    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return False


_sync_pool: ThreadPoolExecutor | None = None


def _syncer() -> ThreadPoolExecutor:
    global _sync_pool
    if _sync_pool is None:
        _sync_pool = ThreadPoolExecutor(1, thread_name_prefix="corpusforge-fsync")
    return _sync_pool


def _wait_for_syncs() -> None:
    """Let every pending part fsync and done marker finish (in this process)."""
    global _sync_pool
    if _sync_pool is not None:
        _sync_pool.shutdown(wait=True)
        _sync_pool = None


def _sync_and_mark(prefixes: list[str], marker: Path, stats: TaskStats) -> None:
    for prefix in prefixes:
        indexed.sync(prefix)
    write_json_atomic(marker, asdict(stats))


def _add_segmented(writer: indexed.IndexedDatasetWriter, flat: np.ndarray, lengths: np.ndarray, counts) -> None:
    """Write documents of `counts[i]` sequences each (0: an empty document, as Megatron writes one); counts=None
    means one sequence per document, the common case, written without a loop.

    Example: _add_segmented(w, np.array([1, 2, 3]), np.array([2, 1]), np.array([2, 0])) -> 2 documents, 2 sequences
    """
    if counts is None:
        writer.add_documents(flat, lengths)
        return
    seq_starts = np.concatenate(([0], np.cumsum(counts)))
    tok_starts = np.concatenate(([0], np.cumsum(lengths)))
    for d in range(len(counts)):
        first, last = seq_starts[d], seq_starts[d + 1]
        writer.add_documents_with_sequences(flat[tok_starts[first] : tok_starts[last]], lengths[first:last])


def append_eod(flat: np.ndarray, lengths: np.ndarray, eod: int) -> tuple[np.ndarray, np.ndarray]:
    """Insert `eod` after every document of a flat batch, without a per-document loop.

    Example: append_eod(np.array([5, 6, 7]), np.array([2, 1]), 0) -> ([5, 6, 0, 7, 0], [3, 2])
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.empty(len(flat) + len(lengths), dtype=np.result_type(flat.dtype, np.min_scalar_type(eod)))
    ends = np.cumsum(lengths + 1) - 1
    is_token = np.ones(len(out), dtype=bool)
    is_token[ends] = False
    out[is_token] = flat
    out[ends] = eod
    return out, lengths + 1


# ---------------------------------------------------------------------------------------------------------------
# placing finished parts in the final files


class _PartMerger:
    """Places finished parts in the final datasets, in task order, while the workers tokenize.

    A part's offset in the final .bin is the sum of the sizes of the parts before it, known as soon as those are
    done; from then on it is copied straight to that offset, several parts at once (indexed.DatasetConcatenator),
    and the .idx is built from the parts' lengths at the end, with one fsync. On one machine the copies run on
    threads of this process. When the executor spans several machines, its nodes copy instead (each part from
    the next node in turn, fsynced there), so the copying bandwidth grows with the cluster rather than funnelling
    through this one process. Writes under temporary names; `finish()` renames, `discard()` removes."""

    def __init__(self, config: PreprocessConfig, parts: Path, tasks: list, dtype, executor: Executor) -> None:
        self.keys, self.parts = config.json_keys, Path(os.path.abspath(parts))  # absolute: other nodes may copy
        # The concatenation is staged in the parts directory; the commit (see above) gives it its final name.
        self.staged = [self.parts / f"all_{key}_document" for key in config.json_keys]
        self.order = [t.index for t in tasks]
        self.dtype, self.executor, self.on_workers = dtype, executor, config.merge_on_workers
        self.done: set[int] = set()
        self.next = 0
        self.concatenators: list[indexed.DatasetConcatenator] | None = None
        self.remote_copies: list[Future] = []

    def _part(self, index: int, key: str) -> Path:
        return self.parts / f"part-{index:05d}_{key}_document"

    def part_done(self, index: int) -> None:
        self.done.add(index)
        if len(self.order) == 1:
            return  # one part is already the whole dataset: finish() renames it, no copy
        while self.next < len(self.order) and self.order[self.next] in self.done:
            if self.concatenators is None:
                self._open()  # late: never before the local workers fork
            for key, cat in zip(self.keys, self.concatenators):
                placement = cat.add(self._part(self.order[self.next], key))
                if self.on_workers:
                    place = partial(indexed.place, dest=cat.bin_tmp, durable=True)
                    self.remote_copies.append(self.executor.submit(place, placement))
            self.next += 1
        for copy in self.remote_copies:  # a full disk on a node stops the run now, not at the end
            if copy.done() and copy.exception() is not None:
                raise copy.exception()

    def _open(self) -> None:
        if self.on_workers is None:
            self.on_workers = self.executor.nodes > 1
        streams = 0 if self.on_workers else indexed.MERGE_STREAMS
        self.concatenators = [indexed.DatasetConcatenator(f, self.dtype, streams) for f in self.staged]

    def finish(self) -> list[Path]:
        """The complete datasets, one per key, under their names in the parts directory, fsynced."""
        if len(self.order) == 1:
            return [self._part(self.order[0], key) for key in self.keys]  # durable: its done marker says so
        assert self.concatenators is not None and self.next == len(self.order), "finish() before every part was placed"
        for copy in self.remote_copies:
            copy.result()
        for cat in self.concatenators:
            cat.finalize()
        return self.staged

    def discard(self) -> None:
        wait(self.remote_copies, timeout=60)  # copies on other nodes end before their file is removed
        for cat in self.concatenators or []:
            cat.discard()
