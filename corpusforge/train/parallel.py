"""The parallel plan: how a plain model is spread over the ranks, applied after it is built (as torchtitan does).

One DeviceMesh with four named dimensions, outermost first:

    pp            pipeline stages (pipeline.py): each rank holds some of the layers
    dp_replicate  data-parallel replicas: DDP, or HSDP's replicate dimension
    dp_shard      FSDP2 fully_shard: parameters, gradients and optimizer state split
    tp            tensor parallel inside each layer (innermost: the ranks that talk most sit closest)

`resolve_layout()` turns the config's degrees into a Layout and refuses, in one line each, what cannot run
(degrees that do not multiply to the world size, tp not dividing the heads, a stage without layers): it is pure
arithmetic, called before the process group starts, so a wrong config never reaches a collective.

`parallelize()` then applies, in this order (torchtitan's parallelize_llama):
1. tensor + sequence parallel (torch.distributed.tensor.parallel): q/k/v and MLP-in split by columns (whole heads
   per rank), out-projections by rows, the embedding's and the head's vocabulary split (the head's logits stay
   sharded for loss_parallel); with sequence parallel the norms and dropouts work on 1/tp of the sequence, each
   all-reduce becoming an all-gather before a block's matmuls and a reduce-scatter after them (Korthikanti et al.
   2022). A tied embedding and head (GPT-2) are tied again after the split: both are split by vocabulary rows.
2. activation checkpointing per block (none / selective / full);
3. FSDP2 per block and at the root over (dp_replicate, dp_shard): FSDP, or HSDP when both are > 1; or DDP when
   the data-parallel ranks are the only dimension and dp_shard is 1.

Example:
    >>> layout = resolve_layout(cfg, world_size=8, model_cfg=mcfg)    # tp=2, pp=2: dp inferred as 2
    >>> mesh = build_mesh(layout, "cuda")
    >>> model = parallelize(model, cfg, layout, mesh)
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from corpusforge.train.config import ConfigError, TrainConfig
from corpusforge.train.llama import Llama, LlamaConfig
from corpusforge.train.model import GPT, GPTConfig

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")

# Pipeline schedules that hold several stages on each rank (looping or V-shaped): stages per rank.
MULTI_STAGE = {"Interleaved1F1B": 2, "LoopedBFS": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2}


@dataclass(frozen=True)
class Layout:
    """The degrees of the four mesh dimensions (their product is the world size) and the pipeline's split."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    stage_layers: tuple[tuple[int, ...], ...] = ()  # layer indices of each pipeline stage
    microbatches: int = 1
    cpu_offload: bool = False  # parallel.offload = "cpu" in one process: FSDP2 on a mesh of one rank

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards (or, with tp or pp, replicates) the model over the data-parallel ranks; DDP when
        data parallelism is the only dimension and nothing is sharded."""
        return self.dp_shard > 1 or (self.dp > 1 and (self.tp > 1 or self.pp > 1)) or self.cpu_offload

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its coordinate on each mesh dimension (row-major, pp outermost, as init_device_mesh lays it)."""
        out = {}
        for name in reversed(DIMS):
            size = getattr(self, name)
            out[name], rank = rank % size, rank // size
        return {name: out[name] for name in DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel shard of each batch `rank` reads: ranks that differ only in pp or tp read the same."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        return f"pp={self.pp} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp}"


def model_heads(mcfg: GPTConfig | LlamaConfig) -> dict[str, int]:
    """The sizes tensor parallelism splits: heads, KV heads, the MLP width and the (padded) vocabulary."""
    if isinstance(mcfg, LlamaConfig):
        return {"n_head": mcfg.n_head, "n_kv_head": mcfg.n_kv_head, "ffn_hidden": mcfg.ffn_hidden,
                "padded_vocab": mcfg.padded_vocab}  # fmt: skip
    return {"n_head": mcfg.n_head, "mlp width": 4 * mcfg.n_embd, "padded_vocab": mcfg.padded_vocab}


