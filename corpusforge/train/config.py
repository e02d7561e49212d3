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
class ParallelConfig:
    """How the ranks share the work: four degrees on one DeviceMesh (pp, dp_replicate, dp_shard, tp) whose product
    is the world size; -1 on one of them means "what the others leave". The section [parallel] of a config file;
    overrides as `parallel.tp=2`. The old `parallel = "ddp"` / `"fsdp"` still work (dp_replicate=-1 / dp_shard=-1).

        [parallel]
        dp_shard = -1      # FSDP2 over what tp and pp leave
        tp = 2             # each layer split over 2 ranks (Megatron tensor + sequence parallel)
        pp = 2             # the layers split into 2 stages
    """

    dp_replicate: int = -1
    """Data-parallel replicas: DDP, or HSDP's replicate dimension when dp_shard > 1; -1: inferred."""

    dp_shard: int = 1
    """FSDP2 (`fully_shard`) degree: parameters, gradients and optimizer state split over this many ranks; -1:
    inferred."""

    tp: int = 1
    """Tensor-parallel degree: q/k/v and MLP-in split by columns, out-projections by rows, the vocabulary of the
    embedding and head split too; must divide the heads, the KV heads and the MLP width."""

    pp: int = 1
    """Pipeline-parallel degree: the layers split into pp stages (torch.distributed.pipelining)."""

    sequence_parallel: bool = True
    """With tp > 1: norms and dropout on 1/tp of the sequence each (Korthikanti et al. 2022), activations cut."""

    loss_parallel: bool = True
    """With tp > 1: cross-entropy on vocabulary-sharded logits, never gathering the full (B, T, V) logits."""

    pp_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble (the
    interleaved, looped and ZB-V schedules put 2 stages on each rank)."""

    pp_microbatches: int = 0
    """Micro-batches each micro_batch_size batch is cut into on its way through the pipeline; 0: the number of
    stages. More shrink the bubble; each must keep at least one sample."""

    pp_layers: list[int] = field(default_factory=list)
    """Layers per stage, e.g. [5, 6, 6, 5]; empty: balanced by parameter count (the embedding and head count)."""

    activation_checkpoint: str = "none"
    """"none", "selective" (keep matmul and attention outputs, recompute the rest) or "full" (recompute each
    block in the backward pass): memory for compute."""

    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state in host memory (dp_shard > 1 only)."""


@dataclass(frozen=True)
class RetroSection:
    """A RETRO model's retrieval (model = "retro" or a retro-* preset): the section [retro] of a config file;
    overrides as `retro.db=db/`. The training samples are the database's query chunks (its own corpus, or the
    dataset it was built for with build-knn --query-prefix), split by position into train and validation by
    `split`; data_path, when given, must be that dataset.

        [retro]
        db = "db/"               # corpusforge build-knn's output directory
        num_neighbours = 2
        chunk_length = 64        # must be the database's
    """

    db: str = ""
    """Retrieval database directory written by `corpusforge build-knn` (chunks, neighbours, manifest.json)."""

    neighbours_path: str = ""
    """Neighbours file of the training samples; empty: DB/neighbours.bin. It must hold a row per query chunk."""

    num_neighbours: int = 2
    """Neighbours K per chunk fed to the model (RETRO: 2); at most what the neighbours file stores."""

    chunk_length: int = 64
    """Tokens per chunk m (RETRO: 64); must be the chunk length the database was built with."""

    retrieved_chunks: int = 2
    """Chunks per neighbour: the neighbour and its continuation (RETRO: 2)."""

    encoder_layers: int = 2
    """Retrieval encoder layers (RETRO, Megatron: 2); 0: the preset's."""

    encoder_n_embd: int = 0
    """Encoder width; 0: the preset's, or the decoder's."""

    encoder_n_head: int = 0
    """Encoder heads; 0: the preset's, or the decoder's head size at the encoder's width."""

    cca_layers: list[int] = field(default_factory=list)
    """0-based decoder layers with chunked cross-attention; empty: Megatron's rule (from layer 6 when there are
    15 layers or fewer, else from layer 9, then every 3rd)."""

    random_eval: bool = True
    """Also compute the validation loss with each neighbour replaced by a random chunk of the database: the gap
    to the real neighbours' loss is what retrieval brings (logged as val_loss_random and retrieval_gain)."""


