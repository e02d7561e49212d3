"""AdamW whose fp32 master weights and two moments live in files (parallel.offload = "nvme"), streamed through a
few page-aligned host buffers by each step, as DeepSpeed's ZeRO-Infinity does with its optimizer state on NVMe.

A step walks the rank's state in chunks (`chunk_bytes` of each kind): a reader thread fills the buffers of the next
chunks (read-ahead), the training thread runs torch's own fused CPU AdamW kernel on the chunk in the buffers and
copies the new weights into the parameters, a writer thread writes the chunk back (write-behind); `buffers` sets of
three buffers rotate between them. The kernel is the same one the in-memory optimizer runs (optim.make_optimizer:
fused=True), on slices that start at 4 KiB (1024-value) boundaries of each parameter: the kernel's vector lanes and
thread splits then fall on the same elements, and the losses are bit-identical to the in-memory run's (tested).
torch releases the GIL in the kernel and in the file reads and writes, so the three overlap.

The kernel runs on one core fewer than torch's intra-op threads (`update_threads`, at least one): the reader and
writer threads need a core for their system calls and O_DIRECT page pinning (all of their copying, on a file system
without O_DIRECT), and OpenMP threads that fill every core stall them. Measured on 2 shared cores (load 4-6): the
update with 2 threads took 0.17-0.76 s per step of 32M values and the step was update-bound (0.58-0.83 s); with 1
thread 0.07-0.11 s, and the step waits on the disk (0.34-0.52 s). The kernel's results do not depend on its thread
count (each thread takes whole 64-byte runs; tested against the in-memory run with torch's own count).

Checkpoints: `state` holds, per parameter, `exp_avg` and `exp_avg_sq` as views of the files' memory maps (a DTensor
around them under FSDP/TP) and `step`, so torch.distributed.checkpoint saves them under the same names as the
in-memory AdamW's (a checkpoint resumes into any placement), one tensor at a time from the page cache, without a
second copy of the state in RAM; a load writes into the maps, and the master weights are re-read from the loaded
parameters before the next step.

Example:
    >>> opt = NvmeAdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, directory=Path("/nvme/r0"))
    >>> loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.optim.adamw import adamw

from corpusforge.sizes import human_bytes
from corpusforge.train.offload.state_files import ALIGN_ELEMS, AlignedBuffer, OffloadError, StateFile, align

KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Slice:
    """Values [start, end) of parameter `param`, at value `at` of its chunk's buffers."""

    param: int
    start: int
    end: int
    at: int


@dataclass(frozen=True)
class Chunk:
    """A run of the files read, updated and written as one: `offset` and `length` in values, 4 KiB aligned."""

    offset: int
    length: int
    slices: tuple[Slice, ...]


