"""On-disk cache of the sample indices: plain `.npy` files named by a hash of what determines them.

Layout, for a description `d` of kind `k` (e.g. "GPTDataset-train") in `cache_dir`:

    {h}-{k}-{name}.npy        one per index array (np.save, never pickled)
    {h}-{k}-description.json  the full description; written last, so its presence marks a complete entry
    {h}-{k}.lock              the build lock (empty; left in place, removing flock files is racy)

where `h` is the first 32 hex digits of sha256(json(d, sorted keys)). Megatron-Core does the same with an md5 of
its `unique_description` (megatron/core/datasets/megatron_dataset.py, MegatronDataset.__init__).

Every file appears under its final name only when complete (temporary name in the same directory, rename), and
one process builds an entry while the others wait on the lock and then load it: the first `fcntl.flock` holder
builds; later holders find the description and load. Where the file system has no flock (some Lustre/NFS mounts),
an `O_CREAT|O_EXCL` lock file with the holder's pid and host replaces it.

Writing is off the builder's critical path: the builder returns the arrays it built as soon as they are built (an
entry of up to 8 MiB it writes itself first, ~1 ms); a background thread of the builder writes larger ones
(temporary name, rename), and a second one fsyncs them and the
directory, writes the description (fsync, rename, fsync) and only then releases the lock (two threads, so that
one entry's fsyncs do not delay the next entry's files). So the description, which readers require,
exists on disk only after the arrays it vouches for are durable: a crash or a kill before that leaves arrays
without a description, which nobody loads and the next builder overwrites; and processes waiting on the lock wake
up to a complete entry. Until the arrays are written, the builder holds them in its memory; a dataset pickled to
a spawned worker then waits for the write and sends their paths. The interpreter waits for the threads at exit
(concurrent.futures joins its workers), `wait_for_index_caches()` waits for them explicitly, and
`wait_for_index_files()` until the array files are complete (not yet durable).

Example:
    >>> cache = IndexCache("cache/")
    >>> arrays, built = cache.get_or_build("GPTDataset-train", {"seed": 1234}, lambda: {"a": np.arange(3)})
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from corpusforge.errors import CorpusforgeError, PickleRefusedError, first_line, pickle_refused, refuses_pickle
from corpusforge.fsutil import atomic_write, fsync_dir, fsync_path
from corpusforge.indexed import IndexedDataset

_DESCRIPTIONS: weakref.WeakKeyDictionary[IndexedDataset, dict[str, Any]] = weakref.WeakKeyDictionary()

# Bump when the index algorithm or the file layout changes: old entries then get another name.
CACHE_FORMAT = 1


class CacheMismatchError(CorpusforgeError, RuntimeError):
    """A cache entry whose recorded description differs from the configuration asking for it."""


def describe_dataset(ds: IndexedDataset) -> dict[str, Any]:
    """What of a token dataset determines its sample indices: the sequence lengths (hashed) and the sizes.

    The path is not part of it, so a copy of the data (local disk, another cluster) keeps its caches and its
    loader states; the token values are not either, since the indices depend on the lengths only.

    Example:
        >>> describe_dataset(IndexedDataset("out/a_text_document"))["sequences"]
        1000
    """
    known = _DESCRIPTIONS.get(ds)
    if known is not None:  # hashing is O(sequences); every split of a dataset asks for it
        return known
    lengths = np.ascontiguousarray(ds.sequence_lengths)
    _DESCRIPTIONS[ds] = description = {
        "sequences": len(ds),
        "documents": ds.num_documents,
        "tokens": ds.num_tokens,
        "dtype": str(ds.dtype),
        "lengths_sha256": hashlib.sha256(memoryview(lengths).cast("B")).hexdigest(),
    }
    return description


def description_hash(description: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a description (sorted keys, no whitespace)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def describe_differences(ours: Mapping[str, Any], theirs: Mapping[str, Any], where: str = "") -> list[str]:
    """The fields that differ between two descriptions, as `path: ours != theirs` lines (recursing into dicts).

    Example:
        >>> describe_differences({"seed": 1, "a": {"b": 2}}, {"seed": 2, "a": {"b": 2}})
        ['seed: 1 != 2']
    """
    out = []
    for key in sorted(set(ours) | set(theirs), key=str):
        a, b = ours.get(key, "<missing>"), theirs.get(key, "<missing>")
        name = f"{where}.{key}" if where else str(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += describe_differences(a, b, name)
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                if isinstance(x, Mapping) and isinstance(y, Mapping):
                    out += describe_differences(x, y, f"{name}[{i}]")
                elif x != y:
                    out.append(f"{name}[{i}]: {x!r} != {y!r}")
        elif a != b:
            out.append(f"{name}: {a!r} != {b!r}")
    return out


class IndexCache:
    """A directory of index caches; `None` builds in memory every time (nothing is written).

    Example:
        >>> arrays, built = IndexCache("cache/").get_or_build("x", {"n": 3}, lambda: {"a": np.arange(3)})
    """

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = Path(directory) if directory is not None else None

    def get_or_build(
        self, kind: str, description: Mapping[str, Any], build: Callable[[], dict[str, np.ndarray]]
    ) -> tuple[dict[str, np.ndarray], bool]:
        """The arrays for `description`: loaded (memory-mapped) from the cache, else built and returned while a
        background thread saves them (in this process's memory then; pickled as their paths once written).

        Returns the arrays and whether this call built them.
        """
        if self.directory is None:
            return build(), True
        description = {"cache_format": CACHE_FORMAT, **description}
        base = self.directory / f"{description_hash(description)[:32]}-{kind}"
        loaded = _load(base, description)
        if loaded is not None:
            return loaded, False
        self.directory.mkdir(parents=True, exist_ok=True)
        _complete_held(Path(f"{base}-description.json"))  # this thread holds that entry's lock: release it first
        lock = contextlib.ExitStack()
        lock.enter_context(_build_lock(Path(f"{base}.lock")))
        try:
            loaded = _load(base, description)  # another process built it while we waited
            if loaded is not None:
                lock.close()
                return loaded, False
            desc_path = Path(f"{base}-description.json")
            if desc_path.exists():  # an entry with a deleted array: it stops counting as complete before we write
                desc_path.unlink()
                fsync_dir(self.directory)
            arrays = build()
        except BaseException:
            lock.close()
            raise
        paths = {name: Path(f"{base}-{name}.npy") for name in arrays}
        record = {"description": description, "arrays": sorted(arrays)}  # encoded by the syncer, off the build
        written = _Written()
        _WRITTEN.append(written)
        for name, array in arrays.items():
            _remember_file(array, paths[name], written)
        # Two threads, so that one entry's fsyncs do not hold back the next entry's writes: the writer writes the
        # arrays of each entry in turn; the syncer, once an entry's arrays are written, makes them durable, writes
        # the description and releases the lock. Both are submitted now: nothing is submitted at interpreter exit.
        if sum(a.nbytes for a in arrays.values()) <= _WRITE_HERE_BYTES:  # no hand-off, at the caller's priority
            _write_arrays(arrays, paths, written, desc_path, background=False)
        else:
            _writer().submit(_write_arrays, arrays, paths, written, desc_path)
        _complete_later(paths, desc_path, record, written, lock)
        return arrays, True

    def wait(self) -> None:
        """Wait until every cache entry this process built is durable and complete (see wait_for_index_caches)."""
        wait_for_index_caches()


# The background threads of this process that finish the entries it built (one writer and one syncer: entries are
# written in the order they were built, and a submit does not wait for a thread to start), what is left to finish,
# and what went wrong.
_WRITER: tuple[int, ThreadPoolExecutor] | None = None
_SYNCER: tuple[int, ThreadPoolExecutor] | None = None
_PENDING: list[Future] = []
_WRITTEN: list[_Written] = []  # per entry: set once its arrays are under their final names (class below)
_ERRORS: list[tuple[Path, BaseException]] = []


# An entry of up to this many bytes is written by the builder itself (~1 ms of page-cache copies at 8 MiB): handing
# it to the niced writer thread cost more than that on a busy machine, where that thread waits for a core. Larger
# ones (1e9 tokens: ~60 MB) are written in the background while the builder goes on. fsyncs are always background.
_WRITE_HERE_BYTES = 8 << 20


def _writer() -> ThreadPoolExecutor:
    global _WRITER
    if _WRITER is None or _WRITER[0] != os.getpid():  # a forked child has the object but not the thread
        _WRITER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="index-cache"))
    return _WRITER[1]


def _syncer() -> ThreadPoolExecutor:
    global _SYNCER
    if _SYNCER is None or _SYNCER[0] != os.getpid():
        _SYNCER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="index-cache-sync"))
    return _SYNCER[1]


class _Written(threading.Event):
    """Set once an entry's arrays are under their final names (complete in the page cache; maybe not on disk)."""

    ok = False


# id(array) -> (weak reference to it, its .npy path, its entry's _Written): for pickling a freshly built array as
# its path (MappedArray) rather than its bytes.
_FILES: dict[int, tuple[weakref.ref, Path, _Written]] = {}


def _remember_file(array: np.ndarray, path: Path, written: _Written) -> None:
    key = id(array)
    _FILES[key] = (weakref.ref(array, lambda _, key=key: _FILES.pop(key, None)), path, written)


def _write_arrays(
    arrays: Mapping[str, np.ndarray],
    paths: Mapping[str, Path],
    written: _Written,
    desc_path: Path,
    background: bool = True,
) -> None:
    """Write each array (temporary name, rename), not yet durable: off the builder's critical path, or in the
    builder's thread for a small entry."""
    # Lowest CPU priority for the writer thread alone (Linux: a thread id is a valid PRIO_PROCESS target): on a busy
    # node it must not slow the builder, which goes on building the next split or starts training.
    if background:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    try:
        for name, array in arrays.items():
            with atomic_write(paths[name], durable=False) as f:
                _save_npy(f, array)
        written.ok = True
    except BaseException as e:  # the entry stays incomplete: the next process to ask builds it again
        _ERRORS.append((desc_path, e))
    finally:
        written.set()


def _save_npy(f: Any, array: np.ndarray) -> None:
    """np.save(f, array, allow_pickle=False), the same bytes: the header, then the array's memory in one write.
    np.save hands a file object's descriptor to C stdio (dup, fdopen, seek, fclose) for each array: ~0.1 ms a file,
    nine files per one-dataset build; a C-contiguous array of plain values needs none of that.

    Example:
        >>> with open("a.npy", "wb") as f:
        ...     _save_npy(f, np.arange(3))
    """
    if array.dtype.hasobject or not array.flags.c_contiguous:
        np.save(f, array, allow_pickle=False)  # refuses object arrays; writes other layouts as numpy does
        return
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    f.write(header.getvalue())
    f.write(array.reshape(-1).view(np.uint8))  # a view of its bytes, whatever the shape (empty too)


def _complete_entry(
    paths: Mapping[str, Path], desc_path: Path, record: dict, written: _Written, lock: contextlib.ExitStack
) -> None:
    """Once the arrays are written: fsync them and the directory, then write the description (fsync, rename,
    fsync); only then release the build lock."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # as the writer
    try:
        written.wait()
        if not written.ok:
            return
        for path in paths.values():
            fsync_path(path)
        fsync_dir(desc_path.parent)
        with atomic_write(desc_path) as f:  # durable: fsync, rename, fsync of the directory
            f.write(json.dumps(record, indent=1, sort_keys=True).encode())
    except BaseException as e:
        _ERRORS.append((desc_path, e))
    finally:
        lock.close()


# Entries built inside a completing_after() block, per thread: their completions are submitted when it ends.
_HOLD = threading.local()


@contextlib.contextmanager
def completing_after() -> Iterator[None]:
    """Submit the completion (fsyncs, description, lock release) of the entries built inside the block only when
    it ends: a build of several entries (train, valid, test) then does not share the GIL and the CPU with the
    syncer thread while it builds (~2 ms of a 20 ms build on a busy 2-core machine). Nested blocks: the outermost
    submits. Another process waiting on one of these entries waits until the block ends (milliseconds more).

    Example:
        >>> with completing_after():
        ...     arrays, built = IndexCache("cache/").get_or_build("x", {"n": 3}, lambda: {"a": np.arange(3)})
    """
    if getattr(_HOLD, "entries", None) is not None:
        yield
        return
    _HOLD.entries = []
    try:
        yield
    finally:
        entries, _HOLD.entries = _HOLD.entries, None
        for args in entries:
            _PENDING.append(_syncer().submit(_complete_entry, *args))


def _complete_later(
    paths: Mapping[str, Path], desc_path: Path, record: dict, written: _Written, lock: contextlib.ExitStack
) -> None:
    """Hand an entry to the syncer thread now, or at the end of this thread's completing_after() block."""
    held = getattr(_HOLD, "entries", None)
    if held is None:
        _PENDING.append(_syncer().submit(_complete_entry, paths, desc_path, record, written, lock))
    else:
        held.append((paths, desc_path, record, written, lock))


def _complete_held(desc_path: Path) -> None:
    """Submit this thread's held completions now if one of them is the entry at desc_path: its lock is held until
    it completes, and taking it again in this thread would wait on ourselves."""
    held = getattr(_HOLD, "entries", None)
    if held and any(args[1] == desc_path for args in held):
        for args in held:
            _PENDING.append(_syncer().submit(_complete_entry, *args))
        held.clear()


def wait_for_index_caches() -> None:
    """Wait until every index cache entry this process built is durable and complete; raise the first error.

    The interpreter waits for them at exit anyway; call this to know the caches are on disk at a given point (a
    job that hands its cache directory to others, a test).

    Example:
        >>> train, valid, test = build_gpt_datasets("out/a_text_document", 1024, cache_dir="cache/")
        >>> wait_for_index_caches()     # cache/*-description.json now exist: other processes load, not build
    """
    while _PENDING:
        _PENDING.pop().result()
    _WRITTEN.clear()  # every entry finished above has its files written
    if _ERRORS:
        (where, error), *_ = _ERRORS
        _ERRORS.clear()
        raise OSError(f"{where}: the index cache entry could not be made durable ({error}); it will be rebuilt")


def wait_for_index_files() -> None:
    """Wait until the arrays of every index cache entry this process built are under their final names: complete
    files in the page cache, as Megatron-Core leaves its caches (np.save, no fsync), but not yet durable nor
    loadable by others (wait_for_index_caches waits for that). For comparing build times with the same work done.

    Example:
        >>> train, valid, test = build_gpt_datasets("out/a_text_document", 1024, cache_dir="cache/")
        >>> wait_for_index_files()      # cache/*-document_index.npy ... exist, complete
    """
    while _WRITTEN:
        _WRITTEN.pop().wait()


class MappedArray:
    """A cached .npy array by path, for pickling: the receiving process maps it again instead of getting a copy."""

    def __init__(self, path: str) -> None:
        self.path = path


def picklable(array: np.ndarray) -> np.ndarray | MappedArray:
    """`array` itself, or a MappedArray if it is a whole .npy file mapped by np.load(mmap_mode="r") or one that
    this process built and is writing to the cache (then once it is written: a path instead of its bytes)."""
    if isinstance(array, np.memmap) and array.filename and str(array.filename).endswith(".npy"):
        return MappedArray(str(array.filename))
    known = _FILES.get(id(array))
    if known is not None and known[0]() is array:
        _, path, written = known
        written.wait()
        if written.ok:
            return MappedArray(str(path))
    return array


def unpickled(value: np.ndarray | MappedArray) -> np.ndarray:
    if isinstance(value, MappedArray):
        return load_array(Path(value.path))
    return value


def load_array(path: Path) -> np.ndarray:
    """A cached .npy array, memory-mapped; one that holds a pickle (object arrays, or no .npy at all: numpy then
    takes the file for a pickle) or is damaged is refused in one line naming it, never unpickled.

    Example:
        >>> load_array(Path("cache/3f2a...-document_index.npy")).dtype
        dtype('int32')
    """
    fix = "delete it (an index cache is rebuilt) or point cache_dir elsewhere"
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError) as e:
        if refuses_pickle(e):
            raise PickleRefusedError(pickle_refused(path, fix)) from None
        raise CacheMismatchError(f"{path}: not a readable .npy array ({first_line(e)}); {fix}") from None


