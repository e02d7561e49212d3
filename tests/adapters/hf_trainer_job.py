"""A few CPU steps of a tiny Llama with the real transformers.Trainer on corpusforge's samples (TrainerSamples),
recording each step's batch as the model receives it (per rank), the ids each rank reads (in its DataLoader
workers too), and the logged loss; checkpoints every SAVE_EVERY steps. Under torchrun, each process is a
data-parallel rank (DDP on gloo).

    python hf_trainer_job.py --corpora A,B --cache DIR --out DIR [--block-after K] [--resume | --resume-from CKPT]
        [--batch B] [--workers N] [--accelerate split_batches,dispatch_batches] [--expect-refusal]
    torchrun --nproc-per-node 2 hf_trainer_job.py --runs RUNS.json    (several runs, one after another)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from adapter_harness import (  # noqa: E402
    MBS,
    SAVE_EVERY,
    SEQ,
    STEPS,
    VOCAB,
    blend_of,
    block_until_killed,
    job_arguments,
    rank_dir,
    record_loss,
    record_read,
    record_step,
    run_in_turn,
)

SAMPLES = STEPS * MBS * 2  # enough for STEPS steps of 2 ranks


def train_dataset(corpora: list[str], cache: str, seed: int = 5):
    from corpusforge.data import build_gpt_datasets

    train, _, _ = build_gpt_datasets(blend_of(corpora), SEQ, "1", seed, (SAMPLES, 0, 0), cache, eod_token_id=0)
    return train


def main(argv: list[str] | None = None) -> None:
    p = job_arguments()
    p.add_argument("--resume-from", help="a checkpoint directory of another run to resume from")
    p.add_argument("--batch", type=int, default=MBS, help="per_device_train_batch_size")
    p.add_argument("--seed", type=int, default=5, help="the dataset's")
    p.add_argument("--workers", type=int, default=0, help="dataloader_num_workers")
    p.add_argument("--accelerate", default="", help="accelerator_config options to set True, comma-separated")
    refusal = "write what check_training_arguments, then the Trainer (unchecked) refused to refusals.txt, a line each"
    p.add_argument("--expect-refusal", action="store_true", help=refusal)
    a = p.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from corpusforge.adapters.hf_trainer import (
        TRAINING_ARGUMENTS,
        LoaderStateCallback,
        TrainerSamples,
        check_training_arguments,
        collate_rows,
    )
    from corpusforge.errors import ArgumentError

    out = Path(a.out)
    mine = rank_dir(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)  # fmt: skip
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=a.batch, max_steps=STEPS, save_strategy="steps",
        save_steps=SAVE_EVERY, logging_steps=1, report_to=[], use_cpu=True, seed=0, learning_rate=1e-3,
        disable_tqdm=True, dataloader_num_workers=a.workers, **TRAINING_ARGUMENTS,
        accelerator_config={option: True for option in a.accelerate.split(",") if option},
    )  # fmt: skip
    refusals = []
    try:
        check_training_arguments(args)
    except ArgumentError as e:
        if not a.expect_refusal:
            raise
        refusals.append(str(e))

    class Record(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == a.block_after:
                block_until_killed(mine / "checkpointed")

    class Reads(TrainerSamples):  # the ids this rank reads (a resume must not read the trained ones)
        def __getitems__(self, ids):
            record_read(mine, ids)
            return super().__getitems__(ids)

    samples = Reads(train_dataset(a.corpora.split(","), a.cache, a.seed))
    trainer = Trainer(model=model, args=args, train_dataset=samples, data_collator=collate_rows,
                      callbacks=[Record(), LoaderStateCallback()])  # fmt: skip

    def record(module, args_, kwargs):  # the batch as the model gets it, at the step being trained
        batch = torch.stack([kwargs["input_ids"], kwargs["shift_labels"]])
        record_step(mine, trainer.state.global_step + 1, batch.numpy())

    def loss(module, args_, kwargs, output):  # this rank's loss on it, unrounded (the Trainer logs 4 digits)
        record_loss(mine, trainer.state.global_step + 1, output.loss.item())

    model.register_forward_pre_hook(record, with_kwargs=True)
    model.register_forward_hook(loss, with_kwargs=True)
    try:
        trainer.train(resume_from_checkpoint=a.resume_from or (True if a.resume else None))
    except ArgumentError as e:
        if not a.expect_refusal:
            raise
        refusals.append(str(e))
    if a.expect_refusal:
        mine.mkdir(parents=True, exist_ok=True)
        (mine / "refusals.txt").write_text("".join(f"{line}\n" for line in refusals))


if __name__ == "__main__":
    if "--runs" in sys.argv:
        run_in_turn(main, sys.argv[1:])
    else:
        main()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
