"""One rank of a torchrun job that sees the file system otherwise than the others, as one node of a cluster may.

    torchrun ... rank_view.py RANK VIEW DIR OVERRIDES...

runs `python -m corpusforge.train OVERRIDES` in every rank; rank RANK first mounts over DIR, in a mount namespace of
its own (unshare), so that no other process sees it: VIEW "empty", an empty tmpfs (a node without the shared file
system); "ro", DIR itself read-only (a node whose mount is read-only); "bind:SRC", the directory SRC (a node that sees
other files under the same name). Only the view is staged; what the trainer does with it is real. Needs root (mount,
unshare), as the suite runs.
"""

from __future__ import annotations

import os
import shlex
import sys

if __name__ == "__main__":
    target, view, where, *overrides = sys.argv[1:]
    command = [sys.executable, "-m", "corpusforge.train", *overrides]
    if os.environ["RANK"] == target:
        d = shlex.quote(where)
        if view == "empty":
            mount = f"mount -t tmpfs -o size=1m tmpfs {d}"
        elif view == "ro":
            mount = f"mount --bind {d} {d} && mount -o remount,bind,ro {d}"
        else:
            mount = f"mount --bind {shlex.quote(view.removeprefix('bind:'))} {d}"
        script = f'{mount} && exec "$@"'
        os.execvp("unshare", ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *command])
    os.execv(sys.executable, command)
