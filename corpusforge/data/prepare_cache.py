"""The loaders' index caches built once, offline: corpusforge's own for a training config, or Megatron-Core's own
files for Megatron-LM's data arguments, so that a job (thousands of ranks waiting on rank 0) starts by mapping them.

`prepare_train_cache(cfg)` builds what `corpusforge train` builds at start (corpusforge/train/data.py: the same
sample counts, the same cache directory) and waits until it is durable. `prepare_megatron_cache(config)` writes,
in `data_cache_path`, the files megatron-core's BlendedMegatronDatasetBuilder looks for, byte for byte:

    {md5}-GPTDataset-{split}-description.txt          json.dumps(unique_identifiers, indent=4)
    {md5}-GPTDataset-{split}-document_index.npy       int32            (np.save format 1.0)
    {md5}-GPTDataset-{split}-sample_index.npy         (n + 1, 2) int32 (int64 past 2**31 - 1)
    {md5}-GPTDataset-{split}-shuffle_index.npy        uint32           (int64 past 2**32 - 2)
    {md5}-BlendedDataset-{split}-description.txt      the datasets' identifiers, the weights, the size
    {md5}-BlendedDataset-{split}-dataset_index.npy    int16
    {md5}-BlendedDataset-{split}-dataset_sample_index.npy  int64

where md5 is of the description's text (megatron_dataset.py: MegatronDataset.__init__; blended_dataset.py). The
identifiers of a GPTDataset are its class, dataset_path (the prefix as given), num_samples, index_split, then
random_seed, sequence_length, split (the string as given), split_matrix and the tokenizer's own unique_identifiers
(MegatronDataset._key_config_attributes): the data itself is not in the hash, so Megatron maps a stale cache for
changed data. Beside them, one `.corpusforge/{md5}.json` per run records the data each entry was built from
(sizes and a sha256 of the sequence lengths: corpusforge/data/cache.py, describe_dataset); a rerun for changed data
is refused in one line. megatron-core ignores that folder.

The arrays are corpusforge's own (gpt_dataset.py, blended.py: the same values as megatron-core's, tested against
it); the sample counts per split follow Megatron-LM (training.py: get_train_valid_test_num_samples, update_train_iters).

Atomic and resumable. A first run (the cache directory absent or empty) writes every file under its final name in a
staging directory beside it, makes them durable with one syncfs, and renames the staging directory onto the cache
directory: every file appears at once or none does (a killed run leaves only the staging directory, which the next
run removes). Otherwise every file is written under a temporary name and renamed; the arrays first, then (after one
syncfs of the file system, or an fsync of each file where syncfs is missing) the descriptions; megatron-core needs
every file of an entry, so a killed run leaves entries it rebuilds. A rerun writes only the files that are missing.

Example:
    >>> stats = prepare_megatron_cache(MegatronCacheConfig(data_path=("0.3", "out/a", "0.7", "out/b"),
    ...     data_cache_path="cache/", seq_length=2048, split="99,1,0", train_samples=100_000,
    ...     global_batch_size=256, vocab_size=50257))
    >>> stats.written_files     # 2 datasets x 2 splits x 4 files, and 2 blends x 3
    22
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import io
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from corpusforge.data.cache import CacheMismatchError, describe_dataset, describe_differences, wait_for_index_caches
from corpusforge.errors import ArgumentError
from corpusforge.fsutil import (
    fsync_dir,
    fsync_path,
    network_fs,
    publish_dir,
    remove_leftovers,
    staging_dir,
    write_at_atomic,
    write_bytes_atomic,
    write_new_at,
)

if TYPE_CHECKING:
    from corpusforge.data.blended import BlendedDataset
    from corpusforge.data.gpt_dataset import GPTDataset

# The index modules (blended, gpt_dataset) are imported where used: this module's MegatronCacheConfig makes the CLI's
# options, and `corpusforge --help` must not start numba.
SPLIT_NAMES = ("train", "valid", "test")

# ---------------------------------------------------------------------------------------------------------------
# the configurations


@dataclass(frozen=True)
class MegatronCacheConfig:
    """Megatron-LM's data arguments, with Megatron-LM's names and meanings (megatron/training/arguments.py)."""

    data_path: tuple[str, ...]
    """--data-path: one prefix, prefixes (weighted by their lengths), or `weight prefix weight prefix ...`."""

    data_cache_path: str
    """--data-cache-path: the directory megatron-core reads its index caches from."""

    seq_length: int
    """--seq-length: tokens per sample."""

    split: str = "969, 30, 1"
    """--split: train, valid, test proportions; Megatron-LM's default when --data-path is given."""

    seed: int = 1234
    """--seed: the seed of every shuffle."""

    train_samples: int | None = None
    """--train-samples: samples to train on (else --train-iters x --global-batch-size)."""

    train_iters: int | None = None
    """--train-iters: iterations to train for (with --global-batch-size)."""

    global_batch_size: int | None = None
    """--global-batch-size: samples per iteration; with --eval-iters and --eval-interval it sizes the validation
    and test splits as Megatron-LM does."""

    eval_iters: int = 100
    """--eval-iters: iterations per evaluation (validation: every --eval-interval; test: once)."""

    eval_interval: int = 1000
    """--eval-interval: iterations between evaluations."""

    valid_samples: int | None = None
    """Validation samples, given directly instead of from --eval-iters and --eval-interval (not a Megatron flag)."""

    test_samples: int | None = None
    """Test samples, given directly instead of from --eval-iters (not a Megatron flag)."""

    tokenizer_type: str = "NullTokenizer"
    """--tokenizer-type: part of megatron-core's cache hash. NullTokenizer is computed here; for another type give
    --tokenizer-identifiers."""

    vocab_size: int | None = None
    """--vocab-size: NullTokenizer's vocabulary (part of its identifiers)."""

    tokenizer_identifiers: str = ""
    """The tokenizer's identifiers as megatron-core records them: a JSON object, or a -description.txt that
    Megatron-LM wrote with this tokenizer (its "tokenizer" object is taken)."""

    mid_level_dataset_surplus: float = 0.005
    """--mid-level-dataset-surplus: a blend builds each dataset this fraction larger than its share."""

    durable: bool = True
    """Make the arrays durable (syncfs) before the descriptions that complete the entries are written."""

    def __post_init__(self) -> None:
        if not self.data_path:
            raise ArgumentError("--data-path: give at least one dataset prefix; see Megatron-LM's --data-path")
        if self.seq_length < 1:
            raise ArgumentError(f"--seq-length {self.seq_length}: must be positive")
        for name in ("train_samples", "train_iters", "global_batch_size", "valid_samples", "test_samples"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ArgumentError(f"--{name.replace('_', '-')} {value}: must not be negative")
        if self.eval_interval < 1:
            raise ArgumentError(f"--eval-interval {self.eval_interval}: must be positive")


@dataclass
class CacheStats:
    """What prepare-cache did: entries (one per dataset and split, one per blend and split), the files it wrote and
    found, the samples of each split, seconds."""

    cache_dir: str
    format: str
    samples: dict[str, int | None] = field(default_factory=dict)
    entries: int = 0
    written_files: int = 0
    found_files: int = 0
    written_bytes: int = 0
    seconds: float = 0.0
    build_seconds: float = 0.0
    sync_seconds: float = 0.0
    """Of `seconds`, waiting for syncfs: the file system's other dirty data is written too (another job's)."""

    def summary(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# Megatron-LM's arithmetic


def megatron_num_samples(config: MegatronCacheConfig) -> tuple[int, int, int]:
    """(train, valid, test) samples as Megatron-LM asks them of the builder (training.py: update_train_iters,
    get_train_valid_test_num_samples): train = --train-samples or --train-iters x --global-batch-size; valid =
    (train_iters // eval_interval + 1) x eval_iters x global_batch_size; test = eval_iters x global_batch_size.

    Example:
        >>> megatron_num_samples(MegatronCacheConfig(("a",), "c", 8, train_iters=10, global_batch_size=4,
        ...     eval_iters=2, eval_interval=5))
        (40, 24, 8)
    """
    gbs, c = config.global_batch_size, config
    need_gbs = c.train_samples is None or c.valid_samples is None or c.test_samples is None
    if need_gbs and not gbs:
        raise ArgumentError("--global-batch-size: needed to size the splits (or give --train-samples, "
                            "--valid-samples and --test-samples)")  # fmt: skip
    if c.train_samples is not None:
        train = c.train_samples
        train_iters = c.train_iters if c.train_iters is not None else (train // gbs if gbs else 0)
    elif c.train_iters is not None:
        train, train_iters = c.train_iters * gbs, c.train_iters
    else:
        raise ArgumentError("--train-samples: give it or --train-iters (Megatron-LM needs one of them)")
    valid = c.valid_samples
    if valid is None:
        valid = (train_iters // c.eval_interval + 1) * c.eval_iters * gbs
    test = c.test_samples if c.test_samples is not None else c.eval_iters * gbs
    return train, valid, test


def megatron_blend(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Prefixes and weights of --data-path as megatron/core/datasets/utils.py: get_blend_from_list reads them: an
    even-length list whose every other item is a number is `weight prefix ...`; anything else is prefixes only.

    Example:
        >>> megatron_blend(["30", "a", "70", "b"])
        (['a', 'b'], [30.0, 70.0])
    """
    from corpusforge.data.blended import parse_blend

    items = list(data_path)
    if len(items) % 2 == 0:
        try:
            weights = [float(w) for w in items[0::2]]
        except ValueError:
            weights = None
        if weights is not None:
            prefixes, _ = parse_blend([x for p, w in zip(items[1::2], weights) for x in (p.strip(), w)])
            return prefixes, weights
    return [p.strip() for p in items], None


def megatron_split_matrix(split: str) -> list[tuple[float, float] | None]:
    """The split's book-ends exactly as megatron-core computes them and records them in its descriptions
    (blended_megatron_dataset_config.py: convert_split_vector_to_split_matrix; the first book-end starts at the
    integer 0).

    Example:
        >>> megatron_split_matrix("99,1")
        [(0, 0.99), (0.99, 1.0), None]
    """
    from corpusforge.data.gpt_dataset import parse_split

    expansion: list[float] = [0]
    for w in parse_split(split):
        expansion.append(expansion[-1] + w)
    return [(lo, hi) if hi > lo else None for lo, hi in zip(expansion[:-1], expansion[1:])]


def tokenizer_identifiers(config: MegatronCacheConfig) -> dict[str, Any]:
    """The tokenizer's unique_identifiers, which megatron-core puts in every description (and so in the hash).

    NullTokenizer's are computed as megatron-core 0.16 builds them (tokenizers/text/utils/build_tokenizer.py: a
    DefaultTokenizerText with no path and the vocabulary size as a string); any other tokenizer's are taken from
    --tokenizer-identifiers (a JSON object, or a -description.txt Megatron-LM wrote with that tokenizer).
    """
    given = config.tokenizer_identifiers.strip()
    if given:
        text, where = given, "--tokenizer-identifiers"
        if not given.startswith("{"):
            where = given
            try:
                text = Path(given).read_text()
            except OSError as e:
                raise ArgumentError(f"{given}: cannot read it ({e.strerror}); give a JSON object or a "
                                    "-description.txt file") from None  # fmt: skip
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ArgumentError(f"{where}: not JSON ({e}); give the tokenizer's identifiers as a JSON object") from None
        value = value.get("tokenizer", value) if isinstance(value, dict) else value
        if isinstance(value, dict) and "datasets" in value:  # a BlendedDataset's description: its first dataset's
            value = value["datasets"][0].get("tokenizer", value)
        if not isinstance(value, dict) or "class" not in value:
            raise ArgumentError(f"{where}: no tokenizer identifiers (an object with a \"class\"); copy the "
                                "\"tokenizer\" object of a -description.txt Megatron-LM wrote")  # fmt: skip
        return value
    if config.tokenizer_type != "NullTokenizer":
        raise ArgumentError(
            f"--tokenizer-type {config.tokenizer_type}: its identifiers are part of megatron-core's cache names; "
            'give --tokenizer-identifiers (the "tokenizer" object of a -description.txt Megatron-LM wrote)'
        )
    ids: dict[str, Any] = {"class": "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText",
                           "tokenizer_path": None}  # fmt: skip
    if config.vocab_size:
        ids["vocab_size"] = str(config.vocab_size)
    return ids


# ---------------------------------------------------------------------------------------------------------------
# entries


@dataclass
class _Entry:
    """One of megatron-core's cache entries: its file-name base, its description, and how to get its arrays."""

    base: str
    description: str
    arrays: Callable[[], dict[str, np.ndarray]]
    data: dict[str, Any] | None  # the data it was built from (GPTDataset entries)


def _md5(text: str) -> str:
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


# Stand-ins in a description template, replaced by each dataset's JSON values: json.dumps(indent=4) is Python code
# (~0.2 ms a description), and a blend has thousands of them, then all of them again inside the blend's own.
_SLOTS = ("\x00path", "\x00samples", "\x00split")


def _gpt_template(common: dict[str, Any]) -> str:
    ids = {"class": "GPTDataset", "dataset_path": _SLOTS[0], "num_samples": _SLOTS[1], "index_split": _SLOTS[2]}
    return json.dumps({**ids, **common}, indent=4)


def _gpt_text(template: str, path: str, num_samples: int | None, split: str) -> str:
    """json.dumps(identifiers, indent=4) of one GPTDataset, from the template: the same text."""
    for slot, value in zip(_SLOTS, (path, num_samples, split)):
        template = template.replace(json.dumps(slot), json.dumps(value), 1)
    return template


def _blend_text(parts: list[str], split: str, weights: list, size: int | None) -> str:
    """json.dumps of a BlendedDataset's identifiers with its datasets' texts nested as json.dumps nests them
    (each line indented by two levels, 8 spaces)."""
    template = json.dumps({"class": "BlendedDataset", "datasets": [_SLOTS[0]], "split": split, "weights": weights,
                           "size": size}, indent=4)  # fmt: skip
    nested = ",\n".join("        " + text.replace("\n", "\n        ") for text in parts)
    return template.replace("        " + json.dumps(_SLOTS[0]), nested, 1)


def _gpt_arrays(part: GPTDataset) -> dict[str, np.ndarray]:
    return {"document_index": part.document_index, "sample_index": part.sample_index,
            "shuffle_index": part.shuffle_index}  # fmt: skip


def _blend_arrays(blend: BlendedDataset) -> dict[str, np.ndarray]:
    return {"dataset_index": blend.dataset_index, "dataset_sample_index": blend.dataset_sample_index}


# ---------------------------------------------------------------------------------------------------------------
# the commands' library functions


def prepare_megatron_cache(
    config: MegatronCacheConfig, progress: Callable[[str, int, int], None] | None = None
) -> CacheStats:
    """Write megatron-core's index caches for Megatron-LM's data arguments into config.data_cache_path (see the
    module docstring); `progress(stage, done, total)` is called as files are written.

    The datasets are made as BlendedMegatronDatasetBuilder makes them (one prefix: a GPTDataset per split; weights:
    each dataset's share of every split plus the surplus, blended into sum_d ceil(n * w_d); prefixes alone: one
    epoch of each, blended by their lengths into min(n, their sum)), as corpusforge/data/builder.py does, in
    memory; each dataset's files are handed to the writer threads as soon as it is built, so that the files' creation
    (latency-bound) overlaps the building of the next datasets and of the blend.

    Example:
        >>> prepare_megatron_cache(MegatronCacheConfig(("out/a_text_document",), "cache/", 2048, split="99,1,0",
        ...     train_samples=1000, valid_samples=10, test_samples=0, vocab_size=50257)).written_files
        8
    """
    from corpusforge.data.blended import BlendedDataset, normalize, samples_per_dataset
    from corpusforge.data.gpt_dataset import GPTDataset, GPTDatasetConfig, split_ranges
    from corpusforge.storage.datasets import open_datasets

    t0 = time.perf_counter()
    sizes = megatron_num_samples(config)
    prefixes, weights = megatron_blend(config.data_path)
    common = {
        "random_seed": config.seed,
        "sequence_length": config.seq_length,
        "split": config.split,
        "split_matrix": megatron_split_matrix(config.split),
        "tokenizer": tokenizer_identifiers(config),  # a bad --tokenizer-identifiers before any work
    }
    template = _gpt_template(common)
    gpt_config = GPTDatasetConfig(seq_length=config.seq_length, seed=config.seed, split=config.split,
                                  mid_level_dataset_surplus=config.mid_level_dataset_surplus)  # fmt: skip
    # One thread builds the blends' indices (a compiled kernel that releases the GIL) while this one opens and builds
    # the datasets: they depend on the weights and the sizes only, and are the longest single piece of work (~0.7 s
    # of CPU for 2M samples of 2,500 datasets), so they start first.
    blender = ThreadPoolExecutor(1, thread_name_prefix="prepare-cache-blend")
    blending: dict[int, Any] = {}
    try:
        if weights is not None:
            weights = normalize(weights)
            blending = _start_blending(config.split, weights, sizes, blender)
        indexed = open_datasets(prefixes)  # every missing file is reported before any file is written
        stats = CacheStats(config.data_cache_path, "megatron-core", dict(zip(SPLIT_NAMES, sizes)))
        writer = _Writer(Path(config.data_cache_path), stats, config.durable, progress)
    except BaseException:
        blender.shutdown(wait=False, cancel_futures=True)
        raise
    with writer, blender:

        def gpt(d: int, split: int, bounds: tuple[int, int], num_samples: int | None) -> tuple[GPTDataset, str]:
            part = GPTDataset(indexed[d], SPLIT_NAMES[split], bounds, num_samples, gpt_config)
            text = _gpt_text(template, prefixes[d], num_samples, part.split)
            data = {"dataset_path": prefixes[d], "data": describe_dataset(part.indexed)}
            writer.add(
                _Entry(f"{_md5(text)}-GPTDataset-{part.split}", text, functools.partial(_gpt_arrays, part), data)
            )
            return part, text

        if len(prefixes) == 1 and weights is None:
            for s, bounds in enumerate(split_ranges(config.split, len(indexed[0]))):
                if bounds is not None:
                    gpt(0, s, bounds, sizes[s])
        else:
            if weights is not None:
                buffer = [samples_per_dataset(weights, n, config.mid_level_dataset_surplus) for n in sizes]
            parts: list[list[tuple[GPTDataset, str]]] = [[], [], []]
            for d, ds in enumerate(indexed):
                for s, bounds in enumerate(split_ranges(config.split, len(ds))):
                    if bounds is not None:
                        parts[s].append(gpt(d, s, bounds, buffer[s][d] if weights is not None else None))
            for s, made in enumerate(parts):
                if not made:
                    continue
                if weights is not None:
                    prebuilt = blending[s].result() if s in blending else None
                    size = sum(samples_per_dataset(weights, sizes[s]))
                    blend = BlendedDataset([p for p, _ in made], weights, size, prebuilt=prebuilt)
                else:
                    lengths = [len(p) for p, _ in made]
                    blend = BlendedDataset([p for p, _ in made], lengths, min(sizes[s], sum(lengths)))
                text = _blend_text([t for _, t in made], blend.split, blend.weights, blend.size)
                arrays = functools.partial(_blend_arrays, blend)
                writer.add(_Entry(f"{_md5(text)}-BlendedDataset-{blend.split}", text, arrays, None))
        stats.build_seconds = round(time.perf_counter() - t0, 3)
    stats.seconds = round(time.perf_counter() - t0, 3)
    return stats


def _start_blending(split: str, weights: list[float], sizes: Sequence[int], pool: ThreadPoolExecutor) -> dict[int, Any]:
    """split -> the future of its blending indices (build_blending_indices), for every split the split string
    gives a weight, started on `pool`."""
    from corpusforge.data.blended import build_blending_indices, samples_per_dataset
    from corpusforge.data.gpt_dataset import split_ranges

    out = {}
    for s, bounds in enumerate(split_ranges(split, 1 << 30)):  # which splits exist does not depend on the size
        if bounds is not None:
            out[s] = pool.submit(build_blending_indices, weights, sum(samples_per_dataset(weights, sizes[s])))
    return out


_ARRAY_NAMES = {
    "GPTDataset": ("document_index", "sample_index", "shuffle_index"),
    "BlendedDataset": ("dataset_index", "dataset_sample_index"),
}


class _Writer:
    """Writes the missing files of the entries it is given (`add`) by writer threads while the caller builds the
    next entries. An entry built for other data than today's is refused before its files are written.

    A cache directory that does not exist yet or is empty (a first run) is filled aside, in a staging directory
    beside it (fsutil.staging_dir), every file under its final name as soon as its entry is built, descriptions too;
    on leaving the block one syncfs (durable) and one rename publish them all at once (fsutil.publish_dir). Where
    another writer put files in the directory meanwhile, they are moved in one by one, arrays first. Otherwise (a
    rerun, files of other runs beside) each file is written whole or not at all in the directory itself
    (fsutil.write_at_atomic: a temporary name, renamed), arrays first; on leaving the block (durable) a syncfs, then
    the descriptions, then a syncfs again: megatron-core takes an entry whose files all exist as complete.

    Files are written by name relative to one open directory; one task per entry (an executor's task costs ~30 us
    of Python)."""

    def __init__(self, directory: Path, stats: CacheStats, durable: bool, progress: Callable | None) -> None:
        self.directory, self.stats, self.durable, self.progress = directory, stats, durable, progress
        self.stage = staging_dir(directory)
        if self.stage is None:
            directory.mkdir(parents=True, exist_ok=True)
            remove_leftovers(directory)  # the temporaries of a killed run
            self.names = set(os.listdir(directory))  # one listing, not 10,000 stats
            self.recorded = _read_records(directory / ".corpusforge")
        else:
            self.names, self.recorded = set(), {}
        self.dir_fd = os.open(self.stage or directory, os.O_RDONLY | os.O_DIRECTORY)
        self.threads = _NETWORK_WRITERS if network_fs(directory) else _WRITERS
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="prepare-cache")
        self.pending: list[Any] = []
        self.arrays: list[str] = []
        self.descriptions: list[tuple[str, str]] = []
        self.fresh: dict[str, Any] = {}
        self.done = 0

    def add(self, entry: _Entry) -> None:
        wanted = [f"{entry.base}-{name}.npy" for name in _ARRAY_NAMES[entry.base.split("-")[1]]]
        desc = f"{entry.base}-description.txt"
        if entry.data is not None:
            known = self.recorded.get(entry.base)
            if known is not None and desc in self.names:
                _check_data(known, entry, self.directory)
            if known != entry.data:
                self.fresh[entry.base] = entry.data
        missing = [n for n in wanted if n not in self.names]
        self.stats.entries += 1
        self.stats.found_files += len(wanted) - len(missing) + (desc in self.names and not missing)
        jobs: list[tuple[str, np.ndarray | str]] = []
        if missing:
            arrays = entry.arrays()
            jobs = [(name, arrays[name[len(entry.base) + 1 : -4]]) for name in missing]
            self.arrays += missing
        if desc not in self.names or missing:
            if self.stage is not None:  # published with the arrays, all at once: no order among them
                jobs.append((desc, entry.description))
                self.arrays.append(desc)
            else:
                self.descriptions.append((desc, entry.description))
        if jobs:
            self.pending.append(self.pool.submit(self._write_all, jobs))

    def _write_all(self, jobs: list[tuple[str, np.ndarray | str]]) -> int:
        return sum(self._write(name, content) for name, content in jobs)

    def _write(self, name: str, content: np.ndarray | str) -> int:
        buffers = (content.encode(),) if isinstance(content, str) else _npy_buffers(content)
        if self.stage is not None:
            size = write_new_at(self.dir_fd, name, *buffers, where=self.directory)
        else:
            if isinstance(content, str) and name in self.names:  # its arrays were rewritten: it stops counting as
                os.unlink(name, dir_fd=self.dir_fd)  # complete before they are
            size = write_at_atomic(self.dir_fd, name, *buffers, where=self.directory)
        self.done += 1  # for the progress line only (threads: a count may be lost)
        if self.progress is not None:
            self.progress("writing", self.done, len(self.arrays) + len(self.descriptions))
        return size

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, kind, *_) -> None:
        published = False
        try:
            if kind is not None:
                return
            written = sum(f.result() for f in self.pending)
            if self.fresh:  # one record file per run, not one per entry: thousands of files cost more than bytes
                records = (self.stage or self.directory) / ".corpusforge"
                records.mkdir(exist_ok=True)
                name = f"{_md5(json.dumps(sorted(self.fresh)))}.json"
                # json.dumps, not json.dump: one C call (dump encodes in Python, chunk by chunk: ~30 ms for 2,500)
                text = json.dumps(self.fresh, sort_keys=True)
                write_bytes_atomic(records / name, text.encode(), durable=False)
            if self.stage is not None:
                if self.durable:
                    _sync(self.stage, self.arrays, self.stats)
                published = publish_dir(self.stage, self.directory, durable=self.durable)
                if not published:
                    _move_in(self.stage, self.directory, self.durable)
                self.stats.written_files = len(self.arrays)
                self.stats.written_bytes = written
                return
            if self.durable and self.arrays:
                _sync(self.directory, self.arrays, self.stats)
            # Last: megatron-core takes an entry whose files all exist as complete, so its description goes last.
            chunk = 1 + len(self.descriptions) // (4 * self.threads)  # a few tasks per thread, not one per file
            batches = [self.descriptions[i : i + chunk] for i in range(0, len(self.descriptions), chunk)]
            written += sum(self.pool.map(self._write_all, batches))
            if self.durable and self.descriptions:
                _sync(self.directory, [name for name, _ in self.descriptions], self.stats)
            self.stats.written_files = len(self.arrays) + len(self.descriptions)
            self.stats.written_bytes = written
        finally:
            self.pool.shutdown(wait=True, cancel_futures=kind is not None)
            os.close(self.dir_fd)
            if self.stage is not None and not published:  # failed, or moved in one by one: nothing of it is kept
                shutil.rmtree(self.stage, ignore_errors=True)


# Threads that write the cache files. On a local disk creating a small file is CPU in the kernel (~30-250 us here,
# ext4 on a shared machine): one thread beside the builder uses the other core; more contend for the directory's
# lock and the GIL (alternating runs here, 4 threads against 1: ~0.4 s more user time, up to twice the system time;
# 32 threads: 2-4 s of system time for 10,000 files). On a network file system each create and rename waits for a
# server round trip: there, threads overlap the waits.
_WRITERS = 1
_NETWORK_WRITERS = 16


def _move_in(stage: Path, directory: Path, durable: bool) -> None:
    """The files of `stage` renamed into `directory` one by one (another writer put files there since the stage
    was made): the arrays, then (durable: after an fsync of the directory) the descriptions, which complete the
    entries for megatron-core; then the record file. Each appears whole: it was complete and synced in the stage."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [n for n in os.listdir(stage) if n != ".corpusforge"]
    arrays = [n for n in names if not n.endswith("-description.txt")]
    for group in (arrays, [n for n in names if n.endswith("-description.txt")]):
        for name in group:
            os.replace(stage / name, directory / name)
        if durable:
            fsync_dir(directory)
    if (stage / ".corpusforge").is_dir():
        (directory / ".corpusforge").mkdir(exist_ok=True)
        for record in os.listdir(stage / ".corpusforge"):
            os.replace(stage / ".corpusforge" / record, directory / ".corpusforge" / record)


def _read_records(directory: Path) -> dict[str, Any]:
    """base -> the data its entry was built from, over every run's record file, the newest winning (a damaged
    one is skipped)."""
    out: dict[str, Any] = {}
    if directory.is_dir():
        for path in sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime_ns):
            with contextlib.suppress(OSError, ValueError):
                out.update(json.loads(path.read_text()))
    return out


def _npy_buffers(array: np.ndarray) -> tuple[bytes, memoryview]:
    """np.save(f, array)'s bytes as megatron-core calls it: the 1.0 header, then the array's bytes."""
    array = np.ascontiguousarray(array)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return header.getvalue(), memoryview(array.reshape(-1).view(np.uint8))


def _check_data(recorded: Any, entry: _Entry, directory: Path) -> None:
    """Refuse an entry whose recorded data differs from today's: megatron-core would map its stale indices."""
    if recorded != json.loads(json.dumps(entry.data)):
        fields = [line.split(":")[0] for line in describe_differences(entry.data or {}, recorded)]
        where = (entry.data or {}).get("dataset_path")
        raise CacheMismatchError(
            f"{directory / entry.base}-description.txt: written for other data ({where} changed: "
            f"{', '.join(fields) or 'its record'}); megatron-core would use its stale indices. Delete the files "
            f"{entry.base}-* or point --data-cache-path elsewhere"
        )


def _sync(directory: Path, names: list[str], stats: CacheStats) -> None:
    """Make the files `names` of `directory` and the directory durable: one syncfs(2) of the file system (one
    journal commit for thousands of small files), else an fsync of each in a few threads. Its seconds are added to
    stats.sync_seconds."""
    t0 = time.perf_counter()
    try:
        _sync_files(directory, names)
    finally:
        stats.sync_seconds = round(stats.sync_seconds + time.perf_counter() - t0, 3)


def _sync_files(directory: Path, names: list[str]) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        if _syncfs(fd):
            return
    finally:
        os.close(fd)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(fsync_path, [directory / name for name in names]))
    fsync_dir(directory)


