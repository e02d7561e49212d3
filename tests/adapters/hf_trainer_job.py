"""A few CPU steps of a tiny Llama with the real transformers.Trainer on corpusforge's samples (TrainerSamples),
recording each step's batch as the model receives it; checkpoints every SAVE_EVERY steps.

    python hf_trainer_job.py --corpora A,B --cache DIR --out DIR [--block-after K] [--resume]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from adapter_harness import MBS, SAVE_EVERY, SEQ, STEPS, VOCAB, blend_of, block_until_killed, job_arguments, record_step  # noqa: E402


def train_dataset(corpora: list[str], cache: str):
    from corpusforge.data import build_gpt_datasets

    train, _, _ = build_gpt_datasets(blend_of(corpora), SEQ, "1", 5, (STEPS * MBS, 0, 0), cache, eod_token_id=0)
    return train


def main(argv: list[str] | None = None) -> None:
    p = job_arguments()
    a = p.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from corpusforge.adapters.hf_trainer import (
        TRAINING_ARGUMENTS,
        TrainerSamples,
        check_training_arguments,
        collate_rows,
    )

    out = Path(a.out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)  # fmt: skip
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=MBS, max_steps=STEPS, save_strategy="steps",
        save_steps=SAVE_EVERY, logging_steps=1, report_to=[], use_cpu=True, seed=0, learning_rate=1e-3,
        disable_tqdm=True, **TRAINING_ARGUMENTS,
    )  # fmt: skip
    check_training_arguments(args)

    class Record(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == a.block_after:
                block_until_killed(out / "checkpointed")

    samples = TrainerSamples(train_dataset(a.corpora.split(","), a.cache))
    trainer = Trainer(model=model, args=args, train_dataset=samples, data_collator=collate_rows, callbacks=[Record()])

    def record(module, args_, kwargs):  # the batch as the model gets it, at the step being trained
        batch = torch.stack([kwargs["input_ids"], kwargs["shift_labels"]])
        record_step(out, trainer.state.global_step + 1, batch.numpy())

    model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train(resume_from_checkpoint=True if a.resume else None)


if __name__ == "__main__":
    main()
