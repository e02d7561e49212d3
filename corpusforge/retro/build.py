"""`build_knn`: the stages in order (chunks → embeddings → index → recall → neighbours) under one manifest.

`DB/manifest.json` holds the resolved configuration, the identity a resumed run must match (data
fingerprint, embedder, chunking, seed), the index plan and the tuned search parameters, and each finished
stage's statistics. A stage is finished when its entry is in the manifest; its files are written atomically
before that, so a killed run resumes at the first unfinished stage (and inside it, at the first missing shard).
A resume may change what shapes only stages not yet begun (--max-index-memory before the index is trained, -k
before the neighbours stage: SHAPED_FIRST); the index is planned before any work, so a budget no index fits
fails at once, not after the embeddings.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from corpusforge.executors import Executor, make_executor
from corpusforge.indexed import IndexedDataset
from corpusforge.retro import chunks as chunks_mod
from corpusforge.retro import index as index_mod
from corpusforge.retro import neighbours as nb_mod
from corpusforge.retro.common import (
    RetroError,
    data_fingerprint,
    import_faiss,
    open_dataset,
    parse_bytes,
    write_json,
)
from corpusforge.retro.config import BuildConfig
from corpusforge.retro.embed import (
    Embedder,
    EmbeddingStore,
    EmbedJob,
    embed_chunks,
    fit_embedder,
    load_embedder,
    load_fitted,
)
from corpusforge.retro.fastscan import is_fast_scan
from corpusforge.retro.gpu import gpus_for
from corpusforge.retro.hashed import HashedNgramEmbedder
from corpusforge.retro.listmajor import search_batch

MANIFEST = "manifest.json"
# What a manifest written before an option existed was built with: before --kmeans, faiss's one k-means
LEGACY_IDENTITY = {"kmeans": "flat"}
RECALL_K = 10


@dataclass
class BuildResult:
    output: str
    plan: dict
    stages: dict = field(default_factory=dict)
    recall: dict = field(default_factory=dict)
    dry_run: bool = False
    estimates: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_tokenizer(prefix: str, spec: str | None) -> str | None:
    """The tokenizer that turns the dataset's tokens into text (model embedders, query-knn): `spec` when given,
    else the one `corpusforge preprocess` recorded in P.preprocess.json; None means the default, cl100k_base.

    Example: resolve_tokenizer("out/c_text_document", None) -> '/data/tok/tokenizer.json'
    """
    if spec is not None:
        return spec
    from corpusforge.describe import recorded_tokenizer
    from corpusforge.tokenizers import DEFAULT_TOKENIZER

    recorded = recorded_tokenizer(prefix)
    if recorded is None or recorded.spec in (None, DEFAULT_TOKENIZER):
        return None
    return recorded.spec


def _load_tokenizer(spec: str | None):
    from corpusforge.tokenizers import load_tokenizer

    return load_tokenizer(spec)


def build_knn(config: BuildConfig, dry_run: bool = False, resume: bool = False, progress=None) -> BuildResult:
    """Build (or with `resume`, finish) the database in `config.output`; `dry_run` plans without writing.

    `progress(stage, total)`, when given, is called as each stage starts and returns `advance(n)`, which the stage
    calls as it goes (chunks, embedding, index, recall, neighbours; total None where it is not known).

    Example: build_knn(BuildConfig("out/corpus_text_document", "db/")).recall["recall@10"] -> 0.96"""
    ds = open_dataset(config.prefix)
    budget = parse_bytes(config.max_index_memory)
    gpus_for(import_faiss(), config.gpu)  # '--gpu on' without a GPU fails now, not after the embeddings stage
    tok_spec = resolve_tokenizer(config.prefix, config.tokenizer)
    tokenizer = _load_tokenizer(tok_spec) if config.embedder != "hashed" else None
    embedder = load_embedder(config.embedder, config.dim, config.seed, tokenizer)
    if dry_run:
        return _dry_run(config, ds, embedder.dim, budget)
    query_ds = open_dataset(config.query_prefix) if config.query_prefix else None
    out = Path(config.output)
    ident = config.identity(
        data_fingerprint(config.prefix),
        embedder.fingerprint,
        data_fingerprint(config.query_prefix) if query_ds else None,
    )
    # the index is planned now, not after hours of embedding: a budget it cannot meet fails before any work
    check_plan = partial(_plan, config, chunks_mod.count_chunks(ds, config.chunk_length), embedder.dim, budget)
    manifest = _open_manifest(out, ident, resume, config, tok_spec, check_plan)
    stages = {"chunks", "embeddings", "index", "recall"} | ({"neighbours"} if config.neighbours else set())
    if not stages <= set(manifest["stages"]):  # (a Ray executor connects on entry: only when there is work)
        with make_executor(
            config.executor, config.workers, config.ray_address, keep_workers=config.ray_keep_workers
        ) as executor:
            try:
                _run_stages(BuildContext(config, manifest, ds, query_ds, embedder, budget, executor, progress))
            finally:
                index_mod.shared_index.cache_clear()  # the driver's copy, which forked workers shared
    return BuildResult(str(out), manifest["plan"], manifest["stages"], manifest["stages"]["recall"])


@dataclass
class BuildContext:
    """One build under way: what its stages read (configuration, datasets, embedder, executor, progress) and the
    manifest each finished stage records itself in (`finish`), which is how a resumed build skips it.

    Example: ctx.done("chunks") or ctx.finish("chunks", build_chunks(ctx.ds, ctx.out / "chunks", 64))"""

    config: BuildConfig
    manifest: dict
    ds: IndexedDataset
    query_ds: IndexedDataset | None
    embedder: Embedder
    """The database's embedder; fitted (its projection read back) once the embeddings stage has run."""
    budget: int
    """--max-index-memory in bytes."""
    executor: Executor
    progress: Callable | None = None
    """build_knn's `progress(stage, total) -> advance(n)`."""

    @property
    def out(self) -> Path:
        return Path(self.config.output)

    def done(self, stage: str) -> bool:
        return stage in self.manifest["stages"]

    def finish(self, stage: str, stats: dict) -> None:
        """Record `stage` as finished with its statistics (its files are all written by then)."""
        self.manifest["stages"][stage] = stats
        self.save()

    def save(self) -> None:
        write_json(self.out / MANIFEST, self.manifest)

    def advance(self, stage: str, total: int | None) -> Callable[[int], None] | None:
        """The progress callback of `stage` (None without progress)."""
        return self.progress(stage, total) if self.progress else None