PARALLEL_LEGACY = {"ddp": {"dp_replicate": -1, "dp_shard": 1}, "fsdp": {"dp_replicate": 1, "dp_shard": -1}}
PP_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"]


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
    """Model preset: gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b; llama3-1b, llama3-3b (Llama 3.2), llama3-8b,
    llama3-70b (Llama 3.1), llama3-tiny; retro-tiny-cpu, retro-172m, retro-425m (RETRO, the paper's two smallest
    decoders); "custom" (then model_family, n_layer, n_head, n_embd) or "retro" (a RETRO decoder of n_layer,
    n_head, n_embd). RETRO models read their data from [retro]."""

    model_family: str = "auto"
    """"gpt2" (GPT-2: LayerNorm, GELU, learned positions, tied head), "llama" (Llama 3: RMSNorm, RoPE, SwiGLU,
    grouped-query attention) or "retro" (a GPT-2 decoder with chunked cross-attention to retrieved neighbours);
    "auto": the preset's family, gpt2 for "custom"."""

    n_layer: int = 0
    """Transformer blocks; 0: from the preset."""

    n_head: int = 0
    """Attention heads; 0: from the preset."""

    n_embd: int = 0
    """Model width; 0: from the preset."""

    n_kv_head: int = 0
    """Llama: key/value heads (grouped-query attention); 0: from the preset, or n_head."""

    ffn_hidden: int = 0
    """Llama: SwiGLU MLP width; 0: from the preset, or Llama's rule (8/3 n_embd rounded up to 256)."""

    rope_theta: float = 0.0
    """Llama: rotary base; 0: from the preset, or 500000 (Llama 3)."""

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

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the ranks share the work: the section [parallel] with ParallelConfig's keys (dp_replicate, dp_shard,
    tp, pp, sequence_parallel, loss_parallel, pp_schedule, pp_microbatches, pp_layers, activation_checkpoint,
    cpu_offload); `parallel = "ddp"` or `"fsdp"` as before."""

    peak_flops: float = 0.0
    """Peak bf16 FLOP/s of one device for MFU; 0: look the device up in the table in metrics.py."""

    retro: RetroSection = field(default_factory=RetroSection)
    """A RETRO model's retrieval database and shape: the section [retro] with RetroSection's keys (db,
    neighbours_path, num_neighbours, chunk_length, retrieved_chunks, encoder_layers, encoder_n_embd,
    encoder_n_head, cca_layers, random_eval); read only when the model is a RETRO one."""

    # ----------------------------------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        if isinstance(self.parallel, str):
            if self.parallel not in PARALLEL_LEGACY:
                raise ConfigError(
                    f"parallel = {self.parallel!r}: choose one of {list(PARALLEL_LEGACY)} or set [parallel]"
                )
            object.__setattr__(self, "parallel", ParallelConfig(**PARALLEL_LEGACY[self.parallel]))
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

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """The config of a `to_dict()` (config.json of a run): sections become their dataclasses again."""
        values = dict(values)
        if isinstance(values.get("storage"), dict):
            values["storage"] = storage_config(values["storage"])
        if isinstance(values.get("parallel"), dict):
            values["parallel"] = ParallelConfig(**values["parallel"])
        if isinstance(values.get("retro"), dict):
            values["retro"] = RetroSection(**values["retro"])
        return cls(**values)

    @property
    def family(self) -> str:
        """ "gpt2" or "llama"."""
        if self.model_family != "auto":
            return self.model_family
        if self.model == "retro" or self.model in _retro_presets():
            return "retro"
        return "llama" if self.model in LLAMA_PRESETS else "gpt2"

    def model_shape(self) -> tuple[int, int, int]:
        """(n_layer, n_head, n_embd): the preset's, with any non-zero key taking precedence."""
        retro = _retro_presets().get(self.model)
        retro_shape = (retro["n_layer"], retro["n_head"], retro["n_embd"]) if retro else None
        base = PRESETS.get(self.model) or retro_shape or LLAMA_PRESETS.get(self.model, {}).get("shape", (0, 0, 0))
        return tuple(mine or theirs for mine, theirs in zip((self.n_layer, self.n_head, self.n_embd), base))  # type: ignore

    def llama_shape(self) -> dict[str, Any]:
        """n_kv_head, ffn_hidden, rope_theta, rope_scaling, tie_embeddings: the preset's, non-zero keys first."""
        preset = LLAMA_PRESETS.get(self.model, {})
        n_head, n_embd = self.model_shape()[1:]
        hidden = 256 * -(-int(8 * n_embd / 3) // 256)  # Llama's rule without ffn_dim_multiplier
        return {
            "n_kv_head": self.n_kv_head or preset.get("n_kv_head", n_head),
            "ffn_hidden": self.ffn_hidden or preset.get("ffn_hidden", hidden),
            "rope_theta": self.rope_theta or preset.get("rope_theta", 500000.0),
            "rope_scaling": preset.get("rope_scaling", 0.0),
            "tie_embeddings": preset.get("tie_embeddings", False),
        }


def _retro_presets() -> dict[str, dict]:
    # retro_model imports this module (for ConfigError): imported when first asked, not at import time
    from corpusforge.train.retro_model import RETRO_PRESETS

    return RETRO_PRESETS


PRESETS: dict[str, tuple[int, int, int]] = {
    # (n_layer, n_head, n_embd) of the GPT-2 family (Radford et al. 2019, Table 2; nanoGPT model.py from_pretrained)
    "gpt2-124m": (12, 12, 768),
    "gpt2-350m": (24, 16, 1024),
    "gpt2-774m": (36, 20, 1280),
    "gpt2-1.5b": (48, 25, 1600),
}

LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    # shape = (n_layer, n_head, n_embd); the rest from Meta's published config.json of each model on the Hugging
    # Face hub (meta-llama/Llama-3.2-1B, -3B, Llama-3.1-8B, -70B): ffn_hidden = intermediate_size, rope_scaling =
    # the "llama3" factor; 3.2 1B and 3B tie the embedding to the head, 3.1 does not.
    "llama3-1b": {"shape": (16, 32, 2048), "n_kv_head": 8, "ffn_hidden": 8192, "rope_theta": 500000.0,
                  "rope_scaling": 32.0, "tie_embeddings": True},
    "llama3-3b": {"shape": (28, 24, 3072), "n_kv_head": 8, "ffn_hidden": 8192, "rope_theta": 500000.0,
                  "rope_scaling": 32.0, "tie_embeddings": True},
    "llama3-8b": {"shape": (32, 32, 4096), "n_kv_head": 8, "ffn_hidden": 14336, "rope_theta": 500000.0,
                  "rope_scaling": 8.0},
    "llama3-70b": {"shape": (80, 64, 8192), "n_kv_head": 8, "ffn_hidden": 28672, "rope_theta": 500000.0,
                   "rope_scaling": 8.0},
    # a CPU-sized model with every feature of the family (GQA 4:2, untied), for tests and a laptop run
    "llama3-tiny": {"shape": (2, 4, 64), "n_kv_head": 2, "ffn_hidden": 192, "rope_theta": 10000.0},
}  # fmt: skip