def plan_chunks(numels: list[int], chunk_values: int) -> tuple[list[int], list[Chunk], int]:
    """(each parameter's offset in the files, the chunks, the values in a file) for parameters of `numels` values,
    each parameter's run padded to 1024 values and cut at multiples of 1024 when it is longer than a chunk.

    Example:
        >>> offsets, chunks, total = plan_chunks([10, 3000], chunk_values=2048)
        >>> offsets, total, [(c.offset, c.length, len(c.slices)) for c in chunks]
        ([0, 1024], 4096, [(0, 2048, 2), (2048, 2048, 1)])
    """
    chunk_values = max(ALIGN_ELEMS, chunk_values // ALIGN_ELEMS * ALIGN_ELEMS)
    offsets, chunks, pos = [], [], 0
    current: list[Slice] = []
    start_of_chunk, used = 0, 0
    for i, n in enumerate(numels):
        offsets.append(pos)
        done = 0
        while done < n:
            if used == chunk_values:
                chunks.append(Chunk(start_of_chunk, used, tuple(current)))
                current, start_of_chunk, used = [], start_of_chunk + used, 0
            take = min(n - done, chunk_values - used)
            current.append(Slice(i, done, done + take, used))
            used += align(take)
            done += take
        pos += align(n)
    if current:
        chunks.append(Chunk(start_of_chunk, used, tuple(current)))
    return offsets, chunks, pos


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter or gradient (a DTensor's shard)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class NvmeAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with its state in files under `directory` (this rank's own); see the module."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 directory: Path, chunk_bytes: int = 8 << 20, buffers: int = 4, direct: bool = True,
                 update_threads: int | None = None) -> None:  # fmt: skip
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=None, capturable=False, differentiable=False, fused=True)  # fmt: skip
        super().__init__(params, defaults)
        self.directory = Path(directory)
        # one core left to the reader and writer threads (see the module); torchrun's ranks run 1 thread anyway
        self.update_threads = update_threads or max(1, torch.get_num_threads() - 1)
        self.params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        locals_ = [_local(p) for p in self.params]
        self.offsets, self.chunks, total = plan_chunks([t.numel() for t in locals_], chunk_bytes // 4)
        self.generation = 0  # optimizer steps taken (the files' generation)
        self._master_stale = True  # the master file is (re)written from the parameters before the next step
        self.notes: list[str] = []  # for the run's log: what the files are and what was found in their place
        self._open(locals_, total * 4, direct)
        chunk = max((c.length for c in self.chunks), default=ALIGN_ELEMS) * 4
        self.notes.insert(0, f"offload: nvme: {len(KINDS)} x {human_bytes(total * 4)} of state in {self.directory} "
                             f"({self.direct_note}), {len(self.chunks)} chunk(s) of up to {human_bytes(chunk)} "
                             f"through {max(2, buffers)} sets of host buffers, the update on "
                             f"{self.update_threads} thread(s)")  # fmt: skip
        self._sets = [{k: AlignedBuffer(chunk) for k in KINDS} for _ in range(max(2, buffers))]
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="offload-write")
        self.io = {"read_bytes": 0, "write_bytes": 0, "seconds": 0.0, "steps": 0}
        self._expose_state()

    # -- the files

    def _open(self, locals_: list[torch.Tensor], nbytes: int, direct: bool) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.directory / "LOCK", "w")  # noqa: SIM115 - held for the optimizer's life
        except OSError as e:
            raise OffloadError(f"{self.directory}: offload_dir cannot be written ({e.strerror}); give "
                               "parallel.offload_dir a directory this user can write") from None  # fmt: skip
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OffloadError(f"{self.directory}: another running process uses these offload files; give each run "
                               "its own parallel.offload_dir") from None  # fmt: skip
        digest = hashlib.sha256(repr([(tuple(t.shape), o) for t, o in zip(locals_, self.offsets)]).encode()).digest()
        self.files: dict[str, StateFile] = {}
        for kind in KINDS:
            self.files[kind], previous = StateFile.create(self.directory / f"{kind}.bin", digest, nbytes, direct)
            if previous:
                self.notes.append(
                    f"offload: {self.files[kind].path}: {previous}; not read, rebuilt (the checkpoint is the state)"
                )
        self.direct_note = self.files["master"].direct_note

    def _expose_state(self) -> None:
        """`state[p]` as torch's AdamW keeps it, its moments views of the memory-mapped files."""
        for i, p in enumerate(self.params):
            local = _local(p)
            views = {}
            for kind in ("exp_avg", "exp_avg_sq"):
                v = self.files[kind].mapped(self.offsets[i], local.numel()).view(local.shape)
                if hasattr(p, "_local_tensor"):
                    from torch.distributed.tensor import DTensor

                    v = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())  # fmt: skip
                views[kind] = v
            self.state[p] = {"step": torch.tensor(float(self.generation)), **views}

    def close(self) -> None:
        """Release the buffers, maps and threads (the files stay, as a cache the next run overwrites)."""
        self._reader.shutdown()
        self._writer.shutdown()
        for s in self._sets:
            for b in s.values():
                b.close()
        self.state.clear()
        for f in self.files.values():
            f.close()
        self._lock.close()

    # -- the step

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One AdamW step over every parameter with a gradient, streamed through the files."""
        assert closure is None, "NvmeAdamW takes no closure"
        t0 = time.perf_counter()
        for f in self.files.values():
            f.check(self.generation)
        if self._master_stale:
            self._write_master()
        for f in self.files.values():
            f.mark(self.generation, 1)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.update_threads)
        try:
            self._stream(self._update)
        finally:
            torch.set_num_threads(threads)
        self.generation += 1
        for f in self.files.values():
            f.mark(self.generation, 0)
        for st in self.state.values():
            st["step"].fill_(float(self.generation))
        self.io["seconds"] += time.perf_counter() - t0
        self.io["steps"] += 1

    def _stream(self, compute: Any, kinds: tuple[str, ...] = KINDS, read: bool = True) -> None:
        """Every chunk through `compute(chunk, buffers)`: read ahead (when `read`), compute here, write behind."""
        reader = (lambda c, bufs: self._read(c, bufs, kinds)) if read else None
        stream_chunks(self.chunks, self._sets, reader, compute, lambda c, bufs: self._write(c, bufs, kinds),
                      self._reader, self._writer)  # fmt: skip

    def _read(self, c: Chunk, bufs: dict, kinds: tuple[str, ...]) -> None:
        n = c.length * 4
        for kind in kinds:
            self.files[kind].read_into(bufs[kind].view[:n], c.offset * 4)
        self.io["read_bytes"] += n * len(kinds)

    def _write(self, c: Chunk, bufs: dict, kinds: tuple[str, ...]) -> None:
        n = c.length * 4
        for kind in kinds:
            self.files[kind].write_from(bufs[kind].view[:n], c.offset * 4)
        self.io["write_bytes"] += n * len(kinds)

    def _update(self, c: Chunk, bufs: dict) -> None:
        """torch's fused AdamW on the chunk's slices (per parameter group), then the new weights into the params."""
        by_group: dict[int, list[Slice]] = {}
        for s in c.slices:
            if self.params[s.param].grad is not None:
                by_group.setdefault(self._group_of[id(self.params[s.param])], []).append(s)
        for gi, slices in by_group.items():
            g = self.param_groups[gi]

            def of(kind: str) -> list[torch.Tensor]:
                return [bufs[kind].tensor[s.at : s.at + s.end - s.start] for s in slices]  # noqa: B023

            grads = [_local(self.params[s.param].grad).reshape(-1)[s.start : s.end] for s in slices]
            grads = [x if x.device.type == "cpu" else x.to("cpu") for x in grads]
            steps = [torch.tensor(float(self.generation)) for _ in slices]  # the kernel counts them up by one
            beta1, beta2 = g["betas"]
            adamw(of("master"), grads, of("exp_avg"), of("exp_avg_sq"), [], steps, foreach=False, fused=True,
                  capturable=False, differentiable=False, grad_scale=None, found_inf=None, has_complex=False,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"],
                  eps=g["eps"], maximize=False)  # fmt: skip
            for s, new in zip(slices, of("master")):
                _local(self.params[s.param]).view(-1)[s.start : s.end].copy_(new, non_blocking=True)
        if any(p.device.type == "cuda" for p in self.params[:1]):
            torch.cuda.current_stream().synchronize()  # the buffers are rewritten once the writer has them

    def _write_master(self) -> None:
        """The master file from the parameters (at the start, and after a checkpoint was loaded into them)."""

        def fill(c: Chunk, bufs: dict) -> None:
            for s in c.slices:
                src = _local(self.params[s.param]).detach().reshape(-1)[s.start : s.end]
                bufs["master"].tensor[s.at : s.at + s.end - s.start].copy_(src)

        self._stream(fill, kinds=("master",), read=False)
        self._master_stale = False

    # -- checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's AdamW state_dict (saved by any placement) into the files; the master weights follow the params."""
        saved = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        by_saved = dict(zip(saved, self.params, strict=True))
        for pid, entries in state_dict["state"].items():
            p = by_saved[pid]
            for kind in ("exp_avg", "exp_avg_sq"):
                mine, theirs = _local(self.state[p][kind]), _local(entries[kind])
                if mine.data_ptr() != theirs.data_ptr():  # DCP loads in place into the maps: nothing to copy then
                    mine.copy_(theirs)
            self.generation = int(entries["step"])
        for g, sg in zip(self.param_groups, state_dict["param_groups"], strict=True):
            g.update({k: v for k, v in sg.items() if k != "params"})
        for f in self.files.values():
            f.mark(self.generation, 0)
        for st in self.state.values():
            st["step"].fill_(float(self.generation))
        self._master_stale = True


