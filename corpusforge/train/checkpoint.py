"""Checkpoints: complete or absent, written while training goes on, resumed exactly.

Layout of `{out_dir}/checkpoints/step_{step:08d}/`, written by rank 0:

    model.pt      full (unsharded) model state dict, CPU tensors, keys as in GPT.state_dict()
    optimizer.pt  full optimizer state dict, keyed by parameter name (torch.distributed.checkpoint.state_dict)
    trainer.pt    {"step", "scheduler": {"step", "lr"}, "rng": [per rank: python, numpy, torch, cuda],
                   "loader": the train loader's state_dict (global: consumed samples, seed, data fingerprint)}
    meta.json     step, model shape, world size, seconds; written last

Atomic: everything is written into `.tmp-step_{step:08d}` beside the final directory, each file fsynced, then the
directory is renamed to its final name and the parent fsynced. A process killed mid-save leaves a `.tmp-*` that
is ignored and removed at the next start, and the previous checkpoint stays the latest.

Not stalling: `save()` takes a CPU copy of the state (collective for FSDP, a device-to-host copy on GPU, a clone
on CPU) and returns; a background thread writes the files. Only the copy stalls training; both times go to
metrics.jsonl ("checkpoint" records: stall_s, write_s). A further save or the end of the run waits for the
previous write first. Files are plain torch.save of tensors and built-in types, loaded with weights_only=True.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from corpusforge.errors import CorpusforgeError, PickleRefusedError, first_line, pickle_refused

PREFIX, TMP = "step_", ".tmp-"


class CheckpointError(CorpusforgeError, ValueError):
    """A checkpoint that cannot be resumed here: another model shape, missing files."""


# ---------------------------------------------------------------------------------------------------------------
# finding checkpoints


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (a directory counts once it has its final name and meta.json)."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def remove_partial(out_dir: str | Path) -> list[Path]:
    """Delete `.tmp-*` directories left by killed saves; returns what was removed."""
    root = checkpoint_root(out_dir)
    stale = [p for p in root.iterdir() if p.name.startswith(TMP)] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


# ---------------------------------------------------------------------------------------------------------------
# state pieces


def rng_state() -> dict[str, Any]:
    """This process's random generators, in types that weights_only loading accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _cpu_copy(obj: Any) -> Any:
    """A deep copy with every tensor on the CPU and detached from the live training state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) full state dicts on CPU, on rank 0 (other ranks get empty dicts). Collective under
    FSDP: every rank must call it. Works alike for a plain module, a DDP module's inner module and FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if next(model.parameters()).device.type != "cpu":
        return model_sd, optim_sd  # cpu_offload already copied them off the device
    return _cpu_copy(model_sd), _cpu_copy(optim_sd)  # on CPU they are the live tensors: snapshot them


def _write_file(path: Path, obj: Any) -> None:
    """torch.save then fsync, so that a rename after it publishes complete bytes."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(out_dir: str | Path, step: int, pieces: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write `pieces` ({"model": ..., "optimizer": ..., "trainer": ...}) as one atomic checkpoint directory."""
    root = checkpoint_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"{PREFIX}{step:08d}", root / f"{TMP}{PREFIX}{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, obj in pieces.items():
        _write_file(tmp / f"{name}.pt", obj)
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if final.exists():  # the same step saved again (a rerun): set the old one aside only now
        old = root / f"{TMP}old-{PREFIX}{step:08d}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def prune(out_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints."""
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# saving while training


