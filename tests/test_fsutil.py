"""The one atomic-write helper: whole or nothing under the final name, on an exception and on a real SIGKILL."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from corpusforge import fsutil


def test_atomic_write_publishes_whole_file_with_shared_permissions(tmp_path):
    target = tmp_path / "a.bin"
    old = os.umask(0o022)
    try:
        with fsutil.atomic_write(target) as f:
            f.write(b"abc")
            assert not target.exists()  # nothing under the final name until the block ends
    finally:
        os.umask(old)
    assert target.read_bytes() == b"abc"
    assert target.stat().st_mode & 0o777 == 0o644
    assert list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_atomic_write_failure_keeps_old_file_and_leaves_no_temp(tmp_path, error):
    target = tmp_path / "a.json"
    target.write_text("old")
    with pytest.raises(type(error)):
        with fsutil.atomic_write(target, "w") as f:
            f.write("half")
            raise error
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("helper", ["atomic_path", "write_json_atomic", "save_npy_atomic", "write_bytes_atomic"])
def test_every_form_cleans_up_on_failure(tmp_path, helper):
    target = tmp_path / "x"
    with pytest.raises((TypeError, ValueError)):
        if helper == "atomic_path":
            with fsutil.atomic_path(target) as tmp:
                tmp.write_bytes(b"half")
                raise TypeError("writer failed")
        elif helper == "write_json_atomic":
            fsutil.write_json_atomic(target, {"a": object()})  # json fails after writing "{"
        elif helper == "save_npy_atomic":
            fsutil.save_npy_atomic(target, np.array([object()]))  # a pickle is refused mid-write
        else:
            fsutil.write_bytes_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_sigkill_mid_write_leaves_old_file_and_a_leftover_that_is_removed(tmp_path):
    target = tmp_path / "a.npy"
    fsutil.save_npy_atomic(target, np.arange(3))
    child = textwrap.dedent(
        f"""
        import os, signal, sys
        from corpusforge import fsutil
        with fsutil.atomic_write({str(target)!r}) as f:
            f.write(b"partial")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", child], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert np.load(target).tolist() == [0, 1, 2]
    removed = fsutil.remove_leftovers(tmp_path)
    assert [p.name.startswith("a.npy.") and p.suffix == ".tmp" for p in removed] == [True]
    assert list(tmp_path.iterdir()) == [target]


def test_json_forms_match_the_writers_they_replace(tmp_path):
    data = {"b": 1, "a": [1, 2]}
    fsutil.write_json_atomic(tmp_path / "plain.json", data)
    fsutil.write_json_atomic(tmp_path / "sorted.json", data, sort_keys=True, newline=True)
    assert (tmp_path / "plain.json").read_text() == json.dumps(data, indent=1)
    assert (tmp_path / "sorted.json").read_text() == json.dumps(data, indent=1, sort_keys=True) + "\n"


def test_refuses_append_and_read_modes(tmp_path):
    for mode in ("ab", "r+b", "a"):
        with pytest.raises(ValueError, match="new file"):
            with fsutil.atomic_write(tmp_path / "x", mode):
                pass


def test_is_url():
    assert fsutil.is_url("s3://b/k") and fsutil.is_url("memory://x")
    assert not fsutil.is_url("/data/x") and not fsutil.is_url("file:///data/x")


# -- a failed write names the path the caller gave, never a temporary file (real tmpfs mounts: run as root) --------

from iobench import iobench_helpers  # noqa: E402 - tests/iobench's helpers: a tmpfs mounted for a test

mount_tmpfs = iobench_helpers.tmpfs  # the fixture: mount(size, options) -> a fresh tmpfs, unmounted after the test

WRITERS = {
    "write_bytes_atomic": fsutil.write_bytes_atomic,
    "save_npy_atomic": lambda path, data: fsutil.save_npy_atomic(path, np.frombuffer(data, np.uint8)),
    "write_json_atomic": lambda path, data: fsutil.write_json_atomic(path, {"x": data.hex()}),
}


def _at(writer):
    """A writer by name in an open directory (write_at_atomic, write_new_at), called with a path."""

    def write(path, data: bytes) -> None:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            writer(fd, path.name, data, where=path.parent)
        finally:
            os.close(fd)

    return write


WRITERS["write_at_atomic"] = _at(fsutil.write_at_atomic)
WRITERS["write_new_at"] = _at(fsutil.write_new_at)


def _write_through(helper: str, path, data: bytes) -> None:
    if helper == "atomic_write":
        with fsutil.atomic_write(path) as f:
            f.write(data)
    elif helper == "atomic_path":
        with fsutil.atomic_path(path) as tmp:
            tmp.write_bytes(data)
    else:
        WRITERS[helper](path, data)


@pytest.mark.parametrize("helper", ["atomic_write", "atomic_path", *WRITERS])
def test_a_read_only_place_names_the_final_path(mount_tmpfs, helper):
    target = mount_tmpfs("1m", ",ro") / "out.bin"
    with pytest.raises(OSError) as err:
        _write_through(helper, target, b"abc")
    assert err.value.errno == errno.EROFS and err.value.filename == str(target)


