"""The trainer's data: corpusforge datasets and loaders sized from the config, checked before any compute."""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from corpusforge.errors import CorpusforgeError
from corpusforge.train.config import ConfigError, TrainConfig, fim_config


class DataError(CorpusforgeError, ValueError):
    """Data that cannot feed this run: missing files, too few tokens, token ids beyond the vocabulary."""


@dataclass
class TrainData:
    train: Any  # Loader of this rank
    valid: Any | None  # Loader of this rank, or None when evaluation is off
    train_samples: int  # samples the run consumes (all ranks)
    train_tokens_per_epoch: int  # tokens of the train split(s), before the sample index repeats them
    read_modes: dict[str, str] = field(default_factory=dict)  # how each dataset is read, and why (run summary)
    valid_random: Any | None = None  # RETRO: the validation samples with random neighbours (the retrieval gap)
    curriculum: dict[str, Any] | None = None  # data.curriculum: tokens per phase, source and length (dry run, plan)

    def __post_init__(self) -> None:
        self.valid_start = self.valid.state_dict() if self.valid is not None else None  # rewound before each eval
        self.valid_random_start = self.valid_random.state_dict() if self.valid_random is not None else None


class SyntheticLoader:
    """Uniform random tokens made once on the device, `pool` micro-batches cycled: a loader that costs nothing,
    for measuring the data path's cost. Its state is the count of batches handed out, so resume works too."""

    def __init__(self, cfg: TrainConfig, device: Any, pool: int = 8) -> None:
        import torch

        g = torch.Generator(device="cpu").manual_seed(cfg.seed)
        shape = (pool, cfg.schedule.micro_batch_size, cfg.model.seq_length + 1)
        text = torch.randint(0, cfg.model.vocab_size, shape, generator=g, dtype=torch.int32).to(device)
        self.tokens, self.labels = text[..., :-1].contiguous(), text[..., 1:].contiguous()
        self.loss_mask = torch.ones(shape[1:2] + (cfg.model.seq_length,), dtype=torch.float32, device=device)
        self.position_ids = torch.arange(cfg.model.seq_length, dtype=torch.int32, device=device).expand(shape[1], -1)
        self.consumed = 0

    def __iter__(self):
        while True:
            i = self.consumed % len(self.tokens)
            self.consumed += 1
            yield {"tokens": self.tokens[i], "labels": self.labels[i], "loss_mask": self.loss_mask,
                   "position_ids": self.position_ids}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"synthetic_batches": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed = int(state.get("synthetic_batches", 0))


def _split_tokens(dataset: Any) -> int:
    """Tokens in the sequences a GPTDataset (or every part of a blend) draws from."""
    parts = getattr(dataset, "datasets", None)
    if parts is not None:
        return sum(_split_tokens(p) for p in parts)
    lo, hi = dataset.documents
    return int(np.sum(dataset.indexed.sequence_lengths[lo:hi], dtype=np.int64))


