"""Several machines: under torchrun or srun every rank runs the same cases, rank 0 gathers and reports.

torchrun sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. srun sets SLURM_PROCID and SLURM_STEP_NUM_TASKS
for the tasks of a job step; MASTER_ADDR and MASTER_PORT must be exported in the job script, as for any torch
job under Slurm. SLURM_NTASKS is not used: a batch script (`sbatch -n 8`) sees SLURM_NTASKS=8 and SLURM_PROCID=0
in its single process, so `corpusforge bench-io` run there directly, without srun, is one rank, not rank 0 of 8
waiting for seven that never come. The collectives are torch.distributed's gloo backend on CPU: no GPU, no NCCL,
small pickled objects only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from corpusforge.errors import MissingExtraError
from corpusforge.iobench.config import BenchConfigError


def launch_env(env: Mapping[str, str]) -> tuple[str, int, int]:
    """(launcher, rank, world) from the environment: "torchrun", "srun", or "single" (one rank).

    >>> launch_env({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"})
    ('srun', 1, 2)
    >>> launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"})  # a batch script, not a step started by srun
    ('single', 0, 1)
    """
    if env.get("WORLD_SIZE"):  # torchrun, also when torchrun itself was started by srun
        return "torchrun", int(env.get("RANK") or 0), int(env["WORLD_SIZE"])
    if env.get("SLURM_STEP_NUM_TASKS"):
        return "srun", int(env.get("SLURM_PROCID") or 0), int(env["SLURM_STEP_NUM_TASKS"])
    return "single", 0, 1


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    group: Any = None  # torch.distributed, once initialised
    launcher: str = "single"  # single | torchrun | srun

    @classmethod
    def detect(cls) -> Ranks:
        """The ranks of this run, with the process group joined when there is more than one.

        >>> Ranks.detect().world  # a plain shell: one rank
        1
        """
        env = os.environ
        launcher, rank, world = launch_env(env)
        if world <= 1:
            return cls(launcher=launcher)
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise BenchConfigError(
                f"running as rank {rank} of {world} ({launcher}) but {' and '.join(missing)} not set; "
                "start with torchrun, or export MASTER_ADDR (the first node) and MASTER_PORT in the srun script"
            )
        try:
            import torch.distributed as dist
        except ImportError:
            raise MissingExtraError("bench-io across ranks needs torch: pip install torch") from None
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world)
        return cls(rank, world, dist, launcher)

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
