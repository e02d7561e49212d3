"""Real slowness, not a FUSE delay: the corpus on an ext4 loop device whose reads a cgroup v2 `io.max` limits
(tests/iobench/iobench_helpers.py's throttled_disk, as bench-io's tests use it), both ranks of a 2-rank torchrun on
gloo inside that cgroup, the page cache of the corpus dropped first. A read that waits longer than stall_s is named
in one warning line by the rank that waited (file, offset, bytes, seconds, its reads' p50/p99), and the run ends
with the losses of a run on an unthrottled disk. The suite runs as root (loop devices, cgroups)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import trainkit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "iobench"))
import iobench_helpers  # noqa: E402

from corpusforge.storage.pagecache import drop_page_cache  # noqa: E402

STALL_S = 1
# The markov corpus's .bin is ~48 KB: at 24 KiB/s its first read (with the kernel's readahead) waits about 2 s, a
# stall; hang_s stays far above, so the slowness is warned about and never taken for a hang.
READ_BPS = 24 << 10
throttled_disk = iobench_helpers.throttled_disk  # the fixture, which pytest finds by its name in this module


def overrides(corpus: str, out: Path) -> list[str]:
    values = {"max_steps": 8, "eval_interval": 0, "checkpoint_interval": 0, "storage.read_mode": '"pread"',
              "watchdog.stall_s": STALL_S, "watchdog.hang_s": 120}  # fmt: skip
    return trainkit.tiny_overrides(corpus, out, **values)


def losses(out: Path) -> list[float]:
    return [r["loss"] for _, r in sorted(trainkit.run_records(out).items())]


@pytest.mark.slow
def test_a_throttled_disk_warns_with_the_read_and_changes_no_loss(throttled_disk, tmp_path):
    (tmp_path / "local").mkdir()
    here = trainkit.write_markov_corpus(tmp_path / "local" / "markov_text_document")
    plain = tmp_path / "plain"
    trainkit.torchrun(overrides(here, plain), 2, timeout=120)

    point, wrap = throttled_disk(READ_BPS, 64 << 20)
    corpus = str(point / "markov_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copyfile(here + suffix, corpus + suffix)
        drop_page_cache(corpus + suffix)  # the reads come from the throttled device
    out, logs = tmp_path / "throttled", tmp_path / "logs"
    # torchrun joins the cgroup, then starts its ranks there (a rank that torchrun started cannot join it: EIO)
    done = trainkit.torchrun(overrides(corpus, out), 2, timeout=180, check=False, launcher=wrap([]),
                             options=["--log-dir", str(logs), "--redirects", "3"])  # fmt: skip
    ranks = trainkit.rank_logs(logs)
    assert done.returncode == 0, (done.stderr[-3000:], ranks)
    warnings = {r: [line for line in text.splitlines() if "warning" in line] for r, text in ranks.items()}
    named = [line for lines in warnings.values() for line in lines if " a read of " in line]
    assert named, ranks  # the first read of the .bin waited for the throttled device
    for r, lines in warnings.items():
        assert len(lines) <= 2, lines  # once per stalled read, not once per step
        for line in lines:
            assert line.startswith(f"corpusforge: warning: rank {r}: "), line
    assert re.fullmatch(
        rf"corpusforge: warning: rank \d: a read of {re.escape(corpus)}\.bin at offset \d+ \(\d+ bytes\) has waited "
        rf"\d+\.\d s \(stall_s {STALL_S}\); this rank's reads so far: "
        rf"(p50 [\d.]+ ms, p99 [\d.]+ ms over \d+ reads|no read finished yet)",  # the first read may be the slow one
        named[0],
    ), named[0]
    assert not list(out.glob("hang-*"))
    np.testing.assert_array_equal(losses(out), losses(plain))
