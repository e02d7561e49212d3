"""The planner follows autofaiss's rules; a budget too small for any index is one clear error; PQ path builds; a
damaged index file is refused in one line."""

import re

import numpy as np
import pytest

from corpusforge.retro.common import RetroError
from corpusforge.retro.index import escalate, optimal_nlist, plan_index, pq_nlist

G = 1 << 30


@pytest.mark.parametrize(
    ("n", "budget", "key"),
    [
        (500, 16 * G, "Flat"),
        (100_000, 16 * G, "HNSW32"),
        (100_000, 80 << 20, "HNSW16"),
        (100_000, 60 << 20, "IVF1024,Flat"),
        (100_000, 30 << 20, "OPQ64_128,IVF1024_HNSW32,PQ64x4fs"),
        (2_000_000, 16 * G, "HNSW32"),
        (10_000_003, 16 * G, "IVF16384_HNSW32,Flat"),  # HNSW32 fits, but IVF-Flat was faster at 10M
        (100_000_000, 64 * G, "IVF32768_HNSW32,Flat"),
        (5_000_000, 2 * G, "OPQ64_128,IVF8192_HNSW32,PQ64x4fs"),
        (10**9, 64 * G, "OPQ64_128,IVF262144_HNSW32,PQ64x4fs"),
        (10**9, 16 * G, "OPQ8_16,IVF262144_HNSW32,PQ8x4fs"),
    ],
)
def test_planner_choices(n, budget, key):
    plan = plan_index(n, 128, budget)
    assert plan.key == key
    assert plan.ram_bytes <= budget
    if plan.nlist:
        assert 39 * plan.nlist <= plan.train_size or plan.train_size == n  # faiss's 39 per list, or all there is
        assert plan.train_size <= max(256 * plan.nlist, 256 * 39)


def test_nlist_grows_with_n():
    sizes = [10**4, 10**5, 10**6 - 1, 10**6, 10**7, 10**8, 10**9, 10**11]
    lists = [optimal_nlist(n) for n in sizes]
    assert lists == sorted(lists) and lists[0] >= 256 and lists[-1] == 2**18
    pq = [pq_nlist(n) for n in sizes]  # below 300M 4·sqrt(N) at most (2^14 measured at 10M), then autofaiss's
    assert pq == sorted(pq) and all(p <= o for p, o in zip(pq, lists)) and pq[4] == 2**14 and pq[-2:] == lists[-2:]


def test_budget_too_small_for_any_index():
    with pytest.raises(RetroError, match=r"too small for any index of 1,000,000,000 vectors.*at least"):
        plan_index(10**9, 128, 1 * G)


def test_forced_key_and_bad_train_per_list():
    assert plan_index(10_000, 64, G, key="IVF16,Flat").nlist == 16
    with pytest.raises(RetroError, match="39..256"):
        plan_index(10_000, 64, G, train_per_list=10)


@pytest.mark.slow
def test_pq_index_builds_and_searches(tmp_path):
    """The OPQ + IVF(HNSW) + PQ path end to end on a small store, with exact re-ranking lifting recall."""
    from corpusforge.retro.embed import EmbeddingStore, HashedNgramEmbedder, shard_path
    from corpusforge.retro.index import build_index, load_index
    from corpusforge.retro.neighbours import Database, exact_search, recall_at, search

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 500, (3000, 16))
    vectors = HashedNgramEmbedder(dim=64).fit(tokens).embed(tokens).astype(np.float16)
    (tmp_path / "e").mkdir()
    np.save(shard_path(tmp_path / "e", 0), vectors[:2000])
    np.save(shard_path(tmp_path / "e", 1), vectors[2000:])
    store = EmbeddingStore(tmp_path / "e", 3000, 64, 2000)
    plan = plan_index(3000, 64, G, key="OPQ8_32,IVF16_HNSW32,PQ8")
    build_index(plan, store, tmp_path / "i", seed=0)
    index = load_index(tmp_path / "i" / "index.faiss", "nprobe=16,quantizer_efSearch=32")
    assert index.ntotal == 3000
    doc = np.arange(3000)
    q = store.get(np.arange(0, 3000, 30))
    exact = exact_search(store, doc, q, doc[::30], 10)
    _, raw = index.search(q, 10)
    approx, _ = search(Database(index, store, doc), q, doc[::30], 10, 600, "nprobe=16,quantizer_efSearch=32")
    assert recall_at(approx, exact) >= 0.9 > recall_at(raw, exact)  # exact re-ranking recovers what PQ8 loses


