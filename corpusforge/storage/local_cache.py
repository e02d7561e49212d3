"""The local cache tier: copies of datasets (local or remote) on fast local disk, shared by every process of a
node, evicted least-recently-used beyond a size cap. `fetch(prefix)` copies a dataset on first use, verifies it,
and returns the local prefix. Layout of the cache directory:

    {key}/{name}.bin, {key}/{name}.idx   a complete, verified copy (key = sha256 of the source location)[:16]
    {key}/meta.json                      source, sizes, sha256 of both files, written before the rename
    {key}.lock                           flock held while copying or evicting that entry
    {key}.readers                        shared flock of every process reading that entry (no eviction then)
    .{key}.partial-{pid}/                a copy in progress; never read; removed by the next lock holder
    {key}.used                           its mtime is the entry's last use (LRU eviction)

One process per node copies while the others wait on the lock; the copy appears under its final name only
complete (rename of the directory), so a killed copy is never used. A reader keeps its copy from eviction with a
ReaderPin (`fetch_pinned`), which storage.open_dataset closes with the dataset.

Example:
    >>> path, pin = LocalCache("/nvme/cf-cache", 200 << 30).fetch_pinned("s3://corpora/web_text_document")
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

from corpusforge.fsutil import flock, fsync_dir, is_url
from corpusforge.indexed import IndexedDataset
from corpusforge.storage.config import MiB
from corpusforge.storage.remote import filesystem


class LocalCache:
    """Copies of datasets on fast local disk, shared by every process of a node, evicted LRU beyond a size cap.

    Example:
        >>> LocalCache("/nvme/cf-cache", max_bytes=200 << 30).fetch("s3://corpora/web_text_document")
        '/nvme/cf-cache/3f2a.../web_text_document'
    """

    def __init__(
        self, directory: str | os.PathLike, max_bytes: int | None = None, storage_options: Mapping | None = None
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.storage_options = dict(storage_options or {})

    def key(self, source: str) -> str:
        """The entry name of a source: the start of sha256 of its absolute location."""
        location = source if is_url(source) else os.path.abspath(source)
        return hashlib.sha256(location.encode()).hexdigest()[:16]

    def fetch(self, source: str, verify_sha256: bool = False) -> str:
        """The local prefix of a verified copy of `source`, copying it first if needed (one process per node).

        The copy may be evicted as soon as this returns; a reader that keeps using it takes `fetch_pinned`."""
        path, pin = self.fetch_pinned(source, verify_sha256)
        pin.close()
        return path

    def fetch_pinned(self, source: str, verify_sha256: bool = False) -> tuple[str, ReaderPin]:
        """`fetch`, plus a pin that keeps the copy from eviction until it is closed (or garbage-collected).

        The pin is a shared flock on `{key}.readers`, taken while the entry's lock is held, so no eviction can come
        between the check that the copy is complete and the pin; forked processes (DataLoader workers) share it.

        Example:
            >>> path, pin = LocalCache("/nvme/cf-cache", 200 << 30).fetch_pinned("s3://corpora/web_text_document")
            >>> ...                     # read path.bin / path.idx: no other process evicts them meanwhile
            >>> pin.close()
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        key, name = self.key(source), source.rstrip("/").rsplit("/", 1)[-1]
        final = self.directory / key
        sizes = self._source_sizes(source)
        with flock(self.directory / f"{key}.lock"):
            if not self._complete(final, name, sizes):
                for stale in self.directory.glob(f".{key}.partial-*"):  # a killed copy: we hold the lock
                    shutil.rmtree(stale, ignore_errors=True)
                if final.exists():  # a copy of an older version of the source
                    if not self._remove_unread(key):
                        raise OSError(
                            f"{source} changed since it was copied to {final}, and running processes still read "
                            f"that copy; stop them first, or give this run another local_cache_dir"
                        )
                self._make_room(sum(sizes.values()), keep=key)
                self._copy(source, key, name, sizes)
            elif verify_sha256:
                self._verify_hashes(final, name)
            Path(self.directory / f"{key}.used").touch()
            pin = ReaderPin(self.directory / f"{key}.readers")
        return str(final / name), pin

    def pin_if_complete(self, source: str, sizes: Mapping[str, int]) -> tuple[str, ReaderPin] | None:
        """The local prefix of a complete copy of `source` whose files have `sizes` ({"bin": n, "idx": m}, what the
        caller read from the source) and a pin on it, or None where there is none yet or it is being copied or
        evicted right now (its lock is held): never copies, never waits, never touches the source (staging's
        readers ask this while training reads the source).

        Example:
            >>> found = LocalCache("/nvme/cf").pin_if_complete("/cephfs/a_text_document", {"bin": 40960, "idx": 2042})
        """
        key, name = self.key(source), source.rstrip("/").rsplit("/", 1)[-1]
        final = self.directory / key
        if not (final / "meta.json").is_file():
            return None
        with flock(self.directory / f"{key}.lock", blocking=False) as held:
            if not held or not self._complete(final, name, sizes):
                return None
            Path(self.directory / f"{key}.used").touch()
            return str(final / name), ReaderPin(self.directory / f"{key}.readers")

    def _source_sizes(self, source: str) -> dict[str, int]:
        if is_url(source):
            fs = filesystem(source, self.storage_options)
            return {ext: int(fs.size(f"{source}.{ext}")) for ext in ("bin", "idx")}
        return {ext: os.path.getsize(f"{source}.{ext}") for ext in ("bin", "idx")}

    def _complete(self, final: Path, name: str, sizes: Mapping[str, int]) -> bool:
        meta = final / "meta.json"
        if not meta.is_file():
            return False
        recorded = json.loads(meta.read_text())
        on_disk = {ext: (final / f"{name}.{ext}").stat().st_size for ext in ("bin", "idx")}
        return recorded.get("sizes") == dict(sizes) == on_disk

    def _copy(self, source: str, key: str, name: str, sizes: Mapping[str, int]) -> None:
        """Copy to a partial directory, check it as a dataset, then rename it to its final name."""
        partial = self.directory / f".{key}.partial-{os.getpid()}"
        partial.mkdir()
        try:
            hashes = {ext: self._copy_file(source, ext, partial / f"{name}.{ext}") for ext in ("idx", "bin")}
            copied = {ext: (partial / f"{name}.{ext}").stat().st_size for ext in ("bin", "idx")}
            if copied != dict(sizes):
                raise OSError(f"{source}: copied {copied} bytes, the source has {dict(sizes)}")
            IndexedDataset(partial / name).close()  # opening checks every length, pointer and document index
            meta = {"source": source, "sizes": dict(sizes), "sha256": hashes, "copied_at": time.time()}
            (partial / "meta.json").write_text(json.dumps(meta, indent=1))
            fsync_dir(partial)
            os.rename(partial, self.directory / key)
            fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def _copy_file(self, source: str, ext: str, dest: Path, chunk: int = 64 * MiB) -> str:
        """Stream one file to `dest`, hashing on the way; fsync before it counts. Returns the sha256."""
        digest = hashlib.sha256()
        opener = filesystem(source, self.storage_options).open if is_url(source) else open
        with opener(f"{source}.{ext}", "rb") as src, open(dest, "wb") as out:
            while data := src.read(chunk):
                digest.update(data)
                out.write(data)
            out.flush()
            os.fsync(out.fileno())
        return digest.hexdigest()

    def _verify_hashes(self, final: Path, name: str) -> None:
        recorded = json.loads((final / "meta.json").read_text())["sha256"]
        for ext, expected in recorded.items():
            digest = hashlib.sha256()
            with open(final / f"{name}.{ext}", "rb") as f:
                while data := f.read(64 * MiB):
                    digest.update(data)
            if digest.hexdigest() != expected:
                shutil.rmtree(final)
                raise OSError(f"{final}/{name}.{ext}: sha256 differs from the copy's record; removed, rerun to recopy")

    def entries(self) -> list[tuple[float, str, int]]:
        """(last use, key, bytes) of every complete entry, least recently used first."""
        out = []
        for meta in self.directory.glob("*/meta.json"):
            key = meta.parent.name
            used = self.directory / f"{key}.used"
            last = used.stat().st_mtime if used.exists() else meta.stat().st_mtime
            out.append((last, key, sum(json.loads(meta.read_text())["sizes"].values())))
        return sorted(out)

    def _make_room(self, needed: int, keep: str) -> None:
        """Evict least-recently-used entries that nobody reads until `needed` more bytes fit under the cap."""
        if self.max_bytes is None:
            return
        if needed > self.max_bytes:
            raise OSError(
                f"a dataset of {needed} bytes does not fit the local cache cap of {self.max_bytes} bytes "
                f"({self.directory}); raise local_cache_max_bytes or read it without the local cache"
            )
        entries = [e for e in self.entries() if e[1] != keep]
        used = sum(size for _, _, size in entries)
        busy = []
        for _, key, size in entries:
            if used + needed <= self.max_bytes:
                break
            if self._evict(key):
                used -= size
            else:
                busy.append(key)
        if used + needed > self.max_bytes:
            raise OSError(
                f"local cache {self.directory}: {needed} more bytes do not fit under its cap of {self.max_bytes}: "
                f"entries {busy} are being read or copied by running processes and are not evicted; raise "
                f"local_cache_max_bytes or wait for those processes to finish"
            )

    def _evict(self, key: str) -> bool:
        """Remove an entry unless another process copies it (holds its lock) or reads it (holds a pin)."""
        with flock(self.directory / f"{key}.lock", blocking=False) as held:
            if not held:
                return False
            if not self._remove_unread(key):
                return False
            (self.directory / f"{key}.used").unlink(missing_ok=True)
            return True

    def _remove_unread(self, key: str) -> bool:
        """Remove entry `key` (its lock held by the caller) unless a reader pins it; whether it was removed."""
        with flock(self.directory / f"{key}.readers", blocking=False) as unread:
            if not unread:
                return False
            doomed = self.directory / f".{key}.evicted-{os.getpid()}"
            os.rename(self.directory / key, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            return True


class ReaderPin:
    """A shared flock on a cache entry's `{key}.readers` file: while any process holds one, the entry stays.

    Closing it (or dropping it) closes the descriptor; the lock lasts while any copy of it is open, so a forked
    DataLoader worker keeps the entry pinned after its parent closed the dataset.

    Example:
        >>> pin = ReaderPin(Path("/nvme/cf-cache/3f2a9c.readers")); pin.close()
    """

    def __init__(self, path: Path) -> None:
        self.fd: int | None = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_SH)  # evictors only ever try LOCK_EX | LOCK_NB: never blocks long

    def close(self) -> None:
        # No LOCK_UN: that would release the lock for forked copies of this descriptor too.
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()
