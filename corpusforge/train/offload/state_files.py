"""The nvme placement's state files: one per kind of state (fp32 master weights, AdamW's exp_avg and exp_avg_sq)
per rank, read and written here, both sides in this module.

Byte layout of `{offload_dir}/rank_{rank:05d}/{kind}.bin` (little-endian):

    0      8   magic b"CFOFFLD1"
    8      8   u64 generation: optimizer steps whose update the file holds
    16     8   u64 state: 0 = consistent at `generation`; 1 = a step is writing it (a run killed then leaves 1)
    24     32  sha256 of the rank's parameter layout (names, shapes, offsets): another model's files never match
    56     8   u64 bytes of values
    64..4096   zeros
    4096   ... fp32 values, parameter after parameter, each parameter's run starting on a 4 KiB boundary, so that every
               read and write of the optimizer step is aligned for O_DIRECT

The files are a cache of the optimizer state, never the checkpoint: a run (re)creates them at its start, from its
checkpoint or from zeros, and never trusts what an earlier process left; within the run each step checks the header
(magic, layout, generation, state 0) before it reads, so a file another process changed or a step left half-written
is refused in one line, never read as state.

Example:
    >>> f = StateFile.create(Path("/nvme/run/rank_00000/exp_avg.bin"), layout_hash, nbytes=1 << 20)
    >>> f.check(generation=0)
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from pathlib import Path

import torch

from corpusforge.errors import CorpusforgeError
from corpusforge.sizes import human_bytes

MAGIC = b"CFOFFLD1"
HEADER = 4096  # bytes before the values; also the alignment of every parameter's run and of every I/O
ALIGN_ELEMS = HEADER // 4  # fp32 values per 4 KiB
_FIELDS = struct.Struct("<8sQQ32sQ")
CLEAN, WRITING = 0, 1


class OffloadError(CorpusforgeError):
    """The offloaded optimizer state cannot be written or read (offload_dir full, unwritable, or changed)."""


def align(n: int, to: int = ALIGN_ELEMS) -> int:
    """`n` rounded up to a multiple of `to`.

    Example:
        >>> align(1), align(1024), align(1025)
        (1024, 1024, 2048)
    """
    return -(-n // to) * to


def space_error(directory: Path, need: int, e: OSError | None = None) -> OffloadError:
    """One line for an offload_dir that cannot hold the state."""
    try:
        free = f"{human_bytes(os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize)} free"
    except OSError:
        free = "no free space reported"
    why = f" ({e.strerror})" if e is not None and e.errno not in (errno.ENOSPC, errno.EDQUOT) else ""
    return OffloadError(
        f"{directory}: offload_dir has {free}{why}, but this rank's optimizer state needs {human_bytes(need)}; free "
        f"space there or give parallel.offload_dir on a larger disk"
    )


class StateFile:
    """One kind's file of one rank: its header, an fd for the step's chunked I/O (O_DIRECT where the file system
    takes it, `direct_note` says which was used and why), and a memory map for state_dict() and load_state_dict()."""

    def __init__(self, path: Path, fd: int, io_fd: int, direct_note: str, layout_hash: bytes, nbytes: int) -> None:
        self.path, self.fd, self.io_fd, self.direct_note = path, fd, io_fd, direct_note
        self.layout_hash, self.nbytes = layout_hash, nbytes
        self.direct = io_fd != fd
        self._maps: list[mmap.mmap] = []

    @classmethod
    def create(cls, path: Path, layout_hash: bytes, nbytes: int, direct: bool = True) -> tuple[StateFile, str]:
        """A fresh file of `nbytes` of zeros (the space reserved with fallocate, so a full disk is found here, not
        mid-step) replacing whatever was there; returns it and a note on what was replaced ("" for nothing)."""
        previous = describe_existing(path, layout_hash)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise OffloadError(f"{path.parent}: offload_dir cannot be written ({e.strerror}); give "
                               "parallel.offload_dir a directory this user can write") from None  # fmt: skip
        try:
            os.posix_fallocate(fd, 0, HEADER + nbytes)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without fallocate: sparse, checked later
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, HEADER + nbytes)
            else:
                raise space_error(path.parent, nbytes, e) from None
        io_fd, note = (fd, "O_DIRECT not asked") if not direct else _open_direct(path, fd)
        f = cls(path, fd, io_fd, note, layout_hash, nbytes)
        f.mark(0, CLEAN)
        return f, previous

    def header(self) -> tuple[bytes, int, int, bytes, int]:
        """(magic, generation, state, layout hash, nbytes) as on disk."""
        return _FIELDS.unpack(os.pread(self.fd, _FIELDS.size, 0))

    def mark(self, generation: int, state: int) -> None:
        """Write the header: `state` WRITING before a step's first write, CLEAN with the new generation after its
        last one."""
        os.pwrite(self.fd, _FIELDS.pack(MAGIC, generation, state, self.layout_hash, self.nbytes), 0)

    def check(self, generation: int) -> None:
        """Refuse the file unless its header says: this layout, `generation`, consistent."""
        magic, gen, state, digest, nbytes = self.header()
        if magic != MAGIC or digest != self.layout_hash or nbytes != self.nbytes:
            why = "is not this run's state file (another run or layout wrote it)"
        elif state != CLEAN:
            why = f"was left mid-step at generation {gen}"
        elif gen != generation:
            why = f"holds generation {gen}, this run expects {generation} (another process wrote it)"
        else:
            return
        raise OffloadError(f"{self.path}: {why}; not read as optimizer state. Two runs may share parallel.offload_dir: "
                           "give each its own, and resume from the last checkpoint")  # fmt: skip

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill `buf` from the values at byte `offset` (both 4 KiB aligned)."""
        done = 0
        while done < len(buf):
            n = os.preadv(self.io_fd, [buf[done:]], HEADER + offset + done)
            if n <= 0:
                raise OffloadError(f"{self.path}: short read at byte {HEADER + offset + done}: the file was cut")
            done += n

    def write_from(self, buf: memoryview, offset: int) -> None:
        """Write `buf` to the values at byte `offset` (both 4 KiB aligned)."""
        done = 0
        while done < len(buf):
            try:
                done += os.pwritev(self.io_fd, [buf[done:]], HEADER + offset + done)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a sparse file on a file system without fallocate
                    raise space_error(self.path.parent, self.nbytes, e) from None
                raise

    def mapped(self, offset: int, numel: int) -> torch.Tensor:
        """The `numel` values at value `offset` (4 KiB aligned) as a tensor over a memory map of exactly them: what
        torch.distributed.checkpoint writes from (one tensor at a time, through the page cache; a view of a larger map
        it would first copy whole) and loads into."""
        if numel == 0:
            return torch.empty(0)
        m = mmap.mmap(self.fd, numel * 4, offset=HEADER + offset * 4)
        self._maps.append(m)
        return torch.frombuffer(m, dtype=torch.float32)

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor over it is still referenced: the map goes with it
                pass
        if self.io_fd != self.fd:
            os.close(self.io_fd)
        os.close(self.fd)


