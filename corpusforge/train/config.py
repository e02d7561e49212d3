"""The trainer's one configuration: a frozen dataclass whose field docstrings are the documentation of every key.

A run is configured by a TOML file of flat `key = value` lines (see configs/) and `key=value` overrides given on
the command line after it; values of overrides are read as TOML (`lr=3e-4`, `compile=false`, `out_dir="runs/a"`,
`data_path=["a_text_document", 0.7, "b_text_document", 0.3]`) and as a plain string when they are not TOML.
One section, `[storage]`, says how the token datasets are read (corpusforge.storage.StorageConfig's keys, its
fsspec options in `[storage.storage_options]`); overrides reach it as `storage.read_mode=direct`,
`storage.storage_options.endpoint_url=http://rgw:7480`.
An unknown key, a value of the wrong type or an impossible combination is an error before anything is built.

    [storage]
    read_mode = "auto"                      # or "direct", "pread", "mmap-random"
    local_cache_dir = "/nvme/cf-cache"      # copy each dataset to local disk on first use
    local_cache_max_bytes = 500_000_000_000
    [storage.storage_options]
    endpoint_url = "http://rgw.example:7480"   # credentials: better from the environment (AWS_ACCESS_KEY_ID, ...)

Example:
    >>> cfg = load_config("configs/tiny-cpu.toml", ["max_steps=20", "out_dir=runs/t"])
    >>> cfg.max_steps
    20
"""

from __future__ import annotations

import ast
import difflib
import inspect
import json
import tomllib
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

from corpusforge.errors import CorpusforgeError
from corpusforge.storage import StorageConfig


class ConfigError(CorpusforgeError, ValueError):
    """A configuration that cannot run: unknown key, wrong type, or values that do not fit together."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run reads. Sizes in tokens are global (all ranks together)."""

    # -- data --------------------------------------------------------------------------------------------------
    data_path: str | list[Any] = ""
    """Token dataset prefix, or a blend `[prefix, weight, ...]` (Megatron's `--data-path` order also accepted)."""

    split: str = "969,30,1"
    """Relative sizes of train, valid, test taken from each dataset (Megatron's `--split`)."""

    data_cache_dir: str = ""
    """Where the sample indices are cached (.npy); empty: `{out_dir}/index-cache`."""

    num_workers: int = 2
    """DataLoader worker processes per rank; 0 reads in the training process."""

    storage: StorageConfig = field(default_factory=StorageConfig)
    """How the token datasets are read: the section [storage] with the keys of corpusforge.storage.StorageConfig
    (read_mode, block_size, cache_blocks, prefetch_blocks, local_cache_dir, local_cache_max_bytes, verify_sha256,
    auto_direct_above_bytes) and [storage.storage_options] for s3:// and other URLs (endpoint_url, ...)."""

    data_source: str = "loader"
    """"loader" (the datasets above) or "synthetic": random tokens made once on the device and reused, no loader;
    the same run without a data path, to measure what the data path costs (tokens/s with one vs the other)."""

    seed: int = 1234
    """Seed of the data order, the initialisation and every random generator."""

    # -- model -------------------------------------------------------------------------------------------------
    model: str = "gpt2-124m"
    """Model preset: gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, or "custom" (then n_layer, n_head, n_embd)."""

    n_layer: int = 0
    """Transformer blocks; 0: from the preset."""

    n_head: int = 0
    """Attention heads; 0: from the preset."""

    n_embd: int = 0
    """Model width; 0: from the preset."""

    vocab_size: int = 100277
    """Tokenizer vocabulary (cl100k_base: 100277, GPT-2: 50257); the embedding is padded to a multiple of 128."""

    seq_length: int = 1024
    """Tokens per sample (the context length)."""

    dropout: float = 0.0
    """Dropout probability (0 for pretraining, as in nanoGPT and llm.c)."""

    bias: bool = True
    """Biases in linear layers and LayerNorms (GPT-2 has them)."""

    # -- batch and schedule ------------------------------------------------------------------------------------
    micro_batch_size: int = 8
    """Samples per rank per forward/backward pass."""

    global_batch_tokens: int = 524288
    """Tokens per optimizer step over all ranks; must be a multiple of micro_batch_size * seq_length * ranks."""

    max_steps: int = 19073
    """Optimizer steps of the whole run (sets the LR schedule and the training samples)."""

    stop_at_step: int = 0
    """Stop after this step (schedule unchanged), to split a run over several jobs; 0: run to max_steps."""

    lr: float = 6e-4
    """Peak learning rate."""

    min_lr: float = 6e-5
    """Learning rate at the end of the cosine decay."""

    warmup_steps: int = 715
    """Steps of linear warmup from 0 to lr."""

    weight_decay: float = 0.1
    """AdamW weight decay, applied to 2-D parameters only (matrices and embeddings, not biases or norms)."""

    beta1: float = 0.9
    """AdamW beta1."""

    beta2: float = 0.95
    """AdamW beta2."""

    eps: float = 1e-8
    """AdamW epsilon."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    # -- evaluation, logging, checkpoints ----------------------------------------------------------------------
    eval_interval: int = 250
    """Steps between validation losses; 0 disables them."""

    eval_batches: int = 20
    """Micro-batches per rank in one validation (the same batches each time, so values compare)."""

    log_interval: int = 10
    """Steps between log lines (and the interval of the data-wait percentiles)."""

    out_dir: str = "runs/gpt"
    """Run directory: checkpoints/, metrics.jsonl, config.json, tensorboard/."""

    checkpoint_interval: int = 1000
    """Steps between checkpoints; 0: only at the end."""

    keep_checkpoints: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""

    async_checkpoint: bool = True
    """Write checkpoints in a background thread from a CPU copy, so training goes on while they are written."""

    resume: str = "auto"
    """"auto": continue from the latest complete checkpoint in out_dir if there is one; "never"; or a path."""

    tensorboard: bool = True
    """Also write TensorBoard events when the `tensorboard` package is installed."""

    # -- hardware ----------------------------------------------------------------------------------------------
    device: str = "auto"
    """"auto" (cuda if available), "cuda" or "cpu"."""

    dtype: str = "auto"
    """Autocast dtype: "auto" (bfloat16 on GPU, float32 on CPU), "bfloat16" or "float32"."""

    compile: bool | str = "auto"
    """torch.compile the model: "auto" (on for GPU, off for CPU), true or false."""

    parallel: str = "ddp"
    """"ddp" (replicated model) or "fsdp" (FSDP2 fully_shard: parameters, gradients and optimizer state sharded)."""

    peak_flops: float = 0.0
    """Peak bf16 FLOP/s of one device for MFU; 0: look the device up in the table in metrics.py."""

    # ----------------------------------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        _check_types(self)
        _check_values(self)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-able values, credentials in storage_options replaced by "<redacted>" (this is
        what config.json and checkpoints record)."""
        out = asdict(self)
        options = out["storage"]["storage_options"]
        for key in options:
            if any(word in key.lower() for word in SECRET_WORDS):
                options[key] = "<redacted>"
        return out

    def model_shape(self) -> tuple[int, int, int]:
        """(n_layer, n_head, n_embd): the preset's, with any non-zero key taking precedence."""
        base = PRESETS.get(self.model, (0, 0, 0))
        return tuple(mine or theirs for mine, theirs in zip((self.n_layer, self.n_head, self.n_embd), base))  # type: ignore


