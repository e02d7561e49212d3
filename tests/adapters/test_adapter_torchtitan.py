"""The torchtitan adapter with the real torchtitan 0.3.0: built as its Trainer builds a dataloader, parsed by its own
ConfigManager from a config-registry function, saved and loaded by its own CheckpointManager (DCP) under a 2-rank
torchrun on gloo, killed and resumed; the batches are corpusforge's loader's, and resume continues exactly, at the
same data-parallel size and at others. What does not run here: torchtitan's Trainer itself (without an accelerator
its device falls back to "cuda": torchtitan/tools/utils.py, get_device_info)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from titan_checkpoint_job import TrainState, checkpointer  # noqa: E402
from titan_grain_data import blend_config, build_train, write_corpora  # noqa: E402
from trainkit import free_port  # noqa: E402

from corpusforge.adapters.torchtitan import CorpusforgeDataLoader  # noqa: E402
from corpusforge.data import LoaderStateError, make_loader  # noqa: E402

JOB = Path(__file__).resolve().parent / "titan_checkpoint_job.py"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "adapters"
MBS, STEPS, SAVE_AT = 2, 6, 3


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return write_corpora(tmp_path_factory.mktemp("titan") / "data")


def build(data: str, dp_rank: int, dp_world: int, mbs: int = MBS, **changes) -> CorpusforgeDataLoader:
    # the keyword arguments torchtitan's Trainer passes to config.dataloader.build (torchtitan/trainer.py)
    return CorpusforgeDataLoader.Config(**blend_config(data, **changes)).build(
        dp_world_size=dp_world, dp_rank=dp_rank, tokenizer=None, seq_len=32, local_batch_size=mbs,
        snapshot_every_n_steps=None)  # fmt: skip


def torchrun(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(JOB), *args]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert not check or done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("reset_position_ids", [False, True])
def test_batches_are_corpusforge_loaders(data, reset_position_ids):
    """Every rank's (inputs, labels) are its corpusforge micro-batches: int64 tokens, labels with IGNORE_INDEX where
    the loss mask is 0, positions (restarting at documents) when reset_position_ids is on."""
    train = build_train(data, reset_position_ids=reset_position_ids)
    masked = 0
    for rank in range(2):
        ours = list(build(data, rank, 2, reset_position_ids=reset_position_ids))
        theirs = list(make_loader(train, MBS, rank, 2))
        assert len(ours) == len(theirs) == 400 // (2 * MBS)
        for (inputs, labels), batch in zip(ours, theirs):
            assert inputs["input"].dtype == labels.dtype == torch.int64
            assert torch.equal(inputs["input"], batch["tokens"].long())
            assert torch.equal(labels, torch.where(batch["loss_mask"] > 0, batch["labels"].long(), -100))
            assert ("positions" in inputs) == reset_position_ids
            if reset_position_ids:
                assert torch.equal(inputs["positions"], batch["position_ids"].long())
            masked += int((labels == -100).sum())
    assert masked > 0  # the blend has end-of-document tokens: the masking was exercised


def test_batches_read_by_workers_are_the_same(data):
    """With DataLoader workers (which send the raw text, assembled into torchtitan's fields in this process)."""
    here = list(build(data, 1, 2, reset_position_ids=True))
    read_by_workers = list(build(data, 1, 2, reset_position_ids=True, num_workers=2))
    assert len(here) == len(read_by_workers) == 400 // (2 * MBS)
    for (inputs, labels), (theirs, their_labels) in zip(read_by_workers, here):
        assert list(inputs) == list(theirs) == ["input", "positions"] and torch.equal(labels, their_labels)
        assert all(inputs[k].dtype == torch.int64 and torch.equal(inputs[k], theirs[k]) for k in inputs)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> Path:
    """A 2-rank torchtitan checkpoint run SIGKILLed after saving, then resumed by a new 2-rank launch."""
    work = tmp_path_factory.mktemp("titan-runs")
    common = ["--data", data, "--work", str(work), "--mbs", str(MBS), "--save-at", str(SAVE_AT)]
    saved = torchrun(["save", *common, "--steps", str(STEPS)], check=False)
    assert saved.returncode != 0 and "Signal 9 (SIGKILL)" in saved.stderr, saved.stderr[-3000:]
    torchrun(["resume", *common, "--steps", str(STEPS - SAVE_AT)])
    return work


def reference(work: Path, rank: int) -> dict[str, np.ndarray]:
    return dict(np.load(work / f"rank{rank}.npz"))


@pytest.mark.slow
def test_killed_and_resumed_at_same_dp_continues_exactly(runs):
    """torchtitan's CheckpointManager saved the dataloader per its checkpoint; a new launch loads it and each rank's
    next batches are the ones the killed run took after the checkpoint. A rank that stood one batch ahead at the
    checkpoint (ckpt/skewed) continues from its own position."""
    for rank in range(2):
        ref, got = reference(runs, rank), dict(np.load(runs / f"resumed2_rank{rank}.npz"))
        assert np.array_equal(got["main_input"], ref["input"][SAVE_AT:])
        assert np.array_equal(got["main_labels"], ref["labels"][SAVE_AT:])
        ahead = 1 if rank == 1 else 0
        assert np.array_equal(got["skewed_input"][: STEPS - SAVE_AT - ahead], ref["input"][SAVE_AT + ahead :])


def resume_at(runs: Path, data: str, folder: str, dp_rank: int, dp_world: int, mbs: int, **changes):
    """Load the 2-rank checkpoint `folder` with torchtitan's CheckpointManager into one rank of another layout
    (in this process: DCP reads it without a process group) and return that rank's next batches."""
    state = TrainState()
    loader = build(data, dp_rank, dp_world, mbs, **changes)
    ckpt = checkpointer(loader, runs / folder, state, SAVE_AT)
    try:
        ckpt.load()
    finally:
        ckpt.close()
    assert state.step == SAVE_AT
    return [inputs["input"].numpy() for inputs, _ in loader]


@pytest.mark.slow
@pytest.mark.parametrize("dp_world", [1, 4])
def test_resume_at_another_dp_size_continues_the_global_order(runs, data, dp_world):
    """Saved by 2 ranks of 2 samples, resumed by 1 rank of 4 or 4 ranks of 1 (the same global batch): rank r's j-th
    batch is the r-th slice of the uninterrupted run's global batch SAVE_AT + j."""
    refs = [reference(runs, r)["input"][SAVE_AT:] for r in range(2)]
    expected = np.concatenate(refs, axis=1)  # (steps, 2 * MBS, S): the global batches after the checkpoint, in order
    mbs = 2 * MBS // dp_world
    for rank in range(dp_world):
        got = resume_at(runs, data, "main", rank, dp_world, mbs)
        assert np.array_equal(np.stack(got[: STEPS - SAVE_AT]), expected[:, rank * mbs : (rank + 1) * mbs])


@pytest.mark.slow
def test_resume_refused_in_one_line(runs, data):
    """Refused, before any batch: ranks at different positions resumed at another dp size, and a state of other data
    or options at any size (the loader says what differs)."""
    with pytest.raises(LoaderStateError) as e:
        resume_at(runs, data, "skewed", 0, 1, 2 * MBS)
    message = str(e.value)
    assert "\n" not in message and "resume with 2 data-parallel ranks" in message and "[12, 16]" in message
    with pytest.raises(LoaderStateError, match=r"seed: 7 != 1234") as e:
        resume_at(runs, data, "main", 0, 2, MBS, seed=7)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_torchtitan_config_manager_takes_the_example_config(data):
    """torchtitan's own ConfigManager loads the example's config-registry function and overrides its dataloader
    fields from the command line (a list as torchtitan writes one: comma-separated); the config builds the loader."""
    from torchtitan.config import ConfigManager
    from torchtitan.trainer import Trainer

    sys.path.insert(0, str(EXAMPLE))
    prefixes = blend_config(data)["blend"]
    args = ["--module", "torchtitan_dataloader", "--config", "llama3_corpusforge",
            "--dataloader.blend", ",".join(prefixes), "--dataloader.split", "90,8,2",
            "--dataloader.num_samples", "400", "--dataloader.seed", "1234",
            "--dataloader.cache_dir", str(Path(data) / "cache"), "--training.seq_len", "32"]  # fmt: skip
    config = ConfigManager().parse_args(args)
    assert isinstance(config, Trainer.Config) and isinstance(config.dataloader, CorpusforgeDataLoader.Config)
    assert config.dataloader.blend == prefixes and config.dataloader.num_samples == 400
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=config.training.seq_len,
                                     local_batch_size=4, snapshot_every_n_steps=None)  # fmt: skip
    train = build_train(data, eod_token_id=None, eod_mask_loss=False)
    first = next(iter(make_loader(train, 4)))
    assert torch.equal(next(iter(loader))[0]["input"], first["tokens"].long())
