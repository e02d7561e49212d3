"""Checkpoints: sharded (every rank writes its own pieces), complete or absent, written while training goes on,
resumed exactly into any layout.

Layout of `{out_dir}/checkpoints/step_{step:08d}/`:

    __{rank}_0.distcp  each rank's shards of the model and optimizer state (torch.distributed.checkpoint, DCP)
    .metadata          DCP's index: every tensor's global shape and which file holds which chunk of it
    trainer.pt         rank 0: {"step", "scheduler": {"step", "lr"}, "rng": [per rank: python, numpy, torch, cuda],
                       "loader": the train loader's state_dict (global: consumed samples, seed, data fingerprint)}
    meta.json          step, model shape, world size, config; written last

The DCP state holds `model.{name}` and `optim.state.{name}.{exp_avg,exp_avg_sq,step}` (tensors only), `name` being
the parameter's name in the whole model whatever the layout: a pipeline stage's layers keep their global names
(`layers.7.attention.wq.weight`), a tensor-parallel or FSDP shard is a chunk of the global tensor, and a tied head
is saved once, as its embedding. So a run saved at tp=2 x pp=2 resumes at dp=4 or in one process: DCP reads each
rank's chunks from whichever files hold them. The optimizer's hyperparameters are not saved: they come from the
config (the learning rate is set every step).

Atomic: every rank writes into `.tmp-step_{step:08d}` beside the final directory (DCP fsyncs each file, and rank 0
writes `.metadata` only once every rank has written its shards), then rank 0 adds trainer.pt and meta.json, renames
the directory to its final name and fsyncs the parent. A process killed mid-save leaves a `.tmp-*` that is ignored
and removed at the next start, and the previous checkpoint stays the latest.

Not stalling: `save()` stages a CPU copy of this rank's shards (dcp.async_save) and returns; a background thread
writes them (its collectives on a gloo group of their own). Only the copy stalls training; both times go to
metrics.jsonl ("checkpoint_stall" records: stall_s, of which wait_s for the previous write and stage_s for the copy;
"checkpoint": write_s). A further save or the end of the run waits for the previous write first. The copy lands in
host buffers allocated at the first save and reused by every later one, pinned on a GPU (checkpoint_staging.py).

Failing in one line: a save first checks that the file system has room for the checkpoint's tensors; a write that
fails all the same (a disk that fills meanwhile) is found at the first step after it ended (`Checkpointer.check`,
agreed by every rank), one CheckpointError naming the checkpoints directory and the step, its `.tmp-` removed.

Untrusted files: no pickle runs code. trainer.pt is loaded with weights_only=True; DCP's `.metadata` is a pickle,
read with an unpickler that builds DCP's own metadata classes and nothing else. Checkpoints of corpusforge before
sharded saves (a full-state model.pt) are refused with the command that converts them (`convert_full_state`).
"""

from __future__ import annotations

import errno
import json
import pickle
import random
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from corpusforge.errors import CorpusforgeError, PickleRefusedError, first_line, pickle_refused
from corpusforge.fsutil import atomic_write, fsync_dir, write_json_atomic
from corpusforge.sizes import human_bytes
from corpusforge.train.checkpoint_staging import PinnedStager
from corpusforge.train.parallel import tied_aliases

PREFIX, TMP = "step_", ".tmp-"
# What DCP writes per saved tensor beyond its bytes: the torch.save archive around it in the .distcp file (~1.5 KiB)
# and its entry in .metadata (~0.2 KiB), measured with torch 2.13; it matters only for small models.
ENTRY_BYTES = 2048

# DCP warns on every save and load by one process that it assumes one process: that is the intent here
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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


def _pairs(model: torch.nn.Module, optimizer: Any) -> list[tuple[torch.nn.Module, Any]]:
    """[(module, its optimizer)]: one pair, or one per pipeline stage (pipeline.Optimizers holds one per stage)."""
    if hasattr(optimizer, "optimizers"):
        return list(zip(model, optimizer.optimizers, strict=True))
    return [(model, optimizer)]


def _saved_name(key: str, aliases: dict[str, str]) -> str:
    """The name a state entry is saved under: a tied head's (`lm_head.weight`, `state.lm_head.weight.exp_avg`) is
    its embedding's."""
    for head, embedding in aliases.items():
        if key == head or key.startswith(f"state.{head}."):
            return key.replace(head, embedding, 1)
    return key