def resolve_layout(cfg: TrainConfig, world_size: int, model_cfg: GPTConfig | LlamaConfig) -> Layout:
    """The Layout of `cfg` on `world_size` ranks; a ConfigError naming the key and the fix for anything that
    cannot run. Pure arithmetic: call it before the process group starts."""
    p = cfg.parallel
    degrees = {k: getattr(p, k) for k in DIMS}
    known = 1
    for v in degrees.values():
        known *= v if v != -1 else 1
    inferred = [k for k, v in degrees.items() if v == -1]
    if inferred:
        if world_size % known:
            raise ConfigError(
                f"parallel: {world_size} rank(s) do not divide by {_product(degrees)} = {known}; launch a multiple "
                f"of {known} processes or change the degrees"
            )
        degrees[inferred[0]] = world_size // known
    elif known != world_size:
        raise ConfigError(
            f"parallel: {_product(degrees)} = {known} but there are {world_size} rank(s); make the degrees "
            f"multiply to the world size, or set one of them to -1 to infer it"
        )
    layout = Layout(**degrees)
    if layout.tp > 1:
        for name, size in model_heads(model_cfg).items():
            if size % layout.tp:
                raise ConfigError(f"parallel.tp = {layout.tp} does not divide {name} {size}; choose a tp that does")
        if p.sequence_parallel and cfg.model.seq_length % layout.tp:
            raise ConfigError(
                f"parallel.tp = {layout.tp} does not divide seq_length {cfg.model.seq_length} (sequence parallel "
                f"splits it); change model.seq_length or set parallel.sequence_parallel=false"
            )
    if p.offload == "cpu" and not layout.fsdp:
        if layout.world > 1:
            raise ConfigError(
                'parallel.offload = "cpu" (the old parallel.cpu_offload): cpu_offload needs FSDP2; set dp_shard above '
                "1, or run one process"
            )
        # FSDP2's CPUOffloadPolicy is the offload: one process gets FSDP2 on a world of one (setup_runtime)
        layout = Layout(**degrees, cpu_offload=True)
    if layout.pp > 1:
        stages, micro = pipeline_split(cfg, layout, model_cfg)
        layout = Layout(**degrees, stage_layers=stages, microbatches=micro)
    return layout


def _product(degrees: dict[str, int]) -> str:
    return " x ".join(f"{k} {v}" for k, v in degrees.items() if v != -1)


def pipeline_split(cfg: TrainConfig, layout: Layout, mcfg: GPTConfig | LlamaConfig) -> tuple[tuple, int]:
    """(layer indices per stage, micro-batches): parallel.pp_layers as given, or balanced by parameters."""
    p = cfg.parallel
    n_stages = layout.pp * MULTI_STAGE.get(p.pp_schedule, 1)
    n_layer = mcfg.n_layer
    if p.pp_layers:
        if len(p.pp_layers) != n_stages or sum(p.pp_layers) != n_layer:
            raise ConfigError(
                f"parallel.pp_layers = {p.pp_layers}: give {n_stages} counts ({p.pp_schedule} on pp={layout.pp}) "
                f"that add up to the {n_layer} layers"
            )
        counts = list(p.pp_layers)
    else:
        if n_layer < n_stages:
            raise ConfigError(
                f"parallel.pp = {layout.pp} with {p.pp_schedule} makes {n_stages} stages for {n_layer} layers: a "
                f"stage would hold no layer; lower pp, pick a schedule with one stage per rank, or add layers"
            )
        counts = balance_stages(n_layer, n_stages, *stage_weights(mcfg))
    stages, start = [], 0
    for n in counts:
        stages.append(tuple(range(start, start + n)))
        start += n
    micro = p.pp_microbatches or n_stages
    if cfg.schedule.micro_batch_size % micro:
        raise ConfigError(
            f"parallel.pp_microbatches = {micro} does not divide micro_batch_size {cfg.schedule.micro_batch_size}; the "
            f"pipeline cuts each batch into equal micro-batches"
        )
    if p.pp_schedule == "ZBVZeroBubble" and getattr(mcfg, "tie_embeddings", True):
        raise ConfigError(
            "parallel.pp_schedule = ZBVZeroBubble puts the first and the last stage on one rank, where a tied "
            "embedding and head cannot be kept in step; use InterleavedZeroBubble or an untied model"
        )
    return tuple(stages), micro