@pytest.mark.parametrize("key", ["IVF64_HNSW32,Flat", "OPQ8_32,IVF64_HNSW32,PQ8"])
def test_an_hnsw_quantizer_gets_an_efsearch_of_at_least_nprobe(key):
    """faiss's HNSW quantizer keeps its efSearch of 16 unless told: at 10M chunks that capped recall at 0.86."""

    def values(params: str) -> dict[str, int]:
        return {k: int(v) for k, v in (p.split("=") for p in params.split(","))}

    params = plan_index(4000, 32, G, key=key).search_params
    for _ in range(12):
        v = values(params)
        assert v["quantizer_efSearch"] >= v["nprobe"]
        params = escalate(params) or params


def test_ivf_flat_with_an_hnsw_quantizer_is_exact_over_every_list(tmp_path):
    """build_index fills and merges an IVF-Flat index with an HNSW quantizer: probing every list is exact search."""
    from corpusforge.retro.embed import EmbeddingStore, shard_path
    from corpusforge.retro.index import build_index, load_index

    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((4000, 32)).astype(np.float16)
    (tmp_path / "e").mkdir()
    np.save(shard_path(tmp_path / "e", 0), vectors)
    store = EmbeddingStore(tmp_path / "e", 4000, 32, 4000)
    plan = plan_index(4000, 32, G, key="IVF64_HNSW32,Flat")
    build_index(plan, store, tmp_path / "i", seed=0)
    queries = vectors[:50].astype(np.float32)
    exact = np.argsort(-(queries @ vectors.astype(np.float32).T), axis=1, kind="stable")[:, :10]
    _, found = load_index(tmp_path / "i" / "index.faiss", "nprobe=64,quantizer_efSearch=128").search(queries, 10)
    assert (np.sort(found, 1) == np.sort(exact, 1)).all()


def test_recall_counts_ties_by_score():
    """Chunks 1..3 are identical (same score): a search that returns 2 and 3 instead of the reference's 1 and 2 is
    right; one that returns the worse chunk 4 is not."""
    from corpusforge.retro.neighbours import recall_at

    score = {0: -1.0, 1: 0.9, 2: 0.9, 3: 0.9, 4: 0.5}  # (-1, "none", is looked up as id 0 and masked)

    def scores(ids):
        return np.vectorize(score.get)(ids).astype(np.float32)

    exact = np.array([[1, 2]])
    assert recall_at(np.array([[2, 3]]), exact) == 0.5  # by ids
    assert recall_at(np.array([[2, 3]]), exact, scores) == 1.0
    assert recall_at(np.array([[3, 4]]), exact, scores) == 0.5
    assert recall_at(np.array([[3, -1]]), np.array([[1, -1]]), scores) == 1.0


def test_search_parameters_escalate_in_steps_of_one_and_a_half_to_4096():
    from corpusforge.retro.index import escalate

    ladder, p = [], "nprobe=8,quantizer_efSearch=64"
    while p:
        ladder.append(p)
        p = escalate(p)
    nprobe = [int(x.split(",")[0].split("=")[1]) for x in ladder]
    assert nprobe[:5] == [8, 16, 24, 32, 48] and nprobe[-1] == 4096
    assert all(b > a for a, b in zip(nprobe, nprobe[1:]))
    assert all(int(x.split("quantizer_efSearch=")[1]) >= n for x, n in zip(ladder, nprobe))
    assert escalate("efSearch=64") == "efSearch=96" and escalate("") is None


def test_candidates_are_tuned_only_for_compressed_ivf_codes():
    from corpusforge.retro.index import candidate_steps, tunes_candidates

    assert [tunes_candidates(k) for k in ("OPQ32_128,IVF16384_HNSW32,PQ32", "IVF8,SQ8", "IVF4096,Flat", "HNSW32")] == [
        True,
        True,
        False,
        False,
    ]
    assert candidate_steps(40) == [40, 64, 96, 144, 216, 320, 480, 720, 1024] and candidate_steps(2000) == [2000]


