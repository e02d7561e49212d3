"""Tiny generated token datasets for the loader tests (imported by the tests and by their subprocesses)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from corpusforge.indexed import IndexedDatasetWriter

EOD = 0
VOCAB = 1000


def write_dataset(
    prefix: Path | str,
    num_docs: int,
    seed: int,
    max_len: int = 300,
    dtype=np.uint16,
    empty_every: int = 0,
) -> str:
    """Documents of random length in [1, max_len] (every `empty_every`-th one empty), random tokens in
    [1, VOCAB) and an EOD token at the end of each non-empty document."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, size=num_docs)
    if empty_every:
        lengths[::empty_every] = 0
    tokens = rng.integers(1, VOCAB, size=int(lengths.sum()), dtype=np.int64)
    ends = np.cumsum(lengths)[lengths > 0] - 1
    tokens[ends] = EOD
    with IndexedDatasetWriter(prefix, dtype) as w:
        w.add_documents(tokens, lengths)
    return str(prefix)


def build_blend(corpora: list[str], cache_dir: Path | str, seed: int = 1234, **options):
    """(train, valid, test) of a three-way blend with short samples: the loader tests' standard data."""
    from corpusforge.data import build_gpt_datasets

    blend = [corpora[0], 0.5, corpora[1], 0.3, corpora[2], 0.2]
    return build_gpt_datasets(
        blend, seq_length=32, split="90,8,2", seed=seed, num_samples=(400, 20, 10), cache_dir=cache_dir, **options
    )
