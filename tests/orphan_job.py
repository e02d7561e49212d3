"""A real corpusforge command whose worker processes stop inside their first task and wait there, so that a test
can SIGKILL the command while its workers are alive and busy (tests/test_orphans.py).

python orphan_job.py MARKERS KIND ARGS...: KIND names what the workers run (preprocess: a local executor's tasks;
neighbours: build-knn's neighbours stage; loader: the trainer's DataLoader workers); each worker touches
MARKERS/<pid> as it enters, then sleeps. Only the timing is staged; the command and the kill are real.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

markers, kind, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]


def busy(*_args, **_kwargs):
    (markers / str(os.getpid())).touch()
    while True:  # a worker inside a long task: torch's own watchdog looks at its parent only between batches
        time.sleep(1)


if kind == "loader":
    import corpusforge.data.loader as loader
    from corpusforge.train import load_config, train

    loader.RawBatches.__getitems__ = busy
    train(load_config(None, args), log=lambda line: print(line, file=sys.stderr, flush=True))
else:
    import corpusforge.preprocess
    import corpusforge.retro.neighbours
    from corpusforge.cli import main

    if kind == "preprocess":
        corpusforge.preprocess._run_task = busy
    elif kind == "neighbours":
        corpusforge.retro.neighbours.neighbours_range = busy
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    main(args)