@pytest.mark.parametrize("helper", ["atomic_write", "atomic_path", *WRITERS])
def test_a_full_disk_names_the_final_path_and_leaves_nothing(mount_tmpfs, helper):
    where = mount_tmpfs("1m")
    with pytest.raises(OSError) as err:
        _write_through(helper, where / "out.bin", os.urandom(3 << 20))
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(where / "out.bin")
    assert list(where.iterdir()) == []


def test_check_writable_creates_the_directory_or_names_the_path(mount_tmpfs, tmp_path):
    fsutil.check_writable(tmp_path / "a" / "b" / "out.json")
    assert (tmp_path / "a" / "b").is_dir()
    target = mount_tmpfs("1m", ",ro") / "sub" / "out.json"
    with pytest.raises(OSError) as err:
        fsutil.check_writable(target)
    assert err.value.errno == errno.EROFS and err.value.filename == str(target)


def test_naming_keeps_the_name_of_an_existing_file_and_errors_that_are_not_the_places(tmp_path):
    existing = tmp_path / "input.jsonl"
    existing.write_text("x")
    for error in (
        OSError(errno.EACCES, "Permission denied", str(existing)),  # an input that cannot be read
        OSError(errno.EIO, "Input/output error"),  # broken storage: not a place to choose differently
        FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "missing")),
    ):
        with pytest.raises(OSError) as err:
            with fsutil.naming(tmp_path / "out.bin"):
                raise error
        assert err.value is error
    with pytest.raises(OSError) as err:
        with fsutil.naming(tmp_path / "out.bin", existing):  # an existing file written for out.bin
            raise OSError(errno.ENOSPC, "No space left on device", str(existing))
    assert err.value.filename == str(tmp_path / "out.bin") and err.value.__cause__ is not None


def _stage_files(stage) -> None:
    fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert fsutil.write_new_at(fd, "a.npy", b"head", memoryview(np.arange(4, dtype=np.int32))) == 20
        fsutil.write_new_at(fd, "a-description.txt", b"{}")
        with pytest.raises(FileExistsError):  # never over an existing file
            fsutil.write_new_at(fd, "a.npy", b"other")
    finally:
        os.close(fd)


@pytest.mark.parametrize("target_state", ["absent", "empty"])
def test_staging_dir_publishes_every_file_at_once(tmp_path, target_state):
    target = tmp_path / "cache"
    if target_state == "empty":
        target.mkdir()
        os.chmod(target, 0o2750)  # its permission bits (setgid too) are the published directory's
    stage = fsutil.staging_dir(target)
    assert stage is not None and stage.parent == tmp_path and stage.name.startswith(".cache.")
    _stage_files(stage)
    assert not (target / "a.npy").exists()  # nothing under the final name before the publish
    assert fsutil.publish_dir(stage, target)
    assert sorted(os.listdir(target)) == ["a-description.txt", "a.npy"] and not stage.exists()
    assert (target / "a.npy").read_bytes()[:4] == b"head"
    if target_state == "empty":
        assert os.stat(target).st_mode & 0o7777 == 0o2750


def test_staging_dir_is_not_used_where_the_directory_holds_anything_or_is_a_link(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / ".hidden").write_text("x")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "file").write_text("x")
    for target in (full, tmp_path / "link", tmp_path / "file"):
        assert fsutil.staging_dir(target) is None, target
    assert sorted(os.listdir(tmp_path)) == ["file", "full", "link", "real"]  # no stage made


def test_publish_refuses_a_directory_filled_meanwhile_and_keeps_both(tmp_path):
    target = tmp_path / "cache"
    stage = fsutil.staging_dir(target)
    _stage_files(stage)
    target.mkdir()
    (target / "theirs.npy").write_bytes(b"theirs")  # another writer, between the stage and the publish
    assert not fsutil.publish_dir(stage, target)
    assert os.listdir(target) == ["theirs.npy"] and sorted(os.listdir(stage)) == ["a-description.txt", "a.npy"]


def test_stages_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    stale = tmp_path / f".cache.{host}-{int(dead.stdout)}.0badf00d.stage"
    live = tmp_path / f".cache.{host}-{os.getpid()}.0badf00d.stage"
    other = tmp_path / f".cachex.{host}-{int(dead.stdout)}.0badf00d.stage"  # another directory's
    for stage in (stale, live, other):
        stage.mkdir()
        (stage / "a.npy").write_bytes(b"partial")
    stage = fsutil.staging_dir(tmp_path / "cache")
    assert not stale.exists() and live.exists() and other.exists() and stage.exists()


def test_staging_in_a_read_only_place_names_the_directory_asked_for(mount_tmpfs):
    where = mount_tmpfs("1m", ",ro")
    for target in (where / "cache", where / "a" / "cache"):
        with pytest.raises(OSError) as err:
            fsutil.staging_dir(target)
        assert err.value.errno == errno.EROFS and err.value.filename == str(target)
