"""Input records for preprocessing: find the input files, cut them into tasks, read a task's documents.

Formats: `.jsonl` / `.json` / `.ndjson` (one JSON object a line), the same compressed as `.gz` or `.zst`,
`.parquet` (FineWeb and most hub corpora), and a local Hugging Face dataset directory written by
`Dataset.save_to_disk`. A directory or glob expands to the supported files in it, sorted, so the document
order never depends on the file system.

A task is a slice of one input that a worker reads alone:

    plain JSON lines      a byte range, cut at line ends     (many tasks per file)
    .gz / .zst            the whole file                     (a compressed stream cannot be entered midway)
    parquet               a run of row groups
    HF dataset            a range of rows

The output is the tasks' concatenation in order, so how the input is cut never changes the bytes: the same
input gives the same bytes for any `--workers`. The last tasks of a run are cut smaller (`taper`): workers
take tasks in order, and a big task started last keeps one core busy while the others have nothing left.

Bad records are reported as `file:line: what is wrong` (a row number for parquet and HF datasets). Line
numbers of a byte-range task are counted from the start of the file only when an error needs one.

Example:
    >>> tasks = plan_tasks(expand_inputs(["corpus/"]), task_bytes=64 << 20)
    >>> for batch in read_task(tasks[0], keys=("text",), on_bad="skip"):
    ...     batch.texts[0][:2], batch.bad
"""

from __future__ import annotations

import glob
import gzip
import io
import mmap
import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from corpusforge.errors import CorpusforgeError, first_line
from corpusforge.jsonl_field import extract_blocks, extract_field

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")
PARQUET_SUFFIXES = (".parquet",)
BLOCK_BYTES = 4 << 20  # one read and one tokenizer batch; large enough to amortise per-call costs

# The kinds of bad record, in the order the summary lists them.
BAD_KINDS = ("malformed_json", "invalid_utf8", "missing_key", "not_string", "empty")


class InputError(CorpusforgeError, ValueError):
    """An input that cannot be used at all (missing, unsupported, wrong schema); one line, with the fix."""


class BadRecordError(CorpusforgeError, ValueError):
    """A bad record met with `--on-bad-line fail`; the message is `file:line: what is wrong (hint)`."""


# ---------------------------------------------------------------------------------------------------------------
# finding inputs


