"""Fast-scan PQ indexes (factory keys ending PQmx4fs), filled as add tasks like any other IVF index.

faiss keeps a fast-scan index's lists in blocks of 32 interleaved 4-bit codes, so that a search scans them with
SIMD table lookups (at 10M chunks, OPQ64_128,IVF16384_HNSW32,PQ64x4fs served the neighbours stage 3.4x faster
than PQ32, same bytes a vector: knn-10m-fastscan-2026-11-22.json). It cannot merge such lists: their code_size is
SIZE_MAX (faiss issue #2407), and merging 39 parts at 10M corrupted the heap. So an add task encodes its rows into
a plain IndexIVFPQ with the trained index's quantizer and 4-bit product quantizer (`plain_twin`), whose lists merge
as any others; the driver merges the parts into plain on-disk lists and packs them into blocks list by list
(`pack_lists`, faiss's own IndexIVFPQFastScan(IndexIVFPQ) conversion). The codes are the ones the fast-scan index's
own add computes, and the packed index is byte for byte the one a single add in the driver writes.
"""

from __future__ import annotations

import re


def is_fast_scan(key: str) -> bool:
    """Whether a factory key's codes are fast-scan PQ.

    Example: is_fast_scan("OPQ64_128,IVF16384_HNSW32,PQ64x4fs") -> True"""
    return bool(re.search(r"PQ\d+x\d+fs", key.split(",")[-1]))


def plain_twin(faiss, fast_ivf):
    """An empty, trained IndexIVFPQ that encodes as `fast_ivf` (an IndexIVFPQFastScan) does: same quantizer (shared,
    not copied: keep `fast_ivf` alive), same product quantizer, same residual choice.

    Example: plain_twin(faiss, faiss.downcast_index(faiss.extract_index_ivf(trained))).add_with_ids(x, ids)"""
    twin = faiss.IndexIVFPQ(fast_ivf.quantizer, fast_ivf.d, fast_ivf.nlist, fast_ivf.pq.M, fast_ivf.pq.nbits)
    twin.metric_type = fast_ivf.metric_type
    twin.pq = fast_ivf.pq
    twin.by_residual = fast_ivf.by_residual
    twin.is_trained = True
    return twin


def pack_lists(faiss, fast_ivf, plain) -> None:
    """Replace `fast_ivf`'s (empty) lists with `plain`'s codes (an IndexIVFPQ from plain_twin, its lists in RAM or on
    disk) packed into fast-scan blocks. Memory: the packed lists, and one plain list at a time."""
    packed = faiss.IndexIVFPQFastScan(plain, fast_ivf.bbs)
    fast_ivf.replace_invlists(packed.invlists, True)
    packed.own_invlists = False  # fast_ivf owns them now
    fast_ivf.ntotal = plain.ntotal
