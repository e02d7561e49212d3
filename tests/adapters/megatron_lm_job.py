"""Megatron-LM's data path on corpusforge's datasets, in its own process: the provider's datasets from Megatron-LM's
arguments, a torch DataLoader with Megatron's pretraining sampler from the checkpoint's consumed samples (as
build_pretraining_data_loader makes it), megatron-core's RerunDataIterator over it (as
build_train_valid_test_data_iterators wraps it) and get_batch_on_this_cp_rank; a "checkpoint" holding
consumed_train_samples (what Megatron-LM's checkpoint keeps of the data) every SAVE_EVERY steps.

    python megatron_lm_job.py --corpora A,B --cache DIR --out DIR [--block-after K] [--resume]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

from adapter_harness import EOD, MBS, SAVE_EVERY, SEQ, STEPS, block_until_killed, job_arguments, record_step  # noqa: E402


def megatron_args(corpora: list[str], cache: str, **changes) -> argparse.Namespace:
    """The data arguments pretrain_gpt.py reads, with Megatron-LM's defaults (megatron/training/arguments.py) and
    --data-path in its WEIGHT PREFIX order."""
    args = argparse.Namespace(
        data_path=["0.6", corpora[0], "0.4", corpora[1]], split="1", seq_length=SEQ, seed=5, data_cache_path=cache,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask_in_dataloader=True, mid_level_dataset_surplus=0.005, mock_data=False, sft=False,
        fim_data=False, per_split_data_args_path=None, train_data_path=None, valid_data_path=None,
        test_data_path=None, data_args_path=None, per_dataset_sequences_path=None, multiple_validation_sets=False,
        hybrid_context_parallel=False, dataloader_inter_document_masking=False,
    )  # fmt: skip
    for key, value in changes.items():
        setattr(args, key, value)
    return args


TOKENIZER = SimpleNamespace(eod=EOD)  # what the provider reads of Megatron's tokenizer (no pad: megatron-core's -1)


def batches(dataset, consumed: int, micro_batch_size: int = MBS, rank: int = 0, world: int = 1, workers: int = 0):
    """Megatron-LM's train iterator over `dataset` from `consumed` samples on."""
    import torch
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_batch_on_this_cp_rank

    from corpusforge.data import PretrainingBatchSampler

    sampler = PretrainingBatchSampler(len(dataset), consumed, micro_batch_size, rank, world)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers, pin_memory=False,
                                         persistent_workers=workers > 0)  # fmt: skip
    iterator = RerunDataIterator(iter(loader))
    for _ in range(len(sampler)):
        yield get_batch_on_this_cp_rank(next(iterator))


def main(argv: list[str] | None = None) -> None:
    p = job_arguments()
    a = p.parse_args(argv)

    from corpusforge.adapters.megatron_lm import build_datasets_from_args
    from corpusforge.fsutil import write_json_atomic

    out, checkpoint = Path(a.out), Path(a.out) / "checkpoint.json"
    consumed = json.loads(checkpoint.read_text())["consumed_train_samples"] if a.resume else 0
    train, _, _ = build_datasets_from_args(megatron_args(a.corpora.split(","), a.cache), [STEPS * MBS, 0, 0], TOKENIZER)
    step = consumed // MBS
    for batch in batches(train, consumed):
        step += 1
        record_step(out, step, batch["tokens"].numpy())
        consumed += MBS  # args.consumed_train_samples after the step
        if step % SAVE_EVERY == 0:
            write_json_atomic(checkpoint, {"iteration": step, "consumed_train_samples": consumed})
            if step == a.block_after:
                block_until_killed(out / "checkpointed")
        if step == STEPS:
            break


if __name__ == "__main__":
    main()
