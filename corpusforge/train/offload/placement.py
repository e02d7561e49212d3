"""Bytes per rank on the device, in host memory and on disk for each placement of the parameters' state, as
`--dry-run` shows them, and the check that refuses an offload_dir too small before any work.

Per parameter value of a rank's shard (fp32 training, as the trainer's models are):
    none: device 16 B (weights 4, gradients 4, AdamW's two moments 8)
    cpu:  host 16 B (FSDP2's CPUOffloadPolicy keeps weights, gradients and moments there; the device holds one
          block's gathered weights at a time)
    nvme: device 8 B (weights, gradients), disk 12 B (master weights, two moments) and the step's host buffers
          (`buffers` sets of three `chunk_bytes` buffers)
Each parameter's run in the files is padded to 4 KiB, which is counted.

Example:
    >>> placement_bytes(1_000_000, [1_000_000])["nvme"]["disk"]
    12017664
"""

from __future__ import annotations

import shutil
from pathlib import Path

from corpusforge.sizes import human_bytes
from corpusforge.train.offload.state_files import HEADER, align

KINDS = 3  # master weights, exp_avg, exp_avg_sq


def placement_bytes(shard_values: int, param_numels: list[int] | None = None, chunk_bytes: int = 8 << 20,
                    buffers: int = 4) -> dict[str, dict[str, int]]:  # fmt: skip
    """{placement: {"device", "host", "disk"}} bytes of one rank holding `shard_values` parameter values;
    `param_numels` (this rank's parameters' sizes) makes the disk figure exact, padding included."""
    padded = sum(align(n) for n in param_numels) if param_numels else align(shard_values)
    disk = KINDS * (HEADER + padded * 4)
    return {
        "none": {"device": 16 * shard_values, "host": 0, "disk": 0},
        "cpu": {"device": 0, "host": 16 * shard_values, "disk": 0},
        "nvme": {"device": 8 * shard_values, "host": KINDS * buffers * chunk_bytes, "disk": disk},
    }


def check_offload_space(directory: str | Path, need: int) -> None:
    """Refuse (ConfigError) an offload_dir whose file system has less than `need` bytes free, naming it."""
    from corpusforge.train.config import ConfigError

    where = Path(directory)
    probe = where
    while not probe.exists() and probe != probe.parent:  # the directory is made at the start: ask its parent
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ConfigError(
            f"{where}: offload_dir has {human_bytes(free)} free, but the optimizer state of this node's ranks needs "
            f"{human_bytes(need)}; free space there or give parallel.offload_dir on a larger disk",
            ["parallel.offload_dir"],
        )
