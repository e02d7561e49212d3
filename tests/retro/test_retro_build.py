"""build-knn end to end: exclusion by document, exact agreement, recall in the summary, byte-identical rebuilds,
resume after a real SIGKILL in every stage, RetroDataset contents, query-knn, and bad input as one line."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from retrokit import near_duplicate_documents, run_cli, topical_documents, write_dataset

from corpusforge.retro import BuildConfig, RetroDataset, build_knn
from corpusforge.retro import neighbours as nb_mod
from corpusforge.retro.chunks import ChunkTable
from corpusforge.retro.common import RetroError
from corpusforge.retro.embed import EmbeddingStore
from corpusforge.retro.index import load_index
from corpusforge.retro.neighbours import exact_search, read_neighbours

DATA_FILES = (
    "chunks/doc.npy",
    "chunks/start.npy",
    "chunks/length.npy",
    "chunks/doc_end.npy",
    "index/index.faiss",
    "neighbours.bin",
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    """~700 chunks: topical documents, then a document of 40 near-identical chunks (A) and one of 2 copies (B)."""
    root = tmp_path_factory.mktemp("retro")
    return write_dataset(root / "corpus", topical_documents(150, max_len=300) + near_duplicate_documents())


def _config(dataset, out, **kw) -> BuildConfig:
    return BuildConfig(prefix=dataset, output=str(out), shard_size=256, recall_queries=200, **kw)


def _files(db: Path) -> dict[str, bytes]:
    paths = list(DATA_FILES) + sorted(str(p.relative_to(db)) for p in (db / "embeddings").glob("*.npy"))
    return {p: (db / p).read_bytes() for p in paths}


def test_neighbours_equal_exact_search_with_same_document_exclusion(dataset, tmp_path):
    result = build_knn(_config(dataset, tmp_path / "db", index_key="Flat", k=4, candidates=8))
    table = ChunkTable.load(tmp_path / "db" / "chunks")
    nb = read_neighbours(tmp_path / "db" / "neighbours.bin")
    assert nb.shape == (len(table), 4) and nb.dtype == np.int64
    store = EmbeddingStore(tmp_path / "db" / "embeddings", len(table), 128, 256)
    exact = exact_search(store, table.doc, store.get(np.arange(len(table))), np.asarray(table.doc), 4)
    # the same ids, except where two scores tie to float32 rounding (einsum vs BLAS): then the same scores
    queries = store.get(np.arange(len(table)))
    score = lambda ids: np.einsum("qkd,qd->qk", store.get(ids), queries)  # noqa: E731
    np.testing.assert_allclose(score(nb), score(exact), atol=1e-5)
    assert (nb == exact).all(1).mean() > 0.98
    valid = nb >= 0
    assert not (table.doc[np.maximum(nb, 0)] == table.doc[:, None])[valid].any()
    assert result.recall["recall@10"] == 1.0


def test_rerank_gathers_candidate_vectors_a_block_of_rows_at_a_time(dataset, tmp_path, monkeypatch):
    """The exact re-rank gathers the candidates' stored vectors a few rows at a time, with the result of one
    gather: all at once, a neighbours task of 65,536 queries at 320 candidates took 10.7 GB."""
    import tracemalloc

    build_knn(_config(dataset, tmp_path / "db", index_key="Flat", neighbours=False))
    table = ChunkTable.load(tmp_path / "db" / "chunks")
    store = EmbeddingStore(tmp_path / "db" / "embeddings", len(table), 128, 256)
    index = load_index(tmp_path / "db" / "index" / "index.faiss", "")
    queries, doc = store.get(np.arange(len(table))), np.asarray(table.doc)
    db = nb_mod.Database(index, store, table.doc)
    whole = nb_mod.search(db, queries, doc, 4, 400)  # 64 MB blocks: 327 rows, ~3 blocks
    monkeypatch.setattr(nb_mod, "GATHER_BYTES", 1 << 20)  # 5 rows of 400 x 128 float32 a block
    tracemalloc.start()
    try:
        small = nb_mod.search(db, queries, doc, 4, 400)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(small[0], whole[0]) and np.array_equal(small[1], whole[1])
    gathered_at_once = len(table) * 400 * 128 * 4  # ~140 MB
    assert peak < 16 << 20 < gathered_at_once, peak


def test_near_duplicate_chunks_never_neighbour_their_own_document(dataset, tmp_path):
    """Doc A's 40 chunks are each other's nearest; with only 4 candidates the search must widen to find doc B."""
    build_knn(_config(dataset, tmp_path / "db", k=2, candidates=4))
    table = ChunkTable.load(tmp_path / "db" / "chunks")
    nb = read_neighbours(tmp_path / "db" / "neighbours.bin")
    doc_a, doc_b = int(table.doc[-1]) - 1, int(table.doc[-1])
    b_chunks = set(np.flatnonzero(table.doc == doc_b).tolist())
    for q in np.flatnonzero(table.doc == doc_a):
        assert set(nb[q].tolist()) == b_chunks  # both of B's copies, nothing of A, no -1
    for q in b_chunks:  # B's two chunks are identical: each other's nearest, but excluded; A's come first
        assert table.doc[nb[q]].tolist() == [doc_a, doc_a]


def test_pq_recall_tuning_raises_the_candidates_and_the_stage_uses_them(dataset, tmp_path):
    """PQ codes order hits approximately: 40 re-ranked candidates miss the target even over every list, so the
    tuning takes more, records them, and the neighbours stage searches with them."""
    from corpusforge.retro.index import load_index
    from corpusforge.retro.neighbours import Database, recall_at, search

    db = tmp_path / "db"
    result = build_knn(_config(dataset, db, index_key="IVF8,PQ4x4", k=2))
    rec = result.recall
    assert rec["recall@10"] >= 0.95 and rec["candidates"] > 40 and rec["queries"] == 200
    manifest = json.loads((db / "manifest.json").read_text())
    assert manifest["candidates"] == rec["candidates"]
    table = ChunkTable.load(db / "chunks")
    store = EmbeddingStore(db / "embeddings", len(table), 128, 256)
    index = load_index(db / "index" / "index.faiss", rec["search_params"])
    every = np.arange(len(table))
    queries, qdoc = store.get(every), np.asarray(table.doc)
    db_ = Database(index, store, table.doc)
    tuned, _ = search(db_, queries, qdoc, 2, rec["candidates"], rec["search_params"])
    assert np.array_equal(read_neighbours(db / "neighbours.bin"), tuned)
    exact = exact_search(store, table.doc, queries, qdoc, 10)
    score = lambda ids: np.einsum("qkd,qd->qk", store.get(ids), queries)  # noqa: E731
    few, _ = search(db_, queries, qdoc, 10, 40, rec["search_params"])
    assert recall_at(few, exact, score) < 0.95  # nprobe is already every list: only the candidates could help


def test_recall_tuning_keeps_the_cheapest_setting_that_reaches_the_target(tmp_path):
    """With re-ranked candidates tuned, the tuning goes on past the first nprobe that reaches the target while a
    wider one could still cost less (index.query_cost), keeps the cheapest, and stops once every list is probed;
    the neighbours stage then searches with what it kept."""
    from corpusforge.retro.index import IndexPlan, candidate_steps, escalate, probes_every_list, query_cost

    dataset = write_dataset(tmp_path / "corpus", topical_documents(600, seed=5, max_len=300))
    config = BuildConfig(
        dataset, str(tmp_path / "db"), index_key="IVF128,PQ4x4", recall_target=0.99, recall_queries=200
    )
    result = build_knn(config)
    plan, rec = IndexPlan(**result.plan), result.recall
    tried = rec["tried"]
    reached = [t for t in tried if t["recall"] >= 0.99]
    assert len(tried) > 1 and reached
    cost = {id(t): query_cost(plan, t["search_params"], t["candidates"]) for t in tried}
    cheapest = min(reached, key=lambda t: cost[id(t)])
    assert (rec["search_params"], rec["candidates"]) == (cheapest["search_params"], cheapest["candidates"])
    assert rec["qps"] == cheapest["qps"] and rec["recall@10"] == cheapest["recall"]
    first = candidate_steps(40)[0]
    for i, t in enumerate(tried[1:], 1):  # each step past the first hit could have cost less than the best so far
        before = [u for u in tried[:i] if u["recall"] >= 0.99]
        if before:
            assert query_cost(plan, t["search_params"], first) < min(cost[id(u)] for u in before)
    last = tried[-1]["search_params"]
    assert probes_every_list(plan, last) or query_cost(plan, escalate(last), first) >= cost[id(cheapest)]
    manifest = json.loads((tmp_path / "db" / "manifest.json").read_text())
    assert (manifest["search_params"], manifest["candidates"]) == (rec["search_params"], rec["candidates"])


def test_missing_neighbours_are_minus_one(tmp_path):
    prefix = write_dataset(tmp_path / "two", [np.arange(200), np.arange(1000, 1100)])
    build_knn(BuildConfig(prefix=prefix, output=str(tmp_path / "db"), k=3, recall_queries=5))
    nb = read_neighbours(tmp_path / "db" / "neighbours.bin")
    # doc 0 has 4 chunks, doc 1 has 2: chunks of doc 0 find only doc 1's two; doc 1's find doc 0's four
    assert nb[:4, 2].tolist() == [-1] * 4 and (nb[:4, :2] >= 4).all()
    assert (nb[4:] >= 0).all() and (nb[4:] < 4).all()


def test_same_seed_gives_identical_bytes(dataset, tmp_path):
    for key in (None, "HNSW32", "IVF8,Flat"):
        a, b = tmp_path / f"a{key}", tmp_path / f"b{key}"
        build_knn(_config(dataset, a, index_key=key))
        build_knn(_config(dataset, b, index_key=key))
        assert _files(a) == _files(b), key
    c = tmp_path / "c"
    build_knn(_config(dataset, c, index_key="IVF8,Flat", seed=1))
    assert _files(c)["embeddings/shard_00000.npy"] != _files(a)["embeddings/shard_00000.npy"]


def test_cli_summary_json_reports_recall(dataset, tmp_path):
    from corpusforge.cli.retro import build_knn_cmd

    r = CliRunner().invoke(build_knn_cmd, [dataset, "--output", str(tmp_path / "db"), "--shard-size", "256", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["recall"]["recall@10"] >= 0.95 and data["plan"]["key"] == "Flat"
    assert data["stages"]["neighbours"]["queries"] == data["stages"]["chunks"]["chunks"]
    manifest = json.loads((tmp_path / "db" / "manifest.json").read_text())
    assert manifest["identity"]["data"]["sha256"] and manifest["search_params"] == data["recall"]["search_params"]
    dry = CliRunner().invoke(build_knn_cmd, [dataset, "--output", str(tmp_path / "dry"), "--dry-run", "--json"])
    assert json.loads(dry.output)["estimates"]["chunks"] == data["stages"]["chunks"]["chunks"]
    assert not (tmp_path / "dry").exists()


def test_retro_dataset_gathers_neighbour_and_continuation_tokens(dataset, tmp_path):
    build_knn(_config(dataset, tmp_path / "db"))
    ds = RetroDataset(tmp_path / "db", seq_length=128, pad_id=0)
    table = ChunkTable.load(tmp_path / "db" / "chunks")
    from corpusforge.indexed import IndexedDataset

    tokens = np.asarray(IndexedDataset(dataset).tokens)
    batch = ds.get_batch([0, 3])
    assert batch["tokens"].shape == (2, 128) and batch["neighbours"].shape == (2, 2, 2, 128)
    sample = ds[3]
    for j, chunk in enumerate(sample["chunk_ids"]):
        s, n = int(table.start[chunk]), int(table.length[chunk])
        assert sample["tokens"][j * 64 : j * 64 + n].tolist() == tokens[s : s + n].tolist()
        for slot, nb in enumerate(sample["neighbour_ids"][j]):
            s, end = int(table.start[nb]), int(table.doc_end[table.doc[nb]])
            expect = tokens[s : min(end, s + 128)].tolist()
            got = sample["neighbours"][j, slot]
            assert got[: len(expect)].tolist() == expect and (got[len(expect) :] == 0).all()
    assert np.array_equal(batch["neighbours"][1], sample["neighbours"])


def test_query_knn_shows_chunks_as_text(tmp_path):
    from corpusforge.cli.retro import query_knn_cmd
    from corpusforge.tokenizers import load_tokenizer

    tok = load_tokenizer(None)
    texts = ["The quick brown fox jumps over the lazy dog.", "Tensor cores multiply matrices in half precision."]
    flat, lengths = tok.encode_batch(texts * 2)
    from corpusforge.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "t", np.int32) as w:
        w.add_documents(flat, lengths)
    build_knn(BuildConfig(prefix=str(tmp_path / "t"), output=str(tmp_path / "db"), recall_queries=4))
    r = CliRunner().invoke(query_knn_cmd, [str(tmp_path / "db"), "matrices in half precision", "-k", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)[0]["text"] == texts[1]
    # a database of an older embedder: its vectors cannot be compared with today's query vectors
    manifest_path = tmp_path / "db" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["identity"]["embedder"] = "hashed-ngram-v1:dim=128:seed=0:bigram=1.0"
    manifest_path.write_text(json.dumps(manifest))
    r = CliRunner().invoke(query_knn_cmd, [str(tmp_path / "db"), "matrices"])
    assert r.exit_code == 1 and "built with embedder hashed-ngram-v1" in r.output and "rebuild" in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/corpus_text_document"], "corpus_text_document.idx: no such file"),
        (["{data}", "--max-index-memory", "1K"], "too small for any index"),
        (["{data}", "--index-key", "IVF8,Flat", "--dim", "2048"], "needs 1..1024"),
    ],
)
def test_bad_input_is_one_line(dataset, tmp_path, args, message):
    from corpusforge.cli.retro import build_knn_cmd

    args = [a.replace("{data}", dataset) for a in args] + ["--output", str(tmp_path / "db")]
    r = CliRunner().invoke(build_knn_cmd, args)
    assert r.exit_code == 1 and message in r.output and r.output.strip().count("\n") == 0, r.output


def test_existing_database_needs_resume_and_same_options(dataset, tmp_path):
    from corpusforge.cli.retro import build_knn_cmd

    out = str(tmp_path / "db")
    assert CliRunner().invoke(build_knn_cmd, [dataset, "--output", out, "--shard-size", "256"]).exit_code == 0
    r = CliRunner().invoke(build_knn_cmd, [dataset, "--output", out, "--shard-size", "256"])
    assert r.exit_code == 1 and "pass --resume" in r.output
    r = CliRunner().invoke(build_knn_cmd, [dataset, "--output", out, "--shard-size", "512", "--resume"])
    assert r.exit_code == 1 and "shard_size was 256, now 512" in r.output
    assert (
        CliRunner().invoke(build_knn_cmd, [dataset, "--output", out, "--shard-size", "256", "--resume"]).exit_code == 0
    )


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["chunks:1", "embeddings:1", "index:0", "index:2", "neighbours:1"])
def test_resume_after_sigkill_is_byte_identical(dataset, tmp_path, kill_at):
    """A real SIGKILL inside each stage (after its first shard/part), then --resume: the same bytes as one run."""
    # --workers 1: the tasks run in this process, so the kill takes the whole build down (a worker's death is
    # the executor's business: tests/test_executors.py)
    opts = ["--shard-size", "256", "--index-key", "IVF8,Flat", "--recall-queries", "200", "--workers", "1"]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    build_knn(_config(dataset, ref, index_key="IVF8,Flat"))
    killed = run_cli("build-knn", dataset, "--output", str(out), *opts, kill_at=kill_at)
    assert killed.returncode == -9, killed.stderr
    assert not (out / "neighbours.bin").exists()
    resumed = run_cli("build-knn", dataset, "--output", str(out), *opts, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert _files(out) == _files(ref)
    assert not list(out.rglob("*.tmp")) and not (out / "index" / "trained.faiss.tmp").exists()
    shutil.rmtree(out)


def test_resume_fills_the_index_that_was_trained_whatever_the_planner_says_now(tmp_path, monkeypatch):
    """Killed after training, resumed where the planner would choose otherwise (here: a machine with no RAM to
    spare, where it plans PQ codes on disk in place of fast-scan ones in RAM): the add tasks fill the index that was
    trained, the manifest still names it, and it stays in RAM, the only place its fast-scan lists can be."""
    from corpusforge.retro import index as index_mod

    dataset = write_dataset(tmp_path / "corpus", topical_documents(600, seed=5, max_len=300))  # past 1,000 chunks
    out = tmp_path / "db"
    opts = ["--shard-size", "1024", "--max-index-memory", "500K", "--recall-queries", "200", "--no-neighbours"]
    killed = run_cli("build-knn", dataset, "--output", str(out), *opts, kill_at="index:0")
    assert killed.returncode == -9, killed.stderr
    trained = json.loads((out / "manifest.json").read_text())["plan"]
    assert trained["key"] == "OPQ64_128,IVF128_HNSW32,PQ64x4fs"
    monkeypatch.setattr(index_mod, "index_ram", lambda: 1)
    assert index_mod.plan_index(trained["n"], 128, 500 << 10, ram=1).key == "OPQ32_128,IVF128_HNSW32,PQ32"
    config = BuildConfig(dataset, str(out), shard_size=1024, max_index_memory="500K", recall_queries=200)
    result = build_knn(replace(config, neighbours=False), resume=True)
    assert result.plan == trained and result.stages["index"]["ntotal"] == trained["n"]
    assert not (out / "index" / "index.ivfdata").exists()
    assert json.loads((out / "manifest.json").read_text())["plan"] == trained


@pytest.mark.parametrize("executor", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_shard_tasks_on_workers_give_the_same_bytes(dataset, tmp_path, executor):
    """Chunking, embedding, index add and neighbours as shard tasks on 2 worker processes (or a 2-CPU Ray): the
    bytes of one process. The local workers fork after the driver trained the index and tuned recall in OpenMP."""
    if executor == "ray":
        pytest.importorskip("ray")
    one = build_knn(_config(dataset, tmp_path / "one", index_key="IVF8,Flat", workers=1))
    many = build_knn(_config(dataset, tmp_path / "many", index_key="IVF8,Flat", workers=2, executor=executor))
    assert _files(tmp_path / "many") == _files(tmp_path / "one")
    for stage, tasks in (("index", "add_tasks"), ("neighbours", "tasks")):  # 493 chunks, 256 per shard and block
        assert many.stages[stage][tasks] == 2 and many.stages[stage]["workers"] == 2, many.stages[stage]
        assert many.stages[stage]["executor"] == executor
    for name in ("pca_mean.npy", "pca_components.npy"):
        assert (tmp_path / "many" / "embeddings" / name).read_bytes() == (
            tmp_path / "one/embeddings" / name
        ).read_bytes()
    assert many.stages["chunks"]["tasks"] >= 2 and many.stages["embeddings"]["shards"] == 2  # 493 chunks
    assert (many.stages["embeddings"]["executor"], many.stages["embeddings"]["workers"]) == (executor, 2)
    assert one.stages["embeddings"]["projection_sha256"] == many.stages["embeddings"]["projection_sha256"]


def test_cli_progress_lines_per_stage(dataset, tmp_path):
    """--progress into a pipe (a Slurm log): a line as each stage ends, at 100%, with its rate; JSON stays clean."""
    r = run_cli("build-knn", dataset, "--output", str(tmp_path / "db"), "--shard-size", "256", "--progress", "--json")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("corpusforge build-knn:")]
    for stage, unit in (("chunks", "chunks"), ("embedding", "chunks"), ("index", "vectors"), ("neighbours", "chunks")):
        assert any(line.startswith(f"corpusforge build-knn: {stage} 100%") and f"{unit}/s" in line for line in lines), (
            stage,
            lines,
        )
    assert json.loads(r.stdout)["stages"]["embeddings"]["shards"] == 2


def test_neighbours_for_another_training_dataset(dataset, tmp_path):
    """--query-prefix: neighbours for a training set's chunks, embedded on the fly; no document is shared."""
    train = write_dataset(tmp_path / "train", topical_documents(20, seed=5))
    build_knn(_config(dataset, tmp_path / "db", query_prefix=train, index_key="Flat"))
    qtable = ChunkTable.load(tmp_path / "db" / "query_chunks")
    nb = read_neighbours(tmp_path / "db" / "neighbours.bin")
    assert nb.shape == (len(qtable), 2) and (nb >= 0).all()
    sample = RetroDataset(tmp_path / "db", seq_length=64)[1]
    from corpusforge.indexed import IndexedDataset

    s, n = int(qtable.start[1]), int(qtable.length[1])
    assert sample["tokens"][:n].tolist() == np.asarray(IndexedDataset(train).tokens[s : s + n]).tolist()