def test_neighbour_time_model_reproduces_its_measurements_and_brackets_the_rest():
    from corpusforge.retro.index import neighbour_seconds

    hnsw_1m = plan_index(1_000_000, 128, 16 * G)
    assert hnsw_1m.key == "HNSW32" and neighbour_seconds(hnsw_1m) == (1 / 1570, 1 / 1570)
    # at 10M chunks and 16384 lists, both assumptions are the measured nprobe: 196 and 265 chunks/s
    flat = neighbour_seconds(plan_index(10**7, 128, 16 * G))
    pq = neighbour_seconds(plan_index(10**7, 128, G, key="OPQ32_128,IVF16384_HNSW32,PQ32"))
    assert 190 < 1 / flat[1] == 1 / flat[0] < 200 and 1 / pq[0] > 250
    # 65536 lists at 10M: measured nprobe 1296 (0.95 crossed at ~1,222), 294 chunks/s
    finer = neighbour_seconds(plan_index(10**7, 128, G, key="OPQ32_128,IVF65536_HNSW32,PQ32"))
    assert 250 < 1 / finer[0] < 350 and finer[1] > finer[0]
    low, high = neighbour_seconds(plan_index(10**9, 128, 64 * G, on_disk=True))  # 262144 lists: 16x those of 10M
    assert high == pytest.approx(16**0.15 * low) and 0.2 < low < 0.3
    # fast-scan: the same bytes scanned 2.5x faster (735 against 295 chunks/s in one run at 10M)
    fast = neighbour_seconds(plan_index(10**9, 128, 64 * G))
    assert fast[0] == pytest.approx(low * 294.7 / 735.2) and fast[1] == pytest.approx(high * 294.7 / 735.2)


