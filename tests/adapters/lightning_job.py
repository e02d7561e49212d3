"""A few CPU steps of a tiny model with the real lightning.Trainer on CorpusforgeDataModule, recording each step's
batch as training_step receives it and its loss (per rank); a checkpoint every SAVE_EVERY steps. Under torchrun,
each process is a rank of Lightning's DDP strategy on gloo; with --devices N, Lightning starts the N processes
itself (this command again, for ranks 1..N-1).

    python lightning_job.py --corpora A,B --cache DIR --out DIR [--block-after K] [--resume | --resume-from CKPT]
        [--workers N] [--devices N]
    torchrun --nproc-per-node 2 lightning_job.py --runs RUNS.json    (several runs, one after another)
    python lightning_job.py --runs RUNS.json --devices 2             (the same, Lightning starting rank 1)
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
    record_loss,
    record_step,
    run_in_turn,
)

SAMPLES = STEPS * MBS * 2  # enough for STEPS steps of 2 ranks


def data_module(corpora: list[str], cache: str, workers: int = 0):
    from corpusforge.adapters.lightning import CorpusforgeDataModule

    return CorpusforgeDataModule(blend_of(corpora), SEQ, MBS, split="1", seed=5, num_samples=(SAMPLES, 0, 0),
                                 cache_dir=cache, num_workers=workers, eod_token_id=0)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = job_arguments()
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--resume-from", help="a checkpoint of another run to resume from")
    p.add_argument("--devices", type=int, help="processes Lightning starts itself (strategy ddp); default: torchrun's")
    a = p.parse_args(argv)

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = Path(a.out)

    def mine(trainer) -> Path:  # where this rank records (known once Lightning has started its processes)
        return out if trainer.world_size == 1 else out / f"rank-{trainer.global_rank}"

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 16)
            self.head = torch.nn.Linear(16, VOCAB)

        def training_step(self, batch, batch_idx):
            record_step(mine(self.trainer), self.global_step + 1, batch["tokens"].numpy())
            logits = self.head(self.embed(batch["tokens"].long()))  # (B, S, V)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].long().flatten(),
                                                     reduction="none")  # fmt: skip
            loss = (loss * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum()
            record_loss(mine(self.trainer), self.global_step + 1, loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class BlockAfterCheckpoint(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            # the checkpoint after step K was written at the end of step K (its save ends in a barrier of all ranks);
            # the next batch is already fetched
            if trainer.global_step == a.block_after:
                block_until_killed(mine(trainer) / "checkpointed")

    world = a.devices or int(os.environ.get("WORLD_SIZE", 1))
    pl.seed_everything(0, verbose=False)
    checkpoints = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=SAVE_EVERY, save_top_k=-1, save_last=True)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                         logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[checkpoints, BlockAfterCheckpoint()])  # fmt: skip
    data = data_module(a.corpora.split(","), a.cache, a.workers)
    resume = a.resume_from or (str(out / "ckpt" / "last.ckpt") if a.resume else None)
    trainer.fit(Tiny(), datamodule=data, ckpt_path=resume)


if __name__ == "__main__":
    if "--runs" in sys.argv:
        run_in_turn(main, sys.argv[1:])
    else:
        main()
