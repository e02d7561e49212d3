"""The trainer's configuration: small frozen dataclasses, one per component (as torchtitan's), whose field
docstrings are the documentation of every key.

A run is configured by a TOML file with one table per component (see configs/) and `section.key=value` overrides
given on the command line after it; values of overrides are read as TOML (`optimizer.lr=3e-4`, `compile=false`,
`out_dir="runs/a"`, `data.path=["a_text_document", 0.7, "b_text_document", 0.3]`) and as a plain string when
they are not TOML. A few keys of the whole run (seed, out_dir, device, dtype, compile) stand outside any table.

    seed = 1234
    out_dir = "runs/gpt2-124m"
    [model]
    name = "gpt2-124m"
    [data]
    path = "data/fineweb_text_document"
    [optimizer]
    lr = 6e-4
    [schedule]
    max_steps = 19073
    [storage]
    read_mode = "auto"                      # or "direct", "pread", "mmap-random"
    [storage.storage_options]
    endpoint_url = "http://rgw.example:7480"   # credentials: better from the environment (AWS_ACCESS_KEY_ID, ...)

The flat keys of earlier versions (`lr = 3e-4`, `max_steps=100`) are still read, each with one warning line that
names its new key (`optimizer.lr`); an unknown key, a value of the wrong type or an impossible combination is an
error before anything is built.

Example:
    >>> cfg = load_config("configs/tiny-cpu.toml", ["schedule.max_steps=20", "out_dir=runs/t"])
    >>> cfg.schedule.max_steps
    20
"""

from __future__ import annotations

import difflib
import json
import tomllib
import typing
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from corpusforge.configs import ConfigError, field_default, field_docs, from_table, type_problem
from corpusforge.storage import StorageConfig


class ConfigDeprecationWarning(FutureWarning):
    """A key written the old way (a flat `lr`, not `optimizer.lr`): still read; the message names the new key."""


@dataclass(frozen=True)
class ModelSection:
    """Which model: a preset, or a shape of your own. The section [model]; overrides as `model.name=gpt2-350m`.

    [model]
    name = "llama3-1b"
    seq_length = 2048
    """

    name: str = "gpt2-124m"
    """Model preset: gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b; llama3-1b, llama3-3b (Llama 3.2), llama3-8b,
    llama3-70b (Llama 3.1), llama3-tiny; retro-tiny-cpu, retro-172m, retro-425m (RETRO, the paper's two smallest
    decoders); "custom" (then family, n_layer, n_head, n_embd) or "retro" (a RETRO decoder of n_layer, n_head,
    n_embd). RETRO models read their data from [retro]."""

    family: str = "auto"
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


@dataclass(frozen=True)
class DataSection:
    """What the model reads: token datasets through corpusforge's loaders, or synthetic tokens. The section
    [data]; overrides as `data.path=...`. How the files are read is [storage].

        [data]
        path = ["a_text_document", 0.7, "b_text_document", 0.3]
        split = "969,30,1"
    """

    path: str | list[Any] = ""
    """Token dataset prefix, or a blend `[prefix, weight, ...]` (Megatron's `--data-path` order also accepted)."""

    split: str = "969,30,1"
    """Relative sizes of train, valid, test taken from each dataset (Megatron's `--split`)."""

    cache_dir: str = ""
    """Where the sample indices are cached (.npy); empty: `{out_dir}/index-cache`."""

    num_workers: int = 2
    """DataLoader worker processes per rank; 0 reads in the training process."""

    source: str = "loader"
    """"loader" (the datasets above) or "synthetic": random tokens made once on the device and reused, no loader;
    the same run without a data path, to measure what the data path costs (tokens/s with one vs the other)."""

    document_mask: bool = False
    """Train packed samples as documents: attention causal within each document and blocked across them, positions
    restarting per document (the loaders' cu_seqlens, as Megatron-LM's --dataloader-inter-document-masking). Off:
    every sample is one causal sequence, today's losses bit for bit. GPT-2 and Llama, every layout (the boundaries
    travel with each pipeline micro-batch); not RETRO."""

    curriculum: list[dict[str, Any]] = field(default_factory=list)
    """Phases of the data: blend weights and/or a sequence length that change over training, exact on resume. Each
    phase a table: `until_step` (or `until_tokens`, a multiple of schedule.global_batch_tokens; the last phase
    without one runs to schedule.max_steps), `weights` (one per data.path dataset, 0 to leave one out; default
    data.path's), `seq_length` (dividing model.seq_length; default model.seq_length). Tokens per step and per
    micro-batch stay constant: a phase of half the length reads twice the samples. Empty: no curriculum. E.g.
    curriculum = [{until_step = 200, seq_length = 512, weights = [0.9, 0.1]}, {weights = [0.6, 0.4]}]
    (see corpusforge.data.curriculum)."""

    fim: dict[str, Any] = field(default_factory=dict)
    """Fill-in-the-middle as Megatron-LM's GPTFIMDataset (corpusforge.data.fim), sample for sample: a table of its
    options with Megatron's names (fim_rate, fim_spm_rate, fim_split_sample, fim_fragment_rate, fim_no_prefix,
    fim_prefix_token, ..., fim_eod_token; and rng = "sample" or "megatron"), and `tokenizer`, the Hugging Face
    tokenizer directory (or tokenizer.json) the corpus was tokenized with, holding the FIM tokens. Empty: off. E.g.
    fim = {tokenizer = "tok/", fim_rate = 0.5, fim_spm_rate = 0.5}."""