def test_truncated_neighbours_file_is_refused(dataset, tmp_path):
    from corpusforge.retro import RetroError

    build_knn(_config(dataset, tmp_path / "db", index_key="Flat"))
    path = tmp_path / "db" / "neighbours.bin"
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(RetroError, match="truncated"):
        read_neighbours(path)
    path.write_bytes(b"XXXXXXXX" + data[8:])
    with pytest.raises(RetroError, match="not a corpusforge neighbours file"):
        read_neighbours(path)


# -- resuming with other options: allowed until the stage an option shapes has begun -------------------------------

# one new value per option, and the first stage it shapes (this test's own table, not the module's)
NEW = {"chunk_length": 32, "dim": 64, "index_key": "IVF8,Flat", "recall_target": 0.9, "k": 3}
SHAPES = {
    "chunk_length": "chunks",
    "dim": "embeddings",
    "index_key": "index",
    "recall_target": "recall",
    "k": "neighbours",
}
# where the build stopped -> the stages begun by then (index-trained: killed inside the index stage, once trained)
STOPS = {
    "chunks": {"chunks"},
    "embeddings": {"chunks", "embeddings"},
    "index-trained": {"chunks", "embeddings", "index"},
    "index": {"chunks", "embeddings", "index"},
    "recall": {"chunks", "embeddings", "index", "recall"},
}


