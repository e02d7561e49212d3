"""One process of a node opening a blend with storage.node_share_dir (run by tests/data/test_node_share.py).

    python node_share_child.py SPEC.json

SPEC: {"blend": [...], "cache_dir", "share_dir", "read_mode", "ready": path or null,
"stall": null | "reading" | "writing"}.
Prints one JSON line: {"digest": sha256 of every sample's tokens, "from_share": whether this process mapped the
node's share (True) or read the indices itself (False)}. With "stall", the test's fault: once this process has
read part of the blend ("reading") or written part of the share ("writing"), it touches `ready` and sleeps until
it is killed, holding the node-local lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path

from corpusforge.data import build_gpt_datasets
from corpusforge.storage import StorageConfig


def stall(ready: str) -> None:
    Path(ready).touch()
    while True:
        time.sleep(1)


def inject(spec: dict) -> None:
    """The test's fault, by monkeypatching this process (never a hook in the library)."""
    from corpusforge.storage import datasets, node_share

    if spec["stall"] == "reading":
        opened, real_open = [], datasets._open

        def slow_open(*args, **kwargs):
            opened.append(1)
            if len(opened) == 3:
                stall(spec["ready"])
            return real_open(*args, **kwargs)

        datasets._open = slow_open
    elif spec["stall"] == "writing":
        real_write = node_share.atomic_write

        @contextlib.contextmanager
        def half_write(path, **kwargs):
            with real_write(path, **kwargs) as f:
                written = []

                class Half:
                    def write(self, data):
                        written.append(len(data))
                        f.write(data)
                        if len(written) == 4:  # the header and part of the indices are in the temporary file
                            f.flush()
                            stall(spec["ready"])

                yield Half()

        node_share.atomic_write = half_write


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    inject(spec)
    train, _, _ = build_gpt_datasets(
        spec["blend"], seq_length=32, split="1", seed=7, num_samples=(300, 0, 0), cache_dir=spec["cache_dir"],
        storage=StorageConfig(read_mode=spec["read_mode"], node_share_dir=spec["share_dir"]),
    )  # fmt: skip
    digest = hashlib.sha256(train.read_raw(range(len(train))).text.tobytes())  # numpy: no torch to import
    from_share = [isinstance(part.indexed._idx, memoryview) for part in train.datasets]
    assert len(set(from_share)) == 1, from_share
    print(json.dumps({"digest": digest.hexdigest(), "from_share": from_share[0]}))


if __name__ == "__main__":
    main()