def _run_stages(ctx: BuildContext) -> None:
    """Every unfinished stage in order; all but recall run as tasks on `ctx.executor`."""
    config, out = ctx.config, ctx.out
    _chunk_and_embed(ctx)
    ctx.embedder = load_fitted(ctx.embedder, out / "embeddings")
    table = chunks_mod.ChunkTable.load(out / "chunks")
    store = EmbeddingStore(out / "embeddings", len(table), ctx.embedder.dim, config.shard_size)
    if not ctx.done("index"):
        ctx.finish("index", _index_stage(ctx, store, len(table)))
    plan = index_mod.IndexPlan(**ctx.manifest["plan"])
    path = out / "index" / "index.faiss"
    # the driver's index is the one the tasks share (forked workers inherit it): see index.shared_index
    index = index_mod.shared_index(str(path.resolve()), path.stat().st_mtime_ns)
    index_mod.set_search_params(index, plan.search_params)
    if not ctx.done("recall"):
        recall = _tune_recall(config, plan, index, store, table, ctx.advance("recall", None))
        ctx.manifest["search_params"], ctx.manifest["candidates"] = recall["search_params"], recall["candidates"]
        ctx.finish("recall", recall)
    if config.neighbours and not ctx.done("neighbours"):
        ctx.finish("neighbours", _neighbours_stage(ctx, store, table))


