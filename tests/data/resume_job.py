"""One rank of a training run's data side, in its own process: build the datasets, optionally load a loader state,
take some steps, save the tokens seen and the state. Used by test_loader.py to resume in a new process.

    python resume_job.py --corpora a,b,c --cache DIR --world 2 --rank 1 --steps 3 [--load S.json] \\
        --save S.json --out T.npy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from loader_data import build_blend  # noqa: E402

from corpusforge.data import make_loader  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpora", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--load")
    p.add_argument("--save", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    train, _, _ = build_blend(a.corpora.split(","), a.cache)
    loader = make_loader(train, a.mbs, a.rank, a.world, num_workers=a.workers)
    if a.load:
        loader.load_state_dict(json.loads(Path(a.load).read_text()))
    tokens = [batch["tokens"].numpy() for _, batch in zip(range(a.steps), loader)]
    np.save(a.out, np.stack(tokens))
    Path(a.save).write_text(json.dumps(loader.state_dict()))


if __name__ == "__main__":
    main()
