"""A tiny generated corpus and config for the trainer tests (imported by the tests and their subprocesses).

The corpus is a Markov chain over VOCAB tokens: after token a comes NEXT[a] with probability 0.9, else a uniform
token. Its unigram distribution is close to uniform (entropy ~ln VOCAB), while a model that learns the bigram
reaches ~0.7 nats: a loss well below the unigram entropy proves that the model learned from the data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from corpusforge.indexed import IndexedDatasetWriter

VOCAB = 64
FOLLOW = 0.9


def write_markov_corpus(prefix: Path | str, num_docs: int = 200, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    follow = rng.permutation(VOCAB)
    lengths = rng.integers(40, 200, size=num_docs)
    docs = []
    for n in lengths:
        doc = np.empty(n, dtype=np.int64)
        doc[0] = rng.integers(VOCAB)
        jumps, randoms = rng.random(n) >= FOLLOW, rng.integers(0, VOCAB, size=n)
        for i in range(1, n):
            doc[i] = randoms[i] if jumps[i] else follow[doc[i - 1]]
        docs.append(doc)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(np.concatenate(docs), lengths)
    return str(prefix)


def unigram_entropy(prefix: str) -> float:
    """Entropy in nats of the corpus's token frequencies: the best loss without context."""
    from corpusforge.indexed import IndexedDataset

    counts = np.bincount(np.asarray(IndexedDataset(prefix).tokens), minlength=VOCAB).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def tiny_overrides(data_path: str, out_dir: Path | str, **extra) -> list[str]:
    """key=value overrides of a model and run small enough for a shared 2-core CI machine."""
    values = {
        "data_path": f'"{data_path}"',
        "out_dir": f'"{out_dir}"',
        "vocab_size": VOCAB,
        "model": '"custom"',
        "n_layer": 1,
        "n_head": 2,
        "n_embd": 32,
        "seq_length": 32,
        "micro_batch_size": 8,
        "global_batch_tokens": 512,
        "max_steps": 40,
        "warmup_steps": 4,
        "lr": 1e-2,
        "min_lr": 1e-3,
        "eval_interval": 20,
        "eval_batches": 2,
        "log_interval": 1,
        "checkpoint_interval": 20,
        "num_workers": 0,
        "device": '"cpu"',
        "compile": "false",
        "tensorboard": "false",
        "split": '"90,10,0"',
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]
