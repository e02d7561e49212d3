"""A torchtitan data side in its own processes: CorpusforgeDataLoader built as torchtitan's trainer builds it, saved
and loaded by torchtitan's own CheckpointManager (DCP) with a model, optimizer and LR scheduler beside it. Run by
test_adapter_torchtitan.py under `torchrun --nproc-per-node=2` (gloo), or alone for one rank.

    save:   take --steps batches, checkpoint after --save-at of them (folder ckpt/main); again where dp rank 1 took
            one batch more before the checkpoint (ckpt/skewed: a rank a batch behind, as torchft #309 heals one);
            write each rank's inputs and labels (rank{r}.npz), then SIGKILL itself, as a preempted job dies.
    resume: load ckpt/main (and ckpt/skewed at the saved dp size), take --steps batches after it, write them.

    torchrun --nproc-per-node=2 titan_checkpoint_job.py save --data DIR --work W --mbs 2 --steps 6 --save-at 3
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

sys.path.insert(0, str(Path(__file__).resolve().parent))

from titan_grain_data import blend_config  # noqa: E402

from corpusforge.adapters.torchtitan import CorpusforgeDataLoader  # noqa: E402
from corpusforge.fsutil import atomic_write  # noqa: E402


class TrainState(Stateful):
    """The trainer's own entry of the checkpoint (torchtitan's Trainer saves its step the same way)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def checkpointer(dataloader, folder: Path, state: TrainState, interval: int):
    """torchtitan's CheckpointManager over a tiny model, its optimizer and scheduler, and the dataloader."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizers = default_adamw(lr=1e-3, implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=100)
    config = CheckpointManager.Config(enable=True, folder=folder.name, interval=interval, keep_latest_k=0)
    return config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                        lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None,
                        base_folder=str(folder.parent))  # fmt: skip


def build(a, dp_rank: int, dp_world: int, **changes) -> CorpusforgeDataLoader:
    config = CorpusforgeDataLoader.Config(**{**blend_config(a.data), **changes})
    # the keyword arguments torchtitan's Trainer passes (torchtitan/trainer.py, "build dataloader")
    return config.build(dp_world_size=dp_world, dp_rank=dp_rank, tokenizer=None, seq_len=32,
                        local_batch_size=a.mbs, snapshot_every_n_steps=None)  # fmt: skip


def take(it, n: int) -> list:
    return [next(it) for _ in range(n)]


def arrays(batches: list) -> dict[str, np.ndarray]:
    return {"input": np.stack([b[0]["input"].numpy() for b in batches]),
            "labels": np.stack([b[1].numpy() for b in batches])}  # fmt: skip


def save(a, rank: int, world: int) -> None:
    work = Path(a.work)
    state = TrainState()
    loader = build(a, rank, world)
    ckpt = checkpointer(loader, work / "main", state, a.save_at)
    it = iter(loader)
    seen = take(it, a.save_at)
    state.step = a.save_at
    ckpt.save(curr_step=a.save_at)  # synchronous DCP: written when it returns
    seen += take(it, a.steps - a.save_at)
    ckpt.close()
    skewed = build(a, rank, world)
    ckpt = checkpointer(skewed, work / "skewed", state, a.save_at)
    it = iter(skewed)
    take(it, a.save_at + (1 if rank == 1 else 0))
    ckpt.save(curr_step=a.save_at)
    ckpt.close()
    with atomic_write(work / f"rank{rank}.npz") as f:
        np.savez(f, **arrays(seen))
    if dist.is_initialized():
        dist.barrier()  # every rank's file is written before any rank dies
    os.kill(os.getpid(), signal.SIGKILL)


def resume(a, rank: int, world: int) -> None:
    work, out = Path(a.work), {}
    for name in ("main", "skewed") if world == a.saved_world else ("main",):
        state = TrainState()
        loader = build(a, rank, world)
        ckpt = checkpointer(loader, work / name, state, a.save_at)
        ckpt.load()
        assert state.step == a.save_at, state.step
        for key, value in arrays(take(iter(loader), a.steps)).items():
            out[f"{name}_{key}"] = value
        ckpt.close()
    with atomic_write(work / f"resumed{world}_rank{rank}.npz") as f:
        np.savez(f, **out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "resume"])
    p.add_argument("--data", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, required=True)
    p.add_argument("--saved-world", type=int, default=2)
    a = p.parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    (save if a.mode == "save" else resume)(a, rank, world)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
