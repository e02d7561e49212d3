"""A blend's indices read once per node: one process of a node opens every dataset of a blend (every `.idx` read,
every `.bin` stat'ed, validated) and writes what it read to one node-local file; the node's other processes wait on
a node-local flock, then map that file and make no metadata operation per dataset on the shared file system.

On CephFS or Lustre each open and stat of a blend's files is a round trip to the metadata server; 8 ranks a node
reading 2,500 datasets each make 8x the requests of one, all at the same moment. Megatron-LM's answer is a job-wide
barrier while rank 0 builds; here nobody waits for another node, and on a node the others wait only for the one
process that reads (a flock in `node_share_dir`, normally /dev/shm: released by the kernel if that process dies, so
a killed reader never leaves the others hanging; the next waiter takes the lock and reads in its place).

Layout of `{node_share_dir}/corpusforge-share-{job}-{hash}.bin` (published complete by rename, never half-written
under that name; `{job}` is the parent process and its start time, see job_identity; `{hash}` of the prefixes and
the StorageConfig):

    b"CFSHARE1"   8 bytes, magic
    u64           length H of the JSON header (little-endian)
    H bytes       {"entries": [[source, path, offset, idx_bytes, bin_bytes, read_mode, reason, align], ...]}
    ...           each .idx's bytes at its offset (8-byte aligned: the index arrays are read in place)

Example:
    >>> datasets = open_shared(["/cephfs/a_text_document", "/cephfs/b_text_document"],
    ...                        StorageConfig(node_share_dir="/dev/shm"))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from corpusforge.fsutil import atomic_write, flock
from corpusforge.indexed import BinReader, IndexedDataset, OpenedIndex
from corpusforge.storage.config import StorageConfig
from corpusforge.storage.readers import LOCAL_READERS, DirectBinReader, PreadBinReader

MAGIC = b"CFSHARE1"
_ALIGN = 8
# This process's mapped shares, by path: a dataset pickled to a DataLoader worker reopens from the share, once.
_MAPPED: dict[str, memoryview] = {}


def sharing() -> bool:
    """Whether this process opens blends with others of its node: under torchrun with several local ranks
    (LOCAL_WORLD_SIZE > 1), or where CORPUSFORGE_NODE_SHARE_JOB names the job. A lone process reads for itself: two
    runs from one shell have the same parent, and the second must not map the first's indices.

    Example:
        >>> sharing()      # torchrun --nproc-per-node 8 ...
        True
    """
    return bool(os.environ.get("CORPUSFORGE_NODE_SHARE_JOB")) or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1


def job_identity() -> str:
    """Who shares a node's share file: the processes with the same parent (torchrun's agent, slurmstepd, mpirun's
    daemon, a test's multiprocessing parent), told apart from an earlier parent with the same pid by its start time
    (/proc/PID/stat field 22); CORPUSFORGE_NODE_SHARE_JOB overrides it (a launcher whose ranks have no common
    parent). A new job never maps a share of an earlier one, whose datasets may have changed since.

    Example:
        >>> job_identity()
        '41873-9120455'
    """
    explicit = os.environ.get("CORPUSFORGE_NODE_SHARE_JOB")
    if explicit:
        return hashlib.sha256(explicit.encode()).hexdigest()[:16]
    ppid = os.getppid()
    return f"{ppid}-{_start_time(ppid)}"


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the command name (field 2) may hold spaces and parentheses: count fields after its closing ")"
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return "0"


def share_path(prefixes: Sequence[str], config: StorageConfig, job: str | None = None) -> Path:
    """The share file of a blend for this job on this node (see the module's layout).

    Example:
        >>> share_path(["/cephfs/a_text_document"], StorageConfig(node_share_dir="/dev/shm")).parent
        PosixPath('/dev/shm')
    """
    assert config.node_share_dir is not None
    what = {"prefixes": [os.path.abspath(p) for p in prefixes], "storage": asdict(replace(config, node_share_dir=None))}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return Path(config.node_share_dir) / f"corpusforge-share-{job or job_identity()}-{digest}.bin"


def open_shared(
    prefixes: Sequence[str],
    config: StorageConfig,
    open_each: Callable[[list[str], StorageConfig], list[IndexedDataset]],
) -> list[IndexedDataset]:
    """The datasets of `prefixes`, read from the node's share file; the first process of the node to get there reads
    them itself with `open_each` (storage.open_datasets without sharing) and writes the share for the others.

    Returns the datasets in the order of `prefixes`; the first error of `open_each` (a missing or faulty dataset) is
    raised in every process, each reading in turn. A share that cannot be written (node_share_dir full) only warns:
    the others then read for themselves.

    Example:
        >>> ds = open_shared(["/cephfs/a_text_document"], StorageConfig(node_share_dir="/dev/shm"), open_datasets)
    """
    if not sharing():
        return open_each(list(prefixes), replace(config, node_share_dir=None))
    path = share_path(prefixes, config)
    found = _map(path)
    if found is not None:  # the common case after the first: no lock, one open of a node-local file
        return _datasets(path, found, config, open_each)
    path.parent.mkdir(parents=True, exist_ok=True)
    with flock(Path(f"{path}.lock")):  # node-local: the kernel lets go when its holder dies
        found = _map(path)  # another process of the node wrote it while we waited
        if found is not None:
            return _datasets(path, found, config, open_each)
        for dead in path.parent.glob(f"{path.name}.*.tmp"):  # a writer killed mid-write (we hold its lock now)
            dead.unlink(missing_ok=True)
        datasets = open_each(list(prefixes), replace(config, node_share_dir=None))
        _remove_stale_shares(path.parent)
        try:
            _write(path, datasets)
        except OSError as e:
            warnings.warn(f"{path}: the node's share of the blend's indices was not written ({e}); each process "
                          "of the node reads the indices itself", stacklevel=2)  # fmt: skip
            return datasets
    # The leader's own datasets reopen from the share too when pickled (DataLoader workers).
    for i, ds in enumerate(datasets):
        ds.reopen = (_reopen, (str(path), i, ds.source, config, open_each))
    return datasets


def _write(path: Path, datasets: Sequence[IndexedDataset]) -> None:
    entries, offset = [], 0
    for ds in datasets:
        reader = ds.reader
        size = len(ds._idx)
        align = getattr(reader, "_align", 0)  # O_DIRECT's block size: found with a stat of the .bin, not repeated
        entries.append([ds.source, ds.prefix, offset, size, reader.nbytes, reader.read_mode, reader.read_mode_reason,
                        align])  # fmt: skip
        offset += -(-size // _ALIGN) * _ALIGN
    header = json.dumps({"entries": entries}).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN
    with atomic_write(path, durable=False) as f:  # RAM-backed and rebuilt on loss: no fsync
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        f.write(b"\0" * (start - len(MAGIC) - 8 - len(header)))
        for ds, entry in zip(datasets, entries):
            f.write(ds._idx)  # bytes, or an mmap of a large .idx
            f.write(b"\0" * (-entry[3] % _ALIGN))


def _map(path: Path) -> memoryview | None:
    """The share file mapped (this process maps each once), or None if there is none yet."""
    key = str(path)
    if key in _MAPPED:
        return _MAPPED[key]
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    view = memoryview(mapping)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise OSError(f"{path}: not a corpusforge node share file; delete it (it is rebuilt)")
    _MAPPED[key] = view
    return view


def _entries(view: memoryview) -> tuple[list[list[Any]], int]:
    (length,) = struct.unpack_from("<Q", view, len(MAGIC))
    header_end = len(MAGIC) + 8 + length
    entries = json.loads(bytes(view[len(MAGIC) + 8 : header_end]))["entries"]
    return entries, -(-header_end // _ALIGN) * _ALIGN


def _datasets(path: Path, view: memoryview, config: StorageConfig, open_each: Callable) -> list[IndexedDataset]:
    entries, start = _entries(view)
    return [_dataset(path, view, entry, start, i, config, open_each) for i, entry in enumerate(entries)]


def _dataset(
    path: Path, view: memoryview, entry: list[Any], start: int, i: int, config: StorageConfig, open_each: Callable
) -> IndexedDataset:
    """Dataset i of a share: its index read in place from the mapping (validated by the process that wrote it; the
    O(1) checks run again), its .bin opened at its first read, like any local dataset's."""
    source, prefix, offset, size, nbytes, mode, reason, align = entry
    index = OpenedIndex.from_bytes(view[start + offset : start + offset + size], f"{prefix}.idx")
    reader = _reader(f"{prefix}.bin", index, nbytes, mode, reason, align)
    ds = IndexedDataset(prefix, check=False, reader=reader, index=index)
    ds.source = source
    ds.reopen = (_reopen, (str(path), i, source, config, open_each))
    return ds


def _reader(location: str, index: OpenedIndex, nbytes: int, mode: str, reason: str, align: int) -> BinReader:
    """The reader the writing process chose, without LocalBinReader's stat and access() nor DirectBinReader's stat
    for the device's block size: it made them (a .bin that changed size since is refused at its first read)."""
    cls = LOCAL_READERS[mode]
    reader = cls.__new__(cls)
    BinReader.__init__(reader, location, index.header.dtype, nbytes)
    reader.read_mode, reader.read_mode_reason = mode, reason
    if issubclass(cls, DirectBinReader):
        PreadBinReader._init_state(reader)
        reader._align = align
    else:
        reader._init_state()
    return reader


def _reopen(path: str, i: int, source: str, config: StorageConfig, open_each: Callable) -> IndexedDataset:
    """Dataset i of the share at `path`, in a process it was pickled to (a DataLoader worker): from the share while
    it exists, else (the job that wrote it has ended and its share was removed) opened from its own files by
    `open_each` (storage.open_datasets, pickled by name: this module does not import storage.datasets, which imports
    it)."""
    view = _map(Path(path))
    if view is not None:
        entries, start = _entries(view)
        return _dataset(Path(path), view, entries[i], start, i, config, open_each)
    return open_each([source], replace(config, node_share_dir=None))[0]


def _remove_stale_shares(directory: Path) -> None:
    """Remove the share files of jobs whose parent process is gone (they would fill /dev/shm over many jobs)."""
    for old in directory.glob("corpusforge-share-*.bin"):
        parts = old.name.split("-")
        if len(parts) < 5 or not parts[2].isdigit():
            continue  # an explicit CORPUSFORGE_NODE_SHARE_JOB: its launcher owns it
        pid, started = int(parts[2]), parts[3]
        if _start_time(pid) != started:
            with contextlib.suppress(OSError):
                old.unlink()
                Path(f"{old}.lock").unlink()
