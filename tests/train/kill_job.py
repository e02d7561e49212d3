"""A training run whose second checkpoint write stops half-way, so that a test can SIGKILL it mid-save.

python kill_job.py OVERRIDES...: trains with checkpoint_interval=10; in the save of step 20 the writer thread
writes model.pt, prints "SAVING" and waits forever. Only the timing is staged; the kill is real.
"""

from __future__ import annotations

import sys
import time

import corpusforge.train.checkpoint as ckpt
from corpusforge.train import load_config, train

real_write = ckpt._write_file


def write_then_hang(path, obj):
    real_write(path, obj)
    if path.parent.name == ".tmp-step_00000020":
        print("SAVING", flush=True)
        while True:
            time.sleep(1)


ckpt._write_file = write_then_hang
train(load_config(None, sys.argv[1:]), log=lambda line: print(line, flush=True))
