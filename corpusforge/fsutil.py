"""File-system helpers, written once: a file appears whole under its final name or not at all.

Every writer in corpusforge that publishes a file goes through `atomic_write` (or one of its thin forms), so they
all behave the same on a crash: the data goes to `{name}.{pid}.{random}.tmp` beside the final name, is flushed and
fsynced, renamed over the final name, and the directory is fsynced so that the rename itself survives a power
cut. An exception (a full disk, a bad value, Ctrl-C) removes the temporary file; a SIGKILL leaves it, and
`remove_leftovers` is how a stage that starts again clears them. A write that fails (a full disk, a read-only or
forbidden place) names the path the caller gave, never the temporary file (`naming`), so that every command's error
says the user's own path.

    >>> with atomic_write(Path("out/x.json"), "w") as f:
    ...     f.write("{}")
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import secrets
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

TMP_SUFFIX = ".tmp"


def temp_path(path: str | os.PathLike) -> Path:
    """A fresh temporary name beside `path`, unique per process and call, ending in `.tmp`.

    Example:
        >>> temp_path("out/a.idx").name  # doctest: +SKIP
        'a.idx.4242.9f3c01ab.tmp'
    """
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by its path; for a directory this makes a rename in it durable (POSIX: the
    directory entry is data of the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync the directory `path` (an alias of fsync_path whose name says why it is called)."""
    fsync_path(path)


WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})
"""The errors of a write that are the place's fault, not the data's: full, too big, read-only, forbidden."""


@contextlib.contextmanager
def naming(path: str | os.PathLike, *temporaries: str | os.PathLike) -> Iterator[None]:
    """Make a failed write inside the block name `path`, the file the caller asked for.

    A full disk fails a write(2) or copy_file_range(2) with no file name at all, and a read-only or forbidden
    directory fails the creation of a temporary file under that temporary's name: an error from inside the block
    with an errno of WRITE_ERRNOS whose file name is missing, one of `temporaries` (the files written for `path`),
    or a file that does not exist (one being created), is raised again as the same OSError naming `path`. An error
    naming another existing file (an input that cannot be read) keeps its name.

    Example:
        >>> with naming("out/m.bin"):
        ...     os.open("out/m.bin.tmp", os.O_CREAT | os.O_WRONLY)  # on a read-only mount
        OSError: [Errno 30] Read-only file system: 'out/m.bin'
    """
    try:
        yield
    except OSError as e:
        named = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes, os.PathLike)) else None
        ours = named is None or named in {os.fspath(t) for t in temporaries} or not os.path.lexists(named)
        if e.errno not in WRITE_ERRNOS or not ours or named == os.fspath(path):
            raise
        raise type(e)(e.errno, e.strerror or os.strerror(e.errno), os.fspath(path)) from e


def check_writable(path: str | os.PathLike) -> None:
    """Create the directory of the file `path` (as mkdir -p) and refuse, naming `path`, a place where it cannot be
    written (read-only file system, no permission), before a command spends its time on work it cannot keep.

    Example:
        >>> check_writable("ro/tokenizer.json")
        OSError: [Errno 30] Read-only file system: 'ro/tokenizer.json'
    """
    parent = Path(path).parent
    with naming(path):
        parent.mkdir(parents=True, exist_ok=True)
    if os.access(parent, os.W_OK | os.X_OK):
        return
    read_only = bool(os.statvfs(parent).f_flag & os.ST_RDONLY)
    code = errno.EROFS if read_only else errno.EACCES
    raise OSError(code, os.strerror(code), os.fspath(path))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path for a writer that wants a file name (faiss.write_index, a subprocess); on a clean
    exit fsync it, rename it to `path` and fsync the directory; on an exception remove it.

    Example:
        >>> with atomic_path(Path("db/index.faiss")) as tmp:
        ...     faiss.write_index(index, str(tmp))  # doctest: +SKIP
    """
    path = Path(path)
    tmp = temp_path(path)
    with naming(path, tmp):
        try:
            yield tmp
            if durable:
                fsync_path(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if durable:
            fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike, mode: str = "wb", *, durable: bool = True, encoding: str | None = None
) -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` for writing; publish it under `path` when the block ends cleanly.

    `mode` is "wb" or "w". The file is created 0o666 minus the umask (not mkstemp's 0o600: datasets and tokenizers
    are read by other users and jobs). `durable=False` skips the fsyncs, for caches that can be rebuilt.

    Example:
        >>> with atomic_write(Path("out/tok.model")) as f:
        ...     f.write(model_bytes)  # doctest: +SKIP
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write writes a new file: mode must be 'wb' or 'w', not {mode!r}")
    with atomic_path(path, durable=durable) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, mode, encoding=encoding if mode == "w" else None) as f:
            yield f


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` whole or not at all.

    Example:
        >>> write_bytes_atomic(Path("out/tok.model"), b"...")  # doctest: +SKIP
    """
    with atomic_write(path, "wb", durable=durable) as f:
        f.write(data)


