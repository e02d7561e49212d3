"""open_dataset: a prefix (a path, a file:// or fsspec URL) and a StorageConfig become an IndexedDataset with the
reader they call for, through the local cache tier when one is configured.

Example:
    >>> ds = open_dataset("s3://corpora/web_text_document",
    ...                   StorageConfig(storage_options={"endpoint_url": "http://127.0.0.1:7480"},
    ...                                 local_cache_dir="/nvme/cf-cache", local_cache_max_bytes=500 << 30))
    >>> ds.read_spans(np.array([0, 4096]), np.array([2049, 2049])).shape
    (4098,)
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from corpusforge.fsutil import is_url, network_fs
from corpusforge.indexed import (
    INDEX_READ_WHOLE_BYTES,
    IndexedDataset,
    IndexedFormatError,
    OpenedIndex,
    open_index,
    require_pair,
)
from corpusforge.storage.config import StorageConfig
from corpusforge.storage.local_cache import LocalCache, ReaderPin
from corpusforge.storage.node_share import open_shared
from corpusforge.storage.read_mode import SMALL_GROUP_MIN, choose_read_modes
from corpusforge.storage.readers import open_reader
from corpusforge.storage.remote import fetch_index


def open_dataset(prefix: str | os.PathLike, config: StorageConfig | None = None) -> IndexedDataset:
    """The token dataset at a local prefix or an fsspec URL, through the local cache tier when one is configured,
    validated, read as `config` says (`ds.read_mode`, `ds.read_mode_reason`: which mode, and why).

    Example:
        >>> open_dataset("out/a_text_document").read_spans(np.array([0]), np.array([3]))
        array([  464,  2068, 50256], dtype=uint16)
    """
    config = config or StorageConfig()
    text = os.fspath(prefix)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if config.local_cache_dir is not None:
        cache = LocalCache(config.local_cache_dir, config.local_cache_max_bytes, config.storage_options)
        path, pin = cache.fetch_pinned(text, verify_sha256=config.verify_sha256)
        return _open(path, config, text, pin)
    if not is_url(text):
        require_pair(text, "a dataset")  # a FileNotFoundError saying why: interrupted write, `out/tiny` meant, ...
    return _open(text, config, text)


def open_datasets(prefixes: Sequence[str | os.PathLike], config: StorageConfig | None = None) -> list[IndexedDataset]:
    """open_dataset of each prefix, in order; the first error in the order of the prefixes is raised.

    A blend of many local datasets read with "auto" is opened as one: each .bin stat'ed once, the read mode of its
    small files decided once for all of them (read_mode.choose_read_modes), not with a mincore probe and an O_DIRECT
    probe per file. One thread: an open is mostly Python holding the GIL, so threads made a 2,500-dataset blend's
    opening 2x slower on a quiet machine (5.1 s against 2.5 s), however well they looked under load.

    Example:
        >>> [len(ds) for ds in open_datasets(["out/a_text_document", "out/b_text_document"])]
        [1000, 400]
    """
    config = config or StorageConfig()
    texts = [os.fspath(p).removeprefix("file://") for p in prefixes]
    if config.local_cache_dir is not None and config.local_cache_staging == "background":
        from corpusforge.storage.stage import wrap_for_staging  # storage.stage imports this module's neighbours

        datasets = open_datasets(texts, replace(config, local_cache_dir=None))  # from the source until staged
        wrap_for_staging(datasets, config)
        return datasets
    if config.node_share_dir is not None and config.local_cache_dir is None and not any(map(is_url, texts)):
        return open_shared(texts, config, open_datasets)  # one process of the node reads; the others map its share
    grouped = config.read_mode == "auto" and config.local_cache_dir is None and len(texts) >= SMALL_GROUP_MIN
    found = None
    if grouped and not any(map(is_url, texts)):
        found = _fetch_concurrently(texts) if network_fs(texts[0]) else None
        found = found or _stat_bins(texts)
    if found is None:  # one by one: a missing file is then reported in the order of the prefixes
        return [open_dataset(p, config) for p in prefixes]
    sizes, devices, indices = found
    choices = choose_read_modes([f"{t}.bin" for t in texts], config, sizes, devices)
    out: list[IndexedDataset] = []
    reopen_configs: dict[str, StorageConfig] = {}  # one per read mode, not a dataclass replace per dataset
    try:
        for text, choice, size, index in zip(texts, choices, sizes, indices):
            out.append(_open(text, config, text, choice=choice, nbytes=size, reopen_configs=reopen_configs,
                             index=index))  # fmt: skip
    except BaseException:
        for ds in out:
            ds.close()
        raise
    return out


def _stat_bins(prefixes: list[str]) -> tuple[list[int], list[int], list[None]] | None:
    """The size and device of each prefix's .bin (and no .idx bytes: each is read when opened); None if one is
    missing (or is no regular file). A missing .idx needs no stat here: opening the datasets in order refuses it
    with its pair's message."""
    sizes, devices = [], []
    try:
        for prefix in prefixes:
            info = os.stat(f"{prefix}.bin")
            if not stat.S_ISREG(info.st_mode):
                return None
            sizes.append(info.st_size)
            devices.append(info.st_dev)
    except OSError:
        return None
    return sizes, devices, [None] * len(prefixes)


