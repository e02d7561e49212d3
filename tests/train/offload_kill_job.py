"""A parallel.offload="nvme" run that stops in the middle of an optimizer step, so that a test can SIGKILL it there.

python offload_kill_job.py STEP OVERRIDES...: trains; in the optimizer step that makes step STEP (1-based), once the
master-weights file's chunk is written and before the moments are, prints "MIDSTEP" on stdout and waits forever: the
files' headers then say a step is writing them, the master file is new, the moments old. Only the timing is staged;
the kill is real. The training log goes to stderr.
"""

from __future__ import annotations

import os
import sys
import time

from corpusforge.train import load_config, train
from corpusforge.train.offload import nvme_optimizer

STOP = int(sys.argv[1])
real_write = nvme_optimizer.NvmeAdamW._write


def write_then_hang(self, chunk, bufs, kinds):
    if self.generation == STOP - 1 and kinds == nvme_optimizer.KINDS:
        self.files["master"].write_from(bufs["master"].view[: chunk.length * 4], chunk.offset * 4)
        os.write(sys.stdout.fileno(), b"MIDSTEP\n")  # one write(2): a whole line
        while True:
            time.sleep(1)
    return real_write(self, chunk, bufs, kinds)


nvme_optimizer.NvmeAdamW._write = write_then_hang
train(load_config(None, sys.argv[2:]), log=lambda line: print(line, file=sys.stderr, flush=True))
