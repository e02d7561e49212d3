"""A process's first samples come from numpy, before numba has started in it: the same fields as the kernel's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from corpusforge.data import build_gpt_datasets
from corpusforge.data.gpt_dataset import _gather, _gather_numpy
from corpusforge.storage import readwatch

OPTIONS = [
    {},
    {"eod_mask_loss": True, "reset_position_ids": True},
    {"pad_token_id": 7, "add_extra_token_to_sequence": False},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_numpy_gather_equals_the_kernel(corpora, tmp_path, options):
    for prefix in corpora[:2]:  # uint16 with empty documents, int32
        train = build_gpt_datasets(prefix, 64, "1", 1234, (300, 0, 0), tmp_path, eod_token_id=0, **options)[0]
        args = train._direct_args()
        slot = readwatch.slot_for(train._mapped_path)  # both mark their read there: one more, at the same offset
        ids = np.random.default_rng(0).integers(0, len(train), 40)
        for batch in (ids[:1], ids):
            ours, theirs = np.empty((2, 4, len(batch), 64), np.int32)
            reads = slot[readwatch.READS]
            assert _gather_numpy(batch, *args, ours, slot) == 0 and slot[readwatch.READS] == reads + 1
            where = slot[readwatch.OFFSET]
            assert _gather(batch, *args, theirs, slot) == 0 and slot[readwatch.READS] == reads + 2
            assert slot[readwatch.OFFSET] == where and slot[readwatch.START] == 0
            np.testing.assert_array_equal(ours, theirs)
        block = np.empty((4, 1, 64), np.int32)
        assert _gather_numpy(np.array([len(train)]), *args, block, slot) == -1


def test_first_sample_of_a_fresh_process_does_not_start_numba(corpora, tmp_path):
    """ds[0] .. ds[9] in a new interpreter: numba not started, and the same tensors as a process that has it."""
    code = f"""
import json, sys
from corpusforge import jit
from corpusforge.data import build_gpt_datasets
train = build_gpt_datasets({corpora[0]!r}, 64, "1", 1234, (300, 0, 0), {str(tmp_path / "fresh")!r}, eod_token_id=0)[0]
rows = [{{k: v.tolist() for k, v in train[i].items()}} for i in range(10)]
print(json.dumps({{"started": jit.started(), "rows": rows}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path.cwd())
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    assert fresh["started"] is False
    train = build_gpt_datasets(corpora[0], 64, "1", 1234, (300, 0, 0), tmp_path / "here", eod_token_id=0)[0]
    train.load_kernels()
    for i, row in enumerate(fresh["rows"]):
        assert row == {k: v.tolist() for k, v in train[i].items()}