class ShardedState:
    """This rank's model and optimizer state in DCP's terms: `flat` maps the saved names (`model.{name}`,
    `optim.state.{name}.{key}`, layout-free) to this rank's tensors (DTensor shards under TP/FSDP); `parts` keeps the
    state dicts of torch.distributed.checkpoint.state_dict per module, whose tensors `flat` shares, to be set back
    into the modules after a load. Not collective: no rank gathers anything.

    Example:
        >>> state = ShardedState.of(model, optimizer)
        >>> sorted(state.flat)[:2]
        ['model.layers.0.attention.wq.weight', 'model.layers.0.attention_norm.weight']
    """

    def __init__(self, parts: list[tuple[torch.nn.Module, Any, dict, dict]], flat: dict[str, torch.Tensor]) -> None:
        self.parts, self.flat = parts, flat

    @classmethod
    def of(cls, model: torch.nn.Module, optimizer: Any, with_optimizer: bool = True) -> ShardedState:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        parts, flat = [], {}
        for module, opt in _pairs(model, optimizer):
            if with_optimizer:
                model_sd, optim_sd = get_state_dict(module, opt, options=options)
            else:
                model_sd, optim_sd = get_model_state_dict(module, options=options), {}
            aliases = tied_aliases(module)
            for prefix, sd in (("model", model_sd), ("optim", optim_sd)):
                for key, value in sd.items():
                    if torch.is_tensor(value):  # the optimizer's hyperparameters come from the config
                        flat.setdefault(f"{prefix}.{_saved_name(key, aliases)}", value)  # a tie: once
            parts.append((module, opt, model_sd, optim_sd))
        return cls(parts, flat)

    @property
    def nbytes(self) -> int:
        """Bytes of the saved tensors at their global size (a DTensor's whole tensor, not this rank's shard)."""
        return sum(v.numel() * v.element_size() for v in self.flat.values())

    def set_back(self) -> None:
        """Put the loaded tensors (DCP loads in place into `flat`) back into the modules and optimizers."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for module, opt, model_sd, optim_sd in self.parts:
            aliases = tied_aliases(module)
            for sd, prefix in ((model_sd, "model"), (optim_sd, "optim")):
                for key in sd:
                    name = f"{prefix}.{_saved_name(key, aliases)}"
                    if name in self.flat and sd[key] is not self.flat[name]:  # a tied head: its embedding's tensor
                        sd[key] = self.flat[name]
            if opt is None:
                set_model_state_dict(module, model_sd, options=options)
            else:
                set_state_dict(module, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)


def _dcp_kwargs(group: Any) -> dict[str, Any]:
    """DCP's process arguments: `group` when distributed, else a save or load by this process alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return {"process_group": group}
    return {"no_dist": True}