@dataclass(frozen=True)
class OptimizerSection:
    """AdamW and gradient clipping. The section [optimizer]; overrides as `optimizer.lr=3e-4`. The learning rate's
    warmup and decay are [schedule]."""

    lr: float = 6e-4
    """Peak learning rate."""

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


@dataclass(frozen=True)
class ScheduleSection:
    """How much is trained and how the learning rate moves: batch sizes, steps, warmup and cosine decay. The
    section [schedule]; overrides as `schedule.max_steps=100`."""

    micro_batch_size: int = 8
    """Samples per rank per forward/backward pass."""

    global_batch_tokens: int = 524288
    """Tokens per optimizer step over all ranks; must be a multiple of micro_batch_size * seq_length * ranks."""

    max_steps: int = 19073
    """Optimizer steps of the whole run (sets the LR schedule and the training samples)."""

    stop_at_step: int = 0
    """Stop after this step (schedule unchanged), to split a run over several jobs; 0: run to max_steps."""

    warmup_steps: int = 715
    """Steps of linear warmup from 0 to optimizer.lr."""

    min_lr: float = 6e-5
    """Learning rate at the end of the cosine decay."""


@dataclass(frozen=True)
class CheckpointSection:
    """When checkpoints are written and kept, and where a run resumes from. The section [checkpoint]; overrides
    as `checkpoint.interval=500`. They go to {out_dir}/checkpoints."""

    interval: int = 1000
    """Steps between checkpoints; 0: only at the end."""

    keep: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""

    async_write: bool = True
    """Write checkpoints in a background thread from a CPU copy, so training goes on while they are written."""

    resume: str = "auto"
    """"auto": continue from the latest complete checkpoint in out_dir if there is one; "never"; or a path."""


@dataclass(frozen=True)
class MetricsSection:
    """What is measured and logged: log lines, validation, TensorBoard, MFU. The section [metrics]; overrides as
    `metrics.log_interval=1`. They go to {out_dir}/metrics.jsonl (and tensorboard/)."""

    log_interval: int = 10
    """Steps between log lines (and the interval of the data-wait percentiles)."""

    eval_interval: int = 250
    """Steps between validation losses; 0 disables them."""

    eval_batches: int = 20
    """Micro-batches per rank in one validation (the same batches each time, so values compare)."""

    tensorboard: bool = True
    """Also write TensorBoard events when the `tensorboard` package is installed."""

    peak_flops: float = 0.0
    """Peak bf16 FLOP/s of one device for MFU; 0: look the device up in the table in metrics.py."""


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

    offload: str = "none"
    """Where the parameters' optimizer state lives: "none" (on the device), "cpu" (FSDP2's CPUOffloadPolicy:
    parameters, gradients and optimizer state in host memory; dp_shard > 1) or "nvme" (the fp32 master weights and
    AdamW's two moments in files under offload_dir, streamed through a few host buffers by each optimizer step; a
    cache of the state, never the checkpoint). See corpusforge.train.offload."""

    offload_dir: str = ""
    """offload = "nvme": the directory of the state files (one sub-directory per rank), best on a local NVMe disk;
    empty: {out_dir}/offload."""

    cpu_offload: bool = False
    """Deprecated: write offload = "cpu" (read as that, with a warning)."""

    def __post_init__(self) -> None:
        if self.cpu_offload:  # the old flag: the same thing as offload = "cpu", recorded that way from now on
            if self.offload not in ("none", "cpu"):
                raise ConfigError(f'parallel.cpu_offload = true and parallel.offload = "{self.offload}": drop '
                                  "cpu_offload (deprecated)", ["parallel.cpu_offload", "parallel.offload"])  # fmt: skip
            warnings.warn('parallel.cpu_offload is deprecated; write parallel.offload = "cpu"',
                          ConfigDeprecationWarning, stacklevel=4)  # fmt: skip
            object.__setattr__(self, "offload", "cpu")
            object.__setattr__(self, "cpu_offload", False)


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

    encoder_lr_scale: float = 0.1
    """The retrieval encoder's learning rate as a fraction of the decoder's, in (0, 1]: at the full rate its output
    collapsed to one vector whatever the neighbour (docs/training.md); 1.0 is Megatron's model."""

    random_eval: bool = True
    """Also compute the validation loss with each neighbour replaced by a random chunk of the database: the gap
    to the real neighbours' loss is what retrieval brings (logged as val_loss_random and retrieval_gain)."""


PARALLEL_LEGACY = {"ddp": {"dp_replicate": -1, "dp_shard": 1}, "fsdp": {"dp_replicate": 1, "dp_shard": -1}}


@dataclass(frozen=True)
class WatchdogSection:
    """When a rank's data reads are called slow, and when a run is called hung and ended for a restart. The section
    [watchdog]; overrides as `watchdog.hang_s=300`."""

    stall_s: float = 30.0
    """A data read (or a wait for a batch) that takes longer than this many seconds prints one warning line for its
    rank (file, offset, bytes, seconds, the p50/p99 of the rank's reads so far). A healthy read takes milliseconds,
    a busy Lustre/CephFS a few seconds; 30 s is an outlier on any of them. 0: no warnings."""

    hang_s: float = 600.0
    """No progress (no batch fetched, no step finished; the first step, which compiles, and checkpoint saves are not
    counted) for this many seconds ends the run: stacks of every rank in out_dir/hang-step<N>-rank<R>.txt, one line
    naming the rank stuck in a read and its file, exit code 5 on every rank. 600 s: long past any storage's
    recovery (Lustre's default client timeout is 100 s, obd_timeout 300 s) and well before gloo's or NCCL's
    collective timeouts (30 and 10 min) would blame another rank. 0: never."""


