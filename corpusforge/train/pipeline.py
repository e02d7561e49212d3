"""Pipeline parallelism: the model cut into stages along its layers, run by a torch.distributed.pipelining schedule.

Each rank keeps a copy of the whole model with the layers of other stages deleted (torchtitan's
pipeline_module_split): a stage's parameters keep the whole model's names, so checkpoints line up across layouts.
The first stage keeps the embedding(s), the last the final norm and the head; the others have them set to None
and pass hidden states (B, T/tp, C) on. Each stage is then parallelized (TP, activation checkpointing, FSDP2) like
a whole model.

A tied embedding and head (GPT-2, Llama 3.2 1B/3B) live on two stages at once: the first stage's embedding and a
copy on the last stage. As in Megatron-LM (its "embedding group"), the two copies start equal and their gradients
are summed across the two stages before every optimizer step, so they stay equal; the copy is left out of the
gradient norm so that it counts once.

Loss scaling: every micro-batch's loss is divided by (micro-batches x gradient-accumulation steps) inside the loss
function, and the schedule's own scaling is off, so that gradients accumulate over several schedule steps exactly
as one process accumulates them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from corpusforge.train.llama import Llama
from corpusforge.train.model import GPT
from corpusforge.train.parallel import Layout, stages_of_rank, tied_pair


def cut_stage(model: GPT | Llama, layers: tuple[int, ...], first: bool, last: bool) -> GPT | Llama:
    """A copy of `model` holding only `layers` (their names unchanged), the embeddings if `first`, the norm and
    head if `last`."""
    stage = copy.deepcopy(model)
    blocks = stage.layers if isinstance(stage, Llama) else stage.transformer.h
    for name in list(blocks):
        if int(name) not in layers:
            del blocks[name]
    if isinstance(stage, Llama):
        if not first:
            stage.tok_embeddings = None
        if not last:
            stage.norm, stage.output = None, None
    else:
        if not first:
            stage.transformer.wte, stage.transformer.wpe, stage.transformer.drop = None, None, None
        if not last:
            stage.transformer.ln_f, stage.lm_head = None, None
    return stage


def mark_tied_copy(part: torch.nn.Module) -> None:
    """Flag a last stage's copy of the tied embedding so that the gradient norm counts it once. Called after the
    stage is parallelized: TP and FSDP replace the parameters, and a flag set before would be lost."""
    names = _tied_names(part)
    if names:
        part.get_submodule(names[1].removesuffix(".weight")).weight._pp_tied_copy = True


def split_model(model: GPT | Llama, layout: Layout, pp_rank: int, schedule: str) -> list[tuple[int, GPT | Llama]]:
    """[(stage index, stage module)] of the rank at pipeline position `pp_rank`."""
    n = len(layout.stage_layers)
    return [(s, cut_stage(model, layout.stage_layers[s], s == 0, s == n - 1))
            for s in stages_of_rank(layout, pp_rank, schedule)]  # fmt: skip


def tied_group(layout: Layout, rank: int, model: torch.nn.Module) -> Any:
    """The process group of the ranks holding the first and the last stage with this rank's dp and tp coordinates
    (Megatron's embedding group), or None for an untied model. Every rank must call it (new_group is collective)."""
    import torch.distributed as dist

    if tied_pair(model) is None:
        return None
    mine = None
    rest = layout.world // layout.pp  # ranks per pipeline position; pp is the outermost mesh dimension
    for offset in range(rest):
        ranks = [offset, (layout.pp - 1) * rest + offset]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def sync_tied_grads(parts: list[torch.nn.Module], group: Any) -> None:
    """Sum the gradients of the tied embedding (first stage) and its head copy (last stage)."""
    import torch.distributed as dist

    if group is None:
        return
    for part in parts:
        pair = tied_pair(part)
        for name in pair or ():
            module = part.get_submodule(name) if _has(part, name) else None
            if module is not None and module.weight.grad is not None:
                weight, grad = module.weight, module.weight.grad
                if hasattr(grad, "to_local"):
                    if grad.placements != weight.placements:  # DTensor does not promise the weight's layout
                        grad = grad.redistribute(weight.device_mesh, weight.placements)
                        weight.grad = grad
                    dist.all_reduce(grad.to_local(), group=group)  # the local shard, in place
                else:
                    dist.all_reduce(grad, group=group)
                break  # a stage holds one of the two (never both: the schedules here put them on two ranks)


def _has(model: torch.nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False


def build_schedule(parts: list[tuple[int, torch.nn.Module]], layout: Layout, name: str, pp_group: Any,
                   device: torch.device, loss_fn: Callable) -> Any:  # fmt: skip
    """The named schedule over this rank's stages; `loss_fn(logits, targets)` already carries the scaling."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    n_stages = len(layout.stage_layers)
    stages = [PipelineStage(module, s, n_stages, device, group=pp_group) for s, module in parts]
    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=layout.microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=layout.microbatches, loss_fn=loss_fn, scale_grads=False)


# ---------------------------------------------------------------------------------------------------------------
# optimizers and checkpoints of a rank that holds stages


class Optimizers:
    """One optimizer per stage this rank holds (so that each one's state is keyed by its stage's parameter names,
    which are the whole model's), stepped as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def _tied_names(part: torch.nn.Module) -> tuple[str, str] | None:
    """(embedding weight name, head weight name) when `part` holds the tied head's copy without the embedding."""
    pair = tied_pair(part)
    if pair and not _has(part, pair[0]) and _has(part, pair[1]):
        return f"{pair[0]}.weight", f"{pair[1]}.weight"
    return None


def full_state(parts: list[torch.nn.Module], optimizers: Optimizers, gather_group: Any, rank: int) -> tuple:
    """(model, optimizer) full state dicts of the whole model on rank 0 (empty elsewhere), in the same form as a
    run without pipelining writes (checkpoint.full_state), so a checkpoint moves between layouts. Collective: each
    stage's ranks gather their stage, then one rank per stage sends it to rank 0 over `gather_group`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {"state": {}, "param_groups": []}
    for part, opt in zip(parts, optimizers.optimizers):
        model_sd.update({k: v.detach().cpu() for k, v in get_model_state_dict(part, options=options).items()})
        osd = get_optimizer_state_dict(part, opt, options=options)
        copy_name = (_tied_names(part) or (None, None))[1]
        for name, state in osd["state"].items():
            if name != copy_name:  # the tied copy's state is the embedding's, saved by the first stage
                optim_sd["state"][name] = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in state.items()}
        _merge_groups(optim_sd["param_groups"], osd["param_groups"], drop=copy_name)
    if gather_group is None:  # not a rank that speaks for its stage
        return {}, {}
    gathered: list[Any] = [None] * dist.get_world_size(gather_group) if rank == 0 else None
    dist.gather_object((model_sd, optim_sd), gathered, dst=0, group=gather_group)
    if rank != 0:
        return {}, {}
    model_all: dict[str, Any] = {}
    optim_all: dict[str, Any] = {"state": {}, "param_groups": []}
    for m, o in gathered:
        model_all.update(m)
        optim_all["state"].update(o["state"])
        _merge_groups(optim_all["param_groups"], o["param_groups"])
    return model_all, optim_all


def _merge_groups(into: list[dict], groups: list[dict], drop: str | None = None) -> None:
    """Param groups of several stages' optimizers as one optimizer's: the same hyperparameters, the names joined."""
    for i, group in enumerate(groups):
        names = [n for n in group["params"] if n != drop]
        if i < len(into):
            into[i]["params"].extend(names)
        else:
            into.append({**group, "params": names})


def load_state(parts: list[torch.nn.Module], optimizers: Optimizers, model_sd: dict, optim_sd: dict) -> None:
    """Load a full checkpoint (of any layout) into this rank's stages: each takes its parameters' entries."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    for part, opt in zip(parts, optimizers.optimizers):
        names = set(part.state_dict())
        set_model_state_dict(part, {k: v for k, v in model_sd.items() if k in names}, options=options)
        tied = _tied_names(part)
        state = {k: v for k, v in optim_sd["state"].items() if k in names}
        if tied:
            state[tied[1]] = optim_sd["state"][tied[0]]
        groups = []
        for group in optim_sd["param_groups"]:
            mine = [n for n in group["params"] if n in names]
            if tied and tied[0] in group["params"]:
                mine.append(tied[1])
            groups.append({**group, "params": mine})
        set_optimizer_state_dict(part, opt, {"state": state, "param_groups": groups}, options=options)


def gather_group(layout: Layout, rank: int) -> Any:
    """The group of the ranks that speak for their stage when saving (dp and tp coordinates all 0, one per
    pipeline position, rank 0 among them), or None for the others. Every rank must call it."""
    import torch.distributed as dist

    rest = layout.world // layout.pp
    ranks = [p * rest for p in range(layout.pp)]
    group = dist.new_group(ranks)
    return group if rank in ranks else None