def stream_chunks(chunks: list[Chunk], sets: list[dict], read: Any, compute: Any, write: Any,
                  reader: ThreadPoolExecutor, writer: ThreadPoolExecutor) -> None:  # fmt: skip
    """The step's I/O schedule, shared with bench-io's offload pattern: every chunk is read into a free buffer set
    on the `reader` thread (`read(chunk, set)`, up to len(sets) - 2 chunks ahead; None: nothing to read), given to
    `compute(chunk, set)` on this thread, then written from that set on the `writer` thread (`write(chunk, set)`),
    which frees the set once done. Errors of either thread are raised here."""
    free = deque(sets)
    reads: deque[tuple[Future, dict]] = deque()
    writes: deque[tuple[Future, dict]] = deque()

    def take() -> dict:
        if not free:
            future, bufs = writes.popleft()
            future.result()
            free.append(bufs)
        return free.popleft()

    def submit_read(c: Chunk) -> None:
        bufs = take()
        reads.append((reader.submit(read, c, bufs) if read else _done(), bufs))

    ahead = max(1, len(sets) - 2)  # one set in compute, one being written
    for c in chunks[:ahead]:
        submit_read(c)
    for i, c in enumerate(chunks):
        future, bufs = reads.popleft()
        future.result()
        if i + ahead < len(chunks):
            submit_read(chunks[i + ahead])
        compute(c, bufs)
        writes.append((writer.submit(write, c, bufs), bufs))
    for future, _ in writes:
        future.result()


def _done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


def offload_directory(offload_dir: str, out_dir: str, rank: int) -> Path:
    """This rank's directory of state files: {offload_dir or out_dir/offload}/rank_{rank:05d}.

    Example:
        >>> offload_directory("", "runs/a", 3)
        PosixPath('runs/a/offload/rank_00003')
    """
    return Path(offload_dir or os.path.join(out_dir, "offload")) / f"rank_{rank:05d}"
