"""The training loop: one process per device under torchrun, or one process alone.

    plan (config checks, data, model) → resume → [micro-batches → step → log → eval → checkpoint] → summary

Everything that can be wrong with a config, the data or a checkpoint is checked in `prepare()`, before the first
forward pass. `train(cfg)` returns the summary (also the last record of metrics.jsonl).

Example:
    >>> from corpusforge.train import load_config, train
    >>> summary = train(load_config("configs/tiny-cpu.toml", ["max_steps=50"]))
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from corpusforge.data.loader import LoaderStateError
from corpusforge.errors import CorpusforgeError
from corpusforge.train import checkpoint as ckpt
from corpusforge.train import llama, retro_model
from corpusforge.train import parallel as par
from corpusforge.train import pipeline as pipe
from corpusforge.train.config import ConfigError, TrainConfig, config_keys, grad_accum_steps
from corpusforge.train.data import TrainData, build_data, check_vocab
from corpusforge.train.llama import Llama, LlamaConfig
from corpusforge.train.metrics import MetricsWriter, format_line, peak_flops, percentiles_ms
from corpusforge.train.model import GPT, GPTConfig, flops_per_token, loss_fn
from corpusforge.train.optim import lr_at, make_optimizer
from corpusforge.train.retro_model import RetroConfig, RetroModel
from corpusforge.train.watchdog import Watchdog

ModelConfig = GPTConfig | LlamaConfig | RetroConfig

Log = Callable[[str], None]
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------------------
# processes and devices


@dataclass
class Runtime:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    distributed: bool = False
    group: Any = None  # a gloo group of all ranks for agree(): CPU objects, whatever the device's backend
    solo_group: bool = False  # a default process group of this process alone, made by setup_runtime for FSDP2

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def agree(self, check: Callable[[], T], here: bool = True) -> T | None:
        """Run `check` on this rank (when `here`) and make its outcome every rank's: its result is returned when no
        rank's check raised a CorpusforgeError, else every rank raises the same one (the lowest failing rank's).
        Collective: every rank calls it at the same point, `here` or not.

        A check that one rank makes (the index caches rank 0 builds, a path one node cannot see, a batch with a bad
        token) then ends every rank with the same one line, and no rank waits in a collective that the failed one
        has left (which gloo reports as a 40-line "Connection reset by peer" traceback of the wrong rank).

        Example:
            >>> data = rt.agree(lambda: build_data(cfg, ...))          # every rank builds; any one's error is all's
            >>> rt.agree(lambda: write_caches(cfg), here=rt.is_main)   # rank 0 decides; the others wait for it
        """
        error, result = None, None
        if here:
            try:
                result = check()
            except CorpusforgeError as e:
                error = e
        self.settle(error, checked=here)
        return result

    def settle(self, error: CorpusforgeError | None, checked: bool = True) -> None:
        """Raise on every rank the error that any rank met (None: this rank met none, or did not look when not
        `checked`); one all-reduce of a flag when none did. Collective."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        flag = torch.tensor([int(error is not None)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return
        met: list[Any] = [None] * self.world_size
        mine = "passed" if checked else None
        if error is not None:
            mine = (type(error).__module__, type(error).__qualname__, str(error), error.exit_code, socket.gethostname())
        dist.all_gather_object(met, mine, group=self.group)
        raise _agreed_error(met) from None


def _agreed_error(met: list[tuple | str | None]) -> CorpusforgeError:
    """The error every rank raises: the lowest failing rank's, of its class where it can be built from its message;
    the rank and host named when another rank made the same check and passed it (a node that sees another file
    system)."""
    failed = [r for r, m in enumerate(met) if isinstance(m, tuple)]
    module, qualname, message, code, host = met[failed[0]]
    if "passed" in met:
        others = f" and {len(failed) - 1} other rank(s)" if len(failed) > 1 else ""
        message = f"{message} (met by rank {failed[0]} on {host}{others})"
    cls = getattr(importlib.import_module(module), qualname, None)
    try:
        error = cls(message) if isinstance(cls, type) and issubclass(cls, CorpusforgeError) else None
    except TypeError:  # a constructor that takes more than the message
        error = None
    error = error or CorpusforgeError(message)
    error.exit_code = code
    return error


def setup_runtime(cfg: TrainConfig) -> Runtime:
    """Join the torchrun process group (NCCL on GPU, gloo on CPU) when RANK/WORLD_SIZE are set."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError('device = "cuda" but torch sees no GPU; use device = "cpu" or "auto"')
    rt = Runtime()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rt.rank, rt.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        rt.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        rt.distributed = rt.world_size > 1
    if use_cuda:
        rt.device = torch.device("cuda", rt.local_rank)
        torch.cuda.set_device(rt.device)
    if rt.distributed and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend, device_id=rt.device if use_cuda else None, **_restart_store(rt))
    if rt.distributed:
        rt.group = dist.new_group(backend="gloo")
    elif cfg.parallel.offload == "cpu" and not dist.is_initialized():
        # offload "cpu" is FSDP2's CPUOffloadPolicy, and FSDP2's mesh needs a process group: one of a world of one
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=rt.device if use_cuda else None)  # fmt: skip
        rt.solo_group = True
    return rt


def _restart_store(rt: Runtime) -> dict[str, Any]:
    """The process group's store for a job that torchrun has restarted (--max-restarts): torchrun's agent keeps one
    store for every attempt, where the groups of the attempt before left their members' addresses under the same
    names, so a new group's first connection waits on ranks that are gone (seen: attempt 1 hung in new_group). Each
    attempt gets its own key space; the first attempt, and jobs not started by torchrun, keep the default."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rt.world_size, is_master=False)
    store = dist.PrefixStore(f"corpusforge/attempt{attempt}", client)
    return {"store": store, "rank": rt.rank, "world_size": rt.world_size}