PP_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run reads: one section per component, and the few keys of the whole run. Sizes in
    tokens are global (all ranks together)."""

    model: ModelSection = field(default_factory=ModelSection)
    """The model, a preset or a shape: the section [model] (name, family, n_layer, n_head, n_embd, n_kv_head,
    ffn_hidden, rope_theta, vocab_size, seq_length, dropout, bias)."""

    data: DataSection = field(default_factory=DataSection)
    """What is read: the section [data] (path, split, cache_dir, num_workers, source, document_mask, curriculum)."""

    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    """AdamW: the section [optimizer] (lr, weight_decay, beta1, beta2, eps, grad_clip)."""

    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    """Batches, steps and the learning-rate schedule: the section [schedule] (micro_batch_size,
    global_batch_tokens, max_steps, stop_at_step, warmup_steps, min_lr)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the ranks share the work: the section [parallel] with ParallelConfig's keys (dp_replicate, dp_shard,
    tp, pp, sequence_parallel, loss_parallel, pp_schedule, pp_microbatches, pp_layers, activation_checkpoint,
    offload, offload_dir); `parallel = "ddp"` or `"fsdp"` as before."""

    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoints: the section [checkpoint] (interval, keep, async_write, resume)."""

    metrics: MetricsSection = field(default_factory=MetricsSection)
    """Logging and validation: the section [metrics] (log_interval, eval_interval, eval_batches, tensorboard,
    peak_flops)."""

    watchdog: WatchdogSection = field(default_factory=WatchdogSection)
    """Slow and hung data reads: the section [watchdog] (stall_s, hang_s); a hung run exits with code 5 (see
    corpusforge.train.watchdog)."""

    storage: StorageConfig = field(default_factory=StorageConfig)
    """How the token datasets are read: the section [storage] with the keys of corpusforge.storage.StorageConfig
    (read_mode, block_size, cache_blocks, prefetch_blocks, local_cache_dir, local_cache_max_bytes, verify_sha256,
    auto_direct_above_bytes) and [storage.storage_options] for s3:// and other URLs (endpoint_url, ...)."""

    retro: RetroSection = field(default_factory=RetroSection)
    """A RETRO model's retrieval database and shape: the section [retro] with RetroSection's keys (db,
    neighbours_path, num_neighbours, chunk_length, retrieved_chunks, encoder_layers, encoder_n_embd,
    encoder_n_head, cca_layers, random_eval); read only when the model is a RETRO one."""

    seed: int = 1234
    """Seed of the data order, the initialisation and every random generator."""

    out_dir: str = "runs/gpt"
    """Run directory: checkpoints/, metrics.jsonl, config.json, tensorboard/."""

    device: str = "auto"
    """"auto" (cuda if available), "cuda" or "cpu"."""

    dtype: str = "auto"
    """Autocast dtype: "auto" (bfloat16 on GPU, float32 on CPU), "bfloat16" or "float32"."""

    compile: bool | str = "auto"
    """torch.compile the model: "auto" (on for GPU, off for CPU), true or false."""

    def __post_init__(self) -> None:
        if isinstance(self.parallel, str):
            if self.parallel not in PARALLEL_LEGACY:
                raise ConfigError(
                    f"parallel = {self.parallel!r}: choose one of {list(PARALLEL_LEGACY)} or set [parallel]",
                    ["parallel"],
                )
            object.__setattr__(self, "parallel", ParallelConfig(**PARALLEL_LEGACY[self.parallel]))
        _check_types(self, "")
        for name in SECTIONS:
            if name != "storage":  # StorageConfig checks its own values; storage_config() its types
                _check_types(getattr(self, name), f"{name}.")
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
        """The config of a `to_dict()` (config.json of a run, meta.json of a checkpoint), of this version or of one
        that wrote flat keys: sections become their dataclasses again.

        Example:
            >>> TrainConfig.from_dict({"lr": 1e-3, "model": "gpt2-350m"}).optimizer.lr
            0.001
        """
        table = nest_flat_keys(values, "recorded config", warn=False)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in table.items() if k in known and k not in SECTIONS}
        for name in SECTIONS:
            if isinstance(table.get(name), dict):
                values[name] = _section(name, table[name], f"recorded config: [{name}]")
        return cls(**values)

    @property
    def family(self) -> str:
        """ "gpt2", "llama" or "retro": model.family, or the preset's."""
        if self.model.family != "auto":
            return self.model.family
        if self.model.name == "retro" or self.model.name in _retro_presets():
            return "retro"
        return "llama" if self.model.name in LLAMA_PRESETS else "gpt2"

    def model_shape(self) -> tuple[int, int, int]:
        """(n_layer, n_head, n_embd): the preset's, with any non-zero key taking precedence."""
        m = self.model
        retro = _retro_presets().get(m.name)
        retro_shape = (retro["n_layer"], retro["n_head"], retro["n_embd"]) if retro else None
        base = PRESETS.get(m.name) or retro_shape or LLAMA_PRESETS.get(m.name, {}).get("shape", (0, 0, 0))
        return tuple(mine or theirs for mine, theirs in zip((m.n_layer, m.n_head, m.n_embd), base))  # type: ignore

    def llama_shape(self) -> dict[str, Any]:
        """n_kv_head, ffn_hidden, rope_theta, rope_scaling, tie_embeddings: the preset's, non-zero keys first."""
        m = self.model
        preset = LLAMA_PRESETS.get(m.name, {})
        n_head, n_embd = self.model_shape()[1:]
        hidden = 256 * -(-int(8 * n_embd / 3) // 256)  # Llama's rule without ffn_dim_multiplier
        return {
            "n_kv_head": m.n_kv_head or preset.get("n_kv_head", n_head),
            "ffn_hidden": m.ffn_hidden or preset.get("ffn_hidden", hidden),
            "rope_theta": m.rope_theta or preset.get("rope_theta", 500000.0),
            "rope_scaling": preset.get("rope_scaling", 0.0),
            "tie_embeddings": preset.get("tie_embeddings", False),
        }


# The tables of a config file, each a component's dataclass.
SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "optimizer": OptimizerSection,
    "schedule": ScheduleSection,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointSection,
    "metrics": MetricsSection,
    "watchdog": WatchdogSection,
    "storage": StorageConfig,
    "retro": RetroSection,
}