def _writev_all(fd: int, buffers: tuple[Any, ...]) -> int:
    """Write every byte of `buffers` to `fd`: one writev, and after a short one (a signal, a huge buffer) the rest
    one write at a time. Returns the bytes written."""
    size = sum(memoryview(b).nbytes for b in buffers)
    done = os.writev(fd, buffers)
    if done < size:
        rest = memoryview(b"".join(bytes(memoryview(b).cast("B")) for b in buffers))[done:]
        while rest:
            rest = rest[os.write(fd, rest) :]
    return size


def write_at_atomic(dir_fd: int, name: str, *buffers: Any, where: str | os.PathLike = "") -> int:
    """Write `buffers` to `name` in the open directory `dir_fd` whole or not at all, as atomic_write does (a
    temporary name beside it, renamed), without the fsyncs (the caller makes many files durable at once: one
    syncfs) and without atomic_write's per-file Python (a file object, pathlib, two context managers: ~25 us a
    file, a quarter of creating a small file here): one writev. Returns the bytes; an error names `where`/name.

    Example:
        >>> fd = os.open("cache", os.O_RDONLY | os.O_DIRECTORY)
        >>> write_at_atomic(fd, "a.npy", header, memoryview(array), where="cache")  # doctest: +SKIP
    """
    tmp = f"{name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
        try:
            size = _writev_all(fd, buffers)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            raise type(e)(e.errno, e.strerror or os.strerror(e.errno), os.path.join(where, name)) from e
        raise
    return size


def write_json_atomic(
    path: str | os.PathLike,
    data: Any,
    *,
    indent: int | None = 1,
    sort_keys: bool = False,
    newline: bool = False,
    durable: bool = True,
) -> None:
    """json.dump `data` to `path` whole or not at all (`newline` adds a final line break).

    Example:
        >>> write_json_atomic(Path("db/done.json"), {"rows": 10}, sort_keys=True, newline=True)  # doctest: +SKIP
    """
    with atomic_write(path, "w", durable=durable) as f:
        json.dump(data, f, indent=indent, sort_keys=sort_keys)
        if newline:
            f.write("\n")


def save_npy_atomic(path: str | os.PathLike, array: np.ndarray, *, durable: bool = True) -> None:
    """np.save `array` (never a pickle) to `path` whole or not at all.

    Example:
        >>> save_npy_atomic(Path("db/chunks.npy"), np.zeros(4, np.int64))  # doctest: +SKIP
    """
    array = np.ascontiguousarray(array)
    if array.dtype.hasobject:
        raise ValueError(f"{path}: object arrays cannot be saved when allow_pickle=False")
    header = np.lib.format.header_data_from_array_1_0(array)
    with atomic_write(path, "wb", durable=durable) as f:
        try:
            np.lib.format.write_array_header_1_0(f, header)
        except ValueError:  # a header too long for format 1.0 (np.save would write 2.0 as well)
            np.lib.format.write_array_header_2_0(f, header)
        # The data through the file's own write, not np.save's ndarray.tofile: a disk that fills makes tofile raise
        # an OSError without an errno ("N requested and M written"), which no handler can tell from a bug.
        f.write(memoryview(array.reshape(-1).view(np.uint8)))


def remove_leftovers(directory: str | os.PathLike, pattern: str = f"*{TMP_SUFFIX}") -> list[Path]:
    """Delete the temporary files a killed writer left in `directory` (matching `pattern`); returns them.

    Example:
        >>> remove_leftovers(Path("db/parts"))  # doctest: +SKIP
        [PosixPath('db/parts/chunks.npy.4242.9f3c01ab.tmp')]
    """
    removed = sorted(Path(directory).glob(pattern))
    for leftover in removed:
        leftover.unlink(missing_ok=True)
    return removed


def fs_type(path: str | os.PathLike) -> str:
    """The file system type of `path` from /proc/self/mountinfo (ext4, xfs, tmpfs, fuse.ceph-fuse, lustre ...).

    Example:
        >>> fs_type("/dev/shm")
        'tmpfs'
    """
    real, best, kind = os.path.realpath(path), "", "unknown"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        left, _, right = line.partition(" - ")
        mount = left.split()[4].replace("\\040", " ")
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, right.split()[0]
    return kind


# File systems whose metadata operations are round trips to a server (a stat, an open, a create: ~0.3-0.7 ms each on
# the loopback CephFS of the tests, more on a loaded cluster), against microseconds of CPU on a local disk.
_NETWORK_FS = ("ceph", "lustre", "nfs", "nfs4", "gpfs", "beegfs", "cifs", "smb3", "9p", "glusterfs", "wekafs")


def network_fs(path: str | os.PathLike) -> bool:
    """Whether `path` is on a network or FUSE file system (by fs_type): where many small file operations are worth
    making from several threads at once, each waiting for its server.

    Example:
        >>> network_fs("/mnt/cephfs/data"), network_fs("/tmp")
        (True, False)
    """
    kind = fs_type(path)
    return kind.startswith("fuse.") or kind.split(".")[0] in _NETWORK_FS