def stage_weights(mcfg: GPTConfig | LlamaConfig) -> tuple[int, int, int]:
    """(parameters of one layer, of the first stage's extras (embeddings), of the last stage's (norm, head))."""
    C, V = mcfg.n_embd, mcfg.padded_vocab
    if isinstance(mcfg, LlamaConfig):
        kv = mcfg.n_kv_head * mcfg.head_dim
        layer = 2 * C * C + 2 * C * kv + 3 * C * mcfg.ffn_hidden + 2 * C
        return layer, V * C, C + V * C
    layer = 12 * C * C + 13 * C if mcfg.bias else 12 * C * C + 2 * C
    return layer, V * C + mcfg.block_size * C, 2 * C + V * C


def balance_stages(n_layer: int, n_stages: int, per_layer: int, first: int, last: int) -> list[int]:
    """Layers per stage, each at least one, minimising the largest stage's parameters (the first stage carries
    `first` more, the last `last` more): exact, by dynamic programming over contiguous splits.

    Example:
        >>> balance_stages(8, 2, 10, 0, 0), balance_stages(8, 2, 10, 0, 40)
        ([4, 4], [6, 2])
    """

    def cost(stage: int, n: int) -> int:
        return n * per_layer + (first if stage == 0 else 0) + (last if stage == n_stages - 1 else 0)

    @functools.cache
    def best(stage: int, left: int) -> tuple[int, tuple[int, ...]]:  # (max cost, counts) of stages stage.. on left
        if stage == n_stages - 1:
            return cost(stage, left), (left,)
        options = []
        for n in range(1, left - (n_stages - stage - 1) + 1):
            rest, counts = best(stage + 1, left - n)
            options.append((max(cost(stage, n), rest), (n, *counts)))
        return min(options)

    return list(best(0, n_layer)[1])


