"""Megatron's `--partitions N`: its input files in its order, and its document order, reproduced byte for byte.

What tools/preprocess_data.py (Megatron-LM d98e8a6; core_v0.19.0 and core_v0.18.2 alike) does with N > 1:

1. The input files are `glob.glob(--input)`, in the order glob returns them (the directory's order, not sorted);
   `.gz` files are read through gzip.
2. Their lines, counted across all the files in that order, are dealt to N partition files: line j to partition
   j % N (round-robin), or with `--keep-sequential-samples` in contiguous runs of ceil(lines / N).
3. Each partition is tokenized alone, and the N datasets are merged in partition order (`add_index`).

So with `--keep-sequential-samples` the output is the files' documents in glob order: what corpusforge writes for
that input list. Without it the output holds documents 0, N, 2N, ..., then 1, N + 1, ..., then N - 1, 2N - 1, ...:
`preprocess_dealt` tokenizes in input order under a staging prefix, then writes each dataset again with its
documents in that order (`deal`; the tokens are copied, not re-tokenized) under the final names. With
`--partitions 1` Megatron opens `--input` as one path, with no glob.

Megatron stops on a record it cannot read; `--on-bad-line skip` (corpusforge's) deals the records it keeps, which
is what Megatron writes for the input without the skipped lines.

Example:
    >>> megatron_inputs("data/*.jsonl", partitions=4)   # doctest: +SKIP
    ('data/b.jsonl', 'data/a.jsonl')
    >>> dealt_order(7, 3)
    array([0, 3, 6, 1, 4, 2, 5])
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from corpusforge import indexed
from corpusforge.fsutil import fsync_dir, temp_path, write_json_atomic
from corpusforge.preprocess import PreprocessConfig, PreprocessStats, Progress, preprocess, run_fingerprint

STAGING_SUFFIX = ".input-order"
"""`{prefix}{STAGING_SUFFIX}`: the prefix of the input-order datasets that `deal` reads, removed once dealt."""

_COPY_TOKENS = 1 << 23  # tokens gathered per write while dealing (16-32 MiB of memory at a time)


def megatron_inputs(pattern: str, partitions: int) -> tuple[str, ...]:
    """`--input` as Megatron reads it, as corpusforge input names (escaped: each names exactly one path).

    `--partitions 1`: the path itself (a glob there is expanded by corpusforge, sorted: Megatron cannot open it).
    More: `glob.glob(pattern)` in its own order, as Megatron lists them; a pattern matching nothing is passed on,
    for preprocess to refuse in words (Megatron would write empty datasets).

    Example: megatron_inputs("c.jsonl", 1) -> ("c.jsonl",)
    """
    if partitions == 1:
        return (glob.escape(pattern) if os.path.exists(pattern) else pattern,)
    found = glob.glob(pattern)
    return tuple(glob.escape(path) for path in found) if found else (pattern,)


def dealt_order(documents: int, partitions: int) -> np.ndarray:
    """The input-order document numbers in Megatron's merged order when line j went to partition j % N.

    Example: dealt_order(5, 2) -> array([0, 2, 4, 1, 3])
    """
    return np.concatenate([np.arange(r, documents, partitions, dtype=np.int64) for r in range(partitions)])


def deal(source: str | os.PathLike, dest: str | os.PathLike, partitions: int, durable: bool = True) -> None:
    """Write the dataset `source` again as `dest` with its documents in `dealt_order` (sequences and tokens of each
    document unchanged); `dest` appears whole (publish_pair) or not at all.

    Example: deal("out/c.input-order_text_document", "out/c_text_document", 4)
    """
    src = indexed.IndexedDataset(source)
    if src.sequence_modes is not None:
        raise ValueError(f"{source}: a multimodal dataset (sequence modes); Megatron's text preprocessing writes none")
    order = dealt_order(src.num_documents, partitions)
    doc_idx = src.document_indices
    counts = np.diff(doc_idx)[order]
    new_doc_idx = np.zeros(len(order) + 1, np.int64)
    np.cumsum(counts, out=new_doc_idx[1:])
    # The source sequence of every destination sequence: each document's run of sequences, moved as a whole.
    seq_of = np.repeat(doc_idx[:-1][order] - new_doc_idx[:-1], counts) + np.arange(new_doc_idx[-1], dtype=np.int64)
    lengths = src.sequence_lengths[seq_of].astype(np.int64)
    first_token = src.sequence_pointers[seq_of] // src.dtype.itemsize
    bin_tmp, idx_tmp = temp_path(indexed.bin_path(dest)), temp_path(indexed.idx_path(dest))
    try:
        with open(bin_tmp, "wb") as out:
            _copy_sequences(src.tokens, first_token, lengths, out)
            out.flush()
            if durable:
                os.fsync(out.fileno())
        indexed.write_index(idx_tmp, src.dtype, lengths, new_doc_idx, durable=durable)
        indexed.publish_pair(bin_tmp, idx_tmp, dest)
    except BaseException:
        bin_tmp.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
        raise
    finally:
        src.close()
    if durable:
        fsync_dir(Path(dest).parent)


def _copy_sequences(tokens: np.ndarray, first: np.ndarray, lengths: np.ndarray, out) -> None:
    """Write tokens[first[i] : first[i] + lengths[i]] for every i, in order, a few million tokens per gather."""
    ends = np.cumsum(lengths)
    start = 0
    while start < len(lengths):
        done = ends[start - 1] if start else 0
        stop = max(int(np.searchsorted(ends, done + _COPY_TOKENS, side="right")), start + 1)
        n = lengths[start:stop]
        starts_out = np.concatenate(([0], np.cumsum(n)[:-1]))
        where = np.repeat(first[start:stop] - starts_out, n) + np.arange(int(n.sum()), dtype=np.int64)
        out.write(memoryview(np.ascontiguousarray(tokens[where])))
        start = stop


def preprocess_dealt(
    config: PreprocessConfig, partitions: int, on_progress: Callable[[Progress], None] | None = None
) -> PreprocessStats:
    """`preprocess(config)` with the documents of every output in Megatron's round-robin partition order.

    Tokenizes under `{prefix}.input-order` (so `--resume` continues an interrupted run there, and a run killed
    while dealing deals again), deals each dataset to its final name, writes `{prefix}.preprocess.json` (the staged
    run's, naming the final outputs and the order), and removes the staged datasets.

    Example: preprocess_dealt(PreprocessConfig(("c.jsonl",), "out/c", keep_empty=True), partitions=4)
    """
    summary_path = Path(f"{config.output_prefix}.preprocess.json")
    if config.resume and (finished := _finished(config, partitions, summary_path)) is not None:
        return finished
    staging = replace(config, output_prefix=f"{config.output_prefix}{STAGING_SUFFIX}")
    stats = preprocess(staging, on_progress)
    t0 = time.perf_counter()
    summary_path.unlink(missing_ok=True)  # while the outputs change, no summary vouches for them
    for source, dest in zip(staging.output_prefixes(), config.output_prefixes()):
        deal(source, dest, partitions)
    staged_summary = Path(f"{staging.output_prefix}.preprocess.json")
    summary = json.loads(staged_summary.read_text())
    stats.outputs = config.output_prefixes()
    stats.seconds += time.perf_counter() - t0
    summary["config"]["output_prefix"] = config.output_prefix
    summary["stats"] = stats.to_dict()
    summary["megatron_partitions"] = {"partitions": partitions, "order": "round-robin (line j in partition j % N)"}
    write_json_atomic(summary_path, summary)
    staged_summary.unlink()
    for source in staging.output_prefixes():
        indexed.idx_path(source).unlink()  # the .idx first: a .bin alone is no dataset to any reader
        indexed.bin_path(source).unlink()
    return stats


def _finished(config: PreprocessConfig, partitions: int, summary_path: Path) -> PreprocessStats | None:
    """The stats of a finished dealt run of the same inputs, tokenizer and partitions whose outputs are all there
    (so that `--resume` after it does nothing, as for preprocess), else None."""
    if not summary_path.is_file():
        return None
    t0 = time.perf_counter()
    summary = json.loads(summary_path.read_text())
    if (summary.get("megatron_partitions") or {}).get("partitions") != partitions:
        return None
    if not all(indexed.exists(p) for p in config.output_prefixes()):
        return None
    if summary.get("fingerprint") != run_fingerprint(config):
        return None
    stats = PreprocessStats.from_dict(summary["stats"])
    stats.already_complete, stats.seconds = True, time.perf_counter() - t0
    return stats