# The flat keys of the versions before the sections, and where each lives now (read with a warning).
FLAT_KEYS: dict[str, str] = {
    "data_path": "data.path",
    "split": "data.split",
    "data_cache_dir": "data.cache_dir",
    "num_workers": "data.num_workers",
    "data_source": "data.source",
    "model": "model.name",
    "model_family": "model.family",
    **{k: f"model.{k}" for k in ("n_layer", "n_head", "n_embd", "n_kv_head", "ffn_hidden", "rope_theta")},
    **{k: f"model.{k}" for k in ("vocab_size", "seq_length", "dropout", "bias")},
    **{k: f"optimizer.{k}" for k in ("lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip")},
    **{k: f"schedule.{k}" for k in ("micro_batch_size", "global_batch_tokens", "max_steps", "stop_at_step")},
    **{k: f"schedule.{k}" for k in ("warmup_steps", "min_lr")},
    "checkpoint_interval": "checkpoint.interval",
    "keep_checkpoints": "checkpoint.keep",
    "async_checkpoint": "checkpoint.async_write",
    "resume": "checkpoint.resume",
    **{k: f"metrics.{k}" for k in ("log_interval", "eval_interval", "eval_batches", "tensorboard", "peak_flops")},
}


def new_key(key: str) -> str:
    """The key as this version writes it: a flat key of an earlier version becomes its section's, others stay.

    Example:
        >>> new_key("lr"), new_key("max_steps"), new_key("optimizer.lr"), new_key("seed")
        ('optimizer.lr', 'schedule.max_steps', 'optimizer.lr', 'seed')
    """
    return FLAT_KEYS.get(key, key)


def _retro_presets() -> dict[str, dict]:
    # imported when first asked: retro_model brings torch, which reading a config must not pay for
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

# parallel.offload: where the optimizer state lives (corpusforge.train.offload)
OFFLOAD_PLACEMENTS = ("none", "cpu", "nvme")

# storage_options keys whose values are not written to config.json (s3fs: key, secret, token; others: password).
SECRET_WORDS = ("key", "secret", "token", "password", "credential")

CHOICES = {
    "model.name": [*PRESETS, *LLAMA_PRESETS, "custom"],
    "model.family": ["auto", "gpt2", "llama", "retro"],
    "device": ["auto", "cuda", "cpu"],
    "dtype": ["auto", "bfloat16", "float32"],
    "data.source": ["loader", "synthetic"],
}
POSITIVE = ["model.seq_length", "schedule.micro_batch_size", "schedule.global_batch_tokens", "schedule.max_steps",
            "metrics.log_interval", "model.vocab_size"]  # fmt: skip
NOT_NEGATIVE = ["model.n_layer", "model.n_head", "model.n_embd", "model.n_kv_head", "model.ffn_hidden",
                "model.rope_theta", "schedule.warmup_steps", "schedule.stop_at_step", "schedule.min_lr",
                "metrics.eval_interval", "metrics.eval_batches", "metrics.peak_flops", "checkpoint.interval",
                "data.num_workers", "optimizer.grad_clip", "optimizer.weight_decay", "watchdog.stall_s",
                "watchdog.hang_s"]  # fmt: skip