# storage_options keys whose values are not written to config.json (s3fs: key, secret, token; others: password).
SECRET_WORDS = ("key", "secret", "token", "password", "credential")

CHOICES = {
    "model": [*PRESETS, *LLAMA_PRESETS, "custom"],
    "model_family": ["auto", "gpt2", "llama", "retro"],
    "device": ["auto", "cuda", "cpu"],
    "dtype": ["auto", "bfloat16", "float32"],
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
        if key == "model":
            allowed = [*allowed, "retro", *_retro_presets()]
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
    if cfg.model in ("custom", "retro") and not (cfg.n_layer and cfg.n_head and cfg.n_embd):
        raise ConfigError(f"model = {cfg.model!r} needs n_layer, n_head and n_embd")
    n_head, n_embd = cfg.model_shape()[1:]
    if n_embd % n_head:
        raise ConfigError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
    for key in ["n_kv_head", "ffn_hidden", "rope_theta"]:
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} = {getattr(cfg, key)}: must not be negative")
    if cfg.family == "llama" and n_head % cfg.llama_shape()["n_kv_head"]:
        raise ConfigError(f"n_head {n_head} is not a multiple of n_kv_head {cfg.llama_shape()['n_kv_head']}")
    _check_parallel(cfg.parallel)
    _check_retro(cfg.retro)


