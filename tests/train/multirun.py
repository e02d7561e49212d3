"""Several training runs in one torchrun launch, one after another: `torchrun ... multirun.py RUNS.json`.

RUNS.json is a list of override lists (`key=value` strings, as `python -m corpusforge.train` takes them). The runs
share the launch's process group: train() joins it when it is not joined yet, and its teardown is held back to the
end here, because a process group created again in the same processes finds its sub-groups' names (counted from 1
again) already in torchrun's store, with the addresses of the groups just destroyed, and its first collective
hangs. Each run builds its own device mesh and groups, so a run starts as a fresh job's would, and a later run may
resume from an earlier one's checkpoint. Launching torchrun and importing torch in every process costs more than a
tiny run on a 2-core CI machine: the tests pay it once per process count, not once per run. The first failing run
ends the launch (its ranks' collectives could not go on).
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from corpusforge.train import load_config, train

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *args, **kwargs: None
    for overrides in runs:
        train(load_config(None, overrides))
    dist.barrier()
    destroy()
