"""StorageConfig: how token datasets are opened and read (the loaders and the trainer's [storage] table take one).

Example:
    >>> StorageConfig(read_mode="direct", local_cache_dir="/nvme/cf-cache").block_size >> 20
    256
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

READ_MODES = ("auto", "pread", "direct", "mmap", "mmap-random")
LOCAL_CACHE_STAGING = ("at-open", "background")
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class StorageConfig:
    """How token datasets are opened and read (the loaders take one; all fields have working defaults)."""

    read_mode: str = "auto"
    """Local reads: "auto" (chosen per dataset when it is opened: "mmap-random" when the .bin fits in half of the
    memory the page cache can use and at least half of it is cached, else "direct" (a cold or too large file), else,
    where O_DIRECT is refused, "mmap-random" for a file that fits and "pread" for one that does not), "mmap-random"
    (memory map with madvise(MADV_RANDOM): no read-ahead, so a cold read costs the pages a sample touches; from the
    page cache a compiled memcpy per span, no system call), "pread" (os.preadv per span, read-ahead off: the same
    pages, one system call each), "direct" (O_DIRECT reads aligned to the device's logical block, bypassing the page
    cache: the least disk traffic on a corpus larger than RAM), "mmap" (memory map with the kernel's read-ahead:
    megabytes per fault on random access; for comparison)."""

    block_size: int = 256 * MiB
    """Remote .bin reads: bytes per ranged request (Megatron-Core's S3 reader reads 256 MiB blocks)."""

    cache_blocks: int = 2
    """Remote .bin reads: blocks kept in memory per dataset (LRU), so block_size * cache_blocks bytes at most."""

    prefetch_blocks: int = 1
    """Remote .bin reads: blocks fetched ahead on background threads for the samples the loader asks for next, so
    that a step does not wait on a GET; per dataset and process, memory is block_size * (cache_blocks +
    prefetch_blocks) at most. 0: no prefetching."""

    auto_direct_above_bytes: int | None = None
    """read_mode "auto": a .bin larger than this is read with O_DIRECT (pread where refused), a smaller one through
    the memory map; None: AUTO_PAGE_CACHE_FRACTION (1/2) of min(MemAvailable, the cgroup's memory limit), read when
    the dataset is opened."""

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec options of remote URLs, e.g. {"endpoint_url": "http://host:7480", "key": ..., "secret": ...}; for
    s3 they go to s3fs.S3FileSystem, with endpoint_url moved into client_kwargs."""

    local_cache_dir: str | None = None
    """A directory on fast local disk: datasets are copied there on first use and read from there."""

    local_cache_max_bytes: int | None = None
    """Size cap of local_cache_dir; least-recently-used datasets are evicted to stay under it (None: no cap)."""

    local_cache_staging: str = "at-open"
    """How datasets reach local_cache_dir: "at-open" (each is copied when it is opened, so training starts once the
    whole blend is local), or "background" (each is opened from its source and read from there; one process per
    node copies the blend into the local cache, in the order the blend first reads its datasets, and each dataset is
    read from its copy from the first read after the copy is complete and verified; progress in
    local_cache_dir/stage-*.json; storage/stage.py)."""

    verify_sha256: bool = False
    """Re-hash a local-cache copy against the sha256 recorded at copy time each time it is opened (O(size))."""

    node_share_dir: str | None = None
    """A node-local directory (e.g. "/dev/shm") where the first process of a node to open a blend reads every .idx
    and stats every .bin once, for the node's other processes to map (storage/node_share.py): the shared file
    system's metadata operations per dataset are then made once per node, not once per rank, and the others wait on
    a node-local flock, not a job-wide barrier. None: each process reads the indices itself. Local paths only (URLs
    and the local cache tier are opened per process)."""

    def __post_init__(self) -> None:
        if self.local_cache_staging not in LOCAL_CACHE_STAGING:
            raise ValueError(f"local_cache_staging {self.local_cache_staging!r}: choose one of {LOCAL_CACHE_STAGING}")
        if self.read_mode not in READ_MODES:
            raise ValueError(f"read_mode {self.read_mode!r}: choose one of {READ_MODES}")
        if self.local_cache_max_bytes is not None and self.local_cache_max_bytes < 1:
            raise ValueError(f"local_cache_max_bytes must be positive or None ({self.local_cache_max_bytes})")
        if self.auto_direct_above_bytes is not None and self.auto_direct_above_bytes < 0:
            raise ValueError(f"auto_direct_above_bytes must not be negative ({self.auto_direct_above_bytes})")
        if self.prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must not be negative ({self.prefetch_blocks})")
        if self.block_size < 1 or self.cache_blocks < 1:
            raise ValueError(f"block_size and cache_blocks must be positive ({self.block_size}, {self.cache_blocks})")


def with_read_mode(config: StorageConfig | None, read_mode: str) -> StorageConfig:
    """`config` with another read mode (benchmarks compare them).

    Example:
        >>> with_read_mode(None, "mmap").read_mode
        'mmap'
    """
    return replace(config or StorageConfig(), read_mode=read_mode)
