"""Token datasets at fsspec URLs (s3://bucket/key/prefix, gs://...): the .idx fetched whole into memory, the .bin
read in large ranged requests (`block_size`, 256 MiB by default as in Megatron-Core's S3 reader,
megatron/core/datasets/object_storage_utils.py) kept in a small LRU of blocks, with blocks fetched ahead on
background threads for the samples the loader asks for next.

Example:
    >>> fs = filesystem("s3://corpora/x", {"endpoint_url": "http://127.0.0.1:7480"})
    >>> reader = RemoteBinReader("s3://corpora/a_text_document.bin", np.dtype(np.uint16), StorageConfig(), fs)
    >>> reader.read_spans(np.array([0]), np.array([2049])).dtype
    dtype('uint16')
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from corpusforge.errors import MissingExtraError
from corpusforge.indexed import SAMPLE_TOKENS, BinReader
from corpusforge.storage import readwatch
from corpusforge.storage.config import StorageConfig


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec file system of `url`, a fresh instance (never shared with a parent process after fork).

    Example:
        >>> fs = filesystem("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:7480", "key": "k", "secret": "s"})
    """
    try:
        import fsspec
    except ImportError:
        raise MissingExtraError("remote datasets need fsspec: pip install 'corpusforge[s3]'") from None
    protocol = url.split("://", 1)[0]
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a") and "endpoint_url" in options:
        client = dict(options.pop("client_kwargs", {}) or {})
        client["endpoint_url"] = options.pop("endpoint_url")
        options["client_kwargs"] = client
        # botocore >= 1.36 sends CRC checksums (aws-chunked uploads) by default, which S3-compatible stores that
        # predate it (Ceph RGW before Squid, older MinIO) answer with 400 InvalidArgument: only when required.
        config = dict(options.pop("config_kwargs", {}) or {})
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        options["config_kwargs"] = config
    try:
        return fsspec.filesystem(protocol, skip_instance_cache=True, **options)
    except (ImportError, ValueError) as e:
        if protocol in ("s3", "s3a"):
            raise MissingExtraError(f"{url}: s3 URLs need s3fs: pip install 'corpusforge[s3]' ({e})") from None
        raise


def fetch_index(prefix: str, storage_options: Mapping[str, Any] | None = None) -> tuple[bytes, Any]:
    """The bytes of `{prefix}.idx` at an fsspec URL, and the file system that fetched them (for the .bin's reader).

    Example:
        >>> index, fs = fetch_index("memory://a_text_document")
    """
    fs = filesystem(prefix, storage_options)
    try:
        return fs.cat_file(f"{prefix}.idx"), fs
    except FileNotFoundError:
        raise _missing(prefix) from None


def _missing(prefix: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"dataset prefix {prefix!r}: {prefix}.idx or {prefix}.bin does not exist; a prefix names the pair "
        "PREFIX.bin/.idx without the extension"
    )


