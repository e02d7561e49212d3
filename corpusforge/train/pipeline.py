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
from corpusforge.train.parallel import Layout, has_module, stages_of_rank, tied_pair


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
            module = part.get_submodule(name) if has_module(part, name) else None
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


class SchedulePerShape:
    """One schedule per micro-batch shape, built on first use over the same stage modules.

    torch's stages infer the shapes of the activations they pass at their first step and keep them, while a
    curriculum's length phase (data.curriculum) changes the batch from (B, S) to (B * S / L, L) mid-run, and
    validation may read at another length than training does then. Each shape seen gets its own schedule (a few
    shape-inference messages between the stages, once); the parameters, and so the gradients, are the same modules'.

    Example:
        >>> schedules = SchedulePerShape(lambda: build_schedule(parts, layout, "1F1B", group, device, loss_fn))
        >>> schedules.of(batch["tokens"].shape).step(batch["tokens"], target=targets, losses=losses)
    """

    def __init__(self, build: Callable[[], Any]) -> None:
        self.build, self.schedules = build, {}

    def of(self, shape: torch.Size | tuple[int, ...]) -> Any:
        key = tuple(shape)
        if key not in self.schedules:
            self.schedules[key] = self.build()
        return self.schedules[key]


# ---------------------------------------------------------------------------------------------------------------
# the optimizers of a rank that holds stages


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
    if pair and not has_module(part, pair[0]) and has_module(part, pair[1]):
        return f"{pair[0]}.weight", f"{pair[1]}.weight"
    return None
