"""RETRO retrieval databases: chunks → embeddings → Faiss index → neighbours, each a resumable stage.

    build_knn(BuildConfig(prefix="out/corpus_text_document", output="db/"))   # the whole pipeline
    query_knn("db/", "some text")                                             # nearest chunks, as text
    RetroDataset("db/")[0]                                                    # a sample with neighbour tokens

Layout of a database directory, every file written under a temporary name and renamed when complete:

    manifest.json                  config, data fingerprint, embedder, index key, search parameters, stats
    chunks/{doc,start,length}.npy  the chunk table (int64 document, int64 first token in the .bin, int16 length)
    embeddings/pca_*.npy           the hashed embedder's projection, fitted on the corpus (see hashed.py)
    embeddings/shard_NNNNN.npy     float16 (n, dim), L2-normalised, `shard_size` chunks each
    index/index.faiss              the filled index (index/trained.faiss, index/part_NNNNN.faiss while building)
    index/index.ivfdata            its inverted lists, when merged on disk (an index larger than half the RAM)
    neighbours.bin                 int64 (queries, K) with a 64-byte header (see neighbours.py)

Chunk tokens are never copied: neighbour and continuation tokens are read from the source `.bin` memmap.
Every stage but recall splits into shard tasks (document ranges, embedding shards, index add ranges, blocks of
query chunks) that an executor runs: local processes (`--workers`) or Ray (`--executor ray`, nodes sharing the
file system); the bytes written do not depend on which, nor on how many workers. Training the index, merging
its parts and tuning recall run in the driver; an HNSW graph cannot be merged, so it is filled there too.
"""

from __future__ import annotations

from corpusforge.lazy_exports import lazy_exports

# Resolved on first use (PEP 562), as in corpusforge.train: `corpusforge.retro.config` must not import numba (0.4 s)
_EXPORTS = {
    "BuildConfig": "config",
    "BuildResult": "build",
    "RetroDataset": "dataset",
    "RetroError": "common",
    "build_knn": "build",
    "query_knn": "build",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
