"""corpusforge's datasets in Megatron-LM: replace one function of pretrain_gpt.py.

In Megatron-LM's pretrain_gpt.py, replace train_valid_test_datasets_provider with:

    from corpusforge.adapters.megatron_lm import build_datasets_from_args

    def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
        return build_datasets_from_args(get_args(), train_val_test_num_samples, tokenizer=get_tokenizer(),
            is_built_on_rank=partial(is_dataset_built_on_rank, vp_stage=vp_stage))

Everything else (--data-path, --split, --seq-length, --seed, --data-cache-path, the mask options, the samplers,
resuming from consumed_train_samples) stays Megatron-LM's. What follows runs the same function here, without
Megatron-LM, on the bundled example: the arguments Megatron-LM would parse, then batches as its loader makes them.

    python examples/adapters/megatron_lm_provider.py [PREFIX]     # default: out/tiny_text_document
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from corpusforge.adapters.megatron_lm import build_datasets_from_args
from corpusforge.data import PretrainingBatchSampler
from corpusforge.tokenizers import load_tokenizer

prefix = sys.argv[1] if len(sys.argv) > 1 else "out/tiny_text_document"
if not Path(prefix + ".idx").exists():  # the bundled example, tokenized once
    from corpusforge.preprocess import PreprocessConfig, preprocess

    preprocess(
        PreprocessConfig(inputs=("examples/tiny-corpus.jsonl.zst",), output_prefix=prefix[: -len("_text_document")])
    )

args = argparse.Namespace(  # what pretrain_gpt.py reads of Megatron-LM's arguments, with its defaults
    data_path=[prefix], split="969,30,1", seq_length=128, seed=1234, data_cache_path="out/cache",
    reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    create_attention_mask_in_dataloader=True, mid_level_dataset_surplus=0.005,
)  # fmt: skip
tokenizer = argparse.Namespace(eod=load_tokenizer("cl100k_base").eod_id)  # Megatron's get_tokenizer() there
train, valid, test = build_datasets_from_args(args, [1000, 100, 10], tokenizer)
print({name: len(ds) for name, ds in zip(("train", "valid", "test"), (train, valid, test)) if ds is not None})

# build_pretraining_data_loader's DataLoader for data-parallel rank 0 of 2, resumed after 8 samples
sampler = PretrainingBatchSampler(len(train), consumed_samples=8, micro_batch_size=4, dp_rank=0, dp_world_size=2)
batch = next(iter(torch.utils.data.DataLoader(train, batch_sampler=sampler)))
print({key: (str(value.dtype), tuple(value.shape)) for key, value in batch.items()})
