"""Several machines: under torchrun or srun every rank runs the same cases, rank 0 gathers and reports.

torchrun sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; srun sets SLURM_PROCID / SLURM_NTASKS (then
MASTER_ADDR and MASTER_PORT must be exported, as for any torch job under Slurm). The collectives are
torch.distributed's gloo backend on CPU: no GPU, no NCCL, small pickled objects only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    group: Any = None  # torch.distributed, once initialised

    @classmethod
    def detect(cls) -> Ranks:
        env = os.environ
        world = int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1)
        if world <= 1:
            return cls()
        rank = int(env.get("RANK") or env.get("SLURM_PROCID") or 0)
        if "MASTER_ADDR" not in env:
            raise RuntimeError(
                f"running as rank {rank} of {world} but MASTER_ADDR/MASTER_PORT are not set; "
                "start with torchrun, or export them in the srun script"
            )
        try:
            import torch.distributed as dist
        except ImportError:
            raise RuntimeError("bench-io across ranks needs torch: pip install torch") from None
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world)
        return cls(rank, world, dist)

    def barrier(self) -> None:
        if self.group is not None:
            self.group.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` on rank 0 (in rank order); other ranks get []."""
        if self.group is None:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        self.group.gather_object(obj, out, dst=0)
        return out or []

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        self.group.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.group is not None and self.group.is_initialized():
            self.group.destroy_process_group()