def _chunk_and_embed(ctx: BuildContext) -> None:
    """The two stages that split into shard tasks on `ctx.executor` (document ranges, embedding shards)."""
    config, out = ctx.config, ctx.out
    if not ctx.done("chunks"):
        chunk = partial(chunks_mod.build_chunks, per_task=config.shard_size, executor=ctx.executor)
        total = chunks_mod.count_chunks(ctx.ds, config.chunk_length)
        stats = chunk(ctx.ds, out / "chunks", config.chunk_length, progress=ctx.advance("chunks", total))
        if ctx.query_ds is not None:
            stats["query"] = chunk(ctx.query_ds, out / "query_chunks", config.chunk_length)
        ctx.finish("chunks", stats)
    if not ctx.done("embeddings"):
        table = chunks_mod.ChunkTable.load(out / "chunks")
        embedder, fit_stats = fit_embedder(ctx.embedder, table, ctx.ds.tokens, out / "embeddings", config.chunk_length)
        job = EmbedJob(
            os.path.abspath(config.prefix),
            os.path.abspath(out / "chunks"),
            os.path.abspath(out / "embeddings"),
            embedder,
            config.shard_size,
            config.chunk_length,
        )
        stats = embed_chunks(job, len(table), ctx.executor, ctx.advance("embedding", len(table)))
        ctx.finish("embeddings", {**stats, **fit_stats})


def _index_stage(ctx: BuildContext, store: EmbeddingStore, n: int) -> dict:
    """Plan (or, once trained, keep the plan of) the index, then train and fill it."""
    config, out = ctx.config, ctx.out
    if "plan" in ctx.manifest and (out / "index" / "trained.faiss").exists():
        # the index is trained to this plan: planning again on a machine with other RAM, or after the
        # planner's rules changed, could name another index than the one the add tasks fill
        plan = index_mod.IndexPlan(**ctx.manifest["plan"])
    else:
        plan = _plan(config, n, ctx.embedder.dim, ctx.budget)
        ctx.manifest["plan"] = plan.to_dict()
        ctx.save()
    on_disk = config.index_on_disk
    if on_disk is None:  # fast-scan lists have no on-disk form: such an index stays in RAM (see plan_index)
        on_disk = not index_mod.fits_in_ram(plan.ram_bytes) and not is_fast_scan(plan.key)
    gpus = gpus_for(import_faiss(), config.gpu) if plan.nlist else 0
    build = partial(index_mod.build_index, executor=ctx.executor, on_disk=on_disk and plan.nlist > 0, gpus=gpus)
    return build(plan, store, out / "index", config.seed, ctx.advance("index", plan.n))


# The first stage each part of the identity shapes: it may change on resume until that stage has begun.
SHAPED_FIRST = {
    "data": "chunks",
    "query_data": "chunks",
    "chunk_length": "chunks",
    "shard_size": "chunks",  # chunk tasks, embedding shards and neighbour blocks are cut by it
    "embedder": "embeddings",
    "seed": "embeddings",  # and the index's training sample, the recall queries
    "train_per_list": "index",
    "kmeans": "index",
    "index_key": "index",
    "max_index_memory": "index",
    "candidates": "recall",  # where the tuning starts; the neighbours stage uses the tuned value
    "recall_queries": "recall",
    "recall_target": "recall",
    "k": "neighbours",
}


def _stage_state(out: Path, manifest: dict, stage: str) -> str | None:
    """'finished', 'begun' (it left files a resume reuses), or None: not begun, so its options may still change."""
    if stage in manifest["stages"]:
        return "finished"
    begun = {
        "chunks": [out / "chunks", out / "query_chunks"],
        "embeddings": [out / "embeddings"],
        "index": [out / "index" / "trained.faiss"],  # a resumed index stage fills the index it trained
        "neighbours": [out / "neighbours.bin.parts"],
    }
    return "begun" if any(p.exists() for p in begun.get(stage, [])) else None


