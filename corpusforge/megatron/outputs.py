"""Where megatron-preprocess writes: Megatron's files in the output directory, corpusforge's own in a hidden one.

Megatron-LM's preprocess_data.py leaves `{prefix}_{key}_{level}.bin/.idx` in the output directory and nothing else,
and Megatron's tools count on that: `tools/merge_datasets.py --input DIR` takes every file of DIR for half of a
.bin/.idx pair and stops at any other (it skips directories). So everything else corpusforge writes for a run goes
to the hidden directory `{output dir}/.corpusforge/`, which Megatron's tools, `ls` and shell globs pass over:

    .corpusforge/{name}.preprocess.json           the run record: configuration, statistics, fingerprint (what
                                                  `--resume` compares; `corpusforge preprocess` writes the same
                                                  record beside its outputs as `{prefix}.preprocess.json`)
    .corpusforge/{name}.staged.parts/             an unfinished run's parts, for `--resume`
    .corpusforge/{name}.staged.input-order_*      --partitions N: the input-order datasets, until dealt
    .corpusforge/{name}.staged_{key}_{level}.*    the finished datasets, until renamed to their final names
    .corpusforge/{name}.staged.preprocess.json    their record, until then

The output directory only receives renames (the same file system), per key through indexed.publish_pair, the one
commit of a pair: the final .idx removed, the .bin renamed, then the .idx, so a reader finds the old pair, no .idx,
or the new pair. A run killed at any point is
finished by `--resume` (tokenizing from the parts, renaming from the staged record); a finished one is not redone.

Example:
    >>> work_prefix("out/corpus")
    'out/.corpusforge/corpus'
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from corpusforge import indexed
from corpusforge.errors import ArgumentError
from corpusforge.fsutil import write_json_atomic
from corpusforge.megatron.partitions import preprocess_dealt
from corpusforge.preprocess import PreprocessConfig, PreprocessStats, Progress, preprocess, run_fingerprint

WORK_DIR = ".corpusforge"
"""The hidden directory, beside the outputs, that holds corpusforge's own files for megatron-preprocess runs."""


def work_prefix(output_prefix: str) -> str:
    """`{dir}/.corpusforge/{name}` for the output prefix `{dir}/{name}`."""
    out = Path(output_prefix)
    return os.fspath(out.parent / WORK_DIR / out.name)


def record_path(output_prefix: str) -> Path:
    """The run record of `output_prefix`: `{dir}/.corpusforge/{name}.preprocess.json`."""
    return Path(f"{work_prefix(output_prefix)}.preprocess.json")


def staged(config: PreprocessConfig) -> PreprocessConfig:
    """`config` writing under the hidden staging prefix instead of its output prefix."""
    return replace(config, output_prefix=f"{work_prefix(config.output_prefix)}.staged")


def preprocess_megatron(
    config: PreprocessConfig, deal: int = 1, on_progress: Callable[[Progress], None] | None = None
) -> PreprocessStats:
    """Preprocess `config` (its documents dealt into Megatron's order over `deal` partitions when > 1), leaving
    only Megatron's files in the output directory (see the module docstring).

    Example: preprocess_megatron(PreprocessConfig(("c.jsonl",), "out/c", keep_empty=True)).outputs
    -> ['out/c_text_document']
    """
    work = check_output(config.output_prefix, config.output_prefixes())
    stage = staged(config)
    try:
        if config.resume:
            if (done := _finished(config, deal)) is not None:
                return done
            staged_record = Path(f"{stage.output_prefix}.preprocess.json")
            if _matches(staged_record, config, deal):  # killed while renaming: finish that
                return _publish(config, stage, None)
        if deal > 1:
            stats = preprocess_dealt(stage, deal, on_progress)
        else:
            stats = preprocess(stage, on_progress=on_progress)
        return _publish(config, stage, stats)
    finally:
        remove_if_empty(work)


def remove_if_empty(work: Path) -> None:
    """The hidden directory goes when nothing is in it (a run that failed before writing, a worker search)."""
    with contextlib.suppress(OSError):
        work.rmdir()