def out_dir_error(out_dir: str | Path, e: OSError) -> CorpusforgeError:
    """One line for an out_dir this rank cannot write (read-only, another user's, full, a file in the way)."""
    why = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable by this user",
           errno.EPERM: "is not writable by this user", errno.ENOSPC: "has no space left",
           errno.EDQUOT: "is over its disk quota", errno.ENOTDIR: f"is not a directory ({e.filename})",
           errno.EEXIST: f"is in the way of a directory ({e.filename})"}.get(e.errno)  # fmt: skip
    what = why or f"cannot be written ({e.strerror}: {e.filename})"
    return ConfigError(f"{out_dir}: the run's out_dir {what}; give an out_dir you can write (out_dir=...)", ["out_dir"])


def check_out_dir(cfg: TrainConfig, rank: int) -> None:
    """Every rank writes its checkpoint shards under out_dir: make out_dir and prove with a file that this rank can
    write there, before any data or model is built."""
    root = Path(cfg.out_dir)
    probe = root / f".write-test-{rank}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise out_dir_error(cfg.out_dir, e) from None


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def use_compile(cfg: TrainConfig, device: torch.device) -> bool:
    return device.type == "cuda" if cfg.compile == "auto" else bool(cfg.compile)


# ---------------------------------------------------------------------------------------------------------------
# the plan: everything checked and built before compute


def gpt_config(cfg: TrainConfig) -> GPTConfig:
    n_layer, n_head, n_embd = cfg.model_shape()
    m = cfg.model
    return GPTConfig(n_layer, n_head, n_embd, m.vocab_size, m.seq_length, m.dropout, m.bias)


def retro_config(cfg: TrainConfig) -> RetroConfig:
    """A RETRO preset (or model = "retro": n_layer, n_head, n_embd) with the [retro] keys that are set."""
    n_layer, n_head, n_embd = cfg.model_shape()
    r = cfg.retro
    keys = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=cfg.model.dropout, bias=cfg.model.bias,
                chunk_length=r.chunk_length, num_neighbours=r.num_neighbours,
                retrieved_chunks=r.retrieved_chunks, encoder_lr_scale=r.encoder_lr_scale)  # fmt: skip
    keys.update({k: getattr(r, k) for k in ("encoder_layers", "encoder_n_embd", "encoder_n_head") if getattr(r, k)})
    if r.cca_layers:
        keys["cca_layers"] = tuple(r.cca_layers)
    if cfg.model.name == "retro":
        return RetroConfig(vocab_size=cfg.model.vocab_size, block_size=cfg.model.seq_length, **keys)
    return retro_model.retro_preset(cfg.model.name, cfg.model.vocab_size, cfg.model.seq_length, **keys)


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The model config of the run's family."""
    if cfg.family == "gpt2":
        return gpt_config(cfg)
    if cfg.family == "retro":
        return retro_config(cfg)
    n_layer, n_head, n_embd = cfg.model_shape()
    return LlamaConfig(n_layer, n_head, n_embd=n_embd, vocab_size=cfg.model.vocab_size,
                       block_size=cfg.model.seq_length, dropout=cfg.model.dropout, **cfg.llama_shape())  # fmt: skip


def build_model(mcfg: ModelConfig) -> GPT | Llama | RetroModel:
    if isinstance(mcfg, RetroConfig):
        return RetroModel(mcfg)
    return Llama(mcfg) if isinstance(mcfg, LlamaConfig) else GPT(mcfg)


def model_shape(g: ModelConfig) -> dict[str, int]:
    """What a checkpoint must match to be resumed into this model."""
    shape = {
        "n_layer": g.n_layer,
        "n_head": g.n_head,
        "n_embd": g.n_embd,
        "padded_vocab": g.padded_vocab,
        "block_size": g.block_size,
    }
    if isinstance(g, LlamaConfig):
        return {"family": "llama", **shape, "n_kv_head": g.n_kv_head, "ffn_hidden": g.ffn_hidden,
                "tie_embeddings": int(g.tie_embeddings)}  # fmt: skip
    if isinstance(g, RetroConfig):
        return {"family": "retro", **shape, "bias": int(g.bias), "chunk_length": g.chunk_length,
                "num_neighbours": g.num_neighbours, "retrieved_length": g.retrieved_length,
                "encoder_layers": g.encoder_layers, "encoder_n_embd": g.enc_embd, "encoder_n_head": g.enc_head,
                "cca_layers": list(g.cca_layer_indices)}  # fmt: skip
    return {**shape, "bias": int(g.bias)}


def memory_estimate(g: GPTConfig | LlamaConfig, n_params: int, cfg: TrainConfig, layout: par.Layout,
                    dtype: torch.dtype, pp_rank: int = 0) -> dict:  # fmt: skip
    """Rough bytes on a rank at pipeline position `pp_rank`: fp32 weights, grads and AdamW's two moments (4 + 4 +
    8 B/param) of its stages' parameters, divided by tp and by dp_shard under FSDP; activations ~34·T·B·C bytes
    per layer in 16-bit with flash attention (Korthikanti et al. 2022, table 2, without the 5·a·T² score term;
    /tp with sequence parallel, their table 4), doubled in fp32, times the micro-batches a stage holds at once
    (GPipe: all; 1F1B and the others: up to pp); logits B·T·V/tp in the autocast dtype plus fp32 copy and grad on
    the rank with the head."""
    stages = par.stages_of_rank(layout, pp_rank, cfg.parallel.pp_schedule)
    params = par.rank_parameters(layout, g, stages, n_params)
    weights = params * 4 / (layout.dp_shard if layout.fsdp else 1)
    half = dtype in (torch.bfloat16, torch.float16)
    t, c = cfg.model.seq_length, g.n_embd
    layers, b, in_flight, has_head = g.n_layer, cfg.schedule.micro_batch_size, 1, True
    if layout.pp > 1:
        layers = sum(len(layout.stage_layers[s]) for s in stages)
        b = cfg.schedule.micro_batch_size // layout.microbatches
        in_flight = layout.microbatches if cfg.parallel.pp_schedule == "GPipe" else min(layout.microbatches, layout.pp)
        has_head = len(layout.stage_layers) - 1 in stages
    per_token_layer = {"none": 34 if half else 68, "selective": 20 if half else 40, "full": 2 if half else 4}
    # selective: the pointwise outputs recomputed, ~40% less (torchtitan's op-level SAC); full: the block input only
    sp = layout.tp if cfg.parallel.sequence_parallel else 1
    activations = per_token_layer[cfg.parallel.activation_checkpoint] * t * b * c * layers * in_flight / sp
    if isinstance(g, RetroConfig):  # data parallel only, no checkpointing (check_retro_layout)
        activations += retro_activation_bytes(g, t, b, half)
    logits = b * t * g.padded_vocab * ((2 if half else 4) + 8) / layout.tp if has_head else 0
    out = {"params_gb": weights, "grads_gb": weights, "optimizer_gb": 2 * weights, "activations_gb": activations,
           "logits_gb": logits}  # fmt: skip
    out = {k: v / 1e9 for k, v in out.items()}
    out["total_gb"] = sum(out.values())
    return out