def _syncfs(fd: int) -> bool:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syncfs(fd) == 0
    return False


def prepare_train_cache(cfg: Any, dp_size: int = 1) -> CacheStats:
    """Build the index caches `corpusforge train` with config `cfg` maps at start, where it would put them (data.
    cache_dir, else {out_dir}/index-cache), for `dp_size` data-parallel ranks (the validation split holds
    eval_batches x micro_batch_size x dp samples): the sample counts of corpusforge/train/data.py: build_data.

    Example:
        >>> prepare_train_cache(load_config("configs/tiny-cpu.toml")).written_files
        9
    """
    from corpusforge.data.builder import build_gpt_datasets

    t0 = time.perf_counter()
    if not cfg.data.path or cfg.data.source == "synthetic" or cfg.family == "retro":
        raise ArgumentError("data.path: this config reads no token datasets (synthetic data or RETRO); nothing "
                            "to prepare")  # fmt: skip
    samples_per_step = cfg.schedule.global_batch_tokens // cfg.model.seq_length
    train = cfg.schedule.max_steps * samples_per_step
    valid = cfg.metrics.eval_batches * cfg.schedule.micro_batch_size * dp_size if cfg.metrics.eval_interval else 0
    cache_dir = Path(cfg.data.cache_dir or Path(cfg.out_dir) / "index-cache")
    before = _listing(cache_dir)
    if cfg.data.curriculum:  # its phases' datasets and indices, as build_data builds them
        from corpusforge.train.data import build_curriculum_splits

        build_curriculum_splits(cfg, valid, str(cache_dir), {})
    else:
        build_gpt_datasets(cfg.data.path, seq_length=cfg.model.seq_length, split=cfg.data.split, seed=cfg.seed,
                           num_samples=(train, valid, 0), cache_dir=cache_dir, storage=cfg.storage)  # fmt: skip
    wait_for_index_caches()
    after = _listing(cache_dir)
    new = [n for n in after if n not in before and not n.endswith(".lock")]
    stats = CacheStats(str(cache_dir), "corpusforge", {"train": train, "valid": valid, "test": 0})
    stats.entries = sum(n.endswith("-description.json") for n in after)
    stats.written_files = len(new)
    stats.found_files = len([n for n in after if n in before and not n.endswith(".lock")])
    stats.written_bytes = sum(after[n] for n in new)
    stats.seconds = stats.build_seconds = round(time.perf_counter() - t0, 3)
    return stats


def _listing(directory: Path) -> dict[str, int]:
    if not directory.is_dir():
        return {}
    return {e.name: e.stat().st_size for e in os.scandir(directory) if e.is_file()}
