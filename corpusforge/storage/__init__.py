"""Where token datasets are read from: local disk, shared file systems, object stores (fsspec), a local cache tier.

`open_dataset(prefix, config)` returns a `corpusforge.indexed.IndexedDataset` whose tokens come through the reader
that `config` (a StorageConfig) calls for: one dataset class over one reader seam (`indexed.BinReader`, as
Megatron-Core's `_BinReader`), the variant chosen in one place (`readers.open_reader`). The loaders call one method
of it, `read_spans(starts, lengths)`: the tokens of many [start, start + length) ranges, back to back, in one call;
or copy samples straight from `ds.reader.memory` where the reader is a memory map.

    config.py       StorageConfig: read mode, remote block sizes, fsspec options, the local cache tier
    readers.py      the local readers (memory map, pread, O_DIRECT) and open_reader, the choice of a variant
    read_mode.py    read_mode "auto": page-cache budget (/proc, cgroup), residency (mincore), O_DIRECT support
    remote.py       fsspec URLs: the .idx fetched whole, the .bin in large ranged GETs through a block cache
    local_cache.py  copies on fast local disk shared by a node's processes (flocks), evicted LRU under a cap
    pagecache.py    page-cache control for honest cold-read measurements (drop a file, ask what is cached)
    datasets.py     open_dataset: a prefix and a StorageConfig become a validated IndexedDataset

Example:
    >>> ds = open_dataset("out/a_text_document", StorageConfig(read_mode="pread"))
    >>> ds.read_mode, type(ds.reader).__name__, ds.read_spans(np.array([0]), np.array([3]))
    ('pread', 'PreadBinReader', array([  464,  2068, 50256], dtype=uint16))
"""

from corpusforge.indexed import BinReader, IndexedDataset, MMapBinReader, copy_spans
from corpusforge.storage.config import READ_MODES, StorageConfig, with_read_mode
from corpusforge.storage.datasets import open_dataset
from corpusforge.storage.local_cache import LocalCache, ReaderPin
from corpusforge.storage.pagecache import drop_page_cache, resident_fraction
from corpusforge.storage.read_mode import choose_read_mode, o_direct_refused, page_cache_memory
from corpusforge.storage.readers import DirectBinReader, PreadBinReader, open_reader
from corpusforge.storage.remote import BlockCache, RemoteBinReader, filesystem

__all__ = [
    "READ_MODES",
    "BinReader",
    "BlockCache",
    "DirectBinReader",
    "IndexedDataset",
    "LocalCache",
    "MMapBinReader",
    "PreadBinReader",
    "ReaderPin",
    "RemoteBinReader",
    "StorageConfig",
    "choose_read_mode",
    "copy_spans",
    "drop_page_cache",
    "filesystem",
    "o_direct_refused",
    "open_dataset",
    "open_reader",
    "page_cache_memory",
    "resident_fraction",
    "with_read_mode",
]
