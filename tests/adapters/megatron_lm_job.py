"""Megatron-LM's data path on corpusforge's datasets, in its own process: the provider's datasets from Megatron-LM's
arguments, a torch DataLoader with Megatron's pretraining sampler from the checkpoint's consumed samples (as
build_pretraining_data_loader makes it), megatron-core's RerunDataIterator over it (as
build_train_valid_test_data_iterators wraps it) and get_batch_on_this_cp_rank; a "checkpoint" holding
consumed_train_samples (what Megatron-LM's checkpoint keeps of the data) every SAVE_EVERY steps.

    python megatron_lm_job.py --corpora A,B --cache DIR --out DIR [--block-after K] [--resume]

With --context-parallel N, under torchrun: megatron-core's parallel_state with context-parallel groups of N ranks
(on gloo; the world's other factor data-parallel), and each rank's get_batch_on_this_cp_rank slices of the first
batches, of corpusforge's datasets and of megatron-core's own, recorded side by side with the rank's data-parallel
and context-parallel rank; with --resume-at C, also corpusforge's from C consumed samples on (Megatron-LM's resume:
its sampler from the checkpoint's consumed_train_samples).

    torchrun --nproc-per-node 4 megatron_lm_job.py --context-parallel 2 --corpora A,B --cache DIR --out DIR
        [--resume-at C]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

from adapter_harness import (  # noqa: E402
    EOD,
    MBS,
    SAVE_EVERY,
    SEQ,
    STEPS,
    VOCAB,
    block_until_killed,
    job_arguments,
    rank_dir,
    record_step,
)


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
TP_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
"""What Megatron-LM's get_batch_on_this_tp_rank (megatron/training/utils.py, not in the package) takes of a batch,
before pretrain_gpt.py's get_batch slices it with get_batch_on_this_cp_rank (which cannot slice a blend's (B,)
dataset_id)."""


class Tokenizer:
    """The attributes megatron-core's GPTDataset reads from a tokenizer (pad only where given)."""

    def __init__(self, pad: int | None = None) -> None:
        self.eod, self.vocab_size = EOD, VOCAB
        if pad is not None:
            self.pad = pad
        self.unique_identifiers = {"class": "Tokenizer", "pad": pad}


def megatron_core_datasets(args: argparse.Namespace, sizes, tokenizer: Tokenizer, cache):
    """megatron-core's own (train, valid, test), configured as pretrain_gpt.py configures them from `args`."""
    from megatron.core.datasets import gpt_dataset as mgpt
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.utils import get_blend_from_list

    config = mgpt.GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=get_blend_from_list(args.data_path),
        split=args.split, path_to_cache=str(cache), tokenizer=tokenizer, reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )  # fmt: skip
    return BlendedMegatronDatasetBuilder(mgpt.GPTDataset, list(sizes), lambda: True, config).build()


def batches(dataset, consumed: int, micro_batch_size: int = MBS, rank: int = 0, world: int = 1, workers: int = 0,
            keys: tuple[str, ...] | None = None):  # fmt: skip
    """Megatron-LM's train iterator over `dataset` from `consumed` samples on (only `keys` of each batch, as
    get_batch_on_this_tp_rank takes them, where given)."""
    import torch
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.utils import get_batch_on_this_cp_rank

    from corpusforge.data import PretrainingBatchSampler

    sampler = PretrainingBatchSampler(len(dataset), consumed, micro_batch_size, rank, world)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers, pin_memory=False,
                                         persistent_workers=workers > 0)  # fmt: skip
    iterator = RerunDataIterator(iter(loader))
    for _ in range(len(sampler)):
        batch = next(iterator)
        if keys is not None:
            batch = {key: batch.get(key) for key in keys}
        yield get_batch_on_this_cp_rank(batch)


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


def context_parallel_main(argv: list[str]) -> None:
    """Each rank's context-parallel slices of its data-parallel rank's first STEPS batches, corpusforge's and
    megatron-core's, saved as rank-R/{ours,theirs}-STEP-KEY.npy (and corpusforge's after --resume-at samples as
    rank-R/resumed-STEP-KEY.npy, STEP counted on from the resume point), with rank-R/ranks.json: its dp and cp rank
    and sizes."""
    import numpy as np
    import torch.distributed as dist
    from megatron.core import parallel_state

    from corpusforge.adapters.megatron_lm import build_datasets_from_args
    from corpusforge.fsutil import save_npy_atomic

    p = job_arguments()
    p.add_argument("--context-parallel", type=int, required=True, help="context_parallel_size")
    p.add_argument("--resume-at", type=int, help="consumed_train_samples of a checkpoint to resume from too")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(context_parallel_size=a.context_parallel)
    args = megatron_args(a.corpora.split(","), a.cache, reset_position_ids=True, eod_mask_loss=True)
    sizes = [STEPS * MBS * parallel_state.get_data_parallel_world_size(), 0, 0]
    sides = {"ours": build_datasets_from_args(args, sizes, TOKENIZER)[0],
             "theirs": megatron_core_datasets(args, sizes, Tokenizer(), Path(a.cache) / "megatron")[0]}  # fmt: skip
    dp_rank, dp_world = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    ranks = {"dp_rank": dp_rank, "dp_size": dp_world, "cp_rank": parallel_state.get_context_parallel_rank(),
             "cp_size": parallel_state.get_context_parallel_world_size()}  # fmt: skip
    out = rank_dir(Path(a.out))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranks.json").write_text(json.dumps(ranks))
    runs = [(side, dataset, 0) for side, dataset in sides.items()]
    if a.resume_at is not None:
        runs.append(("resumed", sides["ours"], a.resume_at))
    for side, dataset, consumed in runs:
        first = consumed // (MBS * dp_world) + 1
        for step, batch in enumerate(batches(dataset, consumed, rank=dp_rank, world=dp_world, keys=TP_KEYS), first):
            for key, value in batch.items():
                if value is not None:  # no attention_mask unless asked
                    save_npy_atomic(out / f"{side}-{step:04d}-{key}.npy", np.asarray(value), durable=False)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    if "--context-parallel" in sys.argv:
        context_parallel_main(sys.argv[1:])
    else:
        main()