def retro_activation_bytes(g: RetroConfig, t: int, b: int, half: bool) -> float:
    """What a RETRO model keeps for backward beyond its decoder's layers, with memory_estimate's per-token rates: the
    encoder's layers over the K*R/m neighbour tokens of each decoder token (34 B per token and width a layer, as a
    decoder layer; its first layer's cross-attention ~11 more), the embedded neighbours (2), and at each CCA layer
    an attention block's query side (11 per decoder token) and its keys and values over the neighbour tokens (4).
    Doubled in fp32.

    Example:
        >>> retro_activation_bytes(retro_model.retro_preset("retro-172m", 50257, 2048), t=2048, b=1, half=True) / 2**20
        708.75
    """
    nb = t * b * g.num_neighbours * g.retrieved_length / g.chunk_length  # neighbour tokens in a micro-batch
    encoder = (34 * g.encoder_layers + 11) * nb * g.enc_embd + 2 * nb * g.n_embd
    cca = len(g.cca_layer_indices) * (11 * t * b * g.n_embd + 4 * nb * g.n_embd)
    return (encoder + cca) * (1 if half else 2)


@dataclass
class Plan:
    cfg: TrainConfig
    rt: Runtime
    gpt: ModelConfig  # the model config, of any family
    layout: par.Layout
    grad_accum: int
    n_params: int
    flops_per_token: int
    memory: dict
    data: TrainData | None = None
    model: torch.nn.Module | None = None  # the module whose state is saved (unwrapped from DDP; FSDP in place)
    step_model: torch.nn.Module | None = None  # what forward passes call (DDP wrapper or the model)
    optimizer: torch.optim.Optimizer | None = None
    resume_from: Path | None = None
    stage_ids: list[int] = field(default_factory=list)  # the pipeline stages this rank holds
    mesh: Any = None  # the DeviceMesh (pp, dp_replicate, dp_shard, tp) when the layout needs one
    schedule: Any = None  # pp > 1: pipeline.SchedulePerShape (then `model` is a ModuleList of this rank's stages)
    tied_group: Any = None  # pp > 1 with a tied embedding: the ranks of the first and last stage (pipeline.py)
    watchdog: Watchdog | None = None  # slow and hung reads (run() starts it)
    placements: dict = field(default_factory=dict)  # offload_bytes(): {placement: {device, host, disk}}

    def loss_context(self):
        """loss_parallel() when the head's logits stay vocabulary-sharded (forward and backward both need it)."""
        if self.layout.tp > 1 and self.cfg.parallel.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def summary(self) -> dict[str, Any]:
        steps = self.cfg.schedule.max_steps
        return {
            "model": self.cfg.model.name,
            "shape": model_shape(self.gpt),
            "params": self.n_params,
            "ranks": self.rt.world_size,
            "device": str(self.rt.device),
            "family": self.cfg.family,
            "layout": {d: getattr(self.layout, d) for d in par.DIMS},
            "micro_batch_size": self.cfg.schedule.micro_batch_size,
            "grad_accum": self.grad_accum,
            "tokens_per_step": self.cfg.schedule.global_batch_tokens,
            "max_steps": steps,
            "train_tokens": steps * self.cfg.schedule.global_batch_tokens,
            "train_split_tokens": self.data.train_tokens_per_epoch if self.data else None,
            "epochs": round(steps * self.cfg.schedule.global_batch_tokens / self.data.train_tokens_per_epoch, 3)
            if self.data
            else None,
            "data_read_modes": self.data.read_modes if self.data else None,
            **({"curriculum": self.data.curriculum} if self.data and self.data.curriculum else {}),
            "flops_per_token": self.flops_per_token,
            "memory_estimate": {k: round(v, 3) for k, v in self.memory.items()},
            "resume_from": str(self.resume_from) if self.resume_from else None,
        }


def find_resume(cfg: TrainConfig, shape: dict[str, int]) -> Path | None:
    """The checkpoint to resume from (None for a fresh run), already checked against the model shape."""
    if cfg.checkpoint.resume == "never":
        return None
    path = ckpt.latest_checkpoint(cfg.out_dir) if cfg.checkpoint.resume == "auto" else Path(cfg.checkpoint.resume)
    if path is None:
        return None
    ckpt.check_compatible(path, ckpt.load_meta(path), shape)
    return ckpt.check_format(path)  # a full-state checkpoint of an earlier version: refused, with how to convert it