def _base(dataset, out, **kw) -> BuildConfig:
    return _config(dataset, out, workers=1, **kw)  # the planner's Flat index (a PQ one would train for minutes)


@pytest.fixture(scope="module")
def stopped(dataset, tmp_path_factory) -> dict[str, Path]:
    """Copies of one build as it stood at each stop: after each stage's manifest entry, and inside the index stage
    once its trained index was written (where a kill there leaves it)."""
    from corpusforge.retro import build as build_mod
    from corpusforge.retro import fill as fill_mod

    root = tmp_path_factory.mktemp("stopped")
    out, snaps = root / "db", {}
    real_write = build_mod.write_json

    def write(path, data):
        real_write(path, data)
        for stage in set(data.get("stages", {})) & set(STOPS) - set(snaps):
            snaps[stage] = shutil.copytree(out, root / stage)

    real_write_index = fill_mod.write_index_atomic

    def write_index(faiss, index, path):  # where killed_build.py kills at index:0
        real_write_index(faiss, index, path)
        if path.name == "trained.faiss":
            snaps["index-trained"] = shutil.copytree(out, root / "index-trained")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build_mod, "write_json", write)
        mp.setattr(fill_mod, "write_index_atomic", write_index)
        build_knn(_base(dataset, out))
    assert set(snaps) == set(STOPS)
    return snaps


