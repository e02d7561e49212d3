"""bench-io as people run it: a real subprocess. Bad input gives one line before any work and leaves nothing
behind; Ctrl-C removes every file; slow and hung storage (a FUSE daemon, stopped with SIGSTOP) get a verdict."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import numpy as np
import pytest
from iobench_helpers import CLI, cli

SMALL = [
    "--file-size",
    "2M",
    "--block-size",
    "256k",
    "--rand-ops",
    "100",
    "--metadata-files",
    "10",
    "--checkpoint-size",
    "1M",
]


def one_error_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("corpusforge: error: "), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_cli_runs_and_writes_json(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = cli(str(out), "--pattern", "seq-read", "--pattern", "metadata", *SMALL, "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    assert "seq-read" in proc.stdout and "p99 ms" in proc.stdout
    assert "OK: no operation slower than" in proc.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [r["pattern"] for r in doc["results"]] == ["seq-read"] + ["metadata"] * 4
    assert os.listdir(out) == []


def test_compare_puts_paths_side_by_side(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    proc = cli(str(a), "--compare", str(b), "--pattern", "seq-read", *SMALL)
    assert proc.returncode == 0, proc.stderr
    header = next(ln for ln in proc.stdout.splitlines() if "pattern" in ln)
    assert " a " in header and " b " in header and "a p99 ms" in header


def test_nonexistent_path(tmp_path):
    one_error_line(cli(str(tmp_path / "nope"), *SMALL), "nope", "no such directory")


def test_a_file_is_not_a_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    one_error_line(cli(str(tmp_path / "f"), *SMALL), "not a directory")


def test_no_write_permission(tmp_path):
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        one_error_line(cli(str(locked), *SMALL), "no write permission")
        return
    # root writes everywhere: run the command as nobody, on a directory it can reach but not write
    top = tempfile.mkdtemp(prefix="cf-iobench-", dir="/tmp")
    try:
        os.chmod(top, 0o755)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        proc = subprocess.run([*as_nobody, *CLI, top, *SMALL], capture_output=True, text=True, timeout=120)
        if "corpusforge" not in proc.stderr:
            pytest.fail(f"nobody cannot run this venv's python: {proc.stderr[-300:]}")
        one_error_line(proc, "no write permission")
        assert os.listdir(top) == []
        unreachable = tmp_path / "deeper"  # tmp_path's parents are 0700: nobody cannot even look
        unreachable.mkdir()
        proc = subprocess.run([*as_nobody, *CLI, str(unreachable), *SMALL], capture_output=True, text=True)
        one_error_line(proc, "permission denied")
    finally:
        shutil.rmtree(top)


def test_read_only_file_system(tmpfs):
    ro = tmpfs("1m", ",ro")
    one_error_line(cli(str(ro), *SMALL), "no write permission")


def test_full_disk(tmpfs):
    full = tmpfs("256k")
    with open(full / "filler", "wb") as f:  # fill it up
        try:
            f.write(b"\0" * (1 << 20))
        except OSError:
            pass
    before = sorted(os.listdir(full))
    one_error_line(cli(str(full), *SMALL), "free", "lower --file-size")
    assert sorted(os.listdir(full)) == before


def test_size_larger_than_free_space(tmpfs):
    small = tmpfs("4m")
    line = one_error_line(cli(str(small), "--file-size", "64M", "--pattern", "seq-read"), "needs 64 MiB")
    assert "4 MiB is free" in line
    assert os.listdir(small) == []


def test_disk_full_during_the_run_is_reported_not_a_crash(tmpfs):
    small = tmpfs("3m")
    proc = cli(str(small), "--pattern", "seq-write", "--file-size", "8M", "--block-size", "1M", "--no-space-check")
    assert proc.returncode == 1
    assert "FAILED" in proc.stderr and "ENOSPC" in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(small) == []


def _sigint_as_in_the_foreground() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_removes_every_file(tmp_path):
    proc = subprocess.Popen(
        [
            *CLI,
            str(tmp_path),
            "--pattern",
            "rand-read",
            "--file-size",
            "32M",
            "--rand-ops",
            "100000000",
            "--duration",
            "60",
            "--sample-size",
            "4k",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # As a foreground job starts. A shell without job control starts its background jobs with SIGINT ignored
        # (`(pytest &)` in a script), and bench-io would inherit that: no Ctrl-C could reach it then.
        preexec_fn=_sigint_as_in_the_foreground,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the workers are reading
        runs = [d for d in os.listdir(tmp_path) if d.startswith(".corpusforge-bench-")]
        data = [tmp_path / d / "data" for d in runs]
        if any(p.is_dir() and any(n.endswith(".done") for n in os.listdir(p)) for p in data):
            break
        time.sleep(0.1)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group gets SIGINT
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # a lost Ctrl-C must fail the test, not leave the benchmark running
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"bench-io did not exit within 60 s of SIGINT; its stderr: {err[-2000:]}")
    assert proc.returncode == 130, err
    assert "interrupted; every file the benchmark created was removed" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_slow_fuse_storage_shows_in_latency_and_stalls(slowfs):
    point, source, _ = slowfs(0.05)
    proc = cli(
        str(point),
        "--pattern",
        "rand-read",
        "--pattern",
        "metadata",
        "--file-size",
        "1M",
        "--rand-ops",
        "20",
        "--metadata-files",
        "5",
        "--stall",
        "0.04",
        "--hang",
        "20",
        "--json",
        "-",
    )
    assert proc.returncode == 4, proc.stderr  # stalls
    doc = json.loads(proc.stdout)
    rand = next(r for r in doc["results"] if r["pattern"] == "rand-read")
    assert rand["latency_ms"]["p50"] >= 50 and rand["stalls"] == 20
    assert doc["verdict"].startswith("STALLS")
    assert os.listdir(source) == []


@pytest.mark.slow
def test_stopped_fuse_daemon_hang_is_reported_and_the_run_ends(slowfs):
    point, source, daemon = slowfs(0.01)
    proc = subprocess.Popen(
        [
            *CLI,
            str(point),
            "--pattern",
            "seq-read",
            "--file-size",
            "64M",
            "--block-size",
            "64k",
            "--stall",
            "0.5",
            "--hang",
            "3",
            "--json",
            "-",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3)  # preparing / reading through the slow mount
    daemon.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        daemon.send_signal(signal.SIGCONT)
    assert time.monotonic() - stopped < 30
    assert proc.returncode == 5, err
    assert "HUNG" in err and "did not return within 3 s" in err
    doc = json.loads(out)
    assert doc["results"][-1]["verdict"] == "hung"
    # What the hung mount did not let it remove is named, and removable once the storage answers again.
    assert doc["leftovers"] and all(os.path.basename(p).startswith(".corpusforge-bench-") for p in doc["leftovers"])


@pytest.mark.slow
def test_train_plot_draws_utilisation_against_accelerators(tmp_path):
    """--plot with the train pattern: a panel of accelerator utilisation against N, the 90% target as a red dashed
    line, the found N marked; the PNG is read back and looked at, not only found."""
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is installed in CI")
    import matplotlib.image

    out = tmp_path / "out"
    out.mkdir()
    png, report = tmp_path / "train.png", tmp_path / "r.json"
    loader = ["--synthetic-tokens", "200k", "--seq-length", "256", "--micro-batch", "2", "--steps", "4"]
    train = ["--compute-time", "0.05", "--max-accelerators", "2"]
    proc = cli(str(out), "--pattern", "train", *loader, *train, "--plot", str(png), "--json", str(report))
    assert proc.returncode in (0, 4), proc.stderr  # 4: stalls, which a loaded 2-core machine may show
    doc = json.loads(report.read_text())
    utilization = {r["extra"]["accelerators"]: r["extra"]["utilization"] for r in doc["results"]}
    tried = sorted(utilization)
    # The search's contract, whatever the machine's load: it starts at 1 and doubles while the target is met (a
    # loaded machine may miss 90% at 1 accelerator, and then 1 is all there is to draw).
    assert tried[0] == 1
    assert (2 in tried) == (utilization[1] >= 0.9), utilization
    image = matplotlib.image.imread(png)  # (H, W, RGBA) floats
    assert image.shape[:2] == (550, 1430)  # two panels (accelerators, latency CDF) of 6.5 x 5 in at 110 dpi
    rgb = image[..., :3]
    red = (rgb[..., 0] > 0.9) & (rgb[..., 1] < 0.15) & (rgb[..., 2] < 0.15)
    left = red[:, : image.shape[1] // 2]
    assert left.sum() > 100 and not red[:, image.shape[1] // 2 :].any()  # the target line, in the left panel only
    row = np.argmax(left.sum(axis=1))  # the line's pixel row: at 90% of the 0..105 axis, near the top
    assert row < image.shape[0] * 0.35, row
    ink = (rgb < 0.9).any(axis=-1).mean()
    assert 0.02 < ink < 0.6  # drawn on, not blank and not a solid block
    assert os.listdir(out) == []


@pytest.mark.slow
def test_a_cgroup_io_throttle_shows_as_the_measured_rate(throttled_disk):
    """A real block-I/O throttle (cgroup io.max / blkio.throttle) on a loop device: bench-io, run inside the
    cgroup, reports the throttled rates within 15%; unthrottled, the same device is much faster."""
    read_bps, write_bps = 16 << 20, 12 << 20
    point, wrap = throttled_disk(read_bps, write_bps)
    args = [str(point), "--pattern", "seq-write", "--pattern", "seq-read", "--file-size", "32M", "--block-size", "1M"]

    def rates(cmd: list[str]) -> dict[str, float]:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert all(r["cache"] == "O_DIRECT" for r in doc["results"])  # the page cache cannot hide the disk
        return {r["pattern"]: r["mb_s"] * 1e6 for r in doc["results"]}

    free = rates([*CLI, *args, "--json", "-"])
    throttled = rates(wrap([*CLI, *args, "--json", "-"]))
    print(f"limits read {read_bps / 1e6:.1f} write {write_bps / 1e6:.1f} MB/s; throttled {throttled}; free {free}")
    assert throttled["seq-read"] == pytest.approx(read_bps, rel=0.15), (throttled, free)
    assert throttled["seq-write"] == pytest.approx(write_bps, rel=0.15), (throttled, free)
    assert free["seq-read"] > 2 * read_bps and free["seq-write"] > 2 * write_bps, free
    assert os.listdir(point) == ["lost+found"]
