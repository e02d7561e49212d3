"""`build-knn`'s options: what a retrieval database is built from and how. Apart from the modules that build it,
so that the CLI makes its options (and `corpusforge --help` lists the command) without importing numba or faiss.

Example:
    >>> BuildConfig(prefix="out/corpus_text_document", output="db/").chunk_length
    64
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuildConfig:
    prefix: str
    """Token dataset (PREFIX.bin/.idx) whose chunks form the retrieval database."""
    output: str
    """Database directory; created if missing."""
    chunk_length: int = 64
    """Tokens per chunk (RETRO: 64). Chunks never cross a document; a document's last chunk may be shorter."""
    embedder: str = "hashed"
    """'hashed' (model-free, lexical) or a local sentence-transformers / Hugging Face model directory."""
    dim: int = 128
    """Dimension of the hashed embedder (a multiple of 64); a model has its own."""
    tokenizer: str | None = None
    """Tokenizer of the dataset, for detokenising (model embedder, query-knn); default: the one recorded by
    preprocess in PREFIX.preprocess.json, else cl100k_base."""
    max_index_memory: str = "16G"
    """RAM the filled index may use; the planner picks the most exact index that fits."""
    index_key: str | None = None
    """Force a Faiss index_factory string instead of the planner's choice."""
    train_per_list: int = 64
    """Training vectors per inverted list (faiss wants 39..256)."""
    kmeans: str = "auto"
    """How an IVF index's lists are trained: 'flat' (faiss's k-means of nlist centroids), 'two-level' (sqrt(nlist)
    clusters, each split by its own k-means: 46x faster at 16,384 lists), 'auto' (two-level from 16,384 lists)."""
    shard_size: int = 1 << 20
    """Chunks per embedding shard: the unit of resuming and of parallel tasks."""
    k: int = 2
    """Neighbours stored per query chunk (RETRO: 2)."""
    candidates: int = 40
    """Approximate hits fetched per query and re-ranked exactly from the stored embeddings; for an index of
    compressed codes (PQ) the recall tuning raises it (up to 1024) where that reaches the target sooner."""
    query_prefix: str | None = None
    """Training dataset whose chunks get neighbours; default the database's own (with same-document exclusion)."""
    recall_queries: int = 1000
    """Held-out chunks (not in the training sample) on which recall@10 against exact search is measured."""
    recall_target: float = 0.95
    """Search parameters are raised (nprobe / efSearch doubled) until recall@10 reaches this."""
    seed: int = 0
    """Seeds the embedder, the training sample and the recall queries."""
    neighbours: bool = True
    """Run the neighbours stage (off: build the searchable index only)."""
    gpu: str = "auto"
    """GPUs for the index's k-means and list assignment with faiss-gpu: 'auto' (every one faiss sees; none with
    faiss-cpu), 'on' (an error without one), 'off'. Not part of the identity, though a GPU-filled index's bytes
    differ from a CPU-filled one's: the GPU assigns each vector its exact nearest list, the HNSW quantizer an
    approximate one. Both are valid; a build resumed on other hardware holds some of each."""
    index_on_disk: bool | None = None
    """Merge an IVF index's inverted lists into index/index.ivfdata, searched memory-mapped, instead of holding them
    in RAM; None: when the planned index needs more than half of this machine's RAM. Not part of the identity:
    the lists and search results are the same either way."""
    executor: str = "local"
    """Where the shard tasks (chunking, embedding, index add, neighbours) run: 'local' processes, or 'ray' (nodes
    sharing the file system). The bytes written do not depend on it, nor on `workers`: neither is part of the
    identity of a build."""
    workers: int = 0
    """Shard tasks at once; 0: every core here (local) or every CPU of the Ray cluster."""
    ray_address: str | None = None
    """Ray cluster to join ('auto': the one `ray start` made here); default a new local Ray."""
    ray_keep_workers: float = 60.0
    """Idle seconds Ray's worker processes wait for the next job (corpusforge.executors.pool); 0 ends them with
    this one."""

    def identity(self, data: dict, embedder_fp: str, query_data: dict | None) -> dict:
        """What a resumed build must share with the run it continues."""
        keys = (
            "chunk_length",
            "shard_size",
            "seed",
            "train_per_list",
            "kmeans",
            "index_key",
            "max_index_memory",
            "k",
            "candidates",
            "recall_queries",
            "recall_target",
        )
        return {"data": data, "embedder": embedder_fp, "query_data": query_data, **{k: getattr(self, k) for k in keys}}