def _check_retro(r: RetroSection) -> None:
    """Each [retro] value on its own; the database itself is checked when the data is built."""
    hints = typing.get_type_hints(RetroSection)
    for f in fields(r):
        value = getattr(r, f.name)
        if not _accepts(hints[f.name], value):
            raise ConfigError(f"retro.{f.name} = {value!r}: expected {hints[f.name]}")
    for key in ("num_neighbours", "chunk_length", "retrieved_chunks"):
        if getattr(r, key) < 1:
            raise ConfigError(f"retro.{key} = {getattr(r, key)}: must be at least 1")
    for key in ("encoder_layers", "encoder_n_embd", "encoder_n_head"):
        if getattr(r, key) < 0:
            raise ConfigError(f"retro.{key} = {getattr(r, key)}: must not be negative")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in r.cca_layers):
        raise ConfigError(f"retro.cca_layers = {r.cca_layers!r}: give 0-based decoder layer indices")


def _check_parallel(p: ParallelConfig) -> None:
    """Each [parallel] value on its own; whether the degrees fit the world size and the model is checked by
    corpusforge.train.parallel.resolve_layout once the world size is known."""
    hints = typing.get_type_hints(ParallelConfig)
    for f in fields(p):
        value = getattr(p, f.name)
        if not _accepts(hints[f.name], value):
            raise ConfigError(f"parallel.{f.name} = {value!r}: expected {hints[f.name]}")
    degrees = {k: getattr(p, k) for k in ("dp_replicate", "dp_shard", "tp", "pp")}
    for key, value in degrees.items():
        if value < 1 and value != -1:
            raise ConfigError(f"parallel.{key} = {value}: give a degree of at least 1, or -1 to infer it")
    if sum(v == -1 for v in degrees.values()) > 1:
        inferred = [k for k, v in degrees.items() if v == -1]
        raise ConfigError(f"parallel: {' and '.join(inferred)} are both -1 (inferred); set all but one of them")
    if p.pp_schedule not in PP_SCHEDULES:
        lower = {name.lower(): name for name in PP_SCHEDULES}
        close = difflib.get_close_matches(p.pp_schedule.lower(), list(lower), n=1)
        hint = f"; did you mean {lower[close[0]]}?" if close else ""
        raise ConfigError(f"parallel.pp_schedule = {p.pp_schedule!r}: choose one of {PP_SCHEDULES}{hint}")
    if p.activation_checkpoint not in ("none", "selective", "full"):
        raise ConfigError(
            f'parallel.activation_checkpoint = {p.activation_checkpoint!r}: "none", "selective" or "full"'
        )
    if p.pp_microbatches < 0:
        raise ConfigError(f"parallel.pp_microbatches = {p.pp_microbatches}: must not be negative")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in p.pp_layers):
        raise ConfigError(f"parallel.pp_layers = {p.pp_layers!r}: give a positive count of layers per stage")


