"""A FUSE passthrough that adds a fixed latency to every read and write: slow storage, made for real.

    python tests/iobench/slowfs.py SOURCE MOUNTPOINT --delay 0.05

Runs in the foreground until unmounted (fusermount -u MOUNTPOINT). Stopping it with SIGSTOP makes every
operation on the mount hang, as a stuck network file system does. Needs fusepy and libfuse2 (apt: libfuse2).
"""

from __future__ import annotations

import argparse
import errno
import os
import time

from fuse import FUSE, FuseOSError, Operations


class SlowPassthrough(Operations):
    def __init__(self, root: str, delay: float) -> None:
        self.root, self.delay = root, delay

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except OSError as e:
            raise FuseOSError(e.errno or errno.EIO) from None

    def access(self, path, mode):
        if not os.access(self._p(path), mode):
            raise FuseOSError(errno.EACCES)

    def getattr(self, path, fh=None):
        st = self._call(os.lstat, self._p(path))
        keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
        return {k: getattr(st, k) for k in keys}

    def readdir(self, path, fh):
        return [".", "..", *self._call(os.listdir, self._p(path))]

    def statfs(self, path):
        st = os.statvfs(self._p(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize")
        return {k: getattr(st, k) for k in keys} | {"f_namemax": st.f_namemax}

    def mkdir(self, path, mode):
        return self._call(os.mkdir, self._p(path), mode)

    def rmdir(self, path):
        return self._call(os.rmdir, self._p(path))

    def unlink(self, path):
        return self._call(os.unlink, self._p(path))

    def rename(self, old, new):
        return self._call(os.rename, self._p(old), self._p(new))

    def chmod(self, path, mode):
        return self._call(os.chmod, self._p(path), mode)

    def utimens(self, path, times=None):
        return self._call(os.utime, self._p(path), times)

    def truncate(self, path, length, fh=None):
        with open(self._p(path), "r+") as f:
            f.truncate(length)

    def open(self, path, flags):
        return self._call(os.open, self._p(path), flags & ~os.O_DIRECT)

    def create(self, path, mode, fi=None):
        return self._call(os.open, self._p(path), os.O_WRONLY | os.O_CREAT, mode)

    def read(self, path, size, offset, fh):
        time.sleep(self.delay)
        return self._call(os.pread, fh, size, offset)

    def write(self, path, data, offset, fh):
        time.sleep(self.delay)
        return self._call(os.pwrite, fh, data, offset)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        return self._call(os.fsync, fh)

    def release(self, path, fh):
        return self._call(os.close, fh)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds added to every read and write")
    args = ap.parse_args()
    # big_writes: libfuse2 splits writes into 4 KiB requests without it
    FUSE(SlowPassthrough(args.source, args.delay), args.mountpoint, foreground=True, nothreads=False, big_writes=True)


if __name__ == "__main__":
    main()
