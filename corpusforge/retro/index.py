"""The index stage: a planner that picks a Faiss index for N vectors and a memory budget, then train and fill.

The planner follows autofaiss's published rules (criteo/autofaiss, `get_optimal_index_keys_v2` and
`get_optimal_nb_clusters`), with changes measured at 10M chunks: below 1,000 vectors exact search; HNSW when
its graph and raw vectors fit the budget and half the RAM, and N is below 3M (beyond, it filled 4x slower than
IVF-Flat and served neighbours slower); IVF-Flat whenever it fits both (autofaiss: below 1M only), 4·sqrt(N)
lists, an HNSW32 coarse quantizer from 8192 lists; beyond that OPQ + IVF with an HNSW32 coarse quantizer + PQ,
with the largest PQ code that fits (fast-scan 4-bit codes when the index is searched in RAM), and the number of
lists growing with N: 4·sqrt(N) below 300M, at most autofaiss's steps (2^14 from 1M, 2^17 from 10M), then
autofaiss's 2^18.
Training takes a seeded sample of `train_per_list` (39..256, faiss's own bounds) vectors per list.

Filling: the driver trains and saves the empty index (`index/trained.faiss`); an IVF index is then filled by
independent add tasks on the build's executor (local processes or Ray), each writing one part, and the parts'
inverted lists are merged into `index/index.faiss`, on disk (`index/index.ivfdata`) when the index does not fit
in RAM: see fill.py (fast-scan PQ lists, which faiss cannot merge, are encoded by the tasks as plain PQ and packed
by the merge: fastscan.py). HNSW and Flat cannot be merged and are filled in one pass, in the driver.
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

from corpusforge.errors import first_line
from corpusforge.fsutil import remove_leftovers
from corpusforge.retro import fill
from corpusforge.retro.common import RetroError, c_stdout_to_stderr, import_faiss
from corpusforge.retro.embed import EmbeddingStore
from corpusforge.retro.fastscan import is_fast_scan
from corpusforge.retro.gpu import train_with
from corpusforge.retro.kmeans import train_two_level
from corpusforge.sizes import human_bytes
from corpusforge.stages import DriverExecutor, TaskRun, run_tasks

# Rates measured by benchmarks/bench_knn.py on this project's 2-core (shared) reference machine, 1M real-text
# chunks, 2026-11-21 (benchmarks/results/knn-pca-1m-full-2026-11-21.json, machine nearly idle; under a load of
# 7-10 from other jobs, knn-pca-1m-2026-11-21.json, they were 2-6x lower). The dry-run's time estimates scale
# them, so they say "hours, not days", not minutes exactly.
# HNSW only below this many vectors, even when it fits. At 1M chunks HNSW32 was the best index here (recall 0.954 at
# 1,849 QPS); at 10M (knn-10m-2026-11-22.json, knn-10m-keys-2026-11-22.json) it took 1,559 s to fill against
# 391 s to train and fill IVF16384_HNSW32,Flat, planned 8.6 GB against 5.5 GB, and its neighbours stage ran at
# 151 chunks/s against 196, both at recall@10 0.96. Between the two sizes nothing is measured: the cut is a guess.
HNSW_MAX_VECTORS = 3_000_000
RATE_HNSW_ADD = 10_000  # vectors/s, HNSW32 (efConstruction 40), d=128: 1M in 96 s (409 s under load)
RATE_IVF_ADD = 100_000  # vectors/s, IVF1024,Flat at 1M (train on 65k + add: 13.7 s)
# effective flop/s of faiss k-means (train_n · nlist · d · 2 · iterations): IVF16384 trained on 1M 128-d vectors in
# 261 s at 10M chunks (knn-10m-keys-2026-11-22.json); the 2e10 taken from the 1M runs (1024 lists) was 8x low
RATE_KMEANS_FLOPS = 1.6e11
RATE_EMBED_HASHED = 75_000  # chunks/s, hashed embedder (1024-d sketch + PCA to 128), gather from the .bin included
# The neighbours stage (search, exclusion, exact re-rank), measured on 2 cores. HNSW32: 1,570 query chunks/s at
# 1M (the whole stage, efSearch 320), 151/s at 10M (efSearch 1616): the cost per query grew as N^1.02.
RATE_NEIGHBOURS_HNSW_1M = 1_570
HNSW_NEIGHBOURS_EXPONENT = 1.02
# IVF at 10M chunks, 16384 lists of ~610 (knn-10m-keys-2026-11-22.json, knn-10m-pq-2026-11-22.json): time is the
# list entries a query scans. Flat (128-d): 196 chunks/s at nprobe 512, 61M entries/s. OPQ32 + PQ32: 265 chunks/s
# at nprobe 384 with 320 re-ranked candidates, 62M entries/s. Those nprobe reached recall@10 0.95 at 10M.
# Fast-scan OPQ64 + PQ64x4fs (32 bytes a code, 4-bit): 735 chunks/s at nprobe 384 with 1,024 candidates, against
# 295 for PQ32 in the same run (knn-10m-fastscan-tasks-2026-11-22.json): 2.5x the PQ32 rate. (1,017 chunks/s in an
# earlier run, 3.4x; the machine is shared and the ratio within one run is what is kept.)
SCAN_RATE_IVF = {"flat": 61e6, "pq": 62e6, "fastscan": 62e6 * 735.2 / 294.7}  # entries/s, re-rank included
NPROBE_AT_10M = {"flat": 512, "pq": 384, "fastscan": 384}
NLIST_AT_10M = 16384
# What one query costs at (nprobe, candidates), to choose among the settings that reach the recall target. At 10M
# chunks, on the kept OPQ64_128,IVF16384_HNSW32,PQ64x4fs index (1,000 queries, 2 cores), each probed list of ~610
# codes cost 1.08 us and each re-ranked candidate 0.90 us: 1,732 QPS at nprobe 384 with 320 candidates, 825 with
# 1,024, 1,399 at nprobe 512 with 320. The recall tuning had stopped at nprobe 384 with 1,024 candidates (recall
# 0.9504, 825 QPS) where nprobe 512 with 480 gave 0.9504 at 1,166. 8-bit PQ scans 2.5x slower (SCAN_RATE_IVF).
SCAN_ONLY_RATE = {"fastscan": 610 / 1.08e-6, "pq": 610 / 1.08e-6 / 2.5}  # code entries/s at 32 bytes a code
RERANK_S_PER_DIM = 0.90e-6 / 128  # a candidate's gather and exact score, per dimension
# How the nprobe for recall 0.95 grows with the lists, at 10M chunks, OPQ32 + PQ32 trained two-level: 16384 lists
# crossed 0.95 at nprobe ~378 (0.932 at 256, 0.951 at 384), 65536 lists at ~1,222 (0.939 at 864, 0.952 at 1296),
# log-interpolated: 3.2x the nprobe for 4x the lists, nlist^0.85 (knn-10m-pq-two-level-2026-11-22.json,
# knn-10m-pq-65536-2026-11-22.json). 1 would be the same share of the lists.
NPROBE_EXPONENT = 0.85
# Two-level k-means (kmeans.py) from this many lists. At 10M chunks, 16384 lists (IVF16384_HNSW32,Flat): 6.3 s of
# training against 292.7 s for faiss's one k-means, recall@10 0.963 against 0.966 at nprobe 512, and the neighbours
# stage no slower (knn-10m-kmeans-2026-11-22.json). Below, faiss's k-means takes minutes at most.
TWO_LEVEL_FROM = 1 << 14
# OPQ rotation + PQ codebooks, trained on faiss's capped samples (65,536 vectors) whatever N: 68 s at d=128, PQ32
PQ_TRAIN_S = 68.0
KMEANS = ("auto", "flat", "two-level")


@dataclass(frozen=True)
class IndexPlan:
    key: str
    """Faiss index_factory string."""
    n: int
    dim: int
    nlist: int
    """Inverted lists (0 when not IVF)."""
    train_size: int
    ram_bytes: int
    """Memory the filled index needs (autofaiss's estimates: codes + ids + centroids + graph)."""
    disk_bytes: int
    search_params: str
    """faiss ParameterSpace string used for queries, before tuning to the recall target."""
    est_train_s: float
    est_add_s: float
    kmeans: str = ""
    """How the coarse centroids are trained: 'flat' (faiss's one k-means), 'two-level' (kmeans.py); '' not IVF."""

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> list[tuple[str, object]]:
        return [
            ("index key", self.key),
            ("vectors", f"{self.n:,} x {self.dim}"),
            ("train sample", f"{self.train_size:,}" + (f" ({self.kmeans} k-means)" if self.kmeans else "")),
            ("index RAM", human_bytes(self.ram_bytes)),
            ("index disk", human_bytes(self.disk_bytes)),
            ("search", self.search_params),
            ("est. train + add", f"{self.est_train_s + self.est_add_s:,.0f} s"),
        ]


def optimal_nlist(n: int) -> int:
    """autofaiss's get_optimal_nb_clusters, first choice: 4·sqrt(N) (a power of two) below 1M, then fixed steps."""
    if n < 1_000_000:
        return max(1, 2 ** round(math.log2(4 * math.sqrt(n))))
    if n < 10_000_000:
        return 2**14
    if n < 300_000_000:
        return 2**17
    return 2**18


def _sqrt_nlist(n: int) -> int:
    """4·sqrt(N) as a power of two: autofaiss's formula below 1M, the low end of faiss's guideline (4-16·sqrt(N))."""
    return max(1, 2 ** round(math.log2(4 * math.sqrt(n))))


def flat_nlist(n: int) -> int:
    """Lists of an IVF-Flat index: 4·sqrt(N), at most 2^16 (the low end of faiss's 4-16·sqrt(N)). 2^14 was measured
    at 10M (recall 0.966); autofaiss's 2^17 there would give lists of ~76 full vectors, and took ~5 h of faiss's
    one-level k-means on 2 cores (two-level k-means, now the default from 2^14 lists, makes training cheap either
    way)."""
    return min(2**16, _sqrt_nlist(n))


def pq_nlist(n: int) -> int:
    """Lists of an OPQ + PQ index: autofaiss's steps, but below 300M at most 4·sqrt(N). At 10M chunks 2^14 lists
    reached recall@10 0.951 (nprobe 384, 320 candidates, knn-10m-pq-2026-11-22.json) after 6 min of training;
    autofaiss's 2^17 would have taken ~5 h of faiss's one-level k-means on 2 cores (two-level k-means now trains
    either in minutes), and more lists bought little at 10M: 4x the lists needed 3.2x the nprobe, 0.81x the codes
    scanned (NPROBE_EXPONENT). From 300M autofaiss's 2^18 stays.

    Example: pq_nlist(10**7) -> 16384; pq_nlist(10**9) -> 262144"""
    if n >= 300_000_000:
        return optimal_nlist(n)
    return min(optimal_nlist(n), _sqrt_nlist(n))


def _hnsw_bytes(n: int, d: int, m: int) -> int:
    return int(n * (4 * d + 8 * m + 16) * 1.1)  # raw vectors + 2M level-0 links + upper levels and levels array


def _ivf_flat_bytes(n: int, d: int, nlist: int) -> int:
    return int(n * (4 * d + 8) * 1.05 + nlist * 4 * d)


def _ivf_pq_bytes(n: int, d: int, nlist: int, m: int, d_out: int) -> int:
    quantizer = nlist * (4 * d_out + 8 * 32 + 16)  # HNSW32 over the centroids
    return int(n * (m + 8) * 1.1 + quantizer + 4 * d * d_out + 256 * 4 * d_out)


def _pq_choices(d: int) -> list[tuple[int, int]]:
    """(m, d_out) from the largest code down: OPQ rotates to d_out = 4m dimensions (autofaiss's choice), so
    m <= dim/4: sub-vectors of at least 4 dimensions (OPQ's training time grows with m, and past d/4 bought
    little recall in our runs)."""
    out = []
    for m in (256, 128, 64, 48, 32, 24, 16, 12, 8, 4):
        if m > max(4, d // 4):
            continue
        d_out = min(d, 4 * m)
        d_out -= d_out % m
        if d_out >= m and m <= d:
            out.append((m, d_out))
    return out


def plan_index(
    n: int,
    dim: int,
    max_memory: int,
    train_per_list: int = 64,
    key: str | None = None,
    ram: int | None = None,
    kmeans: str = "auto",
    on_disk: bool = False,
) -> IndexPlan:
    """Choose an index for `n` vectors of `dim` that fits `max_memory` bytes; `key` forces a factory string.

    `ram`: the most an index of full vectors (Flat, HNSW, IVF-Flat) or of fast-scan codes may take, default
    `max_memory`; build-knn passes half this machine's RAM. Beyond it an index would be searched from disk: at 10M
    chunks under a 3 GiB memory limit, IVF16384_HNSW32,Flat on disk served the neighbours stage at 102 chunks/s
    read list by list (listmajor.py), and a lone query read ~100 MB (0.96 queries/s;
    knn-10m-ondisk-listmajor-3g-2026-11-22.json), while OPQ32 + PQ32 in RAM (0.43 GB) reached the same recall at
    287 queries/s and 265 chunks/s.

    Codes: fast-scan PQ (PQ{2m}x4fs, 4-bit codes scanned with SIMD lookups) where the index fits `ram` and
    `on_disk` (the user's --index-on-disk) is not set, since faiss keeps those lists in RAM only; else PQm, the
    same bytes a vector. At 10M chunks, in one run, OPQ64_128,IVF16384_HNSW32,PQ64x4fs reached recall@10 0.950
    at 704 queries/s and served 735 neighbour chunks/s, OPQ32_128,IVF16384_HNSW32,PQ32 0.951 at 212 and 295
    (knn-10m-fastscan-tasks-2026-11-22.json).

    `kmeans`: how IVF lists are trained, 'flat', 'two-level', or 'auto' (two-level from TWO_LEVEL_FROM lists).

    Example: plan_index(10**7, 128, 16 << 30, ram=3 << 30).key -> 'OPQ64_128,IVF16384_HNSW32,PQ64x4fs'"""
    if not 39 <= train_per_list <= 256:
        raise RetroError(f"--train-per-list {train_per_list}: faiss wants 39..256 training vectors per list")
    if kmeans not in KMEANS:
        raise RetroError(f"--kmeans {kmeans}: choose one of {', '.join(KMEANS)}")
    plan_for = partial(_plan_for_key, n=n, dim=dim, train_per_list=train_per_list, kmeans=kmeans)
    if key is not None:
        try:  # faiss parses the string now, before any stage runs, not after hours of embedding
            import_faiss().index_factory(dim, key)
        except RuntimeError as e:
            reason = str(e).strip().rsplit(": ", 1)[-1]  # faiss's words, after its C++ source location
            hint = "give a faiss index_factory string, e.g. IVF1024,Flat"
            raise RetroError(f"--index-key {key!r}: {reason}; {hint}") from None
        return plan_for(key)
    full = min(max_memory, ram if ram is not None else max_memory)
    if n < 1000 and n * dim * 4 <= full:
        return plan_for("Flat")
    for m in (32, 16):
        if n < HNSW_MAX_VECTORS and _hnsw_bytes(n, dim, m) <= full:
            return plan_for(f"HNSW{m}")
    flat_lists = flat_nlist(n)
    if _ivf_flat_bytes(n, dim, flat_lists) <= full:
        quantizer = "_HNSW32" if flat_lists >= 8192 else ""
        return plan_for(f"IVF{flat_lists}{quantizer},Flat")
    nlist = pq_nlist(n)
    for m, d_out in _pq_choices(dim):
        ram_bytes = _ivf_pq_bytes(n, dim, nlist, m, d_out)
        if ram_bytes <= max_memory:
            if ram_bytes <= full and not on_disk:
                return plan_for(f"OPQ{2 * m}_{d_out},IVF{nlist}_HNSW32,PQ{2 * m}x4fs")
            return plan_for(f"OPQ{m}_{d_out},IVF{nlist}_HNSW32,PQ{m}")
    smallest = _ivf_pq_bytes(n, dim, nlist, 4, 16)
    raise RetroError(
        f"--max-index-memory {human_bytes(max_memory)} is too small for any index of {n:,} vectors of dimension "
        f"{dim}: the smallest (OPQ4_16,IVF{nlist}_HNSW32,PQ4) needs {human_bytes(smallest)}; raise it to at least that"
    )


def _pq_bytes(key: str) -> int | None:
    """The PQ code size in bytes of a factory string (its last component's PQm or PQmxb: m codes of b bits, 8 by
    default, as in the fast-scan PQ64x4fs), None when the codes are not PQ.

    Example: _pq_bytes("OPQ32_128,IVF16384_HNSW32,PQ32") -> 32; _pq_bytes("IVF16384,PQ64x4fs") -> 32"""
    match = re.search(r"PQ(\d+)(?:x(\d+))?", key.split(",")[-1])
    return int(match.group(1)) * int(match.group(2) or 8) // 8 if match else None


def _plan_for_key(key: str, n: int, dim: int, train_per_list: int, kmeans: str = "auto") -> IndexPlan:
    nlist_match = re.search(r"IVF(\d+)", key)
    nlist = int(nlist_match.group(1)) if nlist_match else 0
    m = _pq_bytes(key)
    hnsw_match = re.match(r"HNSW(\d+)", key)
    kmeans_dim = dim
    if hnsw_match:
        ram, params = _hnsw_bytes(n, dim, int(hnsw_match.group(1))), "efSearch=64"
    elif nlist and m:
        d_out = int(re.search(r"OPQ\d+_(\d+)", key).group(1)) if "OPQ" in key else dim
        ram = _ivf_pq_bytes(n, dim, nlist, m, d_out)
        params = _ivf_params(key, min(nlist, 256, max(16, nlist // 64)))
        kmeans_dim = d_out  # the coarse k-means runs after the OPQ rotation
    elif nlist:
        ram, params = _ivf_flat_bytes(n, dim, nlist), _ivf_params(key, min(nlist, max(8, nlist // 32)))
    else:
        ram, params = n * dim * 4, ""
    train = min(n, train_per_list * nlist) if nlist else 0
    if m:
        train = min(n, max(train, 256 * 39))  # the PQ codebooks (256 centroids each) need their own 39 per centroid
    if not nlist:
        kmeans = ""
    elif kmeans == "auto":
        kmeans = "two-level" if nlist >= TWO_LEVEL_FROM else "flat"
    # centroids each training vector meets an iteration: all of them, or sqrt(nlist) at each of two levels
    compared = 2 * math.isqrt(nlist) if kmeans == "two-level" else max(nlist, 256)
    iterations = 10
    est_train = (train * compared * kmeans_dim * 2 * iterations) / RATE_KMEANS_FLOPS if train else 0.0
    if m and kmeans == "two-level":  # measured apart from the k-means only there; inside the flat rate before
        est_train += PQ_TRAIN_S
    est_add = n / (RATE_HNSW_ADD if hnsw_match else RATE_IVF_ADD)
    return IndexPlan(
        key, n, dim, nlist, train, ram, int(ram * 0.95), params, round(est_train, 1), round(est_add, 1), kmeans
    )


def _ivf_params(key: str, nprobe: int) -> str:
    """Search parameters of an IVF index; with an HNSW coarse quantizer its efSearch too, kept at least nprobe
    (see escalate). Left at faiss's default of 16, the quantizer's list choice limits recall whatever nprobe: at
    10M chunks, IVF16384_HNSW32,Flat at nprobe 512 gave recall@10 0.873, and 0.963 with quantizer_efSearch 512;
    the build's tuning, raising nprobe alone, stayed at 0.86 from nprobe 512 to 4096."""
    return f"nprobe={nprobe}" + (f",quantizer_efSearch={max(128, nprobe)}" if "_HNSW" in key else "")


def neighbour_seconds(plan: IndexPlan) -> tuple[float, float]:
    """Seconds per query chunk of the neighbours stage on 2 cores, (low, high), extrapolated from the measurements
    above. HNSW: the N^1.02 fit of 1M and 10M. IVF: the list entries scanned at the measured rate, scaled by
    dimension (Flat) or code bytes (PQ). The nprobe a query needs for recall 0.95 was measured at 10M chunks only,
    at 16384 and 65536 lists: one end of the range takes it to grow as nlist^0.85 as it did there, the other as the
    same share of the lists (nlist^1). Whether more vectors a list need fewer probes or more is not measured.

    Fast-scan codes take the PQ32 nprobe and its growth, at their own rate.

    Example: neighbour_seconds(plan_index(10**9, 128, 64 << 30)) -> (0.10, 0.15)"""
    if not plan.nlist:
        per = (max(plan.n, 1) / 1e6) ** HNSW_NEIGHBOURS_EXPONENT / RATE_NEIGHBOURS_HNSW_1M
        return per, per
    kind, scale = _scan_kind(plan)
    rate = SCAN_RATE_IVF[kind] * scale
    per_list = plan.n / plan.nlist
    ratio = plan.nlist / NLIST_AT_10M
    fitted = min(plan.nlist, max(1.0, NPROBE_AT_10M[kind] * ratio**NPROBE_EXPONENT))
    same_share = min(plan.nlist, max(1.0, NPROBE_AT_10M[kind] * ratio))
    low, high = sorted((fitted * per_list / rate, same_share * per_list / rate))
    return low, high


def _scan_kind(plan: IndexPlan) -> tuple[str, float]:
    """('fastscan' | 'pq' | 'flat', how much faster than the measured 32-byte code or 128-d vector it scans)."""
    m = _pq_bytes(plan.key)
    if not m:
        return "flat", 128 / plan.dim
    return ("fastscan" if is_fast_scan(plan.key) else "pq"), 32 / m


def query_cost(plan: IndexPlan, params: str, candidates: int) -> float:
    """Modeled seconds of one query of an IVF index of compressed codes on 2 cores: its probed lists' codes and its
    re-ranked candidates (SCAN_ONLY_RATE, RERANK_S_PER_DIM). The recall tuning takes the cheapest setting that
    reaches the target by this model, not by timing, so that the same build always chooses the same one.

    Example: query_cost(plan, "nprobe=512", 480) < query_cost(plan, "nprobe=384", 1024) at 10M chunks"""
    kind, scale = _scan_kind(plan)
    nprobe = min(plan.nlist, _nprobe(params))
    scan = nprobe * plan.n / plan.nlist / (SCAN_ONLY_RATE.get(kind, SCAN_ONLY_RATE["pq"]) * scale)
    return scan + candidates * plan.dim * RERANK_S_PER_DIM


def parse_params(params: str) -> dict[str, str]:
    """A faiss ParameterSpace string as {name: value}, in its order; format_params writes it back.

    Example: parse_params("nprobe=64,quantizer_efSearch=128") -> {"nprobe": "64", "quantizer_efSearch": "128"}"""
    return dict(p.split("=") for p in params.split(",")) if params else {}


def format_params(parts: dict[str, object]) -> str:
    return ",".join(f"{k}={v}" for k, v in parts.items())


def _nprobe(params: str) -> int:
    return int(parse_params(params).get("nprobe", 0))


def probes_every_list(plan: IndexPlan, params: str) -> bool:
    """Whether `params` already search every list of the plan's IVF index: a wider nprobe changes nothing.

    Example: probes_every_list(plan_index(10**4, 64, 1 << 30, key="IVF64,Flat"), "nprobe=64") -> True"""
    return plan.nlist > 0 and _nprobe(params) >= plan.nlist


def train_sample_ids(n: int, size: int, seed: int) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False)) if size else np.zeros(0, np.int64)


def build_index(
    plan: IndexPlan,
    store: EmbeddingStore,
    directory: Path,
    seed: int,
    progress=None,
    executor=None,
    on_disk: bool = False,
    gpus: int = 0,
) -> dict:
    """The index stage: train on a seeded sample (here), fill as add tasks on `executor` (default: this process),
    merge; writes directory/index.faiss. `on_disk`: merge an IVF index's lists into index.ivfdata (see fill.py).
    `gpus`: an IVF index's k-means and list assignment run on that many GPUs (gpu.py), its add tasks here.
    `progress(n)` is called as vectors are added.

    Example: build_index(plan_index(10**6, 128, 16 << 30), store, Path("db/index"), 0)["ntotal"] -> 1000000"""
    if on_disk and is_fast_scan(plan.key):
        raise RetroError(
            f"index {plan.key}: fast-scan lists cannot live on disk (faiss keeps them in RAM, in blocks of codes); "
            "drop --index-on-disk, or give a key without 'fs'"
        )
    faiss = import_faiss()
    directory.mkdir(parents=True, exist_ok=True)
    remove_leftovers(directory)  # a killed task's part, a killed merge's scratch lists
    t0 = time.perf_counter()
    trained_path = directory / "trained.faiss"
    if not trained_path.exists():
        index = faiss.index_factory(plan.dim, plan.key, faiss.METRIC_INNER_PRODUCT)
        if plan.train_size:
            _seed_training(faiss, index, seed)
            sample = store.get(train_sample_ids(plan.n, plan.train_size, seed))
            if plan.kmeans == "two-level":
                train_two_level(faiss, index, sample, seed, gpus)
            else:
                if gpus:
                    train_with(faiss, index, gpus)
                index.train(sample)
        fill.write_index_atomic(faiss, index, trained_path)
    t_train = time.perf_counter() - t0
    if plan.nlist:
        run, merge_s = _fill_ivf(store, directory, executor, on_disk, progress, gpus)
    else:
        # HNSW (and Flat, below 1,000 vectors): one task, here, with every core. faiss cannot merge two HNSW
        # graphs, so parts would have to be re-added one by one into one graph: the whole cost again.
        run, merge_s = run_tasks(partial(_fill_whole, store, directory), [0], DriverExecutor(), progress=progress), 0.0
    for part in directory.glob("part_*.faiss"):
        part.unlink()
    return {
        "train_s": round(t_train, 3),
        "add_s": round(time.perf_counter() - t0 - t_train, 3),
        "ntotal": store.n,
        "add_tasks": run.tasks,
        "merge_s": round(merge_s, 3),
        "executor": run.executor,
        "workers": run.workers,
        "gpus": gpus if plan.nlist else 0,
    }


def _fill_whole(store: EmbeddingStore, directory: Path, _task: int, ctx) -> int:
    """The one task of an index without inverted lists: every vector into trained.faiss → index.faiss."""
    faiss = import_faiss()
    index = faiss.read_index(str(directory / "trained.faiss"))
    for _first, block in store.blocks(rows=1 << 16):
        index.add(block)
        if ctx.report:
            ctx.report(len(block))
    fill.write_index_atomic(faiss, index, directory / "index.faiss")
    return store.n


def _fill_ivf(
    store: EmbeddingStore, directory: Path, executor, on_disk: bool, progress=None, gpus: int = 0
) -> tuple[TaskRun[int], float]:
    """Every missing part as an add task on `executor` (with `gpus`, here, one after another: see fill.AddJob),
    then the merge (here); returns (the tasks' run, merge seconds)."""
    job = fill.AddJob(os.path.abspath(store.directory), os.path.abspath(directory), store.shard_size, gpus)

    def finished(task: tuple[int, int, int]) -> int | None:  # a part is written whole: its file is its done marker
        return task[2] - task[1] if fill.part_path(directory, task[0]).exists() else None

    # with GPUs, in this process, with all of its threads for the encoding
    executor = DriverExecutor() if gpus else executor
    tasks = fill.add_tasks(store.n, store.shard_size)
    run = run_tasks(partial(fill.add_range, job), tasks, executor, finished=finished, progress=progress, count=int)
    t0 = time.perf_counter()
    fill.merge_parts(directory, len(tasks), on_disk)
    return run, time.perf_counter() - t0


def _seed_training(faiss, index, seed: int) -> None:
    """Seed every k-means inside the index (coarse quantizer, PQ codebooks, OPQ) for byte-identical rebuilds."""
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is None:
        return
    ivf.cp.seed = seed
    pq = getattr(faiss.downcast_index(ivf), "pq", None)
    if pq is not None:
        pq.cp.seed = seed


def load_index(path: Path, search_params: str, mmap: bool = False):
    """The index at `path` with `search_params` set. On-disk inverted lists are looked for beside it (not at the
    path the build recorded), so a database directory may be moved or mounted elsewhere.

    Example: load_index(Path("db/index/index.faiss"), "efSearch=256").ntotal -> 1000000"""
    faiss = import_faiss()
    if not path.exists():
        raise RetroError(f"{path}: no index; build it with `corpusforge build-knn ... --resume`")
    flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if mmap else 0
    if path.with_suffix(".ivfdata").exists():
        with c_stdout_to_stderr():  # faiss says where it found the lists, on stdout
            index = _read_index(faiss, path, flags | faiss.IO_FLAG_ONDISK_SAME_DIR)
        # No prefetch threads: a search leaves them to be joined by the next one, and in a worker forked after the
        # driver's recall search those threads do not exist: joining them killed the worker. The lists are mapped,
        # so a search still reads them, page by page (see _advise_random); faiss's prefetch was no faster here.
        lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(index).invlists)
        lists.prefetch_nthread = 0
        _advise_random(faiss, lists)
    else:
        index = _read_index(faiss, path, flags)
    set_search_params(index, search_params)
    return index


def _read_index(faiss, path: Path, flags: int):
    """faiss.read_index, with a file it cannot read (cut short, junk, another program's) refused in one line naming
    it: faiss checks every read against what the file's header promised, and raises a RuntimeError whose message
    starts with its C++ source location (tested: truncated at every field of Flat, IVF-Flat and IVF-PQ indexes)."""
    try:
        return faiss.read_index(str(path), flags)
    except (RuntimeError, MemoryError) as e:  # MemoryError: a damaged count asking for more than there is
        why = re.sub(r"^Error in .*? at \S+:\d+: (Error: )?", "", first_line(e))
        why = re.sub(r" \((No such file or directory|Success)\)$", "", why)  # errno left over from an earlier call
        raise RetroError(
            f"{path}: not a readable faiss index ({why}); the file is truncated or damaged: restore it, or rebuild "
            "the database (build-knn into a new --output)"
        ) from None


def _advise_random(faiss, lists) -> None:
    """madvise(MADV_RANDOM) on the mapped lists: a query reads its nprobe lists, scattered over the file, and the
    kernel's read-around on each page fault (8 MB on the reference machine's disk) read 1.3 GB a query at 10M
    chunks for 160 MB of lists, 0.77 queries/s under a 3 GiB limit; with this, 111 MB and 1.1 queries/s
    (knn-10m-ondisk-3g-2026-11-22.json)."""
    import ctypes

    if not lists.totsize:
        return
    address = faiss.rev_swig_ptr(lists.ptr, lists.totsize).__array_interface__["data"][0]
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(address), ctypes.c_size_t(lists.totsize), 1)  # 1: MADV_RANDOM
    except AttributeError:  # no madvise: not Linux; the search is the same, only its reads differ
        pass


@functools.lru_cache(maxsize=2)
def shared_index(path: str, mtime_ns: int):
    """One loaded index per process and file version, for tasks: a forked local worker inherits the driver's (no
    copy until written), a Ray worker loads it once for all the tasks it runs. Callers set their search params.

    Example: shared_index("db/index/index.faiss", os.stat("db/index/index.faiss").st_mtime_ns).ntotal -> 1000000"""
    return load_index(Path(path), "")


def index_ram() -> int | None:
    """What an index may hold in RAM here: half this machine's memory (the rest: page cache for the embeddings the
    neighbours stage re-ranks from, and the driver's other arrays). Linux sysconf; None (no limit) elsewhere."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return None


def fits_in_ram(ram_bytes: int) -> bool:
    """Whether an index of `ram_bytes` fits in index_ram()."""
    limit = index_ram()
    return limit is None or ram_bytes <= limit


def set_search_params(index, params: str) -> None:
    if params:
        faiss = import_faiss()
        faiss.ParameterSpace().set_index_parameters(index, params)


def escalate(params: str) -> str | None:
    """The next, more exhaustive setting of the search parameters (nprobe / efSearch x1.5, rounded to 8), or None
    at the top (4096). Steps of 1.5 rather than 2: QPS falls about as fast as efSearch grows, and at 1M chunks
    recall@10 crossed 0.95 between efSearch 256 (0.946) and 512 (0.964), so doubling paid ~40% of the QPS for
    recall the target did not ask for.

    Example: escalate("efSearch=64") -> "efSearch=96"; escalate("nprobe=8") -> "nprobe=16" """
    if not params:
        return None
    parts = parse_params(params)
    key = "nprobe" if "nprobe" in parts else "efSearch"
    if int(parts[key]) >= 4096:
        return None
    parts[key] = str(min(4096, max(int(parts[key]) + 8, round(int(parts[key]) * 1.5 / 8) * 8)))
    if "quantizer_efSearch" in parts:
        parts["quantizer_efSearch"] = str(max(int(parts["quantizer_efSearch"]), int(parts[key])))
    return format_params(parts)


MAX_TUNED_CANDIDATES = 1024


def tunes_candidates(key: str) -> bool:
    """Whether more re-ranked candidates can lift recall: an IVF index of compressed codes (PQ, SQ, ...) orders its
    hits by approximate distances, so true neighbours can sit below the first 40. At 10M chunks,
    OPQ32_128,IVF16384_HNSW32,PQ32 with 40 candidates stopped at recall@10 0.891 whatever nprobe. Full vectors
    (Flat, HNSW) order them exactly: more candidates add nothing there."""
    return "IVF" in key and not key.endswith(",Flat")


def candidate_steps(first: int) -> list[int]:
    """The re-ranked candidate counts the recall tuning tries, from `first` up by x1.5 (rounded to 8) to
    MAX_TUNED_CANDIDATES: re-ranking gathers every candidate's stored embedding, so each step costs reads.

    Example: candidate_steps(40) -> [40, 64, 96, 144, 216, 320, 480, 720, 1024]"""
    steps = [first]
    while steps[-1] < MAX_TUNED_CANDIDATES:
        steps.append(min(MAX_TUNED_CANDIDATES, max(steps[-1] + 8, round(steps[-1] * 1.5 / 8) * 8)))
    return steps