def check_output(prefix: str, finals: list[str]) -> Path:
    """Create `{dir}/.corpusforge` (as mkdir -p), and refuse what would stop the run only at its end, naming
    --output-prefix; returns the hidden directory."""
    if prefix.endswith(("/", os.sep)) or Path(prefix).name in ("", ".", ".."):
        raise ArgumentError(f"--output-prefix {prefix}: names a directory; add a file name, e.g. {prefix}/corpus")
    out = Path(prefix).parent
    work = out / WORK_DIR
    try:
        work.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        if work.exists():
            raise ArgumentError(
                f"{work} is a file; corpusforge keeps its run records in that directory: move the file away"
            ) from None
        raise ArgumentError(f"--output-prefix {prefix}: a part of {out} is a file; choose another path") from None
    except PermissionError:
        raise ArgumentError(f"--output-prefix {prefix}: cannot create {work} (permission denied); choose a writable "
                            "directory") from None  # fmt: skip
    if not os.access(out, os.W_OK) or not os.access(work, os.W_OK):
        raise ArgumentError(f"--output-prefix {prefix}: {out} is not writable; choose a writable directory")
    for path in (p(f) for f in finals for p in (indexed.bin_path, indexed.idx_path)):
        if path.exists() and not path.is_file():
            raise ArgumentError(f"{path} exists and is not a file; move it away or choose another --output-prefix")
    return work


def _read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _matches(path: Path, config: PreprocessConfig, deal: int) -> bool:
    """Whether the record at `path` is of a run of `config`'s inputs, keys and tokenizer, dealt over `deal`."""
    record = _read_record(path)
    if record is None or (record.get("megatron_partitions") or {}).get("partitions", 1) != deal:
        return False
    return record.get("fingerprint") == run_fingerprint(config)


def _finished(config: PreprocessConfig, deal: int) -> PreprocessStats | None:
    """The stats of a finished run of the same inputs, tokenizer and partitions whose outputs are all there."""
    path = record_path(config.output_prefix)
    if not path.is_file() or not all(indexed.exists(p) for p in config.output_prefixes()):
        return None
    if not _matches(path, config, deal):
        return None
    stats = PreprocessStats.from_dict(_read_record(path)["stats"])
    stats.already_complete, stats.seconds = True, 0.0
    return stats


def _publish(config: PreprocessConfig, stage: PreprocessConfig, stats: PreprocessStats | None) -> PreprocessStats:
    """Rename the staged datasets to their final names and write the run record; idempotent (see the docstring)."""
    staged_record = Path(f"{stage.output_prefix}.preprocess.json")
    summary = _read_record(staged_record)
    final_record = record_path(config.output_prefix)
    final_record.unlink(missing_ok=True)  # while the outputs change, no record vouches for them
    for source, dest in zip(stage.output_prefixes(), config.output_prefixes()):
        if not indexed.idx_path(source).exists():
            continue  # renamed already: its .idx goes last
        indexed.publish_pair(indexed.bin_path(source), indexed.idx_path(source), dest)  # the one commit of a pair
    if stats is None:
        stats = PreprocessStats.from_dict(summary["stats"])
        stats.tasks_resumed = stats.tasks
    stats.outputs = config.output_prefixes()
    summary["config"]["output_prefix"] = config.output_prefix
    summary["stats"] = stats.to_dict()
    write_json_atomic(final_record, summary)
    staged_record.unlink(missing_ok=True)
    _remove_old_record(config.output_prefix)
    return stats


def _remove_old_record(prefix: str) -> None:
    """The record corpusforge before 2026-11-28 wrote beside a megatron-preprocess run's outputs, where Megatron's
    merge_datasets.py stops at it; the outputs it described have just been replaced."""
    old = Path(f"{prefix}.preprocess.json")
    record = _read_record(old) if old.is_file() else None
    if record is not None and "fingerprint" in record:
        old.unlink()