def prepare(cfg: TrainConfig, rt: Runtime, layout: par.Layout, dry_run: bool = False) -> Plan:
    """Check the config against the world size, the checkpoint and the data, then build the model (on the meta
    device for a dry run, so that a 70B plan takes seconds and no memory) and lay it out over the ranks."""
    accum = grad_accum_steps(cfg, layout.dp)
    g = model_config(cfg)
    # each check below is made by every rank (or by rank 0 for all) and agreed: one rank's error is every rank's
    if not dry_run:
        rt.agree(lambda: check_out_dir(cfg, rt.rank))
    resume_from = rt.agree(lambda: find_resume(cfg, model_shape(g)))
    agree = rt.agree if rt.distributed else None
    data = rt.agree(lambda: build_data(cfg, layout.dp_rank(rt.rank), layout.dp, agree, rt.device))
    # GPT and Llama are built on the meta device and only each rank's shards materialised after the parallel plan
    # (par.materialize), so a model larger than one rank's memory can start; RETRO is built whole on every rank
    on_meta = dry_run or not isinstance(g, RetroConfig)
    torch.manual_seed(cfg.seed)  # RETRO: the same initial weights on every rank
    with torch.device("meta" if on_meta else rt.device):
        model = build_model(g)
    n_params = model.num_params()
    if isinstance(g, RetroConfig):  # the encoder and the cross-attentions counted too
        fpt = retro_model.flops_per_token(g, cfg.model.seq_length)
    else:
        fpt = (llama.flops_per_token if isinstance(g, LlamaConfig) else flops_per_token)(
            g, model.num_params(embeddings=False), cfg.model.seq_length
        )
    dtype = autocast_dtype(cfg, rt.device)
    memory = max((memory_estimate(g, n_params, cfg, layout, dtype, r) for r in range(layout.pp)),
                 key=lambda m: m["total_gb"])  # the most loaded pipeline position  # fmt: skip
    plan = Plan(cfg, rt, g, layout, accum, n_params, fpt, memory, data=data, resume_from=resume_from)
    plan.placements = offload_bytes(plan)
    if cfg.parallel.offload == "nvme":  # a disk too small for the state: refused before any work
        from corpusforge.train.offload import check_offload_space, offload_directory

        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        directory = offload_directory(cfg.parallel.offload_dir, cfg.out_dir, rt.rank).parent
        rt.agree(lambda: check_offload_space(directory, plan.placements["nvme"]["disk"] * local_ranks))
    if dry_run:
        return plan
    plan.model, plan.step_model = wrap_model(model, cfg, rt, layout, plan)
    if plan.schedule is not None:  # one optimizer per stage, so that each state is keyed by parameter names
        plan.optimizer = pipe.Optimizers([make_optimizer(part, cfg, rt.device) for part in plan.model])
    else:  # nvme: the state files are made here (fallocate: a full offload_dir is every rank's one line)
        plan.optimizer = rt.agree(lambda: make_optimizer(plan.model, cfg, rt.device, rt.rank))
    return plan


def offload_bytes(plan: Plan) -> dict[str, dict[str, int]]:
    """Bytes of the most loaded rank's parameter state on the device, in host memory and on disk, per placement."""
    from corpusforge.train.offload import placement_bytes

    layout = plan.layout
    most = max(par.rank_parameters(layout, plan.gpt, par.stages_of_rank(layout, r, plan.cfg.parallel.pp_schedule),
                                   plan.n_params) for r in range(layout.pp))  # fmt: skip
    return placement_bytes(int(most / (layout.dp_shard if layout.fsdp else 1)))


def wrap_model(model: GPT | Llama, cfg: TrainConfig, rt: Runtime, layout: par.Layout,
               plan: Plan) -> tuple[torch.nn.Module, torch.nn.Module]:  # fmt: skip
    """(model to save, model to call): the parallel plan (TP/SP, activation checkpointing, FSDP2/HSDP) on a mesh
    when the layout needs one; else torch.compile in place (state-dict keys unchanged), then DDP or nothing."""
    compiled = use_compile(cfg, rt.device)
    if layout.pp > 1:
        return wrap_pipeline(model, cfg, rt, layout, plan, compiled)
    if layout.tp > 1 or layout.fsdp:
        plan.mesh = par.build_mesh(layout, rt.device.type)
        if isinstance(model, RetroModel):  # the encoder its own FSDP unit, before the blocks and the root
            shard_retro_encoder(model, cfg, layout, plan.mesh, autocast_dtype(cfg, rt.device))
        par.parallelize(model, cfg, layout, plan.mesh, autocast_dtype(cfg, rt.device), compiled)
        materialize(model, cfg, rt)
        if compiled and not layout.fsdp:
            model.compile()
        return model, model
    par.apply_ac(model, cfg.parallel.activation_checkpoint)
    materialize(model, cfg, rt)
    if compiled:
        model.compile()
    if rt.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [rt.local_rank] if rt.device.type == "cuda" else None
        return model, DDP(model, device_ids=ids, gradient_as_bucket_view=True)
    return model, model


def materialize(model: torch.nn.Module, cfg: TrainConfig, rt: Runtime, aliases: dict[str, str] | None = None) -> None:
    """This rank's shards of a model built on the meta device, allocated and initialised (par.materialize)."""
    if next(model.parameters()).is_meta:
        par.materialize(model, rt.device, cfg.seed, model.cfg.n_layer, aliases)


