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
With these, data-parallel ranks take the micro-batches Megatron's sampler would give them (accelerate hands batch
k to rank k % world), and a resume from a Trainer checkpoint skips exactly the batches trained: the Trainer replays
the sampler's indices without reading their samples, then continues with the next batch.

Example:
    >>> train, _, _ = build_gpt_datasets("out/a_text_document", 1024, num_samples=(8000, 0, 0), cache_dir="cache/")
    >>> args = TrainingArguments("run/", per_device_train_batch_size=8, max_steps=1000, **TRAINING_ARGUMENTS)
    >>> check_training_arguments(args)
    >>> Trainer(model=model, args=args, train_dataset=TrainerSamples(train), data_collator=collate_rows).train()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from corpusforge.errors import ArgumentError

IGNORE_INDEX = -100  # transformers' and torch's cross-entropy ignore_index

TRAINING_ARGUMENTS: dict[str, Any] = {
    "train_sampling_strategy": "sequential",  # corpusforge's order; a random sampler would reshuffle it
    "remove_unused_columns": False,  # else the Trainer drops shift_labels: not a named argument of forward()
    "dataloader_drop_last": True,  # Megatron's sampler drops a last partial batch too
}
"""TrainingArguments options the Trainer needs to give corpusforge's samples in corpusforge's order."""


def check_training_arguments(args: Any) -> None:
    """Refuse TrainingArguments under which the Trainer would not give corpusforge's samples, in one line naming
    the option to set.

    Example:
        >>> check_training_arguments(TrainingArguments("run/", **TRAINING_ARGUMENTS))
    """
    wrong = [f"{k}={v!r}" for k, v in TRAINING_ARGUMENTS.items() if getattr(args, k, v) != v]
    if wrong:
        raise ArgumentError(f"TrainingArguments: set {', '.join(wrong)} (hf_trainer.TRAINING_ARGUMENTS) for the "
                            "Trainer to train on corpusforge's samples in their order")  # fmt: skip


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
