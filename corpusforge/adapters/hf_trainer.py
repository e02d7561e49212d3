"""corpusforge's samples as a dataset the Hugging Face `transformers.Trainer` takes, resuming exactly.

Each sample is {input_ids, labels, shift_labels, position_ids}, all int64 (S,): input_ids are corpusforge's
tokens; labels are its labels (the next tokens, already shifted) with -100 where its loss_mask is 0. Handing the
model `shift_labels` makes transformers' causal-LM loss use them as they are (loss/loss_utils.py: ForCausalLMLoss)
instead of shifting `labels` once more, so every one of the S targets is trained, as in Megatron; the Trainer counts
the loss's tokens from `shift_labels` too. A micro-batch is read with one gather (`__getitems__`), whose rows
`collate_rows` (the Trainer's data_collator) hands back as the batch tensors they were cut from, without the copy
transformers' default collator makes of every field.

The Trainer must read the samples in order (the dataset's own shuffle index already randomised them) and hand
`shift_labels` to the model; TRAINING_ARGUMENTS says how, and check_training_arguments refuses anything else.
With these, data-parallel ranks take the micro-batches Megatron's sampler would give them: the Trainer's sequential
sampler batched, and accelerate's BatchSamplerShard handing micro-batch k to rank k % world (a global batch of
micro_batch_size x world consecutive samples, rank r taking the r-th slice; with drop_last, the last incomplete
global batch is dropped, not filled from the start). A resume from a Trainer checkpoint skips global_step x
gradient_accumulation_steps micro-batches on every rank (accelerate's skip_first_batches replays the sampler's ids
without reading their samples), then continues with the next global batch. accelerate's `split_batches` (a batch of
per_device_train_batch_size cut into the ranks' slices) gives the same samples and resumes so too, with or without
`dispatch_batches` (rank 0 reads and broadcasts); `dispatch_batches` alone does not resume so and is refused.

That skip is counted in this run's micro-batches, so it lands on the samples trained only when a step takes as many
samples as the checkpoint's did (per_device_train_batch_size x gradient_accumulation_steps x ranks); at another
number of ranks with the same per-step count it continues the global order exactly (2 ranks x 2 -> 1 rank x 4),
otherwise it would silently repeat or skip samples, since the Trainer keeps no count of them. LoaderStateCallback
keeps corpusforge's loader state (the samples consumed, the seed, the data's fingerprint) in every checkpoint and
refuses such a resume, or one over other data, in one line before the first step.

Example:
    >>> train, _, _ = build_gpt_datasets("out/a_text_document", 1024, num_samples=(8000, 0, 0), cache_dir="cache/")
    >>> args = TrainingArguments("run/", per_device_train_batch_size=8, max_steps=1000, **TRAINING_ARGUMENTS)
    >>> check_training_arguments(args)
    >>> Trainer(model=model, args=args, train_dataset=TrainerSamples(train), data_collator=collate_rows,
    ...         callbacks=[LoaderStateCallback()]).train(resume_from_checkpoint=resume)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from corpusforge.data import LoaderStateError, make_loader
from corpusforge.errors import ArgumentError, MissingExtraError

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError:
    raise MissingExtraError(
        "corpusforge.adapters.hf_trainer needs transformers: pip install 'corpusforge[adapters]'"
    ) from None

IGNORE_INDEX = -100  # transformers' and torch's cross-entropy ignore_index

TRAINING_ARGUMENTS: dict[str, Any] = {
    "train_sampling_strategy": "sequential",  # corpusforge's order; a random sampler would reshuffle it
    "remove_unused_columns": False,  # else the Trainer drops shift_labels: not a named argument of forward()
    "dataloader_drop_last": True,  # Megatron's sampler drops a last partial batch too
    "ignore_data_skip": False,  # else a resume trains again from the first sample
}
"""TrainingArguments options the Trainer needs to give corpusforge's samples in corpusforge's order."""


def check_training_arguments(args: Any) -> None:
    """Refuse TrainingArguments under which the Trainer would not give corpusforge's samples, or would not resume
    on the sample after the last one trained, in one line naming the option to set.

    accelerate's `split_batches` and `dispatch_batches` keep corpusforge's order (rank r takes the r-th slice of each
    global batch of consecutive samples), but a resume skips global_step x gradient_accumulation_steps batches of
    the loader accelerate wraps: one a step with split_batches (a global batch) or without either option (each
    rank's shard), 1 of the `world` a step that `dispatch_batches` alone concatenates on rank 0, so such a resume
    would train samples again (run: accelerate 1.15, 2 ranks, samples 8-15 again after step 4). That one is refused.

    Example:
        >>> check_training_arguments(TrainingArguments("run/", **TRAINING_ARGUMENTS))
    """
    wrong = [f"{k}={v!r}" for k, v in TRAINING_ARGUMENTS.items() if getattr(args, k, v) != v]
    if wrong:
        raise ArgumentError(f"TrainingArguments: set {', '.join(wrong)} (hf_trainer.TRAINING_ARGUMENTS) for the "
                            "Trainer to train on corpusforge's samples in their order")  # fmt: skip
    config, world = getattr(args, "accelerator_config", None), getattr(args, "world_size", 1)
    if getattr(config, "dispatch_batches", None) and not getattr(config, "split_batches", False) and world > 1:
        batch = args.per_device_train_batch_size
        raise ArgumentError(
            f"TrainingArguments: accelerator_config dispatch_batches=True without split_batches under {world} ranks "
            f"would resume from a checkpoint on samples already trained (rank 0 reads {world} batches a step, "
            "accelerate's resume skips 1 a step); set split_batches=True too, with per_device_train_batch_size "
            f"{batch * world} (the global batch, cut into the ranks' {batch}), or leave dispatch_batches unset"
        )


class TrainerSamples:
    """A map-style dataset of corpusforge's samples in the fields a transformers causal LM takes.

    Example:
        >>> samples = TrainerSamples(train)
        >>> sorted(samples[0])
        ['input_ids', 'labels', 'position_ids', 'shift_labels']
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, ids: Sequence[int]) -> list[dict[str, Any]]:
        """Samples `ids` read with one gather, one dict per sample (views of the batch's tensors, which
        collate_rows hands back as they are)."""
        from corpusforge.adapters.sample_rows import sample_rows, widened_targets

        batch = self.dataset.get_batch(np.asarray(ids, dtype=np.int64))
        fields = (batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids"))
        input_ids, targets, positions = widened_targets(*fields, ignore_index=IGNORE_INDEX)
        fields = {"input_ids": input_ids, "labels": targets, "shift_labels": targets, "position_ids": positions}
        return sample_rows(fields)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        return dict(self.__getitems__([i % len(self)])[0])


def collate_rows(features: list[dict[str, Any]]) -> dict[str, Any]:
    """The Trainer's data_collator for TrainerSamples: where `features` are the rows of one `__getitems__` call, in
    order, the (B, S) tensors they are views of (no copy); anything else goes to transformers'
    default_data_collator, which stacks (copies) each field.

    Example:
        >>> batch = collate_rows(TrainerSamples(train).__getitems__([0, 1]))
        >>> batch["input_ids"].shape
        torch.Size([2, 1024])
    """
    from corpusforge.adapters.sample_rows import whole_batch

    batch = whole_batch(features)
    if batch is not None:
        return batch
    from transformers import default_data_collator

    return default_data_collator(features)


class LoaderStateCallback(TrainerCallback, ExportableState):
    """corpusforge's loader state in the Trainer's checkpoints (trainer_state.json, as an ExportableState callback),
    checked when a run resumes: a checkpoint of other data, or one whose steps took another number of samples than
    this run's (the Trainer would skip its own count of micro-batches, not the samples trained), is refused in one
    line naming the checkpoint and the fix, before the first step, as are TrainingArguments that
    check_training_arguments refuses. Needs train_dataset=TrainerSamples(...).

    Example:
        >>> trainer = Trainer(..., train_dataset=TrainerSamples(train), callbacks=[LoaderStateCallback()])
        >>> trainer.train(resume_from_checkpoint="run/checkpoint-400")   # saved by 8 ranks, resumed by 4: refused
        LoaderStateError: resume_from_checkpoint: checkpoint-400 consumed 25600 samples in 400 steps, 64 a step; a step
        here takes 32 (per_device_train_batch_size 8 x gradient_accumulation_steps 1 x 4 ranks), ...
    """

    def __init__(self, loader_state: dict[str, Any] | None = None) -> None:
        self.loader_state = loader_state  # the loader's state_dict at the last step trained
        self.samples_per_step = 0

    def state(self) -> dict[str, Any]:
        return {"args": {"loader_state": self.loader_state}, "attributes": {}}

    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        samples = getattr(train_dataloader, "dataset", None)
        if not isinstance(samples, TrainerSamples):
            raise ArgumentError(f"LoaderStateCallback keeps the state of TrainerSamples; the Trainer's train_dataset "
                                f"is a {type(samples).__name__}: pass TrainerSamples(dataset)")  # fmt: skip
        check_training_arguments(args)  # also where the user did not call it: refused before the first step
        self.samples_per_step = samples_per_step(args)
        loader = make_loader(samples.dataset, 1)  # only for its state: the fingerprint, seed and count
        saved = _saved_loader_state(state, type(self).__name__)
        if state.global_step > 0 and saved is not None:
            where = f"resume_from_checkpoint: checkpoint-{state.global_step}"
            try:
                loader.load_state_dict(saved)
            except LoaderStateError as e:
                raise LoaderStateError(f"{where}: {e}") from None
            check_samples_per_step(where, loader.consumed_samples, state.global_step, args)
        elif state.global_step > 0:  # a checkpoint saved without this callback: trust the Trainer's count
            loader.consumed_samples = state.global_step * self.samples_per_step
        self.loader_state = loader.state_dict()
        # transformers looks our entry up by name when it saves; a checkpoint saved without this callback has none
        state.stateful_callbacks[type(self).__name__] = self.state()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.loader_state["consumed_samples"] += self.samples_per_step


def check_samples_per_step(where: str, consumed: int, global_step: int, args: Any) -> None:
    """Refuse a resume at `global_step` after `consumed` samples where the Trainer's skip (global_step steps of this
    run's size) would not land on them, naming what to set.

    Example:
        >>> check_samples_per_step("checkpoint-4", 16, 4, TrainingArguments("run/", per_device_train_batch_size=4))
    """
    per_step = samples_per_step(args)
    if consumed == global_step * per_step:
        return
    theirs = f"{consumed // global_step} a step" if consumed % global_step == 0 else "a varying number a step"
    raise LoaderStateError(
        f"{where} consumed {consumed} samples in {global_step} steps, {theirs}; a step here takes {per_step} "
        f"(per_device_train_batch_size {args.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{args.gradient_accumulation_steps} x {args.world_size} ranks), so the Trainer would resume after sample "
        f"{global_step * per_step}, not {consumed}: set those three to make {consumed // max(1, global_step)} a step, "
        "as the checkpoint's run did"
    )


def samples_per_step(args: Any) -> int:
    """Samples one optimizer step of the Trainer takes, over all data-parallel ranks: each rank's batch, unless
    accelerate's split_batches cuts one batch into the ranks' parts.

    Example:
        >>> samples_per_step(TrainingArguments("run/", per_device_train_batch_size=4, gradient_accumulation_steps=2))
        8
    """
    split = getattr(getattr(args, "accelerator_config", None), "split_batches", False)
    return args.train_batch_size * args.gradient_accumulation_steps * (1 if split else args.world_size)


def _saved_loader_state(state: Any, name: str) -> dict[str, Any] | None:
    saved = (state.stateful_callbacks or {}).get(name)
    if isinstance(saved, list):  # transformers keeps a list when several callbacks of one class were passed
        saved = saved[-1]
    return (saved or {}).get("args", {}).get("loader_state")
