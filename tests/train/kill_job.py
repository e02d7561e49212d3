"""A training run whose second checkpoint stops half-way, so that a test can SIGKILL it mid-save.

python kill_job.py OVERRIDES...: trains with checkpoint_interval=10; in the save of step 20, once DCP has written
the shards and .metadata into the `.tmp-` directory, the writer thread prints "SAVING" on stdout and waits forever
instead of publishing (trainer.pt, meta.json, rename). Only the timing is staged; the kill is real.
The training log goes to stderr: stdout carries the marker alone, because a print from the writer thread could
land inside a log line that the training thread is printing (print writes the text and its newline separately),
and a test waiting for a whole "SAVING" line would then wait for ever.
"""

from __future__ import annotations

import os
import sys
import time

import corpusforge.train.checkpoint as ckpt
from corpusforge.train import load_config, train

real_publish = ckpt.publish


def hang_before_publishing(tmp, final, trainer, meta):
    if tmp.name == ".tmp-step_00000020":
        os.write(sys.stdout.fileno(), b"SAVING\n")  # one write(2): a whole line
        while True:
            time.sleep(1)
    return real_publish(tmp, final, trainer, meta)


ckpt.publish = hang_before_publishing
train(load_config(None, sys.argv[1:]), log=lambda line: print(line, file=sys.stderr, flush=True))