class Checkpointer:
    """Saves from rank 0, in a background thread when `asynchronous`; one save in flight at a time.

    Example:
        >>> ckpt = Checkpointer("runs/a", rank=0, keep=2, asynchronous=True)
        >>> stall_s = ckpt.save(step, pieces, meta)     # returns once the state is copied
        >>> ckpt.wait()                                 # before exit: the write is complete, or its error raised
    """

    def __init__(self, out_dir: str | Path, rank: int, keep: int, asynchronous: bool) -> None:
        self.out_dir, self.rank, self.keep, self.asynchronous = Path(out_dir), rank, keep, asynchronous
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: dict[str, Any] | None = None  # {"step", "path", "write_s"} of the last finished write

    def save(self, step: int, pieces: dict[str, Any], meta: dict[str, Any]) -> None:
        """Write `pieces` (already CPU copies) for `step`; returns at once when asynchronous."""
        self.wait()
        if self.rank != 0:
            return
        if self.asynchronous:
            self._thread = threading.Thread(target=self._write, args=(step, pieces, meta), name="checkpoint")
            self._thread.start()
        else:
            self._write(step, pieces, meta)

    def _write(self, step: int, pieces: dict[str, Any], meta: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            path = write_checkpoint(self.out_dir, step, pieces, meta)
            prune(self.out_dir, self.keep)
            self.last = {"step": step, "path": str(path), "write_s": time.perf_counter() - t0}
        except BaseException as e:  # re-raised in the training thread by wait()
            self._error = e

    def wait(self) -> None:
        """Block until the write in flight is done; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint under {self.out_dir} failed: {error}") from error


# ---------------------------------------------------------------------------------------------------------------
# resuming


def load_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no meta.json); give a step_* directory")
    try:
        return json.loads((path / "meta.json").read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}/meta.json: not valid JSON ({e}); {_delete_hint(path)}") from None


def _delete_hint(path: Path) -> str:
    return f"delete {path} to resume from the checkpoint before it, or give a new out_dir"


def _torch_load(path: Path, mmap: bool = False) -> Any:
    """torch.load of a checkpoint file with weights_only=True; a file that holds other pickled objects (which
    could run code) or is not a torch.save archive (cut short, another format) is refused in one line naming it."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:1] == b"\x80":  # a bare pickle (protocol 2+), not torch.save's zip archive: never unpickled
        raise PickleRefusedError(pickle_refused(path, _delete_hint(path.parent)))
    if head != b"PK\x03\x04":  # torch.save writes a zip archive; torch.load would read anything else as a pickle
        raise CheckpointError(f"{path}: damaged, or not a torch.save archive; {_delete_hint(path.parent)}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:  # weights_only met a global other than tensors and built-in types
        raise PickleRefusedError(pickle_refused(path, _delete_hint(path.parent))) from None
    except (RuntimeError, EOFError, KeyError, OSError) as e:  # what torch.load raises for a damaged or foreign file
        if isinstance(e, OSError) and e.errno != errno.EINVAL:  # EINVAL: its zip reader on a cut archive
            raise
        why = first_line(e).split(". ")[0]  # torch's first sentence; the rest is advice for other programs
        raise CheckpointError(
            f"{path}: damaged, or not a torch.save archive ({why}); {_delete_hint(path.parent)}"
        ) from None


def check_compatible(path: str | Path, meta: dict[str, Any], model_shape: dict[str, int]) -> None:
    """Refuse a checkpoint of another model shape, naming each difference, before any state is loaded."""
    saved = meta.get("model_shape", {})
    diff = [f"{k}: checkpoint {saved.get(k)} != config {v}" for k, v in model_shape.items() if saved.get(k) != v]
    if diff:
        raise CheckpointError(
            f"{path}: the checkpoint is of another model shape ({'; '.join(diff)}); "
            f"resume with the config it was trained with, or set checkpoint.resume=never / another out_dir"
        )


# Config keys (dotted, as corpusforge.train.config.config_keys gives them; a section for all its keys) that say where
# and how a run reads, logs and saves, not what it computes: a difference in them never explains a loader state that
# no longer matches.
NOT_RUN_IDENTITY = frozenset(
    "out_dir checkpoint metrics schedule.stop_at_step data.num_workers data.cache_dir storage device compile".split()
)


def resume_refused(path: str | Path, saved_config: dict[str, Any], config: dict[str, Any], why: str) -> CheckpointError:
    """The error for a checkpoint whose data order (the loader's state) does not fit this run's configuration: which
    config keys differ (as saved, and now) and what to do; `why` (the loader's own differences) when no key does,
    since then the data itself changed.

    Example:
        >>> resume_refused("runs/a/checkpoints/step_00000020", {"max_steps": 40}, {"max_steps": 80}, "num_samples")
        CheckpointError('runs/a/checkpoints/step_00000020: cannot resume: this run was started with max_steps=40, ...
    """
    keys = sorted(k for k in set(saved_config) | set(config) if not {k, k.partition(".")[0]} & NOT_RUN_IDENTITY)
    differ = [k for k in keys if saved_config.get(k, "<unset>") != config.get(k, "<unset>")]
    if not saved_config:  # a checkpoint from before meta.json recorded the config
        return CheckpointError(
            f"{path}: cannot resume: its data order does not fit this configuration ({why}); rerun with the config "
            "it was started with, or give a new out_dir to start another run"
        )
    if not differ:
        return CheckpointError(
            f"{path}: cannot resume: the training data changed since this run was saved ({why}); restore the data "
            "it was started with, or give a new out_dir to start another run"
        )
    was = ", ".join(f"{k}={saved_config.get(k, '<unset>')!r}" for k in differ)
    now = ", ".join(f"{k}={config.get(k, '<unset>')!r}" for k in differ)
    return CheckpointError(
        f"{path}: cannot resume: this run was started with {was}, now {now}, which changes the data order; rerun with "
        f"the values it was started with, or give a new out_dir to start another run"
    )


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load model and optimizer state into `model`/`optimizer` (every rank reads the full files, memory-mapped,
    and keeps its shard under FSDP); returns the trainer state (step, scheduler, rng, loader)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    missing = [n for n in ("model.pt", "optimizer.pt", "trainer.pt") if not (path / n).is_file()]
    if missing:
        raise CheckpointError(f"{path}: missing {', '.join(missing)}")
    model_sd = _torch_load(path / "model.pt", mmap=True)
    optim_sd = _torch_load(path / "optimizer.pt", mmap=True)
    mine = model.state_dict()
    wrong = [
        f"{k}: {tuple(v.shape)} != {tuple(mine[k].shape)}"
        for k, v in model_sd.items()
        if k in mine and tuple(v.shape) != tuple(getattr(mine[k], "shape", v.shape))
    ]
    if wrong or set(model_sd) != set(mine):
        extra = sorted(set(model_sd) ^ set(mine))[:5]
        raise CheckpointError(f"{path}: parameters do not match this model: {'; '.join(wrong[:5])} {extra or ''}")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    return _torch_load(path / "trainer.pt")
