"""Part 4: build-knn's index stage on GPU (corpusforge/retro/gpu.py) against its CPU path, same vectors, same run.

Both sides run the library's own code with a different GPU count: an IVF index's k-means (faiss's, assigning on
a flat index: `train_with`) and its list assignment (`centroid_index` + `add_assigned`), with gpus = what faiss
sees, then gpus = 0. Vectors: a seeded mixture of Gaussians, L2-normalised (inner product, as build-knn's
embeddings), a few million in full mode. Index quality: recall@10 of each index (nprobe fixed) against an exact
search, and how far the two indexes agree; the issue asks for identical or near-identical quality.

Optional: without a faiss that sees a GPU (no faiss-gpu wheel fits the 64 MiB the GPU machine takes: see
wheels.sh), full mode is skipped with the reason. Smoke mode runs the same code with gpus = 0 on both sides.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Context, Skip, first_line, part_main  # noqa: E402

SIZES = {
    False: {"n": 2_000_000, "d": 96, "nlist": 4096, "queries": 1000, "nprobe": 32, "clusters": 2000},
    True: {"n": 5_000, "d": 32, "nlist": 32, "queries": 100, "nprobe": 4, "clusters": 50},
}


def vectors(n: int, d: int, clusters: int, seed: int):
    """(n, d) float32 rows of norm 1: points around `clusters` random centres (the same for every seed), so that
    k-means has work to do; another seed draws other points around them."""
    import numpy as np

    centres = np.random.default_rng(0).standard_normal((clusters, d), dtype=np.float32)
    rng = np.random.default_rng(seed + 1)
    x = centres[rng.integers(0, clusters, n)] + 0.6 * rng.standard_normal((n, d), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def recall_at_10(found, truth) -> float:
    return float(sum(len(set(f) & set(t)) for f, t in zip(found.tolist(), truth.tolist())) / truth.size)


def build(faiss, x, s: dict, gpus: int) -> tuple[object, dict]:
    """The index built the way build-knn's index stage does it on `gpus` GPUs, with the seconds of each step."""
    import numpy as np

    from corpusforge.retro.gpu import add_assigned, centroid_index, train_with

    index = faiss.index_factory(x.shape[1], f"IVF{s['nlist']},Flat", faiss.METRIC_INNER_PRODUCT)
    faiss.extract_index_ivf(index).cp.seed = 1234
    t0 = time.perf_counter()
    train_with(faiss, index, gpus)
    index.train(x)  # faiss samples 256 vectors a list from x, as in build-knn
    t1 = time.perf_counter()
    add_assigned(faiss, index, x, np.arange(len(x)), centroid_index(faiss, index, gpus))
    t2 = time.perf_counter()
    faiss.extract_index_ivf(index).nprobe = s["nprobe"]
    return index, {"train_s": round(t1 - t0, 3), "add_s": round(t2 - t1, 3)}


def run(ctx: Context) -> None:
    from corpusforge.retro.common import import_faiss

    try:
        faiss = import_faiss()
    except Exception as e:  # noqa: BLE001 - RetroError (missing extra) or a broken faiss wheel
        raise Skip(f"faiss is not installed ({first_line(e)}); part 4 needs faiss-gpu") from None
    seen = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if not ctx.smoke and not seen:
        raise Skip("faiss sees no GPU (faiss-cpu, or no faiss-gpu: no wheel fits the GPU machine's 64 MiB carry "
                   "with CUDA 13, see benchmarks/gpu/wheels.sh); install faiss-gpu to run part 4")  # fmt: skip
    s = SIZES[ctx.smoke]
    r = ctx.result
    x = vectors(s["n"], s["d"], s["clusters"], seed=0)
    q = vectors(s["queries"], s["d"], s["clusters"], seed=1)  # queries: other points around the same centres
    exact = faiss.IndexFlatIP(s["d"])
    exact.add(x)
    _, truth = exact.search(q, 10)
    r["figures"].update(vectors=s["n"], dim=s["d"], nlist=s["nlist"], nprobe=s["nprobe"], faiss_gpus=seen,
                        faiss_version=getattr(faiss, "__version__", None))  # fmt: skip
    found = {}
    for side, gpus in (("gpu", seen), ("cpu", 0)):
        index, fig = build(faiss, x, s, gpus)
        _, found[side] = index.search(q, 10)
        fig["recall_at_10"] = round(recall_at_10(found[side], truth), 4)
        fig["gpus"] = gpus
        r["runs"][side] = fig
        ctx.save()
    gpu, cpu = r["runs"]["gpu"], r["runs"]["cpu"]
    r["figures"].update(
        train_speedup=round(cpu["train_s"] / max(gpu["train_s"], 1e-9), 2),
        add_speedup=round(cpu["add_s"] / max(gpu["add_s"], 1e-9), 2),
        recall_difference=round(gpu["recall_at_10"] - cpu["recall_at_10"], 4),
        gpu_results_in_cpu_results=round(recall_at_10(found["gpu"], found["cpu"]), 4),
    )
    f = r["figures"]
    r["headline"] = (f"k-means {f['train_speedup']}x, assignment {f['add_speedup']}x faster on {seen} GPU(s); "
                     f"recall@10 {gpu['recall_at_10']} vs {cpu['recall_at_10']} on CPU")  # fmt: skip


if __name__ == "__main__":
    part_main(run, part=4, name="build-knn gpu")
