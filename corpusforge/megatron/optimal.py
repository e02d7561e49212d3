"""`--find-optimal-num-workers`: time the worker counts of `--workers-to-check` on the first `--max-documents`.

What Megatron-LM's preprocess_data.py (HEAD, d98e8a6) does with it: for each count of `--workers-to-check`
(default 16 32 64) it runs its whole pipeline with that many workers, stops reading after `--max-documents`
(default 100000) documents of each partition, records documents/s every 1000 documents (`--log-interval` is
forced to 1000), and prints, fastest first:

    -----------------------------------
    Performance results (fastest → slowest):
    1. 32 workers → avg. docs/s: 5123.4567
    ...
    -----------------------------------
    The most optimal num of workers is 32 with avg. preprocessed docs/s: 5123.4567.
    -----------------------------------

Here: the first `--max-documents` lines of the input, in Megatron's order (glob order with --partitions > 1), are
copied to `{dir}/.corpusforge/` once, and each count preprocesses that sample with the run's own flags (tokenizer,
keys, sentence splitting, partitions), timed end to end (worker start and tokenizer load included; Megatron's
figure starts after its pool). The report is Megatron's lines, with the count that ran (Megatron prints the count
times --partitions), then one line naming the flag to rerun with.

Deliberate differences: no dataset is left under --output-prefix (Megatron leaves the last count's truncated
dataset there, which looks like a finished one); --max-documents counts the sample, not each partition; counts need
not divide by --partitions (Megatron drops those).

Example:
    >>> search = find_optimal_workers(plan, workers_to_check=[1, 2], max_documents=1000)  # doctest: +SKIP
    >>> search.best.workers
    2
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from corpusforge.errors import ArgumentError
from corpusforge.megatron.outputs import check_output, remove_if_empty, work_prefix
from corpusforge.megatron.partitions import preprocess_dealt
from corpusforge.megatron.tokenizers import open_json_lines
from corpusforge.preprocess import PreprocessConfig, preprocess


@dataclass(frozen=True)
class WorkerTrial:
    """One worker count, run on the sample."""

    workers: int
    documents: int
    tokens: int
    seconds: float
    """End to end: worker start, tokenizer load, tokenizing, writing."""
    docs_per_s: float
    mb_per_s: float


@dataclass(frozen=True)
class WorkerSearch:
    """The trials, fastest first, and the sample they ran on."""

    trials: list[WorkerTrial]
    sample_documents: int
    sample_bytes: int

    @property
    def best(self) -> WorkerTrial:
        return self.trials[0]

    def report(self) -> list[str]:
        """Megatron's lines (preprocess_data.py's find_optimal_num_workers), then the flag to rerun with."""
        lines = ["", "-----------------------------------", "Performance results (fastest → slowest):"]
        lines += [f"{i + 1}. {t.workers} workers → avg. docs/s: {t.docs_per_s:.4f}" for i, t in enumerate(self.trials)]
        lines += ["", "-----------------------------------"]
        lines.append(
            f"The most optimal num of workers is {self.best.workers} with avg. preprocessed docs/s: "
            f"{self.best.docs_per_s:.4f}."
        )
        lines.append("-----------------------------------")
        lines.append(
            f"corpusforge: timed on the first {self.sample_documents:,} documents ({self.sample_bytes / 1e6:,.1f} MB); "
            f"no dataset written: rerun without --find-optimal-num-workers, with --workers {self.best.workers}"
        )
        return lines

    def to_dict(self) -> dict:
        return {
            "trials": [asdict(t) for t in self.trials],
            "best_workers": self.best.workers,
            "sample_documents": self.sample_documents,
            "sample_bytes": self.sample_bytes,
        }


def find_optimal_workers(
    config: PreprocessConfig, deal: int, workers_to_check: list[int], max_documents: int, announce=None
) -> WorkerSearch:
    """Time `config` (dealt over `deal` partitions when > 1) with each count of `workers_to_check` on the first
    `max_documents` records of its inputs; `announce(line)` is told "Processing data with N workers." before each.
    Leaves nothing behind (the output directory is made, as for a run)."""
    if not workers_to_check or min(workers_to_check) < 1:
        raise ArgumentError(f"--workers-to-check {' '.join(map(str, workers_to_check))}: give counts of 1 or more")
    if max_documents < 1:
        raise ArgumentError(f"--max-documents {max_documents}: give a count of 1 or more")
    work = check_output(config.output_prefix, config.output_prefixes())
    sample = Path(f"{work_prefix(config.output_prefix)}.optimal-sample.jsonl")
    trials = []
    try:
        documents = _sample(config.inputs, sample, max_documents)
        for workers in workers_to_check:
            if announce:
                announce(f"Processing data with {workers} workers.")
            trial = replace(config, inputs=(glob.escape(os.fspath(sample)),), workers=workers, resume=False,
                            output_prefix=f"{work_prefix(config.output_prefix)}.optimal-{workers}")  # fmt: skip
            stats = preprocess_dealt(trial, deal) if deal > 1 else preprocess(trial)
            seconds = max(stats.seconds, 1e-9)
            trials.append(WorkerTrial(workers, stats.documents, stats.tokens, round(seconds, 4),
                                      stats.documents / seconds, stats.input_bytes / 1e6 / seconds))  # fmt: skip
            _remove_outputs(trial)
    finally:
        size = sample.stat().st_size if sample.exists() else 0
        sample.unlink(missing_ok=True)
        remove_if_empty(work)
    trials.sort(key=lambda t: t.docs_per_s, reverse=True)
    return WorkerSearch(trials, documents, size)


def _sample(inputs: tuple[str, ...], dest: Path, n: int) -> int:
    """Copy the first `n` lines of the JSON-lines `inputs` (plain, .gz, .zst; in order) to `dest`; how many."""
    from corpusforge import sources

    copied = 0
    with open(dest, "wb") as out:
        for path in sources.find_inputs(inputs).files:
            if path.is_dir() or path.name.endswith(".parquet"):
                raise ArgumentError(
                    f"{path}: --find-optimal-num-workers samples JSON-lines inputs (as Megatron reads); give a .jsonl"
                )
            with open_json_lines(os.fspath(path)) as lines:
                for line in lines:
                    out.write(line if line.endswith(b"\n") else line + b"\n")
                    copied += 1
                    if copied == n:
                        return copied
    return copied


def _remove_outputs(config: PreprocessConfig) -> None:
    for prefix in config.output_prefixes():
        for suffix in (".bin", ".idx"):
            Path(prefix + suffix).unlink(missing_ok=True)
    Path(f"{config.output_prefix}.preprocess.json").unlink(missing_ok=True)
    shutil.rmtree(f"{config.output_prefix}.parts", ignore_errors=True)
