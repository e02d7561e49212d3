"""corpusforge's loaders in Lightning: a tiny model for a few CPU steps, the loader's state in every checkpoint.

    python examples/adapters/lightning_datamodule.py [PREFIX]            # default: out/tiny_text_document
    python examples/adapters/lightning_datamodule.py [PREFIX] --resume   # after a kill: continues with the next batch
    torchrun --nproc-per-node 2 examples/adapters/lightning_datamodule.py [PREFIX] [--resume]   # 2 DDP ranks
                                                                    # (after a first run has tokenized the corpus)
    python examples/adapters/lightning_datamodule.py [PREFIX] --devices=2 [--resume]   # Lightning starts rank 1

Each rank trains its slice of every global batch, as corpusforge's own loader gives it; the checkpoint holds the
samples all ranks consumed, so it resumes at any number of ranks, continuing the same global order.

(Not named lightning.py: a script of that name, run directly, would be imported as the `lightning` package.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from corpusforge.adapters.lightning import CorpusforgeDataModule
from corpusforge.tokenizers import load_tokenizer

prefix = next((a for a in sys.argv[1:] if not a.startswith("--")), "out/tiny_text_document")
if not Path(prefix + ".idx").exists():  # the bundled example, tokenized once
    from corpusforge.preprocess import PreprocessConfig, preprocess

    preprocess(
        PreprocessConfig(inputs=("examples/tiny-corpus.jsonl.zst",), output_prefix=prefix[: -len("_text_document")])
    )

tokenizer = load_tokenizer("cl100k_base")  # what preprocess tokenized with
steps, micro_batch = 10, 4


class TinyLM(pl.LightningModule):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab_size, 32), torch.nn.Linear(32, vocab_size)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["tokens"].long()))  # (B, S, V)
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].long().flatten(),
                                                   reduction="none")  # fmt: skip
        loss = (losses * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum()
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# torchrun's processes (Lightning's DDP strategy joins their process group), or --devices=N that Lightning starts
devices = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--devices=")), None)
ranks = devices or int(os.environ.get("WORLD_SIZE", 1))
# enough samples for 2 ranks; the same dataset at any number of ranks, so that a checkpoint resumes at another one
data = CorpusforgeDataModule(prefix, seq_length=64, micro_batch_size=micro_batch, split="99,1,0",
                             num_samples=(steps * micro_batch * 2, 8, 0), cache_dir="out/cache", num_workers=2,
                             eod_token_id=tokenizer.eod_id)  # fmt: skip
checkpoints = ModelCheckpoint(dirpath="out/lightning", every_n_train_steps=5, save_last=True)
trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=ranks, strategy="ddp" if ranks > 1 else "auto",
                     logger=False, callbacks=[checkpoints], limit_val_batches=0)  # fmt: skip
trainer.fit(TinyLM(tokenizer.vocab_size), datamodule=data, ckpt_path="last" if "--resume" in sys.argv else None)