def publish(tmp: Path, final: Path, trainer: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Complete the checkpoint in `tmp` (every rank's shards and DCP's .metadata written) with trainer.pt and
    meta.json, and rename it to `final` (the same step saved again by a rerun: the old one set aside only now)."""
    with atomic_write(tmp / "trainer.pt") as f:
        torch.save(trainer, f)
    write_json_atomic(tmp / "meta.json", meta)
    fsync_dir(tmp)
    root, old = final.parent, None
    if final.exists():
        old = root / f"{TMP}old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def prune(out_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints."""
    for old in list_checkpoints(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# saving while training


class _MarkedShardWriter(FileSystemWriter):
    """DCP's file writer, marking in `flight` when this rank writes its own shards: a watchdog then tells a rank stuck
    in its write from one waiting for the others' (both sit in the same wait)."""

    def __init__(self, path: Path, flight: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.flight = flight

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.flight["shards_since"] = time.monotonic()
        try:
            return super().write_data(plan, planner)  # writes (and fsyncs) before it returns its done future
        finally:
            self.flight["shards_since"] = None


def _alone(check: Any, here: bool = True) -> Any:
    """agree() of one process: the check's outcome is already everyone's."""
    return check() if here else None


class Checkpointer:
    """Every rank writes its shards (dcp.async_save when `asynchronous`, on a background thread); rank 0 completes
    and publishes the directory once all are written. One save in flight at a time. Every rank must construct it
    (the gloo group for the background collectives is created here) and call save(), check() and close() at the
    same points: with `agree` (the trainer's Runtime.agree) a failure that one rank meets (its disk full, rank 0's
    publish) is every rank's CheckpointError.

    A save first checks that the checkpoint's file system has room for it (the bytes of the state's tensors), and a
    write that fails (a disk that fills while it is written) is one CheckpointError naming the checkpoints directory
    and the step, raised by check() at the first step after it failed, or by the next save() or close(); its
    `.tmp-` directory is removed, so no step directory of it appears and the previous checkpoint stays the latest.

    Example:
        >>> ckpt = Checkpointer("runs/a", rank=0, keep=2, asynchronous=True)
        >>> ckpt.save(step, ShardedState.of(model, optimizer), trainer, meta)   # returns once the state is staged
        >>> ckpt.check()                                # each step: raises if the write has failed meanwhile
        >>> ckpt.close()                                # before exit: the write is complete, or its error raised
    """

    def __init__(self, out_dir: str | Path, rank: int, keep: int, asynchronous: bool, agree: Any = _alone) -> None:
        import torch.distributed as dist

        self.out_dir, self.rank, self.keep, self.asynchronous = Path(out_dir), rank, keep, asynchronous
        self._agree = agree
        # DCP's own collectives (plans, then "all written") on a gloo group: a background save must not interleave
        # with the training's collectives on the default group, and gloo needs no device (as torchtitan does)
        self.group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self._stager = PinnedStager() if asynchronous else None
        self._thread: threading.Thread | None = None
        self._error: CheckpointError | None = None
        self.last: dict[str, Any] | None = None  # {"step", "path", "write_s"} of the last finished write
        self._flight: dict[str, Any] | None = None  # in_flight()
        self.last_stall: dict[str, float] = {}  # {"wait_s", "stage_s"} of the last save() call

    def save(self, step: int, state: ShardedState, trainer: dict[str, Any], meta: dict[str, Any]) -> None:
        """Write `state` (this rank's shards) and, from rank 0, `trainer` and `meta` as the checkpoint of `step`;
        returns once the shards are staged in host memory when asynchronous. Collective."""
        import torch.distributed.checkpoint as dcp

        t_wait = time.perf_counter()
        # before staging: the pinned buffers are the previous write's source until it is done
        self._agree(lambda: self._make_room(step, state))
        root = checkpoint_root(self.out_dir)
        final, tmp = root / f"{PREFIX}{step:08d}", root / f"{TMP}{PREFIX}{step:08d}"
        if self.rank == 0:  # a killed save's leftovers; the others write only after DCP's plan exchange with rank 0
            shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.perf_counter()
        self.last_stall = {"wait_s": t0 - t_wait}
        self._flight = {"step": step, "path": str(tmp), "shards_since": None}
        writer = _MarkedShardWriter(tmp, self._flight, sync_files=True)
        if self.asynchronous:
            future = dcp.async_save(state.flat, storage_writer=writer, async_stager=self._stager,
                                    **_dcp_kwargs(self.group))  # fmt: skip
            self.last_stall["stage_s"] = time.perf_counter() - t0
            self._thread = threading.Thread(target=self._finish, args=(future.result, step, tmp, final, trainer,
                                            meta, t0), name="checkpoint")  # fmt: skip
            self._thread.start()
        else:  # DCP raises a failed write on every rank; publishing (rank 0) is agreed
            write = lambda: dcp.save(state.flat, storage_writer=writer, **_dcp_kwargs(self.group))  # noqa: E731
            self._finish(write, step, tmp, final, trainer, meta, t0)
            self._agree(self.wait)

    def _make_room(self, step: int, state: ShardedState) -> None:
        """Wait for the write in flight (its error raised), then refuse a checkpoint its file system has no room
        for: the bytes of the tensors in `state` at their global size and DCP's overhead on each, what the step
        directory will hold when the ranks share it (of a pipeline stage, only that stage's)."""
        self.wait()
        root = checkpoint_root(self.out_dir)
        need = state.nbytes + ENTRY_BYTES * len(state.flat)
        try:
            root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(root).free
        except OSError as e:
            raise CheckpointError(f"{root}: cannot write checkpoints there ({e.strerror}); {self._fix()}") from None
        if free < need:
            raise CheckpointError(
                f"{root}: {human_bytes(free)} free, but the checkpoint of step {step} needs {human_bytes(need)}; "
                f"{self._fix()}"
            )

    def _finish(self, write: Any, step: int, tmp: Path, final: Path, trainer: dict, meta: dict, t0: float) -> None:
        """Run the write (DCP's; asynchronously, the future's result) and, on rank 0, publish the directory; a
        failure becomes the CheckpointError that wait() and check() raise, and its `.tmp-` directory is removed."""
        try:
            write()  # on rank 0, DCP returns once every rank's shards and .metadata are written
            if self.rank == 0:
                path = publish(tmp, final, trainer, meta)
                prune(self.out_dir, self.keep)
                self.last = {"step": step, "path": str(path), "write_s": time.perf_counter() - t0}
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            self._error = self._write_failed(step, e)
            if self.rank == 0:  # every rank's write has ended: DCP gathered their outcomes before failing
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            self._flight = None

    def in_flight(self) -> dict[str, Any] | None:
        """The write not finished yet, None when there is none: {"step", "path" (its .tmp- directory),
        "shards_since"}, the time.monotonic() at which this rank began writing its own shards, None before and after
        (while DCP plans, or waits for the other ranks' shards).

        Example:
            >>> with watchdog.saving(ckpt.in_flight):
            ...     ckpt.save(step, state, trainer, meta)
        """
        return self._flight

    def _write_failed(self, step: int, error: BaseException) -> CheckpointError:
        root = checkpoint_root(self.out_dir)
        causes = _causes(error)
        full = any(_is_no_space(c) for c in causes)
        why = "no space left on the device" if full else first_line(causes[0] if causes else error)
        return CheckpointError(f"{root}: the checkpoint of step {step} could not be written ({why}); {self._fix()}")

    def _fix(self) -> str:
        """What to do about a checkpoint that cannot be written: room, or another out_dir that continues the run."""
        latest = latest_checkpoint(self.out_dir)
        resume = f" (and checkpoint.resume={latest} to continue from it)" if latest else ""
        return f"free space there (or keep fewer: checkpoint.keep), or give an out_dir with room{resume}"

    def check(self) -> None:
        """Raise the error of a write that has finished since the last call; never waits for one in flight."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the write in flight is done; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """wait() (agreed: collective), then free the pinned staging memory."""
        try:
            self._agree(self.wait)
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def _causes(error: BaseException) -> list[BaseException]:
    """The exceptions behind `error`: each rank's of a DCP CheckpointException (it holds (exception, stack) pairs),
    else `error` and the chain of its causes."""
    if isinstance(error, CheckpointException):
        return [c for exc, _ in error.failures.values() for c in _causes(exc)]
    chain = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
        if len(chain) > 8:
            break
    return chain


def _is_no_space(error: BaseException) -> bool:
    """A write that failed for want of space: ENOSPC/EDQUOT, or torch's zip writer cut short by it (its message
    keeps no errno: "[enforce fail at inline_container.cc:...] unexpected pos")."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return "No space left" in text or "Disk quota exceeded" in text or "unexpected pos" in text


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


# DCP's .metadata is a pickle of these classes (and torch sizes and dtypes): the unpickler builds them and nothing
# else, so a crafted file cannot run code (DESIGN: untrusted files, no pickle)
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class _NotMetadata(pickle.UnpicklingError):
    """The pickle names a global that DCP's metadata never holds: refused, never built."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise _NotMetadata(f"{module}.{name}")


def _reader(path: Path) -> Any:
    """A DCP FileSystemReader of `path` whose .metadata is read by _MetadataUnpickler; a damaged or foreign one is
    refused in one line."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            file = path / ".metadata"
            try:
                with open(file, "rb") as f:
                    if f.read(4) == b"PK\x03\x04":  # a torch.save archive (objects pickled inside), never DCP's
                        raise _NotMetadata("a torch.save archive")
                    f.seek(0)
                    metadata = _MetadataUnpickler(f).load()
            except _NotMetadata as e:
                raise PickleRefusedError(pickle_refused(file, _delete_hint(path)) + f" ({e})") from None
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
                raise CheckpointError(f"{file}: damaged ({first_line(e)}); {_delete_hint(path)}") from None
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def check_format(path: str | Path) -> Path:
    """`path` if it holds a sharded (DCP) checkpoint; a full-state one of earlier corpusforge versions is refused
    with the command that converts it."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    if (path / "model.pt").is_file():
        raise CheckpointError(
            f"{path}: a full-state checkpoint (model.pt) of an earlier corpusforge; convert it to the sharded format "
            f"once with: python -m corpusforge.train.checkpoint {path}"
        )
    raise CheckpointError(f"{path}: no .metadata (not a sharded checkpoint, or damaged); {_delete_hint(path)}")


def _check_shapes(path: Path, reader: Any, state: ShardedState) -> None:
    """Every tensor this run needs is in the checkpoint with the same global shape, or a one-line error."""
    saved = reader.read_metadata().state_dict_metadata
    missing = [k for k in state.flat if k not in saved]
    wrong = [f"{k}: {tuple(saved[k].size)} != {tuple(v.shape)}" for k, v in state.flat.items()
             if k in saved and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(v.shape)]  # fmt: skip
    if missing or wrong:
        raise CheckpointError(
            f"{path}: parameters do not match this model: {'; '.join(wrong[:5])}"
            + (f" missing {', '.join(missing[:5])}" if missing else "")
        )


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: Any, group: Any = None) -> dict[str, Any]:
    """Load a sharded checkpoint (saved with any layout) into `model`/`optimizer` (a whole model, an FSDP/TP one,
    or a ModuleList of pipeline stages with pipeline.Optimizers): each rank reads only the chunks of its shards.
    Collective when distributed (`group`: the Checkpointer's). Returns the trainer state (step, scheduler, rng,
    loader).

    Example:
        >>> trainer = load_checkpoint("runs/a/checkpoints/step_00000020", model, optimizer)
    """

    path = check_format(path)
    if not (path / "trainer.pt").is_file():
        raise CheckpointError(f"{path}: missing trainer.pt; {_delete_hint(path)}")
    state = ShardedState.of(model, optimizer)
    reader = _reader(path)
    _check_shapes(path, reader, state)
    _dcp_load(path, state, reader, **_dcp_kwargs(group))
    state.set_back()
    return _torch_load(path / "trainer.pt")


def _dcp_load(path: Path, state: ShardedState, reader: Any, **kwargs: Any) -> None:
    """dcp.load into `state`; a shard file cut short or damaged is one line (DCP's error lists every rank's)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state.flat, storage_reader=reader, **kwargs)
    except CheckpointException as e:
        why = first_line((_causes(e) or [e])[0])
        raise CheckpointError(f"{path}: a shard file is damaged or missing ({why}); {_delete_hint(path)}") from None


def load_model(path: str | Path, model: torch.nn.Module) -> torch.nn.Module:
    """Load the model weights of a sharded checkpoint into `model`, whole, in this process (export-hf): DCP
    assembles each tensor from every rank's chunks.

    Example:
        >>> model = load_model("runs/a/checkpoints/step_00000020", Llama(cfg))
    """

    path = check_format(path)
    state = ShardedState.of(model, None, with_optimizer=False)
    reader = _reader(path)
    _check_shapes(path, reader, state)
    _dcp_load(path, state, reader, no_dist=True)
    state.set_back()
    return model


def convert_full_state(path: str | Path) -> Path:
    """Rewrite a full-state checkpoint of earlier versions (model.pt, optimizer.pt keyed by parameter name) in the
    sharded format, in place and atomically (the new directory renamed over the old); one process, holding the
    whole state in memory once.

    Example:
        >>> convert_full_state("runs/a/checkpoints/step_00000020")   # python -m corpusforge.train.checkpoint PATH
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    model_sd, optim_sd = _torch_load(path / "model.pt", mmap=True), _torch_load(path / "optimizer.pt", mmap=True)
    flat = {f"model.{k}": v for k, v in model_sd.items()}  # a tied head under both names: the load reads one
    for name, entries in optim_sd["state"].items():
        flat.update({f"optim.state.{name}.{k}": v for k, v in entries.items() if torch.is_tensor(v)})
    tmp = path.with_name(f"{TMP}convert-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save(flat, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
    return publish(tmp, path, _torch_load(path / "trainer.pt"), {**load_meta(path), "converted_from": "full-state"})


if __name__ == "__main__":  # python -m corpusforge.train.checkpoint STEP_DIR...: convert full-state checkpoints
    for arg in sys.argv[1:]:
        print(f"converted {convert_full_state(arg)}")