def test_full_vectors_only_where_they_fit_in_ram():
    """Beyond `ram` (build-knn: half the machine's) an index of full vectors would be searched from disk."""
    assert plan_index(10**7, 128, 16 * G).key == "IVF16384_HNSW32,Flat"
    assert plan_index(10**7, 128, 16 * G, ram=3 * G).key == "OPQ64_128,IVF16384_HNSW32,PQ64x4fs"
    assert plan_index(10**6, 128, 16 * G, ram=G).key == "HNSW32"
    assert plan_index(10**6, 128, 16 * G, ram=G // 2).key.endswith(",PQ64x4fs")


def test_fast_scan_codes_only_where_the_index_is_searched_in_ram():
    """faiss keeps fast-scan lists in RAM only: beyond `ram`, or with --index-on-disk, the same bytes as PQm."""
    in_ram = plan_index(10**9, 128, 64 * G, ram=64 * G)
    assert in_ram.key == "OPQ64_128,IVF262144_HNSW32,PQ64x4fs"
    assert plan_index(10**9, 128, 64 * G, ram=12 * G).key == "OPQ32_128,IVF262144_HNSW32,PQ32"
    forced = plan_index(10**9, 128, 64 * G, on_disk=True)
    assert forced.key == "OPQ32_128,IVF262144_HNSW32,PQ32" and forced.ram_bytes == in_ram.ram_bytes


def test_pq_code_bytes_count_the_bits_of_each_code():
    """PQ64x4fs (fast-scan, 4-bit codes) takes 32 bytes a vector, as PQ32 does: the RAM and time estimates use it."""
    from corpusforge.retro.index import _pq_bytes

    assert _pq_bytes("OPQ32_128,IVF16384_HNSW32,PQ32") == 32 == _pq_bytes("OPQ64_128,IVF16384_HNSW32,PQ64x4fs")
    assert _pq_bytes("IVF8,PQ4x4") == 2 and _pq_bytes("IVF16,Flat") is None and _pq_bytes("HNSW32") is None
    fast = plan_index(10**7, 128, G, key="OPQ64_128,IVF16384_HNSW32,PQ64x4fs")
    assert fast.ram_bytes == plan_index(10**7, 128, G, key="OPQ32_128,IVF16384_HNSW32,PQ32").ram_bytes


def test_query_cost_prefers_more_lists_with_fewer_candidates_where_10m_measured_it():
    """At 10M chunks (kept fast-scan index): nprobe 384 with 1,024 candidates ran 825 QPS, nprobe 512 with 480 ran
    1,166 QPS, both at recall 0.9504; the model ranks them so, and caps nprobe at the lists there are."""
    from corpusforge.retro.index import probes_every_list, query_cost

    plan = plan_index(10**7, 128, G, key="OPQ64_128,IVF16384_HNSW32,PQ64x4fs")
    assert query_cost(plan, "nprobe=512,quantizer_efSearch=512", 480) < query_cost(plan, "nprobe=384", 1024)
    assert 700 < 1 / query_cost(plan, "nprobe=384", 1024) < 900  # 825 QPS measured
    pq = plan_index(10**7, 128, G, key="OPQ32_128,IVF16384_HNSW32,PQ32")
    assert query_cost(pq, "nprobe=384", 40) > query_cost(plan, "nprobe=384", 40)  # 8-bit codes scan slower
    small = plan_index(10**4, 64, G, key="IVF64,PQ8")
    assert query_cost(small, "nprobe=4096", 40) == query_cost(small, "nprobe=64", 40)
    assert probes_every_list(small, "nprobe=64") and not probes_every_list(small, "nprobe=48")
    assert not probes_every_list(plan_index(10**4, 64, G, key="HNSW32"), "efSearch=4096")


# -- a damaged index file is refused on load, in one line naming it ------------------------------------------------


@pytest.fixture(scope="module")
def small_db(tmp_path_factory):
    """A real retrieval database (retrokit's topical documents) with an IVF index, and its tokenizer-free query."""
    from retrokit import topical_documents, write_dataset

    from corpusforge.retro import build_knn
    from corpusforge.retro.config import BuildConfig

    root = tmp_path_factory.mktemp("damaged-index")
    data = write_dataset(root / "corpus", topical_documents(150, max_len=300))
    db = root / "db"
    build_knn(BuildConfig(prefix=data, output=str(db), index_key="IVF8,Flat", recall_queries=50, neighbours=False))
    return db


CUTS = {"empty": 0, "in-magic": 3, "after-magic": 4, "in-header": 20, "in-centroids": 100, "half": 0.5, "last-byte": -1}


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("damage", [*CUTS, "junk", "another-file"])
def test_a_truncated_or_junk_index_is_refused_naming_the_file(small_db, tmp_path, damage, mmap):
    from corpusforge.retro.index import load_index

    index = small_db / "index" / "index.faiss"
    data = index.read_bytes()
    path = tmp_path / "index.faiss"
    if damage == "junk":
        path.write_bytes(b"junk" * 100)
    elif damage == "another-file":
        path.write_bytes((small_db / "manifest.json").read_bytes())
    else:
        cut = CUTS[damage]
        path.write_bytes(data[: int(len(data) * cut) if isinstance(cut, float) else cut])  # (-1: one byte short)
    with pytest.raises(RetroError) as err:
        load_index(path, "nprobe=8", mmap=mmap)
    message = str(err.value)
    assert message.startswith(f"{path}: not a readable faiss index (") and "\n" not in message, message
    assert message.endswith("the file is truncated or damaged: restore it, or rebuild the database (build-knn into a "
                            "new --output)") and "Error in" not in message and ".cpp" not in message  # fmt: skip


@pytest.mark.slow  # a CLI process: ~3 s of imports
def test_query_knn_on_a_truncated_index_is_one_line(small_db, tmp_path):
    import shutil

    from retrokit import run_cli

    db = tmp_path / "db"
    shutil.copytree(small_db, db)
    index = db / "index" / "index.faiss"
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    proc = run_cli("query-knn", str(db), "any text")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"corpusforge: error: {re.escape(str(index))}: not a readable faiss index \(.*read error in .*\); the file "
        r"is truncated or damaged: restore it, or rebuild the database \(build-knn into a new --output\)",
        lines[0],
    ), lines