# Threads that fetch a blend's .bin sizes and .idx bytes from such a file system: each mostly waits for its server.
_FETCHERS = 16


def _fetch_concurrently(prefixes: list[str]) -> tuple[list[int], list[int], list[bytes | None]] | None:
    """What _stat_bins returns, and the bytes of each small .idx (INDEX_READ_WHOLE_BYTES or less; None for a larger
    one, mapped when opened), fetched by _FETCHERS threads at once: on a network file system each stat and open is
    a round trip to the metadata server, and one thread makes 2,500 datasets' trips one after the other (~4 s on
    CephFS). None if any fetch fails: the one-by-one path then reports the first failure in the prefixes' order."""

    def fetch(prefix: str) -> tuple[int, int, bytes | None]:
        info = os.stat(f"{prefix}.bin")
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(prefix)
        fd = os.open(f"{prefix}.idx", os.O_RDONLY)
        try:
            index = os.fstat(fd)
            data = None
            if stat.S_ISREG(index.st_mode) and index.st_size <= INDEX_READ_WHOLE_BYTES:
                data = os.pread(fd, index.st_size, 0)
                data = data if len(data) == index.st_size else None  # short: left to open_index
        finally:
            os.close(fd)
        return info.st_size, info.st_dev, data

    try:
        with ThreadPoolExecutor(_FETCHERS, thread_name_prefix="open-datasets") as pool:
            fetched = list(pool.map(fetch, prefixes))
    except OSError:
        return None
    return [f[0] for f in fetched], [f[1] for f in fetched], [f[2] for f in fetched]


def _open(
    prefix: str,
    config: StorageConfig,
    source: str,
    pin: ReaderPin | None = None,
    choice: tuple[str, str] | None = None,
    nbytes: int | None = None,
    reopen_configs: dict[str, StorageConfig] | None = None,
    index: bytes | None = None,
) -> IndexedDataset:
    """Open `prefix` (local, or a URL) with the reader `config` calls for (or `choice`, a read mode decided for a
    blend, with `nbytes` the size of its .bin), validate it, and record how a pickled copy reopens it: by its
    source, in the read mode chosen here (a worker re-running "auto" could see another MemAvailable and choose
    otherwise). `pin` (a local cache entry's) is closed if the dataset is refused. `index`: the .idx's bytes,
    where they were fetched already."""
    try:
        if is_url(prefix):
            index, fs = fetch_index(prefix, config.storage_options)
            opened = OpenedIndex.from_bytes(index, f"{prefix}.idx")
        elif index is not None:  # the .idx's bytes, fetched with the blend's others (_fetch_concurrently)
            opened, fs = OpenedIndex.from_bytes(index, f"{prefix}.idx"), None  # as open_index names it
        else:
            opened, fs = open_index(prefix), None
        reader = open_reader(f"{prefix}.bin", opened.header.dtype, config, fs, choice, nbytes)
        ds = IndexedDataset(prefix, check=False, reader=reader, index=opened, pin=pin)
    except BaseException:
        if pin is not None:
            pin.close()  # a refused dataset is not being read: let the cache evict it
        raise
    try:  # the full check after "auto" has measured how much of the .bin is cached: its sample caches some pages
        ds.validate()
    except IndexedFormatError:
        ds.close()
        raise
    ds.source = source
    if reader.remote:
        ds.reopen = (open_dataset, (source, config))
        return ds
    reopen_configs = {} if reopen_configs is None else reopen_configs
    if reader.read_mode not in reopen_configs:
        reopen_configs[reader.read_mode] = replace(config, read_mode=reader.read_mode)
    ds.reopen = (open_dataset, (source, reopen_configs[reader.read_mode]))
    return ds