def _open_manifest(out: Path, ident: dict, resume: bool, config: BuildConfig, tok_spec, check_plan) -> dict:
    """The manifest of the build in `out`: a new one, or (`resume`) the existing one, where options that shape only
    stages not yet begun may have changed (they are recorded anew); any other change is refused, in one line that
    names the option and the stage that holds it. `check_plan()` raises where the index cannot be planned (a
    --max-index-memory too small): called before anything is written, unless the index is already trained."""
    path = out / MANIFEST
    if path.exists():
        manifest = json.loads(path.read_text())
        if not resume:
            raise RetroError(
                f"{out}: a database is already there; pass --resume to finish it, or choose a new --output"
            )
        old = {**LEGACY_IDENTITY, **manifest.get("identity", {})}
        changed = [key for key in sorted(set(old) | set(ident)) if old.get(key) != ident.get(key)]
        for key in changed:
            stage = SHAPED_FIRST.get(key, "chunks")
            state = _stage_state(out, manifest, stage)
            if state is not None:
                raise RetroError(
                    f"{out}: cannot resume: {key} was {old.get(key)!r}, now {ident.get(key)!r}, and the {stage} stage "
                    f"it shapes is {state} with the old value; resume with {_option(key, old.get(key))}, or build "
                    "into a new --output"
                )
        if _stage_state(out, manifest, "index") is None:
            check_plan()
        if changed:  # every change is to a stage not begun: resume under the new options
            manifest["identity"], manifest["config"] = ident, asdict(config)
            write_json(path, manifest)
        return manifest
    check_plan()
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"version": 1, "identity": ident, "config": asdict(config), "tokenizer": tok_spec, "stages": {}}
    write_json(path, manifest)
    return manifest


def _option(key: str, value) -> str:
    """How a user gives `key` = `value` again on the command line."""
    if key in ("data", "query_data"):
        return "the same dataset (unchanged since)" if key == "data" else "the same --query-prefix dataset"
    if key == "embedder":
        return f"the same --embedder, --dim and --seed (embedder {value})"
    flag = {"k": "--neighbours-k"}.get(key, "--" + key.replace("_", "-"))
    return f"no {flag}" if value is None else f"{flag} {value}"


def _eval_ids(n: int, plan: index_mod.IndexPlan, config: BuildConfig) -> tuple[np.ndarray, int]:
    """Query chunks for recall: a seeded sample of chunks outside the index's training sample, topped up from the
    training sample where too few are left out (a small database that trained on all of it). Returns (ids, how
    many of them are held out)."""
    rng = np.random.default_rng(config.seed + 1)
    train = index_mod.train_sample_ids(n, plan.train_size, config.seed)
    pool = np.setdiff1d(np.arange(n), train, assume_unique=True)
    held_out = rng.choice(pool, size=min(config.recall_queries, len(pool)), replace=False)
    top_up = min(config.recall_queries, n) - len(held_out)
    return np.sort(np.concatenate([held_out, rng.choice(train, size=top_up, replace=False)])), len(held_out)