def build_mesh(layout: Layout, device_type: str) -> Any:
    """The DeviceMesh of `layout` (every dimension named, size-1 ones too, so plans can always slice by name)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(getattr(layout, d) for d in DIMS), mesh_dim_names=DIMS)


# ---------------------------------------------------------------------------------------------------------------
# 1. tensor and sequence parallel


def tp_plan(model: torch.nn.Module, sp: bool, loss_parallel: bool) -> tuple[dict[str, Any], list[tuple[str, dict]]]:
    """(plan of the model's top-level modules, [(block name, plan of its modules)]) for parallelize_module."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sp else Replicate()  # the residual stream's layout between blocks
    head = ColwiseParallel(
        input_layouts=seq,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )

    def block_plan(norms: tuple[str, str], attn: str, qkv: tuple[str, ...], out: str, mlp: str, mlp_in, mlp_out):
        extra = (None,) if isinstance(model, Llama) else ()  # Llama's attention also takes the position ids
        plan: dict[str, Any] = {
            attn: PrepareModuleInput(
                input_layouts=(seq, *extra), desired_input_layouts=(Replicate(), *extra), use_local_output=True
            ),
            **{f"{attn}.{p}": ColwiseParallel() for p in qkv},
            f"{attn}.{out}": RowwiseParallel(output_layouts=seq),
            mlp: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True),
            **{f"{mlp}.{p}": ColwiseParallel() for p in mlp_in},
            f"{mlp}.{mlp_out}": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan.update({n: SequenceParallel() for n in norms})
        return plan

    if isinstance(model, Llama):
        top = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "output": head,
            **({"norm": SequenceParallel()} if sp else {}),
        }
        blocks = [(f"layers.{name}", block_plan(("attention_norm", "ffn_norm"), "attention", ("wq", "wk", "wv"),
                                                "wo", "feed_forward", ("w1", "w3"), "w2"))
                  for name in model.layers]  # fmt: skip
        return top, blocks
    # GPT: the learned positions are added to the token embedding, so the embedding's output is replicated (an
    # all-reduce rather than a reduce-scatter) and the sum is cut into sequence shards at the dropout.
    top = {"transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()), "lm_head": head}
    if sp:
        top["transformer.drop"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        top["transformer.ln_f"] = SequenceParallel()
    blocks = [(f"transformer.h.{name}", block_plan(("ln_1", "ln_2"), "attn", ("q_proj", "k_proj", "v_proj"), "c_proj",
                                                   "mlp", ("c_fc",), "c_proj"))
              for name in model.transformer.h]  # fmt: skip
    return top, blocks


def tied_pair(model: torch.nn.Module) -> tuple[str, str] | None:
    """(embedding, head) module names when the model ties their weights."""
    if isinstance(model, GPT):
        return "transformer.wte", "lm_head"
    if isinstance(model, Llama) and model.cfg.tie_embeddings:
        return "tok_embeddings", "output"
    return None


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{head weight name: embedding weight name} when `model` (a whole model or a pipeline stage) holds the head of
    a tied pair: the head is initialised, saved and loaded as the embedding (a checkpoint holds the matrix once,
    and a last pipeline stage's copy of it starts and resumes equal to the first stage's embedding).

    Example:
        >>> tied_aliases(GPT(cfg))
        {'lm_head.weight': 'transformer.wte.weight'}
    """
    pair = tied_pair(model)
    return {f"{pair[1]}.weight": f"{pair[0]}.weight"} if pair and has_module(model, pair[1]) else {}


def apply_tp(model: torch.nn.Module, tp_mesh: Any, sp: bool, loss_parallel: bool) -> None:
    """Tensor (+ sequence) parallel in place; afterwards every parameter is a DTensor on `tp_mesh`."""
    from torch.distributed.tensor.parallel import parallelize_module

    top, blocks = tp_plan(model, sp, loss_parallel)
    top = {k: v for k, v in top.items() if has_module(model, k)}  # a pipeline stage may lack the embedding or the head
    parallelize_module(model, tp_mesh, top)
    for name, plan in blocks:
        if has_module(model, name):
            parallelize_module(model.get_submodule(name), tp_mesh, plan)
    pair = tied_pair(model)
    if pair and has_module(model, pair[0]) and has_module(model, pair[1]):
        # parallelize_module gave the embedding and the head a DTensor each: tie them again (both Shard(0) rows)
        model.get_submodule(pair[1]).weight = model.get_submodule(pair[0]).weight
    replicate_rest(model, tp_mesh)


def has_module(model: torch.nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


def replicate_rest(model: torch.nn.Module, tp_mesh: Any) -> None:
    """Make the parameters the plan left plain (GPT's position embedding; the norms without sequence parallel)
    Replicate DTensors, converting their modules' inputs and outputs, so that every parameter is a DTensor on
    one mesh: the optimizer's foreach kernels and the gradient norm cannot mix DTensors with plain tensors."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(_mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)  # fmt: skip

    def to_local(_mod, output, _mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)


# ---------------------------------------------------------------------------------------------------------------
# 2. activation checkpointing


def apply_ac(model: torch.nn.Module, mode: str) -> None:
    """Checkpoint each block: "full" recomputes the whole block in the backward pass; "selective" keeps the
    outputs of matmuls and attention (the costly ops) and recomputes the cheap ones (torchtitan's op-level SAC).
    Done by wrapping each block's forward, so parameter names (and checkpoints) do not change."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    if mode == "none":
        return
    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}  # fmt: skip

    def policy(_ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    def contexts():
        return create_selective_checkpoint_contexts(policy)

    for block in blocks_of(model):
        forward = block.forward
        kwargs = {"context_fn": contexts} if mode == "selective" else {}
        block.forward = functools.partial(checkpoint, forward, use_reentrant=False, preserve_rng_state=True, **kwargs)


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list((model.layers if isinstance(model, Llama) else model.transformer.h).values())


# ---------------------------------------------------------------------------------------------------------------
# 3. data parallel


def apply_fsdp(model: torch.nn.Module, dp_mesh: Any, dtype: torch.dtype, cpu_offload: bool, compiled: bool) -> None:
    """FSDP2 per block (one all-gather per block, overlapping the previous block's compute) and at the root (the
    embeddings, final norm and head); HSDP when `dp_mesh` is 2-D."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    options: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp}
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in blocks_of(model):
        if compiled:
            block.compile()
        fully_shard(block, **options)
    fully_shard(model, **options)


def parallelize(model: torch.nn.Module, cfg: TrainConfig, layout: Layout, mesh: Any, dtype: torch.dtype,
                compiled: bool) -> torch.nn.Module:  # fmt: skip
    """Apply TP/SP, activation checkpointing and FSDP2 to `model` (a whole model, or a pipeline stage) in place;
    returns it. DDP and torch.compile without FSDP stay with the trainer's wrap_model."""
    p = cfg.parallel
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], p.sequence_parallel, p.loss_parallel)
    apply_ac(model, p.activation_checkpoint)
    if layout.fsdp:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        apply_fsdp(model, dp_mesh, dtype, p.offload == "cpu", compiled)
    return model


# ---------------------------------------------------------------------------------------------------------------
# 4. materialising a model built on the meta device


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed of (run seed, parameter name), the same in every process (Python's hash() is not).

    Example:
        >>> parameter_seed(1337, "layers.0.attention.wq.weight") == parameter_seed(1337, "layers.0.attention.wq.weight")
        True
    """
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def shared_parameters(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module, str]]:
    """[(module, name, source module, source name)] for each parameter that is another module's (a tied head)."""
    seen: dict[int, tuple[torch.nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in seen:
                ties.append((module, name, *seen[id(param)]))
            elif param is not None:
                seen[id(param)] = (module, name)
    return ties


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device, seed: int, n_layer: int,
                aliases: dict[str, str] | None = None) -> None:  # fmt: skip
    """Allocate this rank's shards of a model built on the meta device (and already split, tensor-parallelized and
    sharded) on `device`, and initialise them: each parameter is drawn whole from a generator seeded by (seed, its
    name) and this rank keeps its slice, so that any layout starts from the weights one process would have.
    `aliases` maps a parameter name to the one whose weights it copies (a pipeline's tied head copy draws as the
    embedding). Costs one full-size parameter of memory at a time and every rank draws every parameter it holds a
    piece of (docs/training.md: what this costs at scale, and torchtitan's seed checkpoint instead).

    Example:
        >>> with torch.device("meta"):
        ...     model = Llama(cfg)
        >>> materialize(model, torch.device("cpu"), seed=1337, n_layer=cfg.n_layer)
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    from corpusforge.train.model import init_parameter

    ties = shared_parameters(model)
    model.to_empty(device=device)
    for module, name, source, source_name in ties:  # to_empty gives each module its own tensor: tie them again
        setattr(module, name, getattr(source, source_name))
    done: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in done:  # a tied head: drawn once, as the embedding (registered first)
                continue
            done.add(id(param))
            full_name = f"{module_name}.{name}" if module_name else name
            generator = torch.Generator(device=device)
            generator.manual_seed(parameter_seed(seed, (aliases or {}).get(full_name, full_name)))
            whole = torch.empty(param.shape, dtype=param.dtype, device=device)
            init_parameter(module, name, whole, n_layer, generator)
            if isinstance(param, DTensor):  # every rank holds `whole`: each slices its own shard, no communication
                whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param = param.to_local()
            param.copy_(whole)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()


# ---------------------------------------------------------------------------------------------------------------
# the gradient norm over every layout


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float, pp_group: Any = None) -> torch.Tensor:
    """Clip the global gradient norm of `params` to `max_norm` and return it, whatever mix of plain tensors and
    DTensors on different meshes the layout left, summed over the pipeline stages (each holds some parameters).
    Parameters flagged `_pp_tied_copy` (a tied head's copy on the last stage) count once, on the first stage."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None and not getattr(p, "_pp_tied_copy", False):
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    device = next((p.device for p in params), torch.device("cpu"))
    total_sq = torch.zeros((), device=device, dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    total = total_sq.sqrt()
    if max_norm < float("inf"):
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
    return total


# ---------------------------------------------------------------------------------------------------------------
# the layout in words (--dry-run)


def stages_of_rank(layout: Layout, pp_rank: int, schedule: str) -> list[int]:
    """The pipeline stages held by the rank at `pp_rank`: one; two looped (r, r + pp); or two in a V (r, 2pp-1-r)
    for ZB-V (torch.distributed.pipelining's stage placement)."""
    if layout.pp == 1:
        return [0]
    per_rank = MULTI_STAGE.get(schedule, 1)
    if schedule == "ZBVZeroBubble":
        return [pp_rank, 2 * layout.pp - 1 - pp_rank]
    return [pp_rank + i * layout.pp for i in range(per_rank)]


def rank_parameters(layout: Layout, mcfg: GPTConfig | LlamaConfig, stages: list[int], n_params: int) -> int:
    """Parameters a rank holds before FSDP sharding: its stages' share, divided by tp (norms, replicated, are
    counted as split: they are a rounding error)."""
    if layout.pp == 1:
        return n_params // layout.tp
    per_layer, first, last = stage_weights(mcfg)
    n_stages = len(layout.stage_layers)
    total = sum(len(layout.stage_layers[s]) * per_layer + (first if s == 0 else 0) + (last if s == n_stages - 1 else 0)
                for s in stages)  # fmt: skip
    return total // layout.tp


def describe_ranks(layout: Layout, mcfg: GPTConfig | LlamaConfig, schedule: str) -> list[dict[str, Any]]:
    """One row per rank: its mesh coordinates, the layers (and embedding/head) it holds, and which shard."""
    rows = []
    n_stages = max(1, len(layout.stage_layers))
    for rank in range(layout.world):
        c = layout.coords(rank)
        stages = stages_of_rank(layout, c["pp"], schedule)
        parts = []
        for s in stages:
            layers = layout.stage_layers[s] if layout.pp > 1 else tuple(range(mcfg.n_layer))
            extra = (["embedding"] if s == 0 else []) + (["norm+head"] if s == n_stages - 1 else [])
            parts.append(f"stage {s}: layers {layers[0]}-{layers[-1]}" + (f" + {' + '.join(extra)}" if extra else ""))
        shard = []
        if layout.tp > 1:
            shard.append(f"tp {c['tp']}/{layout.tp} of each layer's heads, MLP columns and vocabulary")
        if layout.fsdp and layout.dp_shard > 1:
            shard.append(f"FSDP shard {c['dp_shard']}/{layout.dp_shard} of parameters, grads, optimizer state")
        if layout.dp_replicate > 1:
            shard.append(f"replica {c['dp_replicate']}/{layout.dp_replicate}")
        rows.append({"rank": rank, **c, "dp_rank": layout.dp_rank(rank), "stages": stages, "holds": "; ".join(parts),
                     "shard": ", ".join(shard) or "whole model"})  # fmt: skip
    return rows