def _get(cfg: Any, key: str) -> Any:
    """cfg's value of a dotted key ("optimizer.lr")."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_types(section: Any, prefix: str) -> None:
    """Each field of one dataclass against its annotation (a section's dataclasses are not looked into); ints given
    for floats become floats."""
    hints = typing.get_type_hints(type(section))
    for f in fields(section):
        value, hint = getattr(section, f.name), hints[f.name]
        if is_dataclass(hint):
            if not isinstance(value, hint):
                raise ConfigError(f"{prefix}{f.name} = {value!r}: expected the section [{f.name}]", [prefix + f.name])
        elif problem := type_problem(hint, value):
            raise ConfigError(f"{prefix}{f.name} = {value!r}: {problem}", [prefix + f.name])
        elif hint is float and isinstance(value, int):
            object.__setattr__(section, f.name, float(value))


def _check_values(cfg: TrainConfig) -> None:
    for key, allowed in CHOICES.items():
        if key == "model.name":
            allowed = [*allowed, "retro", *_retro_presets()]
        if _get(cfg, key) not in allowed:
            close = difflib.get_close_matches(str(_get(cfg, key)), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key} = {_get(cfg, key)!r}: choose one of {allowed}{hint}", [key])
    if cfg.compile not in (True, False, "auto"):
        raise ConfigError(f'compile = {cfg.compile!r}: choose true, false or "auto"', ["compile"])
    for key in POSITIVE:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key} = {_get(cfg, key)}: must be at least 1", [key])
    for key in NOT_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} = {_get(cfg, key)}: must not be negative", [key])
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep = {cfg.checkpoint.keep}: keep at least 1", ["checkpoint.keep"])
    m = cfg.model
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout = {m.dropout}: must be in [0, 1)", ["model.dropout"])
    if cfg.schedule.min_lr > cfg.optimizer.lr:
        raise ConfigError(f"schedule.min_lr {cfg.schedule.min_lr} is above optimizer.lr {cfg.optimizer.lr}",
                          ["schedule.min_lr", "optimizer.lr"])  # fmt: skip
    shape_keys = ["model.name", "model.n_layer", "model.n_head", "model.n_embd"]
    if m.name in ("custom", "retro") and not (m.n_layer and m.n_head and m.n_embd):
        raise ConfigError(f"model.name = {m.name!r} needs model.n_layer, model.n_head and model.n_embd", shape_keys)
    n_head, n_embd = cfg.model_shape()[1:]
    if n_embd % n_head:
        raise ConfigError(f"n_embd {n_embd} is not a multiple of n_head {n_head}", shape_keys)
    if cfg.family == "llama" and n_head % cfg.llama_shape()["n_kv_head"]:
        raise ConfigError(f"n_head {n_head} is not a multiple of n_kv_head {cfg.llama_shape()['n_kv_head']}",
                          [*shape_keys, "model.n_kv_head"])  # fmt: skip
    _check_parallel(cfg.parallel)
    _check_retro(cfg.retro)
    _check_document_mask(cfg)
    _check_curriculum(cfg)
    _check_fim(cfg)


def _check_document_mask(cfg: TrainConfig) -> None:
    """What data.document_mask does not reach yet is refused, never ignored."""
    if not cfg.data.document_mask:
        return
    if cfg.data.source == "synthetic":
        raise ConfigError('data.document_mask: synthetic tokens have no documents; set data.source="loader" or '
                          "data.document_mask=false", ["data.document_mask", "data.source"])  # fmt: skip
    if cfg.family == "retro":
        raise ConfigError("data.document_mask: RETRO does not train with document masks yet; set "
                          "data.document_mask=false", ["data.document_mask", "model.name"])  # fmt: skip


def fim_config(cfg: TrainConfig) -> tuple[Any, str] | None:
    """(FIMConfig, tokenizer path) of data.fim, or None when it is off; a bad option is one line naming it."""
    if not cfg.data.fim:
        return None
    from corpusforge.data.fim import FIMConfig
    from corpusforge.errors import CorpusforgeError

    options = dict(cfg.data.fim)
    tokenizer = options.pop("tokenizer", "")
    if not isinstance(tokenizer, str) or not tokenizer:
        raise ConfigError('data.fim: give the tokenizer the corpus was made with, e.g. data.fim = {tokenizer = "tok/", '
                          "fim_rate = 0.5}", ["data.fim"])  # fmt: skip
    known = [f.name for f in fields(FIMConfig)]
    unknown = [k for k in options if k not in known]
    if unknown:
        raise ConfigError(f"data.fim: unknown option(s) {', '.join(unknown)}; Megatron-LM's are {', '.join(known)}",
                          ["data.fim"])  # fmt: skip
    try:
        return FIMConfig(**{"seed": cfg.seed, **options}), tokenizer
    except (CorpusforgeError, TypeError, ValueError) as e:
        raise ConfigError(f"data.fim: {e}", ["data.fim"]) from None


def _check_fim(cfg: TrainConfig) -> None:
    """data.fim's options, and what fill-in-the-middle does not combine with."""
    if fim_config(cfg) is None:
        return
    clash = [key for key, on in (("data.document_mask", cfg.data.document_mask), ("data.curriculum",
             bool(cfg.data.curriculum)), ("data.source", cfg.data.source == "synthetic"),
             ("model.name", cfg.family == "retro")) if on]  # fmt: skip
    if clash:
        raise ConfigError(f"data.fim: fill-in-the-middle rewrites each sample as one document of GPT tokens, which "
                          f"{clash[0]} does not give; drop data.fim or {clash[0]}", ["data.fim", clash[0]])  # fmt: skip


def _check_curriculum(cfg: TrainConfig) -> None:
    """Each phase of data.curriculum (corpusforge.data.curriculum says what), and what it does not reach yet."""
    if not cfg.data.curriculum:
        return
    from corpusforge.data.curriculum import Curriculum

    s = cfg.schedule
    curriculum = Curriculum.from_table(cfg.data.curriculum, s.max_steps, s.global_batch_tokens, cfg.model.seq_length,
                                       cfg.data.path)  # fmt: skip
    if cfg.data.source == "synthetic" or cfg.family == "retro":
        raise ConfigError("data.curriculum: a curriculum is for token datasets read by GPT-2 and Llama models (not "
                          "synthetic tokens, not RETRO); drop data.curriculum",
                          ["data.curriculum", "data.source"])  # fmt: skip
    tp = cfg.parallel.tp  # an inferred tp (-1) is checked for model.seq_length only, by parallel.resolve_layout
    uneven = sorted({p.seq_length for p in curriculum.phases if p.seq_length % tp}) if tp > 1 else []
    if uneven and cfg.parallel.sequence_parallel:
        raise ConfigError(f"data.curriculum: parallel.tp = {tp} does not divide a phase's seq_length {uneven[0]} "
                          f"(sequence parallel splits it); use a multiple of {tp} or set "
                          "parallel.sequence_parallel=false", ["data.curriculum", "parallel.tp"])  # fmt: skip


def _check_retro(r: RetroSection) -> None:
    """Each [retro] value on its own; the database itself is checked when the data is built."""
    for key in ("num_neighbours", "chunk_length", "retrieved_chunks"):
        if getattr(r, key) < 1:
            raise ConfigError(f"retro.{key} = {getattr(r, key)}: must be at least 1", [f"retro.{key}"])
    for key in ("encoder_layers", "encoder_n_embd", "encoder_n_head"):
        if getattr(r, key) < 0:
            raise ConfigError(f"retro.{key} = {getattr(r, key)}: must not be negative", [f"retro.{key}"])
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in r.cca_layers):
        raise ConfigError(f"retro.cca_layers = {r.cca_layers!r}: give 0-based decoder layer indices",
                          ["retro.cca_layers"])  # fmt: skip