def _tune_recall(config, plan, index, store, table, progress=None) -> dict:
    t0 = time.perf_counter()
    ids, held_out = _eval_ids(store.n, plan, config)
    queries, qdoc = store.get(ids), np.asarray(table.doc[ids])
    k = min(RECALL_K, max(1, store.n - 1))
    exact = nb_mod.exact_search(store, table.doc, queries, qdoc, k)
    db = nb_mod.Database(index, store, table.doc)

    def scores(ids: np.ndarray) -> np.ndarray:  # exact similarities of (Q, k) chunk ids to their queries
        return np.einsum("qkd,qd->qk", store.get(ids), queries)

    widths = index_mod.candidate_steps(config.candidates) if index_mod.tunes_candidates(plan.key) else None
    params, tried, best = plan.search_params, [], None
    while True:
        width = config.candidates
        if widths:  # the fewest candidates that reach the target at these params, else the most
            found = nb_mod.search_prefixes(db, queries, qdoc, k, params, widths)
            reach = [w for w in widths if nb_mod.recall_at(found[w], exact, scores) >= config.recall_target]
            width = reach[0] if reach else widths[-1]
        t1 = time.perf_counter()
        approx, _ = nb_mod.search(db, queries, qdoc, k, width, params)
        qps = len(ids) / (time.perf_counter() - t1)
        r = nb_mod.recall_at(approx, exact, scores)
        tried.append({"search_params": params, "candidates": width, "recall": round(r, 4), "qps": round(qps)})
        if progress:
            progress(1)
        if r >= config.recall_target:
            # with candidates tuned, a wider nprobe may reach the target with fewer of them, for less: keep the
            # cheapest setting (index.query_cost) and go on while a wider one could still cost less
            cost = index_mod.query_cost(plan, params, width) if widths else 0.0
            if best is None or cost < best[0]:
                best = (cost, len(tried) - 1)
        nxt = index_mod.escalate(params)
        if nxt is None or index_mod.probes_every_list(plan, params):
            break
        if best is not None and (not widths or index_mod.query_cost(plan, nxt, widths[0]) >= best[0]):
            break
        params = nxt
    if best is not None:
        chosen = tried[best[1]]
        params, width, r = chosen["search_params"], chosen["candidates"], chosen["recall"]
        index_mod.set_search_params(index, params)  # the last step tried may have been a wider one
    raw = _recall_without_rerank(index, table.doc, queries, qdoc, k, exact, scores)
    return {
        f"recall@{k}": round(r, 4),
        "recall_without_rerank": round(raw, 4),
        "queries": len(ids),
        "held_out": held_out,
        "search_params": params,
        "candidates": width,
        "qps": tried[best[1] if best is not None else -1]["qps"],
        "tried": tried,
        "target": config.recall_target,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _recall_without_rerank(index, db_doc, queries, qdoc, k, exact, scores) -> float:
    """The index's own order: the first k hits outside the query's document, as a search without re-ranking gives."""
    _, cand = search_batch(index, queries, max(4 * k, 32))
    bad = (cand < 0) | (db_doc[np.maximum(cand, 0)] == qdoc[:, None])
    approx = np.array(
        [c[~b][:k].tolist() + [-1] * (k - int((~b).sum()) if (~b).sum() < k else 0) for c, b in zip(cand, bad)]
    )
    return nb_mod.recall_at(approx, exact, scores)


def _neighbours_stage(ctx: BuildContext, store: EmbeddingStore, table: chunks_mod.ChunkTable) -> dict:
    config, manifest, embedder, executor = ctx.config, ctx.manifest, ctx.embedder, ctx.executor
    out = ctx.out.resolve()
    queries = None
    n = len(table)
    if ctx.query_ds is not None:  # another dataset's chunks, embedded inside the tasks
        qtable = chunks_mod.ChunkTable.load(out / "query_chunks")
        queries = nb_mod.QueryChunks(
            os.path.abspath(config.query_prefix), str(out / "query_chunks"), embedder, config.chunk_length
        )
        n = len(qtable)
        if not isinstance(embedder, HashedNgramEmbedder):
            executor = None  # a model (torch, maybe a GPU) embeds in this process only, as in the embeddings stage
    job = nb_mod.NeighbourJob(
        index=str(out / "index" / "index.faiss"),
        params=manifest["search_params"],
        chunks=str(out / "chunks"),
        embeddings=str(out / "embeddings"),
        dim=store.dim,
        shard_size=config.shard_size,
        parts=str(out / "neighbours.bin.parts"),
        k=config.k,
        candidates=manifest.get("candidates", config.candidates),  # tuned (older databases: as configured)
        queries=queries,
    )
    block = min(config.shard_size, 65536)
    return nb_mod.build_neighbours(
        job, n, out / "neighbours.bin", block, executor, progress=ctx.advance("neighbours", n)
    )


def _plan(config: BuildConfig, n: int, dim: int, budget: int) -> index_mod.IndexPlan:
    """The planner's index for `n` vectors under `config` on this machine (half its RAM for in-RAM indexes)."""
    return index_mod.plan_index(
        n,
        dim,
        budget,
        config.train_per_list,
        config.index_key,
        index_mod.index_ram(),
        config.kmeans,
        on_disk=config.index_on_disk is True,
    )


def _dry_run(config: BuildConfig, ds, dim: int, budget: int) -> BuildResult:
    n = chunks_mod.count_chunks(ds, config.chunk_length)
    plan = _plan(config, n, dim, budget)
    est = estimates(n, dim, plan, config.k)
    return BuildResult(config.output, plan.to_dict(), dry_run=True, estimates=est)


def estimates(n: int, dim: int, plan: index_mod.IndexPlan, k: int) -> dict:
    """Disk and time of every stage for `n` chunks (time from the rates in index.py, a 2-core machine)."""
    disk = {
        "chunks": n * 18,
        "embeddings": n * dim * 2,
        "index": plan.disk_bytes,
        "neighbours": n * k * 8,
    }
    low, high = index_mod.neighbour_seconds(plan)
    hours = {
        "embeddings": round(n / index_mod.RATE_EMBED_HASHED / 3600, 3),
        "index": round((plan.est_train_s + plan.est_add_s) / 3600, 3),
        "neighbours": [round(n * low / 3600, 3), round(n * high / 3600, 3)],  # a range: see neighbour_seconds
    }
    return {
        "chunks": n,
        "disk_bytes": disk,
        "disk_total": sum(disk.values()),
        "ram_bytes": plan.ram_bytes,
        "hours_2_cores": hours,
    }


# -- query ----------------------------------------------------------------------------------------------------


def query_knn(db: str | os.PathLike, text: str, k: int = 5, max_chunks: int = 4) -> list[dict]:
    """The nearest DB chunks of each chunk of `text` (at most `max_chunks`), as decoded text with scores."""
    db = Path(db)
    path = db / MANIFEST
    if not path.is_file():
        raise RetroError(f"{db}: not a retrieval database (no {MANIFEST}); build one with `corpusforge build-knn`")
    manifest = json.loads(path.read_text())
    if "recall" not in manifest["stages"]:
        raise RetroError(f"{db}: the database is unfinished; rerun build-knn with --resume")
    cfg = BuildConfig(**manifest["config"])
    tokenizer = _load_tokenizer(manifest.get("tokenizer"))
    embedder = load_embedder(cfg.embedder, cfg.dim, cfg.seed, tokenizer)
    built_with = manifest["identity"]["embedder"]
    if built_with != embedder.fingerprint:  # a database of an older embedder: its vectors are not comparable
        raise RetroError(
            f"{db}: built with embedder {built_with}, but this corpusforge embeds with {embedder.fingerprint}; "
            "rebuild the database (build-knn into a new --output)"
        )
    embedder = load_fitted(embedder, db / "embeddings")
    ds = open_dataset(cfg.prefix)
    table = chunks_mod.ChunkTable.load(db / "chunks")
    store = EmbeddingStore(db / "embeddings", len(table), embedder.dim, cfg.shard_size)
    index = index_mod.load_index(db / "index" / "index.faiss", manifest["search_params"])
    ids = np.asarray(tokenizer.encode_batch([text])[0], dtype=np.int64)
    if len(ids) == 0:
        raise RetroError("the query text is empty")
    pieces = [ids[i : i + cfg.chunk_length] for i in range(0, len(ids), cfg.chunk_length)][:max_chunks]
    qtok = np.full((len(pieces), cfg.chunk_length), -1, dtype=np.int64)
    for i, p in enumerate(pieces):
        qtok[i, : len(p)] = p
    found, scores = nb_mod.search(
        nb_mod.Database(index, store, table.doc),
        embedder.embed(qtok),
        None,
        k,
        max(manifest.get("candidates", cfg.candidates), k),
        manifest["search_params"],
    )
    results = []
    for qi, piece in enumerate(pieces):
        for rank, (cid, score) in enumerate(zip(found[qi], scores[qi])):
            if cid < 0:
                continue
            tokens = table.tokens(ds.tokens, [cid], cfg.chunk_length)[0]
            results.append(
                {
                    "query_chunk": qi,
                    "query_text": tokenizer.decode(piece.tolist()),
                    "rank": rank,
                    "chunk": int(cid),
                    "document": int(table.doc[cid]),
                    "score": round(float(score), 4),
                    "text": tokenizer.decode(tokens[tokens >= 0].tolist()),
                }
            )
    return results