@pytest.fixture(scope="module")
def fresh(dataset, tmp_path_factory):
    """fresh(option): a whole build with that option's new value (built once per module)."""
    root, built = tmp_path_factory.mktemp("fresh"), {}

    def get(option: str) -> Path:
        if option not in built:
            build_knn(_base(dataset, root / option, **{option: NEW[option]}))
            built[option] = root / option
        return built[option]

    return get


def _identity(db: Path) -> dict:
    manifest = json.loads((db / "manifest.json").read_text())
    return {key: manifest[key] for key in ("identity", "plan", "search_params", "candidates")}


@pytest.mark.slow
@pytest.mark.parametrize("stop", sorted(STOPS))
@pytest.mark.parametrize("option", sorted(NEW))
def test_resume_may_change_only_options_of_stages_not_begun(dataset, stopped, fresh, tmp_path, option, stop):
    """A resume with another value of an option: the same bytes as a fresh build with it where the stage it shapes
    had not begun; else one line naming the option and the stage that holds it, and nothing changed."""
    out = shutil.copytree(stopped[stop], tmp_path / "db")
    config = _base(dataset, out, **{option: NEW[option]})
    stage = SHAPES[option]
    if stage in STOPS[stop]:
        before = (out / "manifest.json").read_bytes()
        with pytest.raises(RetroError) as e:
            build_knn(config, resume=True)
        key = "embedder" if option == "dim" else option
        state = "finished" if stop != "index-trained" or stage != "index" else "begun"
        assert f"cannot resume: {key} was " in str(e.value) and f"the {stage} stage it shapes is {state}" in str(
            e.value
        )
        assert "\n" not in str(e.value)
        assert (out / "manifest.json").read_bytes() == before
        return
    build_knn(config, resume=True)
    assert _files(out) == _files(fresh(option))
    assert _identity(out) == _identity(fresh(option))