def _check_parallel(p: ParallelConfig) -> None:
    """Each [parallel] value on its own; whether the degrees fit the world size and the model is checked by
    corpusforge.train.parallel.resolve_layout once the world size is known."""
    degrees = {k: getattr(p, k) for k in ("dp_replicate", "dp_shard", "tp", "pp")}
    for key, value in degrees.items():
        if value < 1 and value != -1:
            raise ConfigError(f"parallel.{key} = {value}: give a degree of at least 1, or -1 to infer it",
                              [f"parallel.{key}"])  # fmt: skip
    if sum(v == -1 for v in degrees.values()) > 1:
        inferred = [k for k, v in degrees.items() if v == -1]
        raise ConfigError(f"parallel: {' and '.join(inferred)} are both -1 (inferred); set all but one of them",
                          [f"parallel.{k}" for k in inferred])  # fmt: skip
    if p.pp_schedule not in PP_SCHEDULES:
        lower = {name.lower(): name for name in PP_SCHEDULES}
        close = difflib.get_close_matches(p.pp_schedule.lower(), list(lower), n=1)
        hint = f"; did you mean {lower[close[0]]}?" if close else ""
        raise ConfigError(f"parallel.pp_schedule = {p.pp_schedule!r}: choose one of {PP_SCHEDULES}{hint}",
                          ["parallel.pp_schedule"])  # fmt: skip
    if p.activation_checkpoint not in ("none", "selective", "full"):
        raise ConfigError(
            f'parallel.activation_checkpoint = {p.activation_checkpoint!r}: "none", "selective" or "full"',
            ["parallel.activation_checkpoint"],
        )
    if p.offload not in OFFLOAD_PLACEMENTS:
        close = difflib.get_close_matches(p.offload, OFFLOAD_PLACEMENTS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"parallel.offload = {p.offload!r}: choose one of {list(OFFLOAD_PLACEMENTS)}{hint}",
                          ["parallel.offload"])  # fmt: skip
    if p.offload == "nvme" and p.pp != 1:
        raise ConfigError(f'parallel.offload = "nvme" with parallel.pp = {p.pp}: pipeline stages keep their optimizer '
                          'state in memory for now; set parallel.pp=1 or parallel.offload="cpu"',
                          ["parallel.offload", "parallel.pp"])  # fmt: skip
    if p.pp_microbatches < 0:
        raise ConfigError(f"parallel.pp_microbatches = {p.pp_microbatches}: must not be negative",
                          ["parallel.pp_microbatches"])  # fmt: skip
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in p.pp_layers):
        raise ConfigError(f"parallel.pp_layers = {p.pp_layers!r}: give a positive count of layers per stage",
                          ["parallel.pp_layers"])  # fmt: skip


def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """Micro-batches per rank per optimizer step, `world_size` being the data-parallel ranks (the world size over
    tp x pp); an error when the global batch does not divide evenly."""
    s = cfg.schedule
    per_pass = s.micro_batch_size * cfg.model.seq_length * world_size
    if s.global_batch_tokens % per_pass:
        raise ConfigError(
            f"global_batch_tokens {s.global_batch_tokens} is not a multiple of micro_batch_size "
            f"{s.micro_batch_size} x seq_length {cfg.model.seq_length} x {world_size} data-parallel rank(s) = "
            f"{per_pass}; "
            f"use e.g. schedule.global_batch_tokens={max(1, round(s.global_batch_tokens / per_pass)) * per_pass}"
        )
    return s.global_batch_tokens // per_pass


# ---------------------------------------------------------------------------------------------------------------
# reading TOML and overrides

TOP_KEYS = ("seed", "out_dir", "device", "dtype", "compile")


def key_docs() -> dict[str, str]:
    """Every key's docstring, read from the dataclasses' source (the single documentation of the keys): the
    sections' keys dotted (`optimizer.lr`), the run's own keys plain (`seed`).

    Example:
        >>> key_docs()["optimizer.lr"]
        'Peak learning rate.'
    """
    docs = {k: v for k, v in field_docs(TrainConfig).items() if k not in SECTIONS}
    for name, cls in SECTIONS.items():
        docs.update({f"{name}.{k}": v for k, v in field_docs(cls).items()})
    return docs


