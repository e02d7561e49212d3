"""A FUSE passthrough (tests/iobench/slowfs.py's) whose reads a test slows or blocks on command, for real:

    python tests/train/hangfs.py SOURCE MOUNTPOINT CONTROL [--page-cache]

While the file CONTROL/block exists, every read waits (a storage server that stopped answering; the reading process
sits in the kernel, in no state any signal ends); removing it releases them. A file CONTROL/delay-once holding a
number of seconds delays the next read by that much, once (the file is taken by that read). While CONTROL/block-writes
exists, every write and fsync waits the same way (a checkpoint's storage that stopped). Mounted with direct_io,
so that every read reaches this process and none is served from the page cache; with --page-cache, without it, as
a memory map needs (direct_io forbids a shared map): a page fault then reaches this process only for a page that is
not cached (the test drops them, posix_fadvise DONTNEED, before it blocks). Runs until unmounted.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fuse import FUSE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "iobench"))
from slowfs import SlowPassthrough  # noqa: E402


class CommandedPassthrough(SlowPassthrough):
    def __init__(self, root: str, control: str) -> None:
        super().__init__(root, 0.0)
        self.control = Path(control)

    def read(self, path, size, offset, fh):
        once = self.control / "delay-once"
        taken = self.control / f"delay-taken-{os.getpid()}-{time.monotonic_ns()}"
        try:
            os.rename(once, taken)  # one read takes it, whatever the threads
            time.sleep(float(taken.read_text()))
            taken.unlink()
        except FileNotFoundError:
            pass
        while (self.control / "block").exists():
            time.sleep(0.05)
        return self._call(os.pread, fh, size, offset)

    def write(self, path, data, offset, fh):
        self._wait("block-writes")
        return super().write(path, data, offset, fh)

    def fsync(self, path, datasync, fh):
        self._wait("block-writes")
        return super().fsync(path, datasync, fh)

    def _wait(self, name: str) -> None:
        while (self.control / name).exists():
            time.sleep(0.05)


if __name__ == "__main__":
    source, mountpoint, control = sys.argv[1:4]
    direct_io = "--page-cache" not in sys.argv[4:]
    FUSE(CommandedPassthrough(source, control), mountpoint, foreground=True, nothreads=False, direct_io=direct_io)