def build_data(cfg: TrainConfig, rank: int, world_size: int, agree=None, device: Any = "cpu") -> TrainData:
    """Train and validation loaders for `rank`. Under torch.distributed (`agree`: the trainer's Runtime.agree) rank 0
    builds the index caches first while the others wait for its outcome, then the others map them: an error of rank
    0 (a dataset that does not exist) is every rank's at once, as is one of another rank (a node that cannot read
    the caches)."""
    from corpusforge.data import build_gpt_datasets, make_loader, read_modes

    if cfg.family == "retro":
        if cfg.data.source == "synthetic":
            raise ConfigError('data.source = "synthetic" is for GPT models; a RETRO model reads [retro] db')
        return build_retro_data(cfg, rank, world_size)
    if cfg.data.source == "synthetic":
        valid = SyntheticLoader(cfg, device) if cfg.metrics.eval_interval else None
        tokens = cfg.schedule.max_steps * cfg.schedule.global_batch_tokens
        return TrainData(SyntheticLoader(cfg, device), valid, tokens // cfg.model.seq_length, tokens)
    if not cfg.data.path:
        raise ConfigError("data.path is empty: give a token dataset prefix such as out/tiny_text_document")
    samples_per_step = cfg.schedule.global_batch_tokens // cfg.model.seq_length
    train_samples = cfg.schedule.max_steps * samples_per_step
    valid_samples = (
        cfg.metrics.eval_batches * cfg.schedule.micro_batch_size * world_size if cfg.metrics.eval_interval else 0
    )
    cache_dir = cfg.data.cache_dir or str(Path(cfg.out_dir) / "index-cache")

    options = {"document_boundaries": True} if cfg.data.document_mask else {}  # off: today's batches
    fim = fim_config(cfg)
    if fim is not None:  # Megatron's GPTFIMDataset reads its samples with the tokenizer's eod and pad ids
        tokenizer = _fim_tokenizer(fim[1])
        options = {"eod_token_id": tokenizer.token_id(fim[0].fim_eod_token),
                   "pad_token_id": tokenizer.token_id(fim[0].fim_pad_token)}  # fmt: skip

    def build():
        try:
            if cfg.data.curriculum:
                return build_curriculum_splits(cfg, valid_samples, cache_dir, options)
            return build_gpt_datasets(
                cfg.data.path,
                seq_length=cfg.model.seq_length,
                split=cfg.data.split,
                seed=cfg.seed,
                num_samples=(train_samples, valid_samples, 0),
                cache_dir=cache_dir,
                storage=cfg.storage,
                **options,
            )
        except OSError as e:  # a missing prefix, a dataset over the local cache's cap, an unreachable endpoint
            raise DataError(_cache_error(e, cache_dir)) from None

    if agree is None:
        train, valid, _ = build()
    else:
        first = agree(build, here=rank == 0)  # rank 0 writes the index caches while the others wait for its outcome
        train, valid, _ = agree(build if rank != 0 else lambda: first)  # then they map them; rank 0 has its own
    if train is None:
        raise DataError(f"split {cfg.data.split!r} gives the train split no data")
    tokens, modes = _split_tokens(train), read_modes(train)
    if fim is not None:
        from corpusforge.data.fim import with_fim

        train, valid = with_fim((train, valid), fim[0], tokenizer)
    if tokens < cfg.schedule.global_batch_tokens:
        raise DataError(
            f"{cfg.data.path}: the train split holds {tokens:,} tokens, fewer than one global batch of "
            f"{cfg.schedule.global_batch_tokens:,}; every batch would repeat the same tokens. Use more data or a "
            f"smaller schedule.global_batch_tokens"
        )
    if cfg.metrics.eval_interval and valid is None:
        raise DataError(
            f"split {cfg.data.split!r} gives validation no data; change data.split or set metrics.eval_interval=0"
        )
    options = _loader_options(cfg)
    train_loader = make_loader(train, cfg.schedule.micro_batch_size, rank, world_size, cfg.data.num_workers, **options)
    valid_loader = None
    if cfg.metrics.eval_interval:
        valid_loader = make_loader(valid, cfg.schedule.micro_batch_size, rank, world_size, 0)
    curriculum = train.tokens() if cfg.data.curriculum else None
    return TrainData(train_loader, valid_loader, train_samples, tokens, modes, curriculum=curriculum)


def build_curriculum_splits(cfg: TrainConfig, valid_samples: int, cache_dir: str, options: dict[str, Any]) -> tuple:
    """(train, valid, None) of a run with data.curriculum: the train split as the curriculum serves it (in loader
    units of model.seq_length tokens, as many as without one), validation as without a curriculum (data.path's
    weights at model.seq_length), so that its losses compare across phases and with runs without one."""
    from corpusforge.data import build_gpt_datasets
    from corpusforge.data.blended import parse_blend
    from corpusforge.data.curriculum import Curriculum, build_curriculum_dataset

    s = cfg.schedule
    curriculum = Curriculum.from_table(cfg.data.curriculum, s.max_steps, s.global_batch_tokens, cfg.model.seq_length,
                                       cfg.data.path)  # fmt: skip
    prefixes, _ = parse_blend(cfg.data.path)
    try:
        train = build_curriculum_dataset(curriculum, prefixes, cfg.data.split, cfg.seed, cache_dir, cfg.storage,
                                         **options)  # fmt: skip
    except ValueError as e:  # an empty train split; a source too short for what a phase takes is repeated instead
        raise DataError(str(e)) from None
    valid = None
    if valid_samples:  # one train sample: the smallest split a weighted blend builds beside its validation
        valid = build_gpt_datasets(cfg.data.path, seq_length=cfg.model.seq_length, split=cfg.data.split, seed=cfg.seed,
                                   num_samples=(1, valid_samples, 0), cache_dir=cache_dir, storage=cfg.storage,
                                   **options)[1]  # fmt: skip
    return train, valid, None


def _cache_error(e: OSError, cache_dir: str) -> str:
    """The line for an OSError of building the datasets: the index cache's directory and the fix when it cannot be
    written; the library's own line (a missing prefix names it and the fix) otherwise."""
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
        why = "no space left" if e.errno in (errno.ENOSPC, errno.EDQUOT) else e.strerror
        return (
            f"{cache_dir}: cannot write the index caches there ({why}: {e.filename}); set data.cache_dir to a "
            f"directory you can write, or build them beforehand with corpusforge prepare-cache"
        )
    return str(e)


def _fim_tokenizer(path: str) -> Any:
    """data.fim's tokenizer; one line when it cannot be read."""
    from corpusforge.data.fim import FIMTokenizer
    from corpusforge.errors import CorpusforgeError

    try:
        return FIMTokenizer(path)
    except (OSError, ValueError, CorpusforgeError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"data.fim: tokenizer {path}: {why}; give the Hugging Face tokenizer directory or "
            "tokenizer.json the corpus was made with"
        ) from None


def _loader_options(cfg: TrainConfig) -> dict[str, Any]:
    options = {"pin_memory": cfg.device != "cpu" and _cuda(), "persistent_workers": cfg.data.num_workers > 0}
    if cfg.data.num_workers > 0:
        options["prefetch_factor"] = 4
    return options


def build_retro_data(cfg: TrainConfig, rank: int, world_size: int) -> TrainData:
    """RETRO's loaders: the database's query chunks as samples of seq_length tokens, split by position (train
    first, then validation: they share no chunk), each with its K neighbours (and, for the second validation
    loader, K random chunks of the database instead). Everything a database can disagree with the config on is
    checked here, one line each, before any model is built.

    Example:
        >>> data = build_retro_data(load_config("configs/retro-tiny-cpu.toml"), rank=0, world_size=1)
    """
    from corpusforge.data import make_loader
    from corpusforge.data.gpt_dataset import split_ranges
    from corpusforge.retro import RetroDataset

    r = cfg.retro
    if not r.db:
        raise ConfigError('retro.db is empty: give the directory `corpusforge build-knn` wrote, e.g. retro.db="db/"')
    db = Path(r.db)
    check_retro_database(cfg, db)
    common = dict(seq_length=cfg.model.seq_length, num_neighbours=r.num_neighbours, chunk_length=r.chunk_length,
                  retrieved_chunks=r.retrieved_chunks, seed=cfg.seed,
                  neighbours_path=r.neighbours_path or None)  # fmt: skip
    whole = RetroDataset(db, **common)  # raises for another chunk length, too few neighbours, a short file
    n = len(whole)
    train_range, valid_range, _ = split_ranges(cfg.data.split, n)
    if train_range is None or train_range[1] <= train_range[0]:
        raise DataError(f"{db}: split {cfg.data.split!r} gives the train split none of the {n} samples")
    samples_per_step = cfg.schedule.global_batch_tokens // cfg.model.seq_length
    train_samples = cfg.schedule.max_steps * samples_per_step
    tokens = (train_range[1] - train_range[0]) * cfg.model.seq_length
    if tokens < cfg.schedule.global_batch_tokens:
        raise DataError(
            f"{db}: the train split holds {tokens:,} tokens, fewer than one global batch of "
            f"{cfg.schedule.global_batch_tokens:,}; use a larger database or a smaller schedule.global_batch_tokens"
        )
    train = RetroDataset(db, **common, sample_range=train_range, num_samples=train_samples)
    options = _loader_options(cfg)
    train_loader = make_loader(train, cfg.schedule.micro_batch_size, rank, world_size, cfg.data.num_workers, **options)
    valid_loader = random_loader = None
    if cfg.metrics.eval_interval:
        if valid_range is None or valid_range[1] <= valid_range[0]:
            raise DataError(
                f"{db}: split {cfg.data.split!r} gives validation none of the {n} samples; change data.split or set "
                f"metrics.eval_interval=0"
            )
        valid_samples = cfg.metrics.eval_batches * cfg.schedule.micro_batch_size * world_size
        valid = RetroDataset(db, **common, sample_range=valid_range, num_samples=valid_samples)
        valid_loader = make_loader(valid, cfg.schedule.micro_batch_size, rank, world_size, 0)
        if r.random_eval:
            rand = RetroDataset(db, **common, sample_range=valid_range, num_samples=valid_samples, neighbours="random")
            random_loader = make_loader(rand, cfg.schedule.micro_batch_size, rank, world_size, 0)
    modes = {str(db): "mmap (chunk tables, neighbours and token files memory-mapped)"}
    return TrainData(train_loader, valid_loader, train_samples, tokens, modes, random_loader)


def check_retro_database(cfg: TrainConfig, db: Path) -> None:
    """One line for each way a database cannot serve this config: not a database, no neighbours yet, token data
    changed since the build (its chunk table and neighbours describe other tokens), data_path naming a dataset
    the neighbours were not computed for, or the database's corpus and the training data tokenised differently."""
    from corpusforge.describe import recorded_tokenizer
    from corpusforge.retro.common import data_fingerprint

    manifest_path = db / "manifest.json"
    if not manifest_path.is_file():
        raise DataError(f"{db}: not a retrieval database (no manifest.json); build one with corpusforge build-knn")
    try:
        manifest = json.loads(manifest_path.read_text())
        built, identity = manifest["config"], manifest.get("identity") or {}
    except (ValueError, KeyError, TypeError):
        raise DataError(
            f"{manifest_path}: unreadable manifest; rebuild the database with corpusforge build-knn"
        ) from None
    corpus, query = built["prefix"], built.get("query_prefix") or built["prefix"]
    for prefix, key in ((corpus, "data"), (query, "query_data" if built.get("query_prefix") else "data")):
        recorded = identity.get(key)
        if not recorded:
            continue
        try:
            now = data_fingerprint(prefix)
        except OSError as e:
            raise DataError(
                f"{db}: the database's dataset {prefix} cannot be read ({e}); restore it or rebuild"
            ) from None
        if now["sha256"] != recorded.get("sha256") or now["bin_bytes"] != recorded.get("bin_bytes"):
            raise DataError(
                f"{db}: {prefix} changed since the database was built (its chunks and neighbours describe other "
                f"tokens); rerun corpusforge build-knn on it"
            )
    if cfg.data.path:
        if not isinstance(cfg.data.path, str):
            raise ConfigError(
                "data.path: a RETRO model trains on one dataset, not a blend; give its prefix or leave it empty"
            )
        same = False
        try:
            same = data_fingerprint(cfg.data.path)["sha256"] == data_fingerprint(query)["sha256"]
        except OSError:
            raise DataError(f"{cfg.data.path}: no such token dataset (.bin/.idx)") from None
        if not same:
            raise DataError(
                f"{db}: its neighbours cover the chunks of {query}, not of data.path {cfg.data.path}; compute them "
                f"with corpusforge build-knn {corpus} --output {db} --query-prefix {cfg.data.path} (a new database "
                f"directory), or leave data.path empty"
            )
    mine, theirs = recorded_tokenizer(query), recorded_tokenizer(corpus)
    if mine is not None and theirs is not None and mine.fingerprint != theirs.fingerprint:
        raise DataError(
            f"{db}: the database's corpus {corpus} was tokenised with {theirs.spec}, the training data {query} with "
            f"{mine.spec}; neighbours would be ids of another vocabulary. Preprocess both with one tokenizer"
        )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_vocab(tokens, labels, vocab_size: int, data_path: Any) -> None:
    """A clear error for token ids the embedding does not have (on GPU they would be a device-side assert)."""
    top = max(int(tokens.max()), int(labels.max()))
    if top >= vocab_size:
        raise DataError(
            f"{data_path}: token id {top} is not below vocab_size {vocab_size}; set model.vocab_size to the "
            f"tokenizer's vocabulary (cl100k_base: 100277, gpt2: 50257)"
        )