def _unknown_key(key: str, where: str) -> ConfigError:
    """The error for a key no section has; an old or a leaf name close to the key suggests the key in full."""
    dotted = [k for k in key_docs() if "." in k]
    by_leaf = {**{k.rpartition(".")[2]: k for k in dotted}, **FLAT_KEYS}
    names = [*TOP_KEYS, *dotted]
    close = difflib.get_close_matches(key, names, n=3) or [
        by_leaf[k] for k in difflib.get_close_matches(key.rpartition(".")[2], list(by_leaf), n=3)
    ]
    hint = (
        f"did you mean {', '.join(dict.fromkeys(close))}?"
        if close
        else f"known keys: {', '.join(TOP_KEYS)} and the sections' (corpusforge train --list-keys)"
    )
    return ConfigError(f"{where}: unknown key {key!r}; {hint}")


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` → (key, value), the value read as TOML when it is TOML, else as a string.

    Example:
        >>> parse_override("optimizer.lr=3e-4"), parse_override("out_dir=runs/a")
        (('optimizer.lr', 0.0003), ('out_dir', 'runs/a'))
    """
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ConfigError(f"command line: {text}: write key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def nest_flat_keys(values: dict[str, Any], where: str, warn: bool = True) -> dict[str, Any]:
    """A table of a config file (or a recorded config) with every flat key of an earlier version moved into its
    section (`lr` → optimizer.lr), one ConfigDeprecationWarning each when `warn`; other keys are left as they are.

    Example:
        >>> nest_flat_keys({"lr": 1e-3, "seed": 1, "schedule": {"max_steps": 5}}, "c.toml", warn=False)
        {'seed': 1, 'schedule': {'max_steps': 5}, 'optimizer': {'lr': 0.001}}
    """
    table: dict[str, Any] = {}
    moved: list[tuple[str, Any]] = []
    for key, value in values.items():
        if key == "parallel" and isinstance(value, str):  # the old parallel = "ddp" / "fsdp": its own meaning
            if value not in PARALLEL_LEGACY:
                raise ConfigError(f"{where}: parallel = {value!r}: choose one of {list(PARALLEL_LEGACY)} or set "
                                  "parallel.KEY")  # fmt: skip
            moved += [(f"parallel.{k}", v) for k, v in PARALLEL_LEGACY[value].items()]
        elif key in FLAT_KEYS and not (key in SECTIONS and isinstance(value, dict)):
            if warn:
                section, _, leaf = FLAT_KEYS[key].partition(".")
                warnings.warn(
                    f"{where}: key {key!r} is deprecated; write {FLAT_KEYS[key]} (in a file: [{section}] {leaf} = ...)",
                    ConfigDeprecationWarning,
                    stacklevel=3,
                )
            moved.append((FLAT_KEYS[key], value))
        else:
            table[key] = value
    for dotted, value in moved:
        section, _, leaf = dotted.partition(".")
        table.setdefault(section, {})
        if not isinstance(table[section], dict):
            raise ConfigError(f"{where}: {section} must be the section [{section}], got {table[section]!r}")
        table[section][leaf] = value
    return table


def _dotted(key: str, value: Any, where: str) -> dict[str, Any]:
    """An override's key=value as a table: `optimizer.lr` → {"optimizer": {"lr": v}}; only storage_options has a
    level below its section. `where` names the override in errors."""
    first, _, rest = key.partition(".")
    if not rest:
        return {key: value}
    if first not in SECTIONS:
        raise _unknown_key(key, where)
    parts = rest.split(".")
    if first == "storage" and (not all(parts) or len(parts) > 2 or (len(parts) == 2 and parts[0] != "storage_options")):
        raise ConfigError(f"{where}: write storage.KEY=value or storage.storage_options.KEY=value")
    if first != "storage" and len(parts) > 1:
        raise ConfigError(f"{where}: write {first}.KEY=value")
    inner: Any = value
    for part in reversed(parts):
        inner = {part: inner}
    return {first: inner}


def _check_source(table: dict[str, Any], where: str, dotted: bool) -> None:
    """Unknown keys and values of the wrong type in one source (the file, or one command-line override), each error
    naming that source (`where`); `dotted`: suggest keys as the command line writes them (model.n_layer)."""
    for key, value in table.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key} must be the section [{key}], got {value!r}", [key])
            hints = typing.get_type_hints(SECTIONS[key])
            for leaf, v in value.items():
                if leaf not in hints:
                    prefix = f"{key}." if dotted else ""
                    close = difflib.get_close_matches(leaf, list(hints), n=3, cutoff=0.75)
                    hint = (f"did you mean {', '.join(prefix + c for c in close)}?" if close
                            else f"known keys: {', '.join(prefix + n for n in hints)}")  # fmt: skip
                    raise ConfigError(f"{where}: unknown key {leaf!r} in [{key}]; {hint}", [f"{key}.{leaf}"])
                _check_value(f"{key}.{leaf}", v, hints[leaf], where, dotted)
        elif key in TOP_KEYS:
            _check_value(key, value, typing.get_type_hints(TrainConfig)[key], where, dotted)
        elif isinstance(value, dict):
            raise ConfigError(
                f"{where}: [{key}]: not a section; the sections are {', '.join(f'[{s}]' for s in SECTIONS)}"
            )
        else:
            raise _unknown_key(key, where)


def _check_value(key: str, value: Any, hint: Any, where: str, command_line: bool) -> None:
    """A value's type against its field's: in a file `key = value: expected ...`; on the command line, where the
    override is quoted already, what was expected (and, for a string read as another TOML type, the quoting)."""
    problem = type_problem(hint, value)
    if problem is None:
        return
    if not command_line:
        raise ConfigError(f"{where}: {key} = {value!r}: {problem}", [key])
    as_text = not isinstance(value, dict | list) and type_problem(hint, str(value)) is None
    quote = f'; quote it: {key}="{value}"' if as_text else ""  # `model.name=5` read 5 as a number
    raise ConfigError(f"{where}: {problem}{quote}", [key])


def _merge(table: dict[str, Any], new: dict[str, Any], where: str, sources: dict[str, str]) -> None:
    """Put the keys of one source (the file, an override) into the run's table, later sources winning key by key,
    and record in `sources` where each key's value came from."""
    for key, value in new.items():
        if key not in SECTIONS:
            table[key], sources[key] = value, where
            continue
        section = table.setdefault(key, {})
        for leaf, v in value.items():
            if isinstance(v, dict) and isinstance(section.get(leaf), dict):
                section[leaf] = {**section[leaf], **v}  # storage.storage_options, key by key
            else:
                section[leaf] = v
            sources[f"{key}.{leaf}"] = where


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The TrainConfig of a TOML file (or of the defaults when `path` is None) with `key=value` overrides; flat keys
    of earlier versions are read with a ConfigDeprecationWarning naming the new key. An error names the source of
    the values it is about: the file, or the override as given (`command line: model.n_layer=x: ...`)."""
    table: dict[str, Any] = {}
    sources: dict[str, str] = {}  # dotted key -> the file or the override that set it
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        where = str(path)
        nested = nest_flat_keys(data, where)
        _check_source(nested, where, dotted=False)
        _merge(table, nested, where, sources)
    for text in overrides:
        where = f"command line: {text}"
        key, value = parse_override(text)
        nested = nest_flat_keys(_dotted(key, value, where), where)
        _check_source(nested, where, dotted=True)
        _merge(table, nested, where, sources)
    try:
        values = {k: v for k, v in table.items() if k not in SECTIONS}
        for name in SECTIONS:
            if name in table:
                values[name] = _section(name, table[name], f"[{name}]")  # an error gets its source below
        return TrainConfig(**values)
    except ConfigError as e:
        blamed = dict.fromkeys(sources[k] for k in e.keys if k in sources)
        raise ConfigError(f"{' and '.join(blamed) or str(path or 'config')}: {e}", e.keys) from None


def _section(name: str, values: dict[str, Any], where: str) -> Any:
    """The dataclass of section `name` from its table; its keys' types are checked by TrainConfig."""
    if name == "storage":
        return storage_config(values, where)
    return from_table(SECTIONS[name], values, where, ConfigError, check_types=False)


def parallel_config(values: dict[str, Any], where: str = "[parallel]") -> ParallelConfig:
    """A ParallelConfig from the [parallel] section's values; unknown keys are ConfigErrors with a suggestion.

    Example:
        >>> parallel_config({"tp": 2, "dp_shard": -1}).tp
        2
    """
    return from_table(ParallelConfig, values, where, ConfigError, check_types=False)


def storage_config(values: dict[str, Any], where: str = "[storage]") -> StorageConfig:
    """A StorageConfig from the [storage] section's values: unknown keys, wrong types and bad values are
    ConfigErrors naming the key.

    Example:
        >>> storage_config({"read_mode": "direct", "storage_options": {"endpoint_url": "http://rgw:7480"}}).read_mode
        'direct'
    """
    options = values.get("storage_options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: storage_options = {options!r}: expected a table of fsspec options",
                          ["storage.storage_options"])  # fmt: skip
    try:
        return from_table(StorageConfig, values, where, ConfigError)
    except ConfigError as e:  # StorageConfig names the key in its own words: find which of the given ones
        raise ConfigError(str(e), [f"storage.{k}" for k in values if k in str(e)]) from None


def config_keys(values: dict[str, Any]) -> dict[str, Any]:
    """A recorded config (a `to_dict()`, of this version or of one that wrote flat keys) as one level of dotted
    keys, so that two runs' configs compare key by key (`schedule.max_steps`).

    Example:
        >>> config_keys({"max_steps": 40, "seed": 1})
        {'seed': 1, 'schedule.max_steps': 40}
    """
    table = nest_flat_keys(values, "recorded config", warn=False)
    flat = {}
    for key, value in table.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def describe_keys() -> str:
    """Every key with its default and documentation, for `--list-keys`: the sections' keys under their header."""
    docs = field_docs(TrainConfig)
    lines = []
    for f in fields(TrainConfig):
        if f.name not in SECTIONS:
            lines.append(f"{f.name} = {json.dumps(field_default(f))}\n    {_indent(docs.get(f.name, ''))}")
            continue
        section = SECTIONS[f.name]
        lines.append(f"[{f.name}]\n    {_indent(docs.get(f.name, ''))}")
        section_docs = field_docs(section)
        for sf in fields(section):
            default = field_default(sf)
            shown = "(required)" if default is MISSING else json.dumps(default)
            lines.append(f"{f.name}.{sf.name} = {shown}\n    {_indent(section_docs.get(sf.name, ''))}")
    return "\n".join(lines)


def _indent(doc: str) -> str:
    return doc.replace("\n", "\n    ")


@dataclass(frozen=True)
class ExportConfig:
    """What `corpusforge export-hf` exports and where to (its options are these fields).

    Example:
        >>> from corpusforge.train.export_hf import export_hf  # torch is imported there, not here
        >>> export_hf(**asdict(ExportConfig(run_dir=Path("runs/a"), output=Path("hf/a"))))  # doctest: +SKIP
    """

    run_dir: Path
    """The training run's directory (`out_dir`), whose checkpoints/ hold the model."""

    output: Path
    """Directory to write (created as needed)."""

    checkpoint: Path | None = None
    """A step_* directory; default: the run's latest complete checkpoint."""

    tokenizer: str | None = None
    """Tokenizer to ship: an encoding name (cl100k_base, o200k_base, gpt2) or a .tiktoken, tokenizer.json or
    sentencepiece .model path, as every command takes it; default: the one the run's data was written with."""

    overwrite: bool = False
    """Replace an existing non-empty output directory (swapped in one step where the file system can)."""
