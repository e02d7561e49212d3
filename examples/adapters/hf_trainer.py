"""corpusforge's samples in the Hugging Face Trainer: a tiny Llama for a few CPU steps, resumable.

    python examples/adapters/hf_trainer.py [PREFIX]             # default: out/tiny_text_document
    python examples/adapters/hf_trainer.py [PREFIX] --resume    # after a kill: continues with the next batch
    torchrun --nproc-per-node 2 examples/adapters/hf_trainer.py [PREFIX] [--resume]   # 2 data-parallel ranks
                                                                  # (after a first run has tokenized the corpus)

The Trainer takes corpusforge's samples in corpusforge's order (TRAINING_ARGUMENTS) and trains all S next-token
targets of each (shift_labels); each data-parallel rank takes its slice of every global batch, as corpusforge's own
loader gives it; resume_from_checkpoint skips exactly the samples trained. LoaderStateCallback keeps corpusforge's
loader state in the checkpoint and refuses a resume that would not continue the global order (other data, or a step
of another number of samples: per_device_train_batch_size x gradient_accumulation_steps x ranks).
dataloader_num_workers and accelerator_config={"split_batches": True} (with or without "dispatch_batches") keep both;
"dispatch_batches" alone over several ranks would resume on samples already trained, and is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from corpusforge.adapters.hf_trainer import (
    TRAINING_ARGUMENTS,
    LoaderStateCallback,
    TrainerSamples,
    check_training_arguments,
    collate_rows,
)
from corpusforge.data import build_gpt_datasets
from corpusforge.tokenizers import load_tokenizer

prefix = next((a for a in sys.argv[1:] if not a.startswith("--")), "out/tiny_text_document")
if not Path(prefix + ".idx").exists():  # the bundled example, tokenized once
    from corpusforge.preprocess import PreprocessConfig, preprocess

    preprocess(
        PreprocessConfig(inputs=("examples/tiny-corpus.jsonl.zst",), output_prefix=prefix[: -len("_text_document")])
    )

tokenizer = load_tokenizer("cl100k_base")  # what preprocess tokenized with
steps, micro_batch = 10, 4
# enough samples for 2 ranks; the same dataset at any number of ranks, so that a checkpoint resumes at another one
train, _, _ = build_gpt_datasets(prefix, seq_length=64, split="99,1,0", num_samples=(steps * micro_batch * 2, 8, 0),
                                 cache_dir="out/cache", eod_token_id=tokenizer.eod_id)  # fmt: skip
config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
model = LlamaForCausalLM(config)
args = TrainingArguments("out/hf-trainer", per_device_train_batch_size=micro_batch, max_steps=steps, save_steps=5,
                         logging_steps=5, use_cpu=True, report_to=[], **TRAINING_ARGUMENTS)  # fmt: skip
check_training_arguments(args)
trainer = Trainer(model=model, args=args, train_dataset=TrainerSamples(train), data_collator=collate_rows,
                  callbacks=[LoaderStateCallback()])  # fmt: skip
trainer.train(resume_from_checkpoint="--resume" in sys.argv)