def _open_direct(path: Path, fd: int) -> tuple[int, str]:
    """An O_DIRECT fd on `path` when its file system takes O_DIRECT reads of 4 KiB (tried), else the buffered `fd`."""
    if not hasattr(os, "O_DIRECT"):
        return fd, "buffered: this OS has no O_DIRECT"
    try:
        dfd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        return fd, f"buffered: O_DIRECT is refused here ({errno.errorcode.get(e.errno, e.errno)})"
    probe = AlignedBuffer(HEADER)
    try:
        os.preadv(dfd, [probe.view], 0)
    except OSError as e:
        os.close(dfd)
        return fd, f"buffered: O_DIRECT reads are refused here ({errno.errorcode.get(e.errno, e.errno)})"
    finally:
        probe.close()
    return dfd, "O_DIRECT"


def describe_existing(path: Path, layout_hash: bytes) -> str:
    """What a file left at `path` by an earlier process was, for the log: never read as state either way."""
    try:
        with open(path, "rb") as f:
            magic, gen, state, digest, _ = _FIELDS.unpack(f.read(_FIELDS.size))
    except (OSError, struct.error):
        return "" if not path.exists() else "an unreadable file"
    if magic != MAGIC:
        return "a file that is not a state file"
    if state != CLEAN:
        return f"a killed run's file, left mid-step at generation {gen}"
    return f"an earlier run's file at generation {gen}" + ("" if digest == layout_hash else " of another layout")


class AlignedBuffer:
    """Page-aligned host memory (an anonymous mmap) as a float32 tensor and a memoryview, for O_DIRECT; pinned for
    the GPU's copies with cudaHostRegister when a GPU is there (one registration, no power-of-two rounding)."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # anonymous memory, not shmem
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.float32)
        self.pinned = False
        if torch.cuda.is_available():
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            self.pinned = int(err) == 0

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        self.view.release()
        self._map.close()