def input_format(path: Path) -> str | None:
    """'jsonl', 'jsonl.gz', 'jsonl.zst', 'parquet', 'hf' or None for a file corpusforge does not read."""
    if path.is_dir():
        # Either of save_to_disk's two files marks one (a damaged one too: then it is refused as damaged, rather than
        # its state.json read as JSON lines)
        return "hf" if (path / "state.json").is_file() or (path / "dataset_info.json").is_file() else None
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    for comp in COMPRESSED_SUFFIXES:
        if name.endswith(comp) and name[: -len(comp)].endswith(JSONL_SUFFIXES):
            return "jsonl.gz" if comp == ".gz" else "jsonl.zst"
    return "jsonl" if name.endswith(JSONL_SUFFIXES) else None


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Resolve files, directories and globs into the sorted list of readable inputs; refuse what is not there.
    A file named twice is read once (see `find_inputs`, which also says which were named twice).

    Example: expand_inputs(["data/*.jsonl.zst", "extra.parquet"])
    """
    return find_inputs(inputs).files


@dataclass(frozen=True)
class FoundInputs:
    """The inputs to read, in order, and the names that pointed again at one of them (and were dropped)."""

    files: list[Path]
    repeated: list[tuple[Path, Path]] = field(default_factory=list)
    """(the name given again, the earlier name of the same file): the same path twice, a symlink or hard link to
    it, or a file also inside a directory or glob given before."""


def find_inputs(inputs: Sequence[str | os.PathLike]) -> FoundInputs:
    """`expand_inputs`, saying which files were named more than once.

    Such a file is read once: tokenizing a file twice doubles its documents in the dataset, which is almost never
    meant (an overlapping glob, a directory and a file in it); a corpus repeated on purpose is a blend weight.

    Example: find_inputs(["data/", "data/a.jsonl"]).repeated -> [(Path("data/a.jsonl"), Path("data/a.jsonl"))]
    """
    found: list[Path] = []
    for item in inputs:
        text = os.fspath(item)
        if glob.has_magic(text):
            matches = sorted(Path(p) for p in glob.glob(text, recursive=True))
            paths = [p for p in matches if input_format(p)]
            if not paths:
                raise InputError(f"{text}: the pattern matches no .jsonl/.json(.gz|.zst)/.parquet file")
        else:
            paths = _expand_path(Path(text))
        found.extend(paths)
    first: dict[tuple[int, int], Path] = {}  # the file's identity (a symlink or hard link is the same file)
    unique, repeated = [], []
    for path in found:
        st = path.stat()
        key = (st.st_dev, st.st_ino)
        if key in first:
            repeated.append((path, first[key]))
        else:
            first[key] = path
            unique.append(path)
    if not unique:
        raise InputError("no input files given")
    return FoundInputs(unique, repeated)


def _expand_path(path: Path) -> list[Path]:
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    fmt = input_format(path)
    if fmt:
        return [path]
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = ", ".join(sorted(p.name for p in path.iterdir() if p.is_dir()))
            raise InputError(f"{path}: a Hugging Face DatasetDict; name one split directory ({splits})")
        files = sorted(p for p in path.rglob("*") if p.is_file() and input_format(p))
        if not files:
            raise InputError(f"{path}: the directory holds no .jsonl/.json(.gz|.zst)/.parquet file")
        return files
    raise InputError(
        f"{path}: unsupported input; use .jsonl/.json/.ndjson (optionally .gz or .zst), .parquet, "
        "or a Hugging Face dataset directory saved with save_to_disk"
    )


# ---------------------------------------------------------------------------------------------------------------
# planning tasks


@dataclass(frozen=True)
class Task:
    """One independent slice of one input. `start`/`stop` are bytes (jsonl), row groups (parquet) or rows (hf)."""

    index: int
    path: str
    format: str
    start: int
    stop: int
    first_row: int = 0  # rows before this task in its file (parquet, hf), for error messages
    size: int = 0  # bytes this task reads, roughly, for progress and ETA

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("index", "path", "format", "start", "stop", "first_row", "size")}


def plan_tasks(files: Sequence[Path], task_bytes: int = 64 << 20, taper: int = 0) -> list[Task]:
    """Cut the inputs into tasks of about `task_bytes` each (see the module docstring for the rules); with `taper`,
    the last `taper` tasks of plain JSON lines are cut into pieces that shrink towards the end (see _tapered)."""
    slices: list[tuple] = []
    for path in files:
        fmt = input_format(path)
        if fmt == "jsonl":
            slices += [(path, fmt, a, b, 0, b - a) for a, b in _line_aligned_ranges(path, task_bytes)]
        elif fmt in ("jsonl.gz", "jsonl.zst"):
            slices.append((path, fmt, 0, -1, 0, path.stat().st_size))
        elif fmt == "parquet":
            slices += [(path, fmt, *r) for r in _parquet_ranges(path, task_bytes)]
        elif fmt == "hf":
            slices += [(path, fmt, *r) for r in _hf_ranges(path, task_bytes)]
    slices = _tapered(slices, taper)
    return [Task(i, os.fspath(p), f, a, b, first, size) for i, (p, f, a, b, first, size) in enumerate(slices)]


TAPER_MIN_BYTES = 2 << 20  # smaller tasks are not cut further: each task costs two fsyncs and a merge step


def _tapered(slices: list[tuple], taper: int) -> list[tuple]:
    """Cut the last `taper` JSON-lines slices into pieces that shrink towards the end (at line ends).

    Each piece is a 1/(2 * taper) share of the tail still left after it (guided self-scheduling), so the work a
    worker may still hold when the others run out shrinks geometrically: on a machine where another job shares a
    core, the worker on that core runs at half speed, and a big last task there kept the whole run waiting.
    """
    if taper <= 0:
        return slices
    tail: list[tuple] = []
    for path, fmt, a, b, first, size in slices[-taper:]:  # one range where slices of a file follow each other
        if tail and fmt == "jsonl" and tail[-1][1] == fmt and tail[-1][0] == path and tail[-1][3] == a:
            tail[-1] = (path, fmt, tail[-1][2], b, first, b - tail[-1][2])
        else:
            tail.append((path, fmt, a, b, first, size))
    left = sum(size for _, fmt, _, _, _, size in tail if fmt == "jsonl")
    out = slices[: len(slices) - min(taper, len(slices))]
    for path, fmt, a, b, first, size in tail:
        if fmt != "jsonl" or size < TAPER_MIN_BYTES:
            out.append((path, fmt, a, b, first, size))
            left -= size if fmt == "jsonl" else 0
            continue
        with open(path, "rb") as f:
            while a < b:
                f.seek(a + max(TAPER_MIN_BYTES, left // (2 * taper)))
                f.readline()  # finish the line the cut fell into
                end = b if f.tell() >= b - TAPER_MIN_BYTES // 2 else f.tell()  # no crumb of a piece at the end
                out.append((path, fmt, a, end, first, end - a))
                left -= end - a
                a = end
    return out


def _line_aligned_ranges(path: Path, task_bytes: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
    """Byte ranges of about task_bytes covering [lo, hi) (hi: a line end, default the file's end), each ending
    just after a newline or at hi."""
    hi = path.stat().st_size if hi is None else hi
    cuts = [lo]
    with open(path, "rb") as f:
        while cuts[-1] + task_bytes < hi:
            f.seek(cuts[-1] + task_bytes)
            f.readline()  # finish the line the cut fell into
            if f.tell() >= hi:
                break
            cuts.append(f.tell())
    cuts.append(hi)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a] or [(lo, lo)]


def _parquet_ranges(path: Path, task_bytes: int) -> list[tuple[int, int, int, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except pa.ArrowInvalid as e:  # the one place a parquet file is first opened: wrong magic, a cut footer
        raise InputError(
            f"{path}: not a parquet file, or a damaged one (pyarrow: {first_line(e)}); "
            "re-download it, or name it after the format it holds"
        ) from None
    ranges, first_group, first_row, rows, nbytes = [], 0, 0, 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        rows += rg.num_rows
        nbytes += rg.total_byte_size
        if nbytes >= task_bytes or g == meta.num_row_groups - 1:
            ranges.append((first_group, g + 1, first_row, nbytes))
            first_group, first_row, rows, nbytes = g + 1, first_row + rows, 0, 0
    return ranges or [(0, 0, 0, 0)]


def _hf_ranges(path: Path, task_bytes: int) -> list[tuple[int, int, int, int]]:
    dataset = _load_hf(path)
    total = len(dataset)
    nbytes = sum(f.stat().st_size for f in path.glob("*.arrow")) or 1
    per_task = max(1, int(total * task_bytes / nbytes))
    return [
        (a, min(a + per_task, total), a, nbytes * (min(a + per_task, total) - a) // max(total, 1))
        for a in range(0, total, per_task)
    ] or [(0, 0, 0, 0)]


def _load_hf(path: Path):
    try:
        import datasets
    except ImportError:
        raise InputError(f"{path}: reading a Hugging Face dataset needs `pip install 'corpusforge[hf]'`") from None
    import pyarrow as pa

    try:
        return datasets.load_from_disk(os.fspath(path))
    except (pa.ArrowException, ValueError, OSError) as e:  # a cut or junk shard, a missing or garbled state.json
        raise _hf_damaged(path, e) from None


def _hf_damaged(path: str | Path, e: BaseException) -> BaseException:
    """The one line for a Hugging Face dataset directory that datasets/pyarrow cannot read. An I/O error (errno set,
    other than a missing file, which is the directory's own damage) is the disk's, not the dataset's: kept as it is."""
    if isinstance(e, OSError) and e.errno is not None and not isinstance(e, FileNotFoundError):
        return e
    return InputError(
        f"{path}: not a Hugging Face dataset saved with save_to_disk, or a damaged one ({first_line(e)}); "
        "re-save it with Dataset.save_to_disk (or re-download it)"
    )


# ---------------------------------------------------------------------------------------------------------------
# reading a task


@dataclass
class RecordBatch:
    """The good documents of one block of a task, one column of texts per key (aligned), and what was skipped.

    A column is a list of str, an Arrow string array when the block was read by a C++ reader, or JoinedTexts
    when by the JSON-lines extractor (the tokenizers read those buffers in place); `text_list()` gives str for
    any of them."""

    texts: list
    input_bytes: int
    records: int  # records read, good and bad
    file_bytes: int = 0  # bytes of the input file consumed (compressed, for .gz/.zst): the unit of progress
    bad: Counter = field(default_factory=Counter)
    first_bad: str | None = None  # the first skipped record's `file:line: problem`, for the summary


def read_task(task: Task, keys: Sequence[str], on_bad: str = "fail", keep_empty: bool = False) -> Iterator[RecordBatch]:
    """Yield the documents of `task` in order, in blocks; with on_bad='fail' raise BadRecordError on the first
    bad record, with 'skip' count it in the batch and go on. `keep_empty`: an empty or whitespace-only text of a
    JSON line is a document, not a bad record (Megatron's preprocess_data.py tokenizes it; corpusforge.megatron)."""
    if on_bad not in ("fail", "skip"):
        raise ValueError(f"on_bad must be 'fail' or 'skip', not {on_bad!r}")
    if task.format == "parquet":
        yield from _read_parquet(task, keys, on_bad)
    elif task.format == "hf":
        yield from _read_hf(task, keys, on_bad)
    else:
        yield from _read_jsonl(task, keys, on_bad, keep_empty)


def _open_stream(task: Task) -> tuple[io.BufferedIOBase, io.BufferedIOBase]:
    """(the decompressed stream, the raw file under it, whose position measures progress)."""
    raw = open(task.path, "rb")  # noqa: SIM115 - closed by the caller
    if task.format == "jsonl.gz":
        return _GzipStream(raw, task.path), raw
    if task.format == "jsonl.zst":
        return _ZstdStream(raw, task.path), raw
    raw.seek(task.start)
    return raw, raw


def _truncated(path: str, kind: str, where: str) -> InputError:
    return InputError(
        f"{path}: truncated {kind} stream (the file ends inside {where}), so the rest of its records are missing; "
        "re-download or re-compress the file"
    )


def _corrupt(path: str, kind: str, error: Exception) -> InputError:
    return InputError(f"{path}: corrupt {kind} stream ({first_line(error)}); re-download or re-compress the file")


class _ZstdStream(io.RawIOBase):
    """Every frame of a .zst file, in turn, decompressed; an error if the file ends inside a frame.

    zstandard's stream_reader returns what it has and stops when the file ends mid-frame, as if the file were
    complete (the issue-21 case: half a corpus, exit 0). Here each frame has its own decompressor, so the state at
    the end of the file is known: between frames is a complete file, inside one (header or data) is truncated.
    A file cut exactly between two frames is a valid shorter .zst: no reader can tell it from a complete one
    (`zstd -t` accepts it too). Skippable frames (pzstd's) decompress to nothing.

    Example: _ZstdStream(open("a.jsonl.zst", "rb"), "a.jsonl.zst").read(1 << 20)
    """

    READ_BYTES = 1 << 20  # compressed bytes per read of the file

    def __init__(self, raw: io.BufferedIOBase, path: str) -> None:
        import zstandard

        self._raw, self._path, self._zstd = raw, path, zstandard
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = None  # the decompressor of the frame being read; None between frames
        self._frames = 0  # frames finished
        self._pending, self._pos = b"", 0  # decompressed bytes, and how many of them were returned

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        parts, need = [], size
        while need:
            available = len(self._pending) - self._pos
            if available:
                take = available if need < 0 else min(need, available)
                parts.append(self._pending[self._pos : self._pos + take])
                self._pos += take
                need -= take
                continue
            chunk = self._raw.read(self.READ_BYTES)
            if not chunk:
                if self._frame is not None:
                    raise _truncated(self._path, "zstd", f"frame {self._frames + 1}")
                break
            self._pending, self._pos = self._decompress(chunk), 0
        return b"".join(parts)

    def _decompress(self, chunk: bytes) -> bytes:
        out = []
        while chunk:
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            try:
                out.append(self._frame.decompress(chunk))
            except self._zstd.ZstdError as e:
                raise _corrupt(self._path, "zstd", e) from e
            if not self._frame.eof:
                break
            chunk, self._frame = self._frame.unused_data, None
            self._frames += 1
        return b"".join(out)


class _GzipStream(io.RawIOBase):
    """A .gz file's members, decompressed, with one clear line for a truncated or corrupt file. Like gzip (and
    zstd, above), a file cut exactly between two members is a valid shorter file."""

    def __init__(self, raw: io.BufferedIOBase, path: str) -> None:
        self._gzip, self._path = gzip.GzipFile(fileobj=raw, mode="rb"), path

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        try:
            return self._gzip.read(size)
        except EOFError as e:  # "Compressed file ended before the end-of-stream marker was reached"
            raise _truncated(self._path, "gzip", "a member") from e
        except (OSError, zlib.error) as e:  # a bad header, CRC or length; damaged deflate data
            if isinstance(e, OSError) and e.errno is not None:
                raise  # the disk or the network failed, not the file's contents: no verdict on the file
            raise _corrupt(self._path, "gzip", e) from e


def _blocks(task: Task) -> Iterator[tuple[bytes | memoryview, int]]:
    """(a block of whole lines, raw file bytes consumed), about BLOCK_BYTES at a time. Plain files come as
    memoryviews of the mapped file: orjson parses the page cache in place, no read() copy."""
    return _mapped_blocks(task) if task.format == "jsonl" else _stream_blocks(task)


def _mapped_blocks(task: Task) -> Iterator[tuple[memoryview, int]]:
    if task.stop <= task.start:
        return
    with open(task.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm.madvise(mmap.MADV_SEQUENTIAL)
    view, pos = memoryview(mm), task.start
    while pos < task.stop:
        end = _block_end(mm, pos, task.stop)
        yield view[pos:end], end - pos
        # The block is consumed (its texts were copied out): unmap its pages from this process. They stay in the
        # page cache, but no longer count in the worker's RSS, which otherwise grew by the whole task (64 MB).
        _release(mm, pos, end)
        pos = end


def _block_end(mm: mmap.mmap, pos: int, stop: int) -> int:
    """Where the block of a task's range [pos, stop) that starts at `pos` ends: the last line end within
    BLOCK_BYTES, or the end of a longer line."""
    end = min(pos + BLOCK_BYTES, stop)
    cut = mm.rfind(b"\n", pos, end)
    if cut < 0 and end < stop:  # a line longer than a block: take it whole
        cut = mm.find(b"\n", end, stop)
    return stop if cut < 0 else cut + 1


# ---------------------------------------------------------------------------------------------------------------
# blocks extracted ahead (preprocess: while the parent loads the tokenizer, before its workers fork)

PREFETCH_BYTES = 128 << 20
"""At most this much input is extracted ahead: its texts are held in memory until a worker takes them."""

_prefetched: dict[int, tuple[str, str, dict]] = {}
"""task index -> (path, key, {(start, end): the fast path's result for that block, None where it declined})"""


def prefetch_blocks(
    tasks: Sequence[Task],
    key: str,
    stop: bytearray,
    budget: int = PREFETCH_BYTES,
    before_scan: Callable[[], object] | None = None,
) -> int:
    """Extract the blocks of the first plain-JSON-lines tasks (up to `budget` input bytes, from the first file's
    first task on) with the compiled extractor in one call without the GIL, so that it runs while another thread
    holds the GIL (preprocess: gigatoken loading the tokenizer, 0.1-0.15 s that would leave a core idle); it stops
    early once `stop[0]` is set, and `before_scan()` is called just before it starts. `read_task` of those tasks,
    in this process or in a worker forked from it, then takes their texts instead of extracting them again: the
    same batches, the same counts. Returns the input bytes it extracted (of whole tasks only).

    Example:
        >>> prefetch_blocks(plan_tasks([Path("corpus.jsonl")], 8 << 20), "text", bytearray(1))
        104857600
    """
    first = [t for t in tasks if t.format == "jsonl" and t.stop > t.start]
    first = [t for t in first if t.path == first[0].path] if first else []
    if not first:
        return 0
    with open(first[0].path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        spans: list[tuple[Task, int, int]] = []
        for task in first:
            pos = task.start
            while pos < task.stop:
                end = _block_end(mm, pos, task.stop)
                if end - pos > budget:  # the budget holds even for a block of one line longer than BLOCK_BYTES
                    break
                spans.append((task, pos, end))
                budget -= end - pos
                pos = end
            if pos < task.stop:  # a task is taken whole or not at all: its blocks come in order from one place
                spans = [span for span in spans if span[0] is not task]
                break
        if before_scan is not None:
            before_scan()
        found = extract_blocks(mm, key, [(a, b) for _, a, b in spans], stop) if spans else None
    finally:
        mm.close()
    if not found:
        return 0
    done: dict[int, dict] = {}
    for (task, a, b), result in zip(spans, found):
        done.setdefault(task.index, {})[(a, b)] = result
    extracted = 0
    for task in first:  # a scan stopped early leaves a task part-done: only whole tasks are kept
        blocks = done.get(task.index, {})
        if sum(b - a for a, b in blocks) == task.stop - task.start:
            _prefetched[task.index] = (task.path, key, blocks)
            extracted += task.stop - task.start
    return extracted


def drop_prefetched(upto: int | None = None) -> None:
    """Forget the blocks extracted ahead, of every task or of tasks up to index `upto` (preprocess's parent as
    tasks finish: forked workers have their own copy; a task run in this process has taken its own already)."""
    for index in [i for i in _prefetched if upto is None or i <= upto]:
        del _prefetched[index]


def _take_prefetched(task: Task, key: str) -> dict:
    """The blocks of `task` extracted ahead ({} if none), forgotten here; so are those of the tasks before it,
    which another worker took (tasks are handed out in order)."""
    drop_prefetched(upto=task.index - 1)
    path, prefetched_key, blocks = _prefetched.pop(task.index, (None, None, {}))
    return blocks if path == task.path and prefetched_key == key and task.format == "jsonl" else {}


def _release(mm: mmap.mmap, start: int, end: int) -> None:
    """MADV_DONTNEED on the whole pages of [start, end) of a read-only file mapping: a later read of them
    faults them back in from the page cache, so this can never lose data."""
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        mm.madvise(mmap.MADV_DONTNEED, first, last - first)


def _stream_blocks(task: Task) -> Iterator[tuple[bytes, int]]:
    remaining = task.stop - task.start if task.stop >= 0 else -1
    carry, pending = b"", 0
    stream, raw = _open_stream(task)
    position = raw.tell()
    with stream, raw:
        while remaining:
            want = BLOCK_BYTES if remaining < 0 else min(BLOCK_BYTES, remaining)
            data = stream.read(want)  # a truncated or corrupt .gz/.zst raises InputError, whatever --on-bad-line
            if not data:
                break
            if remaining > 0:
                remaining -= len(data)
            cut = data.rfind(b"\n") + 1
            pending, position = pending + raw.tell() - position, raw.tell()
            if cut == 0:  # no line ends in this read: keep collecting
                carry += data
                continue
            block, carry = carry + data[:cut], data[cut:]
            yield block, pending
            pending = 0
    if carry:
        yield carry, pending


def _split_lines(block: bytes | memoryview) -> list:
    """The lines of a block, without their newlines (a final newline ends the last line, adds no empty one)."""
    if isinstance(block, bytes):
        lines = block.split(b"\n")
        if lines and not lines[-1]:
            lines.pop()
        return lines
    lines, start, end = [], 0, len(block)
    data = np.frombuffer(block, np.uint8)
    for nl in np.flatnonzero(data == 10).tolist() + ([end] if end and data[-1] != 10 else []):
        lines.append(block[start:nl])
        start = nl + 1
    return lines


def _read_jsonl(task: Task, keys: Sequence[str], on_bad: str, keep_empty: bool = False) -> Iterator[RecordBatch]:
    # Measured here: Arrow's C++ JSON reader parses no faster than orjson, and gigatoken encodes Arrow buffers no
    # faster than str. A block of good records with one key is read by the compiled extractor (2-3x orjson, and
    # no str per document); any other block by the exact path, which finds, reports and skips bad records.
    first_line = 0
    ready = _take_prefetched(task, keys[0]) if len(keys) == 1 else {}
    pos = task.start
    for block, file_bytes in _blocks(task):
        span, pos = (pos, pos + file_bytes), pos + file_bytes  # plain JSON lines: the block's bytes in the file
        if span in ready:  # extracted ahead, before this worker forked (prefetch_blocks)
            extracted = ready.pop(span)
        else:
            extracted = extract_field(block, keys[0]) if len(keys) == 1 else None
        if extracted is not None:
            docs, lines, texts = extracted
            yield RecordBatch([texts], len(block), docs, file_bytes)
            first_line += lines
            continue
        lines = _split_lines(block)
        yield _parse_lines(task, lines, first_line, keys, on_bad, len(block), file_bytes, keep_empty)
        first_line += len(lines)


def _parse_lines(
    task: Task, lines: list, first_line: int, keys, on_bad: str, nbytes: int, file_bytes: int, keep_empty: bool = False
):
    """The exact path: orjson per line, every bad record classified and reported as file:line."""
    loads, JSONDecodeError = orjson.loads, orjson.JSONDecodeError
    only_key = keys[0] if len(keys) == 1 else None
    columns: list[list[str]] = [[] for _ in keys]
    append = columns[0].append
    batch = RecordBatch(columns, nbytes, len(lines), file_bytes)
    for offset, line in enumerate(lines):
        try:
            record = loads(line)
        except JSONDecodeError as e:
            if not line or bytes(line).isspace():  # blank lines (trailing newline, CRLF leftovers): no record
                batch.records -= 1
                continue
            _bad(task, first_line + offset, *_classify_json_error(line, e), on_bad, batch)
            continue
        if only_key is not None and type(record) is dict:
            text = record.get(only_key)
            if type(text) is str and text and not text.isspace():
                append(text)
                continue
        texts = _fields(record, keys, keep_empty)
        if isinstance(texts, tuple):
            _bad(task, first_line + offset, *texts, on_bad, batch)
            continue
        for column, text in zip(columns, texts):
            column.append(text)
    return batch


def _classify_json_error(line: bytes | memoryview, error: Exception) -> tuple[str, str]:
    try:
        bytes(line).decode("utf-8")
    except UnicodeDecodeError as e:
        return "invalid_utf8", f"invalid UTF-8 at byte {e.start} of the line"
    return "malformed_json", f"malformed JSON ({error})"


def _fields(record, keys: Sequence[str], keep_empty: bool = False) -> list[str] | tuple[str, str]:
    """The record's text for every key, or (kind, problem) for the first thing wrong with it."""
    if not isinstance(record, dict):
        return "malformed_json", f"expected a JSON object, found {type(record).__name__}"
    texts = []
    for key in keys:
        if key not in record:
            present = ", ".join(list(record)[:8])
            return "missing_key", f"no key {key!r} (keys present: {present}); choose one with --json-keys"
        text = record[key]
        if not isinstance(text, str):
            shown = "null" if text is None else type(text).__name__
            return "not_string", f"{key!r} is {shown}, not a string"
        if not keep_empty and not text.strip():
            return "empty", f"{key!r} is an empty document"
        texts.append(text)
    return texts


def _bad(task: Task, line_in_task: int, kind: str, problem: str, on_bad: str, batch: RecordBatch) -> None:
    if on_bad == "fail" or batch.first_bad is None:
        where = f"{task.path}:{_absolute_line(task, line_in_task)}"
        if on_bad == "fail":
            raise BadRecordError(f"{where}: {problem} (pass --on-bad-line skip to skip and count such records)")
        batch.first_bad = f"{where}: {problem}"
    batch.bad[kind] += 1


def _absolute_line(task: Task, line_in_task: int) -> int:
    """1-based line number in the file; counts the newlines before a byte-range task only when asked."""
    before = 0
    if task.format == "jsonl" and task.start > 0:
        with open(task.path, "rb") as f:
            left = task.start
            while left:
                chunk = f.read(min(BLOCK_BYTES, left))
                before += chunk.count(b"\n")
                left -= len(chunk)
    return before + line_in_task + 1


# -- columnar inputs ---------------------------------------------------------------------------------------------


def _read_parquet(task: Task, keys: Sequence[str], on_bad: str) -> Iterator[RecordBatch]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(task.path)
    _check_columns(task, pf.schema_arrow.names, keys)
    row = task.first_row
    groups = list(range(task.start, task.stop))
    if not groups:
        return
    batches = pf.iter_batches(batch_size=8192, row_groups=groups, columns=list(keys))
    while True:
        try:
            table = next(batches, None)
        except (pa.ArrowException, OSError) as e:  # a damaged page: the rows from it on are unreadable
            if isinstance(e, OSError) and e.errno is not None:
                raise  # an I/O error, not the file's contents
            raise InputError(
                f"{task.path}: a damaged parquet file (pyarrow: {first_line(e)}); re-download or re-write it"
            ) from None
        if table is None:
            return
        yield _columns_batch(task, keys, [table.column(k) for k in keys], row, on_bad)
        row += table.num_rows


def _read_hf(task: Task, keys: Sequence[str], on_bad: str) -> Iterator[RecordBatch]:
    dataset = _load_hf(Path(task.path))
    _check_columns(task, dataset.column_names, keys)
    table = dataset.select_columns(list(keys)).with_format("arrow")
    import pyarrow as pa

    for start in range(task.start, task.stop, 8192):
        try:
            part = table[start : min(start + 8192, task.stop)]
        except (pa.ArrowException, OSError) as e:  # a shard cut after its schema: the rows from it on are lost
            raise _hf_damaged(task.path, e) from None
        yield _columns_batch(task, keys, [part.column(k) for k in keys], start, on_bad)


def _check_columns(task: Task, names: Sequence[str], keys: Sequence[str]) -> None:
    for key in keys:
        if key not in names:
            raise InputError(
                f"{task.path}: no column {key!r} (columns: {', '.join(names)}); choose one with --json-keys"
            )


def _columns_batch(task: Task, keys: Sequence[str], columns: list, first_row: int, on_bad: str) -> RecordBatch:
    """Turn arrow columns into aligned text lists, checking types, nulls and emptiness without a Python loop."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(columns[0])
    good = pa.array([True] * n)
    problems: list[tuple[int, str, str]] = []
    for key, col in zip(keys, columns):
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            problems += [(i, "not_string", f"{key!r} is {col.type}, not a string") for i in range(n)]
            good = pa.array([False] * n)
            continue
        empty = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(pc.fill_null(col, ""))), 0)
        for mask, kind, what in (
            (pc.is_null(col), "not_string", "is null, not a string"),
            (empty, "empty", "is empty"),
        ):
            mask = pc.and_(mask, good)
            problems += [(i, kind, f"{key!r} {what}") for i in pc.indices_nonzero(mask).to_pylist()]
            good = pc.and_(good, pc.invert(mask))
    nbytes = int(sum(c.nbytes for c in columns))
    batch = RecordBatch([], nbytes, n, nbytes)
    for i, kind, what in sorted(problems):
        _bad_row(task, first_row + i, kind, what, on_bad, batch)
    batch.texts = [_valid_strings(task, pc.filter(col, good) if problems else col) for col in columns]
    return batch


def _valid_strings(task: Task, column):
    """One contiguous Arrow string array, its UTF-8 checked: parquet strings are not validated on read."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    try:
        column.validate(full=True)
    except pa.ArrowInvalid as e:
        raise InputError(f"{task.path}: a string column holds invalid UTF-8 ({e}); the file is corrupt") from e
    return column


def _bad_row(task: Task, row: int, kind: str, what: str, on_bad: str, batch: RecordBatch) -> None:
    where = f"{task.path}:row {row + 1}"
    if on_bad == "fail":
        raise BadRecordError(f"{where}: {what} (pass --on-bad-line skip to skip and count such records)")
    batch.bad[kind] += 1
    batch.first_bad = batch.first_bad or f"{where}: {what}"


def text_list(column) -> list[str]:
    """A column of a RecordBatch as a list of str (a list already, or an Arrow array or JoinedTexts)."""
    return column if isinstance(column, list) else column.to_pylist()


def iter_texts(
    files: Sequence[Path], keys: Sequence[str] = ("text",), on_bad: str = "fail", max_bytes: int | None = None
) -> Iterator[str]:
    """Every document text of the inputs, in order (each key's text in turn), up to about `max_bytes`.

    Example: train_tokenizer(iter_texts(expand_inputs(["corpus/"])), 32000, Path("tok.json"))
    """
    seen = 0
    for task in plan_tasks(files):
        for batch in read_task(task, keys, on_bad):
            for column in batch.texts:
                yield from text_list(column)
            seen += batch.input_bytes
            if max_bytes is not None and seen >= max_bytes:
                return