class RemoteBinReader(BinReader):
    """A .bin at an fsspec URL, read through a BlockCache of ranged GETs; each process makes its own client.

    Example:
        >>> index, fs = fetch_index("s3://corpora/a_text_document", {"endpoint_url": "http://127.0.0.1:7480"})
        >>> RemoteBinReader("s3://corpora/a_text_document.bin", np.dtype(np.uint16), StorageConfig(), fs).nbytes
        409600
    """

    read_mode = "remote"
    remote = True

    def __init__(self, url: str, dtype: np.dtype, config: StorageConfig, fs: Any = None) -> None:
        self.config = config
        self._fs, self._fs_pid = fs, os.getpid() if fs is not None else -1
        try:
            nbytes = int(self._filesystem().size(url))
        except FileNotFoundError:
            raise _missing(url.removesuffix(".bin")) from None
        super().__init__(url, dtype, nbytes)
        self.name = url  # messages name the whole URL
        self.read_mode_reason = f"ranged reads of {config.block_size >> 20} MiB blocks"
        self.blocks = BlockCache(self._fetch, nbytes, config.block_size, config.cache_blocks, config.prefetch_blocks)

    def _filesystem(self) -> Any:
        # fsspec's async clients (s3fs/aiohttp) must not cross a fork: each process makes its own.
        if self._fs_pid != os.getpid():
            self._fs, self._fs_pid = filesystem(self.location, self.config.storage_options), os.getpid()
        return self._fs

    def _fetch(self, lo: int, hi: int) -> bytes:
        return self._filesystem().cat_file(self.location, start=lo, end=hi)

    def token_sample(self) -> tuple[np.ndarray, np.ndarray]:
        """The first tokens only, in one small ranged GET rather than a first block of `block_size`; the middle and
        end samples of a local open would cost two more requests."""
        head = self._filesystem().cat_file(
            self.location, start=0, end=min(self.nbytes, SAMPLE_TOKENS * self.dtype.itemsize)
        )
        tokens = np.frombuffer(head, self.dtype, len(head) // self.dtype.itemsize)
        return tokens, np.arange(len(tokens))

    def read_spans(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        out = np.empty(int(lengths.sum()), dtype=self.dtype)
        view, itemsize, pos = memoryview(out).cast("B"), self.dtype.itemsize, 0
        if not len(starts):
            return out
        t0 = readwatch.begin(self.location, int(starts[0]) * itemsize, len(out) * itemsize)  # a watchdog sees it
        try:
            for start, length in zip((starts * itemsize).tolist(), (lengths * itemsize).tolist()):
                readwatch.advance(start)
                self.blocks.read_into(view[pos : pos + length], start)
                pos += length
        finally:
            readwatch.end(t0)
        return out

    def prefetch_spans(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Start fetching the blocks that read_spans(starts, lengths) will need, soonest first."""
        itemsize = self.dtype.itemsize
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        self.blocks.prefetch(self.blocks.blocks_of(starts * itemsize, lengths * itemsize))

    def describe(self) -> str:
        return self.read_mode_reason

    def close(self) -> None:
        self.blocks.close()


class BlockCache:
    """An LRU of fixed-size blocks of one remote file, each fetched with one ranged GET, and blocks fetched ahead.

    `prefetch(blocks)` starts background GETs (threads of this process) for blocks that reads will want soon, at
    most `prefetch_blocks` fetched-ahead blocks held or in flight; a read takes its block from there (waiting for
    it if its GET is still running) instead of issuing a GET itself. Memory: at most
    (max_blocks + prefetch_blocks) * block_size.

    Counters (the tests assert on them): `requests` and `bytes_fetched`, what went over the network;
    `read_requests`, GETs that a read issued itself; `prefetch_requests`; `waits`, reads that waited on the network
    (their own GET or a prefetch still in flight); `peak_blocks`, the most blocks held or in flight at once.

    Example:
        >>> blocks = BlockCache(lambda lo, hi: fs.cat_file(path, lo, hi), size=10 << 30, block_size=256 << 20,
        ...                     max_blocks=2, prefetch_blocks=2)
        >>> blocks.prefetch([7, 3])    # GETs of blocks 7 and 3 start in the background
        >>> blocks.read_into(memoryview(bytearray(64)), 7 * (256 << 20))   # block 7, without a GET of its own
    """

    def __init__(self, fetch, size: int, block_size: int, max_blocks: int, prefetch_blocks: int = 0) -> None:
        self.fetch, self.size, self.block_size, self.max_blocks = fetch, size, block_size, max_blocks
        self.prefetch_blocks = prefetch_blocks
        self.blocks: OrderedDict[int, bytes] = OrderedDict()  # read recently (LRU)
        self.ahead: dict[int, bytes] = {}  # fetched ahead, not read yet
        self.in_flight: dict[int, Future] = {}
        self.requests = self.bytes_fetched = self.read_requests = self.prefetch_requests = 0
        self.waits = self.peak_blocks = 0
        self._lock = threading.Lock()  # torch DataLoader pin-memory threads may read concurrently
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a process forked from the one that made us (a DataLoader worker): the parent's prefetch threads are
        not here, and the lock may have been copied while one of them held it. Start over with the blocks."""
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._pool, self._pid = None, os.getpid()
            self.in_flight = {}

    def _get(self, b: int) -> bytes:
        lo = b * self.block_size
        hi = min(lo + self.block_size, self.size)
        data = bytes(self.fetch(lo, hi))
        if len(data) != hi - lo:
            raise OSError(f"ranged read [{lo}, {hi}) returned {len(data)} bytes")
        with self._lock:
            self.requests += 1
            self.bytes_fetched += len(data)
        return data

    def _keep(self, b: int, data: bytes) -> None:
        """Put a block that is being read into the LRU (lock held)."""
        self.blocks[b] = data
        self.blocks.move_to_end(b)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def _take(self, b: int) -> bytes | None:
        """Block b from the LRU or from the fetched-ahead blocks (lock held)."""
        data = self.blocks.get(b)
        if data is not None:
            self.blocks.move_to_end(b)
            return data
        data = self.ahead.pop(b, None)
        if data is not None:
            self._keep(b, data)
        return data

    def _block(self, b: int) -> bytes:
        self._forked()
        with self._lock:
            data = self._take(b)
            future = self.in_flight.get(b) if data is None else None
            if data is None:
                self.waits += 1
        if data is not None:
            return data
        if future is not None:
            with contextlib.suppress(Exception):  # a failed prefetch: the read below tries again itself
                future.result()
            with self._lock:
                data = self._take(b)
            if data is not None:
                return data
        data = self._get(b)
        with self._lock:
            self.read_requests += 1
            self._keep(b, data)
        return data

    def prefetch(self, blocks: list[int]) -> None:
        """Fetch `blocks` (soonest needed first) in the background, as far as prefetch_blocks allows; fetched-ahead
        blocks not among them are dropped (the reads that would have wanted them went elsewhere)."""
        if self.prefetch_blocks < 1:
            return
        self._forked()
        wanted = list(dict.fromkeys(int(b) for b in blocks))
        with self._lock:
            keep = set(wanted)
            for stale in [b for b in self.ahead if b not in keep]:
                del self.ahead[stale]
            for b in wanted:
                if len(self.ahead) + len(self.in_flight) >= self.prefetch_blocks:
                    break
                if b in self.ahead or b in self.in_flight:
                    continue
                if b in self.blocks:  # held where reads of other blocks could evict it first: keep it aside
                    self.ahead[b] = self.blocks.pop(b)
                    continue
                self.in_flight[b] = self._executor().submit(self._fetch_ahead, b)
            held = len(self.blocks) + len(self.ahead) + len(self.in_flight)
            self.peak_blocks = max(self.peak_blocks, held)

    def _fetch_ahead(self, b: int) -> None:
        try:
            data = self._get(b)
        except BaseException:
            with self._lock:
                self.in_flight.pop(b, None)
            raise
        with self._lock:
            self.in_flight.pop(b, None)
            self.prefetch_requests += 1
            if b not in self.blocks:
                self.ahead[b] = data

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # a few GETs in parallel: one ranged GET rarely fills the link
            self._pool = ThreadPoolExecutor(max(1, min(self.prefetch_blocks, 4)), thread_name_prefix="prefetch")
        return self._pool

    def blocks_of(self, starts: np.ndarray, nbytes: np.ndarray) -> list[int]:
        """The blocks that byte ranges [starts[k], starts[k] + nbytes[k]) touch, in order of first use."""
        out: dict[int, None] = {}
        for lo, n in zip(starts.tolist(), nbytes.tolist()):
            if n > 0:
                out.update(dict.fromkeys(range(lo // self.block_size, (lo + n - 1) // self.block_size + 1)))
        return list(out)

    def close(self) -> None:
        """Drop every block; prefetches in flight finish in the background and are dropped too."""
        with self._lock:
            self.blocks.clear()
            self.ahead.clear()
            self.prefetch_blocks = 0
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False)

    def read_into(self, out: memoryview, offset: int) -> None:
        """Fill `out` with the bytes at [offset, offset + len(out))."""
        pos, n = 0, len(out)
        while pos < n:
            b, within = divmod(offset + pos, self.block_size)
            data = self._block(b)
            take = min(n - pos, len(data) - within)
            if take <= 0:
                raise OSError(f"read past the end of the file at byte {offset + pos} (size {self.size})")
            out[pos : pos + take] = data[within : within + take]
            pos += take