PRESETS: dict[str, tuple[int, int, int]] = {
    # (n_layer, n_head, n_embd) of the GPT-2 family (Radford et al. 2019, Table 2; nanoGPT model.py from_pretrained)
    "gpt2-124m": (12, 12, 768),
    "gpt2-350m": (24, 16, 1024),
    "gpt2-774m": (36, 20, 1280),
    "gpt2-1.5b": (48, 25, 1600),
}

# storage_options keys whose values are not written to config.json (s3fs: key, secret, token; others: password).
SECRET_WORDS = ("key", "secret", "token", "password", "credential")

CHOICES = {
    "model": [*PRESETS, "custom"],
    "device": ["auto", "cuda", "cpu"],
    "dtype": ["auto", "bfloat16", "float32"],
    "parallel": ["ddp", "fsdp"],
    "data_source": ["loader", "synthetic"],
}


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether `value` fits a field annotation of the simple kinds used here (int, float, bool, str, list, unions)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_accepts(a, value) for a in typing.get_args(annotation))
    origin = typing.get_origin(annotation) or annotation
    if origin is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin)


def _check_types(cfg: TrainConfig) -> None:
    hints = typing.get_type_hints(TrainConfig)
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if not _accepts(hints[f.name], value):
            raise ConfigError(f"{f.name} = {value!r}: expected {hints[f.name]}")
        if hints[f.name] is float and isinstance(value, int):
            object.__setattr__(cfg, f.name, float(value))


def _check_values(cfg: TrainConfig) -> None:
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise ConfigError(f"{key} = {getattr(cfg, key)!r}: choose one of {allowed}")
    if cfg.compile not in (True, False, "auto"):
        raise ConfigError(f'compile = {cfg.compile!r}: choose true, false or "auto"')
    positive = ["seq_length", "micro_batch_size", "global_batch_tokens", "max_steps", "log_interval", "vocab_size"]
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key} = {getattr(cfg, key)}: must be at least 1")
    for key in [
        "n_layer",
        "n_head",
        "n_embd",
        "warmup_steps",
        "eval_interval",
        "eval_batches",
        "stop_at_step",
        "checkpoint_interval",
        "num_workers",
        "grad_clip",
        "weight_decay",
        "min_lr",
        "peak_flops",
    ]:
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} = {getattr(cfg, key)}: must not be negative")
    if cfg.keep_checkpoints < 1:
        raise ConfigError(f"keep_checkpoints = {cfg.keep_checkpoints}: keep at least 1")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"dropout = {cfg.dropout}: must be in [0, 1)")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"min_lr {cfg.min_lr} is above lr {cfg.lr}")
    if cfg.model == "custom" and not (cfg.n_layer and cfg.n_head and cfg.n_embd):
        raise ConfigError('model = "custom" needs n_layer, n_head and n_embd')
    n_head, n_embd = cfg.model_shape()[1:]
    if n_embd % n_head:
        raise ConfigError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")