def test_index_budget_is_checked_before_any_work_and_may_change_until_the_index_is_trained(dataset, tmp_path, stopped):
    """--max-index-memory too small for any index: one line before anything is written, for a new build and for a
    resume of one stopped after its embeddings (it used to fail after them, and refuse the resume with a larger
    budget). A budget changed before the index stage resumes under the new one; after it, one line says why not."""
    from corpusforge.cli.retro import build_knn_cmd

    r = CliRunner().invoke(build_knn_cmd, [dataset, "--output", str(tmp_path / "new"), "--max-index-memory", "1K"])
    assert r.exit_code == 1 and "too small for any index" in r.output and r.output.strip().count("\n") == 0
    assert not (tmp_path / "new").exists()
    args = [dataset, "--shard-size", "256", "--recall-queries", "200", "--workers", "1", "--resume"]
    out = shutil.copytree(stopped["embeddings"], tmp_path / "db")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r = CliRunner().invoke(build_knn_cmd, [*args, "--output", str(out), "--max-index-memory", "1K"])
    assert r.exit_code == 1 and "too small for any index" in r.output, r.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    r = CliRunner().invoke(build_knn_cmd, [*args, "--output", str(out), "--max-index-memory", "300K"])  # Flat fits
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["identity"]["max_index_memory"] == "300K"
    assert _files(out) == _files(stopped["recall"].parent / "db")  # the whole build the stops were copied from
    done = shutil.copytree(stopped["index"], tmp_path / "indexed")
    r = CliRunner().invoke(build_knn_cmd, [*args, "--output", str(done), "--max-index-memory", "300K"])
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0, r.output
    assert "max_index_memory was '16G', now '300K', and the index stage it shapes is finished" in r.output
    assert "resume with --max-index-memory 16G" in r.output