def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """Micro-batches per rank per optimizer step, `world_size` being the data-parallel ranks (the world size over
    tp x pp); an error when the global batch does not divide evenly."""
    per_pass = cfg.micro_batch_size * cfg.seq_length * world_size
    if cfg.global_batch_tokens % per_pass:
        raise ConfigError(
            f"global_batch_tokens {cfg.global_batch_tokens} is not a multiple of micro_batch_size "
            f"{cfg.micro_batch_size} x seq_length {cfg.seq_length} x {world_size} data-parallel rank(s) = "
            f"{per_pass}; "
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
    sections: dict[str, dict[str, Any]] = {"storage": {}, "parallel": {}, "retro": {}}
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        for key, value in data.items():
            if key == "parallel" and isinstance(value, str):  # the old parallel = "ddp" / "fsdp"
                sections["parallel"].update(_legacy_parallel(value, str(path)))
                continue
            if key in sections:
                if not isinstance(value, dict):
                    raise ConfigError(f"{path}: {key} must be the section [{key}], got {value!r}")
                sections[key].update(value)
                continue
            if isinstance(value, dict):
                raise ConfigError(
                    f"{path}: [{key}]: sections are not used (except [storage], [parallel], [retro]); write flat lines"
                )
            if key not in known:
                raise _unknown_key(key, str(path))
            values[key] = value
    for text in overrides:
        key, value = parse_override(text)
        if key.startswith("storage."):
            _set_dotted(sections["storage"], key.split(".")[1:], value, text)
            continue
        if key.startswith("parallel."):
            sections["parallel"][key.partition(".")[2]] = value
            continue
        if key.startswith("retro."):
            sections["retro"][key.partition(".")[2]] = value
            continue
        if key == "parallel" and isinstance(value, str):
            sections["parallel"].update(_legacy_parallel(value, f"override {text!r}"))
            continue
        if key not in known:
            raise _unknown_key(key, f"override {text!r}")
        values[key] = value
    if sections["storage"]:
        values["storage"] = storage_config(sections["storage"], f"{path or 'config'}: [storage]")
    if sections["parallel"]:
        values["parallel"] = parallel_config(sections["parallel"], f"{path or 'config'}: [parallel]")
    if sections["retro"]:
        values["retro"] = retro_section(sections["retro"], f"{path or 'config'}: [retro]")
    try:
        return TrainConfig(**values)
    except ConfigError as e:
        raise ConfigError(f"{path or 'config'}: {e}") from None


def _legacy_parallel(value: str, where: str) -> dict[str, int]:
    if value not in PARALLEL_LEGACY:
        raise ConfigError(f"{where}: parallel = {value!r}: choose one of {list(PARALLEL_LEGACY)} or set parallel.KEY")
    return dict(PARALLEL_LEGACY[value])


def parallel_config(values: dict[str, Any], where: str = "[parallel]") -> ParallelConfig:
    """A ParallelConfig from the [parallel] section's values; unknown keys are ConfigErrors with a suggestion.

    Example:
        >>> parallel_config({"tp": 2, "dp_shard": -1}).tp
        2
    """
    names = [f.name for f in fields(ParallelConfig)]
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"known keys: {', '.join(names)}"
            raise ConfigError(f"{where}: unknown key {key!r}; {hint}")
    return ParallelConfig(**values)


def retro_section(values: dict[str, Any], where: str = "[retro]") -> RetroSection:
    """A RetroSection from the [retro] section's values; unknown keys are ConfigErrors with a suggestion.

    Example:
        >>> retro_section({"db": "db/", "num_neighbours": 2}).db
        'db/'
    """
    names = [f.name for f in fields(RetroSection)]
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"known keys: {', '.join(names)}"
            raise ConfigError(f"{where}: unknown key {key!r}; {hint}")
    return RetroSection(**values)


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
        if f.name in ("parallel", "retro"):
            section = ParallelConfig if f.name == "parallel" else RetroSection
            lines.append(f"[{f.name}]\n    {key_docs().get(f.name, '')}")
            docs = _attribute_docs(section)
            for pf in fields(section):
                default = pf.default if pf.default is not MISSING else pf.default_factory()  # type: ignore[misc]
                lines.append(f"{f.name}.{pf.name} = {json.dumps(default)}\n    {docs.get(pf.name, '')}")
            continue
        default = f.default if f.default is not MISSING else "(required)"
        lines.append(f"{f.name} = {json.dumps(default)}\n    {key_docs().get(f.name, '')}")
    return "\n".join(lines)