def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """Micro-batches per rank per optimizer step; an error when the global batch does not divide evenly."""
    per_pass = cfg.micro_batch_size * cfg.seq_length * world_size
    if cfg.global_batch_tokens % per_pass:
        raise ConfigError(
            f"global_batch_tokens {cfg.global_batch_tokens} is not a multiple of micro_batch_size "
            f"{cfg.micro_batch_size} x seq_length {cfg.seq_length} x {world_size} rank(s) = {per_pass}; "
            f"use e.g. global_batch_tokens={max(1, round(cfg.global_batch_tokens / per_pass)) * per_pass}"
        )
    return cfg.global_batch_tokens // per_pass


# ---------------------------------------------------------------------------------------------------------------
# reading TOML and overrides


@cache
def key_docs() -> dict[str, str]:
    """Each key's docstring, read from this class's source (the single documentation of the keys)."""
    return _attribute_docs(TrainConfig)


def _attribute_docs(cls: type) -> dict[str, str]:
    """The string after each annotated field of a dataclass's source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(after.value.value)  # type: ignore[attr-defined]
    return docs


def _unknown_key(key: str, where: str) -> ConfigError:
    names = [f.name for f in fields(TrainConfig)]
    close = difflib.get_close_matches(key, names, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(names)}"
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` → (key, value), the value read as TOML when it is TOML, else as a string.

    Example:
        >>> parse_override("lr=3e-4"), parse_override("out_dir=runs/a")
        (('lr', 0.0003), ('out_dir', 'runs/a'))
    """
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ConfigError(f"override {text!r}: write key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The TrainConfig of a TOML file (or of the defaults when `path` is None) with `key=value` overrides."""
    known = {f.name for f in fields(TrainConfig)}
    values: dict[str, Any] = {}
    storage: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for key, value in data.items():
            if key == "storage":
                if not isinstance(value, dict):
                    raise ConfigError(f"{path}: storage must be the section [storage], got {value!r}")
                storage.update(value)
                continue
            if isinstance(value, dict):
                raise ConfigError(f"{path}: [{key}]: sections are not used (except [storage]); write flat lines")
            if key not in known:
                raise _unknown_key(key, str(path))
            values[key] = value
    for text in overrides:
        key, value = parse_override(text)
        if key.startswith("storage."):
            _set_dotted(storage, key.split(".")[1:], value, text)
            continue
        if key not in known:
            raise _unknown_key(key, f"override {text!r}")
        values[key] = value
    if storage:
        values["storage"] = storage_config(storage, f"{path or 'config'}: [storage]")
    try:
        return TrainConfig(**values)
    except ConfigError as e:
        raise ConfigError(f"{path or 'config'}: {e}") from None


def _set_dotted(table: dict[str, Any], keys: list[str], value: Any, text: str) -> None:
    """storage.a.b=v → table["a"]["b"] = v (only storage_options has a level below storage)."""
    if not keys or not all(keys) or len(keys) > 2 or (len(keys) == 2 and keys[0] != "storage_options"):
        raise ConfigError(f"override {text!r}: write storage.KEY=value or storage.storage_options.KEY=value")
    if len(keys) == 2:
        table = table.setdefault("storage_options", {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {text!r}: storage.storage_options is not a table")
    table[keys[-1]] = value


def storage_config(values: dict[str, Any], where: str = "[storage]") -> StorageConfig:
    """A StorageConfig from the [storage] section's values: unknown keys, wrong types and bad values are
    ConfigErrors naming the key.

    Example:
        >>> storage_config({"read_mode": "direct", "storage_options": {"endpoint_url": "http://rgw:7480"}}).read_mode
        'direct'
    """
    names = [f.name for f in fields(StorageConfig)]
    hints = typing.get_type_hints(StorageConfig)
    for key, value in values.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"known keys: {', '.join(names)}"
            raise ConfigError(f"{where}: unknown key {key!r}; {hint}")
        if key == "storage_options":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: storage_options = {value!r}: expected a table of fsspec options")
        elif not _accepts(hints[key], value):
            raise ConfigError(f"{where}: {key} = {value!r}: expected {hints[key]}")
    try:
        return StorageConfig(**values)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def describe_keys() -> str:
    """Every key with its default and documentation, for `--list-keys`."""
    lines = []
    for f in fields(TrainConfig):
        if f.name == "storage":
            lines.append(f"[storage]\n    {key_docs().get(f.name, '')}")
            docs = _attribute_docs(StorageConfig)
            for sf in fields(StorageConfig):
                default = sf.default if sf.default is not MISSING else sf.default_factory()  # type: ignore[misc]
                lines.append(f"storage.{sf.name} = {json.dumps(default)}\n    {docs.get(sf.name, '')}")
            continue
        default = f.default if f.default is not MISSING else "(required)"
        lines.append(f"{f.name} = {json.dumps(default)}\n    {key_docs().get(f.name, '')}")
    return "\n".join(lines)
