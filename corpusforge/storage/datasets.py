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
from dataclasses import replace

from corpusforge.fsutil import is_url
from corpusforge.indexed import HEADER_SIZE, IndexedDataset, IndexedFormatError, idx_path, parse_header, read_header
from corpusforge.storage.config import StorageConfig
from corpusforge.storage.local_cache import LocalCache, ReaderPin
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
        missing = [p for p in (f"{text}.idx", f"{text}.bin") if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"dataset prefix {text!r}: missing {' and '.join(missing)}; a prefix names the pair PREFIX.bin/.idx "
                f"(e.g. out/corpus_text_document, without the extension) as written by `corpusforge preprocess`"
            )
    return _open(text, config, text)


def _open(prefix: str, config: StorageConfig, source: str, pin: ReaderPin | None = None) -> IndexedDataset:
    """Open `prefix` (local, or a URL) with the reader `config` calls for, validate it, and record how a pickled
    copy reopens it: by its source, in the read mode chosen here (a worker re-running "auto" could see another
    MemAvailable and choose otherwise). `pin` (a local cache entry's) is closed if the dataset is refused."""
    try:
        if is_url(prefix):
            index, fs = fetch_index(prefix, config.storage_options)
            dtype = parse_header(index[:HEADER_SIZE], f"{prefix}.idx").dtype
        else:
            index, fs, dtype = None, None, read_header(idx_path(prefix)).dtype
        reader = open_reader(f"{prefix}.bin", dtype, config, fs)
        ds = IndexedDataset(prefix, check=False, reader=reader, index=index, pin=pin)
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
    ds.reopen = (open_dataset, (source, config if reader.remote else replace(config, read_mode=reader.read_mode)))
    return ds