def is_url(path: str | os.PathLike) -> bool:
    """True for an fsspec URL with a protocol other than file (s3://, gs://, http://, memory://, ...).

    Example:
        >>> is_url("s3://bucket/a_text_document"), is_url("/data/a_text_document")
        (True, False)
    """
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


@contextlib.contextmanager
def flock(path: str | os.PathLike, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive flock on `path` (created if missing) for the block; yields False, holding nothing, when not
    `blocking` and another process holds it. Node-local: the kernel lets go when its holder dies, however it dies.

    Example:
        >>> with flock("cache/entry.lock", blocking=False) as held:
        ...     if held: copy_the_entry()
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def write_new_at(dir_fd: int, name: str, *buffers: Any, where: str | os.PathLike = "") -> int:
    """Write `buffers` to a new file `name` in the open directory `dir_fd`, which no one else sees yet (one that
    `staging_dir` made): under its final name at once, no temporary name and no rename, since the directory itself is
    published whole (`publish_dir`). O_EXCL: an existing file is an error, never overwritten. A failed write removes
    the file. Returns the bytes; an error names `where`/name.

    Example:
        >>> fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
        >>> write_new_at(fd, "a.npy", header, memoryview(array), where="cache")  # doctest: +SKIP
    """
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in WRITE_ERRNOS:
            raise type(e)(e.errno, e.strerror or os.strerror(e.errno), os.path.join(where, name)) from e
        raise
    try:
        size = _writev_all(fd, buffers)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            raise type(e)(e.errno, e.strerror or os.strerror(e.errno), os.path.join(where, name)) from e
        raise
    finally:
        os.close(fd)
    return size


# A staging directory is named .{name}.{host}-{pid}.{random}.stage beside the directory it will become.
_STAGE_SUFFIX = ".stage"


def staging_dir(directory: str | os.PathLike) -> Path | None:
    """A new empty directory beside `directory`, to fill with files under their final names (`write_new_at`) and
    then publish whole (`publish_dir`: one rename), where `directory` does not exist or is an empty plain directory
    of this user's (not a symlink, not a mount point, no ACL: the staging one takes its permission bits); else None,
    and the caller writes each file atomically in `directory` itself (write_at_atomic).

    Why: every file then appears whole under its final name or not at all, as with a temporary name and a rename
    per file, without the 10,000 renames of a cache of 10,000 small files, and with no order among its files (a
    reader that takes an entry whose files all exist as complete sees all of them at once). Staging directories a
    killed run of this host left (their process gone) are removed first.

    Example:
        >>> stage = staging_dir("cache")      # "cache" absent or empty
        >>> ... write_new_at(fd_of(stage), "a.npy", data) ...
        >>> publish_dir(stage, "cache")
        True
    """
    directory = Path(directory)
    parent, name = directory.parent, directory.name
    if not name or name in (".", ".."):
        return None
    with naming(directory):
        parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_stages(parent, name)
    mode = None
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or os.path.ismount(directory):
            return None
        with os.scandir(directory) as entries:
            if next(entries, None) is not None or any(a.startswith("system.posix_acl") for a in _xattrs(directory)):
                return None
        mode = stat.S_IMODE(st.st_mode)
    stage = parent / f".{name}.{socket.gethostname()}-{os.getpid()}.{secrets.token_hex(4)}{_STAGE_SUFFIX}"
    with naming(directory, stage):  # a read-only or forbidden place names the directory asked for
        os.mkdir(stage)
    if mode is not None:
        os.chmod(stage, mode)
    return stage


def publish_dir(stage: str | os.PathLike, directory: str | os.PathLike, *, durable: bool = True) -> bool:
    """Rename `stage` onto `directory` (absent, or an empty directory: rename(2) replaces it), so that all its files
    appear at once; with `durable`, the rename is made durable (an fsync of the parent; the files themselves are the
    caller's to sync before). False, changing nothing, where `directory` is no longer empty (another writer put
    files there meanwhile): the caller then moves its files in one by one.

    Example:
        >>> publish_dir(stage, "cache")
        True
    """
    try:
        os.rename(stage, directory)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            return False
        raise
    if durable:
        fsync_dir(Path(directory).parent)
    return True


def _remove_stale_stages(parent: Path, name: str) -> None:
    """Remove the staging directories for `name` in `parent` whose process (on this host) is gone."""
    host = socket.gethostname()
    for stage in parent.glob(f".{glob.escape(name)}.{glob.escape(host)}-*{_STAGE_SUFFIX}"):
        pid = stage.name[len(name) + len(host) + 3 :].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stage, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def _xattrs(path: Path) -> list[str]:
    try:
        return os.listxattr(path, follow_symlinks=False)
    except OSError:  # no extended attributes on this file system
        return []
