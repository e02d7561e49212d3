"""Tiny token datasets for the retro tests: topical random documents, and documents of near-duplicate chunks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from corpusforge.indexed import IndexedDatasetWriter

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def topical_documents(n_docs: int, seed: int = 0, min_len: int = 10, max_len: int = 400) -> list[np.ndarray]:
    """Documents of Zipf-distributed tokens around a per-document topic, so that neighbours are meaningful."""
    rng = np.random.default_rng(seed)
    docs = []
    for length in rng.integers(min_len, max_len, n_docs):
        topic = int(rng.integers(0, 40))
        docs.append((rng.zipf(1.3, length) + topic * 1000) % 50_000)
    return docs


def near_duplicate_documents(copies: int = 40, chunk_length: int = 64, seed: int = 1) -> list[np.ndarray]:
    """Document A: one 64-token chunk repeated `copies` times with one token changed per copy; document B: the
    same chunk twice. Every chunk of A is nearest to A's other chunks; its true neighbours outside A are B's."""
    rng = np.random.default_rng(seed)
    base = rng.integers(60_000, 90_000, chunk_length)
    a = []
    for i in range(copies):
        c = base.copy()
        c[i % chunk_length] = 90_000 + i
        a.append(c)
    b = np.concatenate([base, base])
    return [np.concatenate(a), b]


def write_dataset(prefix: Path | str, docs: list[np.ndarray]) -> str:
    with IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_documents(np.concatenate(docs), np.array([len(d) for d in docs]))
    return os.fspath(prefix)


def cli_group():
    """The retro verbs in a tiny click group, so the tests do not depend on the lead's registration in
    cli/__init__.py."""
    import click

    from corpusforge.cli.retro import build_knn_cmd, query_knn_cmd

    group = click.Group()
    group.add_command(build_knn_cmd)
    group.add_command(query_knn_cmd)
    return group


def run_cli(*args: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    """`corpusforge ARGS` in a fresh interpreter (for real kills and exit codes); `kill_at` ("stage:step") runs it
    under killed_build.py, which SIGKILLs the build at that point."""
    if kill_at is None:
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import retrokit\n"
        code += "retrokit.cli_group()(sys.argv[1:], prog_name='corpusforge')"
        command = [sys.executable, "-c", code, *args]
    else:
        command = [sys.executable, str(HERE / "killed_build.py"), kill_at, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