def shard_retro_encoder(model: RetroModel, cfg: TrainConfig, layout: par.Layout, mesh: Any,
                        dtype: torch.dtype) -> None:  # fmt: skip
    """FSDP2 on RETRO's retrieval encoder: gathered once per step at the first RETRO layer, which calls it."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
    options: dict[str, Any] = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
    }
    if cfg.parallel.offload == "cpu":
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    fully_shard(model.encoder, **options)


def check_retro_layout(cfg: TrainConfig, layout: par.Layout) -> None:
    """RETRO runs data-parallel only (DDP, FSDP2, HSDP) without activation checkpointing: one line otherwise."""
    if cfg.family != "retro":
        return
    if layout.tp > 1 or layout.pp > 1:
        raise ConfigError(
            f"parallel: tp = {layout.tp}, pp = {layout.pp}: a RETRO model trains with data parallelism only (DDP, "
            f"FSDP2) for now (Megatron's RETRO had no pipeline either); set parallel.tp=1 and parallel.pp=1"
        )
    if cfg.parallel.activation_checkpoint != "none":
        # the first RETRO layer encodes the neighbours once for all later ones; a recomputed block would reuse that
        # encoding instead of recomputing it, which torch.utils.checkpoint refuses
        raise ConfigError(
            f'parallel.activation_checkpoint = "{cfg.parallel.activation_checkpoint}": not supported for RETRO '
            f'models yet; set parallel.activation_checkpoint="none"'
        )


def wrap_pipeline(model: GPT | Llama, cfg: TrainConfig, rt: Runtime, layout: par.Layout, plan: Plan,
                  compiled: bool) -> tuple[torch.nn.Module, None]:  # fmt: skip
    """This rank's pipeline stages, each parallelized like a whole model, and the schedule that runs them."""
    plan.mesh = par.build_mesh(layout, rt.device.type)
    parts = pipe.split_model(model, layout, layout.coords(rt.rank)["pp"], cfg.parallel.pp_schedule)
    for _, part in parts:
        par.parallelize(part, cfg, layout, plan.mesh, autocast_dtype(cfg, rt.device), compiled)
        materialize(part, cfg, rt, par.tied_aliases(part))
        pipe.mark_tied_copy(part)
    plan.tied_group = pipe.tied_group(layout, rt.rank, model)
    scale = plan.grad_accum * layout.microbatches

    def loss_of_microbatch(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Masked positions come as target -1 (the schedule passes one target tensor)."""
        return loss_fn(logits, targets.clamp(min=0), (targets >= 0).float()) / scale

    plan.schedule = pipe.SchedulePerShape(
        lambda: pipe.build_schedule(
            parts, layout, cfg.parallel.pp_schedule, plan.mesh["pp"].get_group(), rt.device, loss_of_microbatch
        )
    )
    plan.stage_ids = [s for s, _ in parts]
    return torch.nn.ModuleList([m for _, m in parts]), None


def pipeline_pass(plan: Plan, batch: dict[str, torch.Tensor], train: bool = True) -> torch.Tensor:
    """One batch through the pipeline (forward and backward when `train`): the batch's mean loss / grad_accum on
    the ranks with the last stage, zero elsewhere."""
    last = len(plan.layout.stage_layers) - 1
    targets = torch.where(batch["loss_mask"] > 0, batch["labels"], -1)
    losses: list[torch.Tensor] = []
    args = (batch["tokens"],) if 0 in plan.stage_ids else ()
    # data.document_mask: every stage masks attention by document, and Llama's stages rotate by position, so the
    # boundaries and the restarting positions travel with each micro-batch as keyword arguments, which the schedule
    # splits like the tokens and hands to every stage (activations alone pass between stages).
    documents = {k: batch[k] for k in ("position_ids", "cu_seqlens")} if "cu_seqlens" in batch else {}
    schedule = plan.schedule.of(batch["tokens"].shape)  # a curriculum's length phase changes the shape
    run = schedule.step if train else schedule.eval
    with plan.loss_context(), autocast(plan):
        run(*args, target=targets, losses=losses, **documents)
    if last in plan.stage_ids:
        return torch.stack([x.detach() for x in losses]).sum()
    return torch.zeros((), device=plan.rt.device)


# ---------------------------------------------------------------------------------------------------------------
# the loop


class DataStream:
    """The train loader as an endless stream of device batches, timing each wait. Data loading runs with the
    torch RNG forked, so creating loader iterators (which draw a seed) never shifts the training RNG (dropout),
    and a resumed run draws the same dropout masks as an uninterrupted one."""

    def __init__(self, loader: Any, plan: Plan) -> None:
        self.loader, self.plan, self.it = loader, plan, None
        self.non_blocking = plan.rt.device.type == "cuda"

    def next(self) -> tuple[dict[str, torch.Tensor], float]:
        t0 = time.perf_counter()
        dog = self.plan.watchdog
        # the first batch of an iterator waits for its workers to start (seconds): only its reads are watched
        watched = dog.waiting_for_data() if dog and self.it is not None else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[]), watched:
            if self.it is None:
                self.it = iter(self.loader)
            batch = next(self.it)
        wait = time.perf_counter() - t0
        cfg = self.plan.cfg
        retro = "neighbours" in batch
        if batch["tokens"].device.type == "cpu":  # on the device, .max() would wait for the GPU every micro-batch
            check_vocab(batch["tokens"], batch["labels"], cfg.model.vocab_size, cfg.data.path or cfg.retro.db)
            if retro:  # the neighbours are tokens of the database's corpus: the same embedding reads them
                where = f"{cfg.retro.db} (neighbours)"
                check_vocab(batch["neighbours"], batch["neighbours"], cfg.model.vocab_size, where)
        return batch_to_device(batch, self.plan.rt.device, self.non_blocking), wait


def batch_to_device(batch: dict, device: torch.device, non_blocking: bool = True) -> dict[str, torch.Tensor]:
    """The fields a step reads (a RETRO batch's neighbours too), on `device`; token ids widened to int64 there.

    Example:
        >>> batch_to_device(next(iter(loader)), torch.device("cuda"))["tokens"].dtype
        torch.int64
    """
    retro = "neighbours" in batch
    keys = ("tokens", "labels", "loss_mask", "position_ids") + (("neighbours", "neighbour_mask") if retro else ())
    keys += ("cu_seqlens",) if "cu_seqlens" in batch else ()  # data.document_mask; int32, as the model takes it
    dev = {k: batch[k].to(device, non_blocking=non_blocking) for k in keys}
    for k in ("tokens", "labels", "position_ids") + (("neighbours",) if retro else ()):
        dev[k] = dev[k].long()  # int32 on the wire, int64 for the embedding: widened on the device
    return dev


def forward(plan: Plan, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of a batch: RETRO models also read its neighbours and their mask."""
    if "neighbours" in batch:
        return plan.step_model(batch["tokens"], batch["neighbours"], batch["neighbour_mask"], batch["position_ids"])
    if "cu_seqlens" in batch:  # data.document_mask: attention within each document
        return plan.step_model(batch["tokens"], batch["position_ids"], batch["cu_seqlens"])
    return plan.step_model(batch["tokens"], batch["position_ids"])


def grad_sync(plan: Plan, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    m = plan.step_model
    if hasattr(m, "set_requires_gradient_sync"):  # FSDP2
        m.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if isinstance(m, torch.nn.parallel.DistributedDataParallel) and not enabled:
        return m.no_sync()
    return contextlib.nullcontext()


def autocast(plan: Plan):
    dtype = autocast_dtype(plan.cfg, plan.rt.device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(plan.rt.device.type, dtype=dtype)


def all_mean(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The mean over the data-parallel ranks of a value that every rank holds (tp ranks hold equal ones), or,
    under pipelining, that only the last stage's ranks hold (the others hold zero)."""
    if plan.rt.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x = x / (plan.rt.world_size // plan.layout.pp)
    return x


def next_batches(plan: Plan, stream: DataStream, count: int, before: Callable[[], None] = lambda: None) -> list:
    """The next `count` micro-batches [(batch, seconds waited)], checked (DataStream.next) on every rank and agreed
    before any of them is computed: a bad batch on one rank ends every rank with its line, not a collective with a
    rank that left. `before`: this rank's other pending errors (a checkpoint write that failed), agreed with them in
    the same one collective per step."""

    def fetch() -> list:
        before()
        return [stream.next() for _ in range(count)]

    return plan.rt.agree(fetch)


def train_step(plan: Plan, batches: list, step: int, loss_of) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step over grad_accum micro-batches (next_batches): (mean loss, grad norm, seconds waited for
    data)."""
    lr = lr_at(step, plan.cfg)
    for group in plan.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # RETRO's encoder: a fraction (optim.make_optimizer)
    loss_sum = torch.zeros((), device=plan.rt.device)
    waited = 0.0
    for micro, (batch, wait) in enumerate(batches):
        waited += wait
        if plan.schedule is not None:
            loss_sum += pipeline_pass(plan, batch)
            continue
        with grad_sync(plan, micro == plan.grad_accum - 1), plan.loss_context():
            with autocast(plan):
                logits = forward(plan, batch)  # (B, T, V), maybe V-sharded
                loss = loss_of(logits, batch["labels"], batch["loss_mask"]) / plan.grad_accum
            loss.backward()
        loss_sum += loss.detach()
    clip = plan.cfg.optimizer.grad_clip if plan.cfg.optimizer.grad_clip > 0 else math.inf
    pp_group = None
    if plan.schedule is not None:
        pipe.sync_tied_grads(list(plan.model), plan.tied_group)
        pp_group = plan.mesh["pp"].get_group()
    norm = par.clip_grad_norm_(list(plan.model.parameters()), clip, pp_group)
    plan.optimizer.step()
    plan.optimizer.zero_grad(set_to_none=True)
    return all_mean(loss_sum, plan), norm, waited


@torch.no_grad()
def evaluate(plan: Plan, loss_of, random_neighbours: bool = False) -> float:
    """Mean loss over the same eval_batches validation micro-batches per rank every time; for RETRO with
    `random_neighbours`, the same samples with random database chunks as neighbours."""
    loader = plan.data.valid_random if random_neighbours else plan.data.valid
    loader.load_state_dict(plan.data.valid_random_start if random_neighbours else plan.data.valid_start)
    stream = DataStream(loader, plan)
    plan.model.eval()
    total = torch.zeros((), device=plan.rt.device)
    for batch, _ in next_batches(plan, stream, plan.cfg.metrics.eval_batches):
        if plan.schedule is not None:
            total += pipeline_pass(plan, batch, train=False) * plan.grad_accum  # the loss carries 1/grad_accum
            continue
        with autocast(plan), plan.loss_context():
            total += loss_of(forward(plan, batch), batch["labels"], batch["loss_mask"])
    plan.model.train()
    return float(all_mean(total / plan.cfg.metrics.eval_batches, plan))


def gather_waits(waits: list[float], plan: Plan) -> list[list[float]]:
    """[[p50_ms, p99_ms] per rank] of the steps' data waits since the last log line."""
    mine = torch.tensor(percentiles_ms(waits), dtype=torch.float64, device=plan.rt.device)
    if not plan.rt.distributed:
        return [mine.tolist()]
    out = [torch.zeros_like(mine) for _ in range(plan.rt.world_size)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def save_checkpoint(plan: Plan, saver: ckpt.Checkpointer, step: int, writer: RunFiles) -> float:
    """Hand this rank's shards to the saver (it stages them to host memory and writes them in the background);
    returns the seconds training stood still."""
    t0 = time.perf_counter()
    state = ckpt.ShardedState.of(plan.model, plan.optimizer)  # layout-free names, whatever this rank holds
    rngs = [ckpt.rng_state()]
    if plan.rt.distributed:
        rngs = [None] * plan.rt.world_size
        dist.all_gather_object(rngs, ckpt.rng_state())
    trainer = {
        "step": step,
        "scheduler": {"step": step, "lr": lr_at(step - 1, plan.cfg)},
        "rng": rngs,
        "loader": plan.data.train.state_dict(),
    }
    meta = {
        "step": step,
        "model_shape": model_shape(plan.gpt),
        "world_size": plan.rt.world_size,
        "time": time.time(),
        "config": plan.cfg.to_dict(),
    }
    previous = saver.last
    saver.save(step, state, trainer, meta)
    stall = time.perf_counter() - t0
    if previous is not None and plan.rt.is_main:  # the write before this one has finished by now
        writer.write(
            "checkpoint", {"step": previous["step"], "path": previous["path"], "write_s": round(previous["write_s"], 4)}
        )
    parts = {k: round(v, 4) for k, v in saver.last_stall.items()}  # wait_s for the previous write, stage_s the copy
    writer.write("checkpoint_stall", {"step": step, "stall_s": round(stall, 4), **parts, "async": saver.asynchronous})
    return stall


def resume(plan: Plan, log: Log, group: Any = None) -> int:
    """Load the checkpoint into the model, optimizer, loader and RNGs; returns the step to continue after. Each rank
    reads its own shards of the model and optimizer state (`group`: the saver's gloo group)."""
    state = ckpt.load_checkpoint(plan.resume_from, plan.model, plan.optimizer, group)
    try:
        plan.data.train.load_state_dict(state["loader"])
    except LoaderStateError as e:  # say it in config keys (max_steps 40 -> 80), not in the loader's num_samples
        saved = ckpt.load_meta(plan.resume_from).get("config", {})
        now = config_keys(plan.cfg.to_dict())  # dotted keys; a checkpoint's flat keys of an older version too
        raise ckpt.resume_refused(plan.resume_from, config_keys(saved), now, str(e)) from None
    rngs = state["rng"]
    if len(rngs) != plan.rt.world_size:
        log(
            f"resume: checkpoint from {len(rngs)} rank(s), now {plan.rt.world_size}: data order continues exactly, "
            f"per-rank random streams (dropout) restart from rank 0's"
        )
    ckpt.set_rng_state(rngs[plan.rt.rank] if plan.rt.rank < len(rngs) else rngs[0])
    log(f"resumed from {plan.resume_from} at step {state['step']}")
    return int(state["step"])


def default_log(rt: Runtime) -> Log:
    return (lambda line: print(line, flush=True)) if rt.is_main else (lambda line: None)


def train(cfg: TrainConfig, dry_run: bool = False, log: Log | None = None, world_size: int | None = None) -> dict:
    """Run (or, with dry_run, only plan) the training described by `cfg`; returns the summary. A dry run plans
    for `world_size` ranks when given (default: torchrun's WORLD_SIZE, or 1) and prints which rank holds what."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1
    layout = par.resolve_layout(cfg, world_size or world, model_config(cfg))  # before any process group
    check_retro_layout(cfg, layout)
    rt = setup_runtime(cfg) if not (dry_run and world_size) else Runtime()
    log = log if log is not None and rt.is_main else default_log(rt)
    try:
        plan = prepare(cfg, rt, layout, dry_run)
        if dry_run:
            return dry_run_report(plan, log)
        summary = run(plan, log)
        rt.barrier()  # no rank tears the group down while another is still in a collective
        return summary
    finally:
        if (rt.distributed or rt.solo_group) and dist.is_initialized():
            dist.destroy_process_group()


def dry_run_report(plan: Plan, log: Log) -> dict[str, Any]:
    """The plan, which rank holds which layers and shard, and each pipeline position's memory estimate; logged as
    a table (one line per rank up to 64 ranks, else per pipeline and tensor position) and returned as data."""
    cfg, layout = plan.cfg, plan.layout
    dtype = autocast_dtype(cfg, plan.rt.device)
    memory = [memory_estimate(plan.gpt, plan.n_params, cfg, layout, dtype, r) for r in range(layout.pp)]
    ranks = par.describe_ranks(layout, plan.gpt, cfg.parallel.pp_schedule)
    for row in ranks:
        row["memory_gb"] = {k: round(v, 3) for k, v in memory[row["pp"]].items()}
    pipeline = f", {layout.microbatches} pipeline micro-batches ({cfg.parallel.pp_schedule})" if layout.pp > 1 else ""
    log(
        f"layout: {layout.describe()} on {layout.world} rank(s); dp={layout.dp}, grad_accum={plan.grad_accum}{pipeline}"
    )
    shown = ranks if len(ranks) <= 64 else [r for r in ranks if r["dp_rank"] == 0]
    for row in shown:
        m = row["memory_gb"]
        log(
            f"  rank {row['rank']:>4} pp {row['pp']} dp {row['dp_rank']} tp {row['tp']} | {row['holds']} | "
            f"{row['shard']} | ~{m['total_gb']:.2f} GB: params {m['params_gb']:.2f}, grads {m['grads_gb']:.2f}, "
            f"optimizer {m['optimizer_gb']:.2f}, activations {m['activations_gb']:.2f}, logits {m['logits_gb']:.2f}"
        )
    if len(shown) < len(ranks):
        log(f"  ... {len(ranks) - len(shown)} more ranks: the same with other data-parallel coordinates")
    for name, where in plan.placements.items():  # parallel.offload: what each placement would put where
        chosen = " (chosen)" if name == cfg.parallel.offload else ""
        log(f"  offload {name:<4}{chosen}: per rank " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in where.items()))
    if plan.data is not None and plan.data.curriculum:  # what each source and each length gives, phase by phase
        from corpusforge.data.curriculum import report_lines

        for line in report_lines(plan.data.curriculum):
            log(line)
    return {"dry_run": True, **plan.summary(), "ranks": ranks, "offload_bytes": plan.placements}


class RunFiles:
    """The run directory's config.json and metrics.jsonl (rank 0). A write that fails (a disk that fills) does not
    end rank 0 alone in the middle of a step: its error waits for the next agreement (`pending`), where every rank
    raises it."""

    def __init__(self, cfg: TrainConfig, rt: Runtime) -> None:
        self.out, self.error = Path(cfg.out_dir), None
        try:
            if rt.is_main:
                ckpt.remove_partial(self.out)  # a killed save's leftovers
                (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
            self.metrics = MetricsWriter(self.out, rt.is_main, cfg.metrics.tensorboard)
        except OSError as e:
            raise out_dir_error(self.out, e) from None

    def write(self, kind: str, record: dict[str, Any]) -> None:
        if self.error is None:
            try:
                self.metrics.write(kind, record)
            except OSError as e:
                self.error = out_dir_error(self.out, e)

    def pending(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.metrics.close()
        self.pending()


def run(plan: Plan, log: Log) -> dict[str, Any]:
    cfg, rt = plan.cfg, plan.rt
    out = Path(cfg.out_dir)
    writer = rt.agree(lambda: RunFiles(cfg, rt))
    # nvme: saved from the state files' maps tensor by tensor, not staged whole in RAM (offload/nvme_optimizer.py)
    asynchronous = cfg.checkpoint.async_write and cfg.parallel.offload != "nvme"
    saver = ckpt.Checkpointer(out, rt.rank, cfg.checkpoint.keep, asynchronous, agree=rt.agree)
    start = resume(plan, log, saver.group) if plan.resume_from else 0
    if not plan.resume_from:
        torch.manual_seed(cfg.seed + rt.rank)  # each rank its own dropout masks
    if rt.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 matmuls left outside autocast
        torch.backends.cudnn.allow_tf32 = True
    loss_of = torch.compile(loss_fn) if use_compile(cfg, rt.device) else loss_fn
    on_gpu = rt.device.type == "cuda"
    peak = cfg.metrics.peak_flops or (peak_flops(torch.cuda.get_device_name(rt.device)) if on_gpu else None)
    info = plan.summary()
    writer.write("plan", info)
    log(f"plan: {json.dumps(info)}")
    for line in getattr(plan.optimizer, "notes", []):  # parallel.offload = "nvme": its files, O_DIRECT or not
        log(line)
    if rt.device.type == "cuda" and peak is None:
        log(f"mfu: {torch.cuda.get_device_name(rt.device)} is not in the peak-FLOPS table; set peak_flops to report it")
    last = min(cfg.schedule.max_steps, cfg.schedule.stop_at_step or cfg.schedule.max_steps)
    plan.watchdog = Watchdog(out, rt.rank, rt.world_size, cfg.watchdog.stall_s, cfg.watchdog.hang_s,
                             what=str(cfg.data.path or cfg.retro.db)).start()  # fmt: skip
    try:
        stats = loop(plan, log, writer, saver, start, last, loss_of, peak)
        with plan.watchdog.saving(saver.in_flight):
            saver.close()  # waits for the last write: its error, agreed, is every rank's
    finally:
        plan.watchdog.stop()
    if saver.last is not None and rt.is_main:
        writer.write(
            "checkpoint",
            {"step": saver.last["step"], "path": saver.last["path"], "write_s": round(saver.last["write_s"], 4)},
        )
    summary = stats.summary(plan, start, last, saver)
    writer.write("summary", summary)
    rt.agree(writer.close)
    for line in summary_lines(summary):
        log(line)
    return summary


def loop(plan: Plan, log: Log, writer: RunFiles, saver: ckpt.Checkpointer, start: int, last: int, loss_of,
         peak: float | None) -> Stats:  # fmt: skip
    """Steps start + 1 .. last: train, log, evaluate, checkpoint."""
    cfg, rt = plan.cfg, plan.rt
    stream = DataStream(plan.data.train, plan)
    stats = Stats()
    interval_t0, interval_steps, waits = time.perf_counter(), 0, []

    def pending() -> None:  # what this rank met since the last step: a checkpoint write or a metrics write failed
        writer.pending()
        saver.check()

    for step in range(start + 1, last + 1):  # `step` counts optimizer steps done once this one is taken
        batches = next_batches(plan, stream, plan.grad_accum, pending)
        loss, norm, waited = train_step(plan, batches, step - 1, loss_of)
        plan.watchdog.beat(step)
        waits.append(waited)
        interval_steps += 1
        if step % cfg.metrics.log_interval == 0 or step == last:
            loss_value, norm_value = float(loss), float(norm)  # syncs the device: the interval's time is real
            elapsed = time.perf_counter() - interval_t0
            tokens_per_s = interval_steps * cfg.schedule.global_batch_tokens / elapsed
            mfu = plan.flops_per_token * tokens_per_s / (peak * rt.world_size) if peak else None
            m = {
                "step": step,
                "max_steps": cfg.schedule.max_steps,
                "loss": loss_value,
                "lr": lr_at(step - 1, cfg),
                "grad_norm": norm_value,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "step_s": elapsed / interval_steps,
                "data_wait_ms": gather_waits(waits, plan),
                "data_wait_s_total": sum(waits),
            }
            log(format_line(m))
            writer.write("train", m)
            stats.add_interval(m, interval_steps, elapsed)
            interval_t0, interval_steps, waits = time.perf_counter(), 0, []
        if cfg.metrics.eval_interval and (step % cfg.metrics.eval_interval == 0 or step == last):
            t0 = time.perf_counter()
            val = evaluate(plan, loss_of)
            stats.valid.append((step, val))
            record: dict[str, Any] = {"step": step, "val_loss": val}
            if plan.data.valid_random is not None:  # what retrieval brings: the loss without informative neighbours
                record["val_loss_random"] = evaluate(plan, loss_of, random_neighbours=True)
                record["retrieval_gain"] = record["val_loss_random"] - val
                stats.valid_random.append((step, record["val_loss_random"]))
            log(
                f"step {step:>6}/{cfg.schedule.max_steps} | "
                + " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step")
            )
            writer.write("valid", record)
            interval_t0 += time.perf_counter() - t0  # evaluation time is not training time
        if (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0) or step == last:
            with plan.watchdog.saving(saver.in_flight):  # a save waits for the previous write: watched as a write
                stats.stalls.append(save_checkpoint(plan, saver, step, writer))  # the stall counts against tokens/s
    return stats


@dataclass
class Stats:
    intervals: list[dict] = field(default_factory=list)
    valid: list[tuple[int, float]] = field(default_factory=list)
    valid_random: list[tuple[int, float]] = field(default_factory=list)  # RETRO, random neighbours
    stalls: list[float] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0

    def add_interval(self, m: dict, steps: int, elapsed: float) -> None:
        self.intervals.append({**m, "steps": steps, "elapsed": elapsed})
        self.seconds += elapsed
        self.steps += steps

    def summary(self, plan: Plan, start: int, last: int, saver: ckpt.Checkpointer) -> dict[str, Any]:
        steady = self.intervals[1:] or self.intervals  # the first interval holds compilation and warmup
        tokens = sum(i["steps"] for i in steady) * plan.cfg.schedule.global_batch_tokens
        secs = sum(i["elapsed"] for i in steady)
        mfus = [i["mfu"] for i in steady if i["mfu"] is not None]
        waits = [w for i in steady for w in i["data_wait_ms"]]  # [p50, p99] per rank per interval
        retro = {}
        if self.valid_random:
            retro = {"final_val_loss_random": self.valid_random[-1][1],
                     "retrieval_gain": self.valid_random[-1][1] - self.valid[-1][1]}  # fmt: skip
        return {
            "steps": last - start,
            "first_step": start + 1,
            "last_step": last,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(tokens / secs, 1) if secs else None,
            "mfu": round(sum(mfus) / len(mfus), 4) if mfus else None,
            "final_loss": self.intervals[-1]["loss"] if self.intervals else None,
            "final_val_loss": self.valid[-1][1] if self.valid else None,
            "best_val_loss": min(v for _, v in self.valid) if self.valid else None,
            **retro,
            "data_wait_ms_p50_max": round(max((w[0] for w in waits), default=0.0), 3),
            "data_wait_ms_p99_max": round(max((w[1] for w in waits), default=0.0), 3),
            "data_wait_fraction": round(sum(i["data_wait_s_total"] for i in steady) / secs, 4) if secs else None,
            "checkpoint_stall_s_max": round(max(self.stalls, default=0.0), 4),
            "checkpoint_write_s_last": round(saver.last["write_s"], 4) if saver.last else None,
            "checkpoint": saver.last["path"] if saver.last else None,
            "ranks": plan.rt.world_size,
        }


def summary_lines(s: dict[str, Any]) -> list[str]:
    return ["summary:"] + [f"  {k:<24} {v}" for k, v in s.items()]
