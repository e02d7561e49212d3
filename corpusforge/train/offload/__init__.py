"""Where the optimizer state lives (parallel.offload): "none" (on the device), "cpu" (FSDP2's CPUOffloadPolicy,
applied by corpusforge.train.parallel) or "nvme" (files under parallel.offload_dir, streamed by each step).

    nvme_optimizer.py  NvmeAdamW: AdamW whose master weights and moments are files, read ahead and written behind
    state_files.py     the files' byte layout, O_DIRECT where the file system takes it, aligned host buffers
    placement.py       bytes per rank on the device, in host memory and on disk for each placement (--dry-run)

Example:
    >>> from corpusforge.train.offload import NvmeAdamW, placement_bytes
"""

from corpusforge.train.offload.nvme_optimizer import NvmeAdamW, offload_directory, plan_chunks
from corpusforge.train.offload.placement import check_offload_space, placement_bytes
from corpusforge.train.offload.state_files import OffloadError

__all__ = ["NvmeAdamW", "OffloadError", "check_offload_space", "offload_directory", "placement_bytes", "plan_chunks"]