def _load(base: Path, description: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """The arrays of a complete entry, or None when there is none; a mismatching entry is an error."""
    desc_name = f"{base}-description.json"
    if not os.path.isfile(desc_name):  # a string, not a Path: asked twice per entry, of every entry of a build
        return None
    desc_path = Path(desc_name)
    try:
        record = json.loads(desc_path.read_text())
        recorded, names = record["description"], record["arrays"]
    except (ValueError, KeyError, TypeError) as e:
        raise CacheMismatchError(f"{desc_path}: not a corpusforge index cache description ({e}); delete it") from e
    ours = json.loads(json.dumps(description))  # tuples -> lists, as they were written
    if recorded != ours:
        diff = "; ".join(describe_differences(ours, recorded)) or "(key order only)"
        raise CacheMismatchError(
            f"{desc_path}: this cache entry was written for another configuration ({diff}); "
            f"it is not used. Delete the files {base.name}-* or point cache_dir elsewhere."
        )
    arrays = {}
    for name in names:
        path = Path(f"{base}-{name}.npy")
        if not path.is_file():
            return None  # an array was deleted by hand: rebuild under the lock
        arrays[name] = load_array(path)
    return arrays


@contextlib.contextmanager
def _build_lock(path: Path, poll_s: float = 0.05, stale_s: float = 3600.0) -> Iterator[None]:
    """Hold an exclusive lock on `path` (flock; O_EXCL lock file where flock is not supported)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            with _exclusive_file_lock(Path(f"{path}.excl"), poll_s, stale_s):
                yield
            return
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _exclusive_file_lock(path: Path, poll_s: float, stale_s: float) -> Iterator[None]:
    """A lock file created with O_CREAT|O_EXCL; one older than `stale_s` is taken as left by a dead holder."""
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - path.stat().st_mtime > stale_s:
                    path.unlink()
            time.sleep(poll_s)
    try:
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        os.close(fd)
        yield
    finally:
        path.unlink(missing_ok=True)
