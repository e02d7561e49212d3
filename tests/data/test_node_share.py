"""storage.node_share_dir with real processes: one process of a node reads a blend's indices, the others map its
share, and a leader killed (SIGKILL) while reading or while writing the share leaves nobody hanging and nothing
half-written under the share's name."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from loader_data import write_dataset

from corpusforge.data import build_gpt_datasets
from corpusforge.storage import StorageConfig, o_direct_refused

CHILD = Path(__file__).with_name("node_share_child.py")
DATASETS = 12
TIMEOUT = 90


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp("node-share-data")
    prefixes = [write_dataset(root / f"d{k:02d}_text_document", 30 + 7 * k, seed=k, max_len=90) for k in range(12)]
    return [x for k, p in enumerate(prefixes) for x in (p, 1.0 + k / 10)]


@pytest.fixture(scope="module")
def reference(blend, tmp_path_factory) -> str:
    """The digest of one process reading for itself (no sharing: no LOCAL_WORLD_SIZE, no job name)."""
    train, _, _ = build_gpt_datasets(
        blend, seq_length=32, split="1", seed=7, num_samples=(300, 0, 0), cache_dir=tmp_path_factory.mktemp("c")
    )
    return hashlib.sha256(train.read_raw(range(len(train))).text.tobytes()).hexdigest()


@functools.cache
def read_mode(first_bin: str) -> str:
    """O_DIRECT where the file system has it: its reader stats each .bin for the device's block size, which the
    processes mapping a share must not repeat. Asked once (it opens the file)."""
    return "auto" if o_direct_refused(first_bin) else "direct"


def start(tmp_path: Path, blend: list, job: str, name: str, stall: str | None = None) -> subprocess.Popen:
    spec = {"blend": blend, "cache_dir": str(tmp_path / "cache"), "share_dir": str(tmp_path / "shm"),
            "ready": str(tmp_path / f"{name}.ready"), "stall": stall,
            "read_mode": read_mode(f"{blend[0]}.bin")}  # fmt: skip
    (tmp_path / f"{name}.json").write_text(json.dumps(spec))
    env = {**os.environ, "CORPUSFORGE_NODE_SHARE_JOB": job, "PYTHONPATH": str(CHILD.parent)}
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path / f"{name}.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_one_process_reads_the_others_map_and_read_no_index(blend, reference, tmp_path, monkeypatch):
    job = uuid.uuid4().hex
    procs = [start(tmp_path, blend, job, f"rank{r}") for r in range(2)]
    results = [result(p) for p in procs]
    assert [r["digest"] for r in results] == [reference] * 2
    assert sorted(r["from_share"] for r in results) == [False, True]  # exactly one read the indices
    # A process of the same job on this node opening the blend now touches no .idx at all: with every .idx gone it
    # still gets the same samples (its tokens come from the .bin files, as anyone's).
    moved = []
    try:
        for prefix in blend[0::2]:
            os.rename(f"{prefix}.idx", f"{prefix}.idx.away")
            moved.append(prefix)
        read_mode(f"{blend[0]}.bin")  # asked before the spy starts
        calls = record_calls(monkeypatch, Path(blend[0]).parent)
        late = opened_here(tmp_path, blend, job, monkeypatch)
    finally:
        for prefix in moved:
            os.rename(f"{prefix}.idx.away", f"{prefix}.idx")
    assert late == (reference, True)
    # Nor does it stat or access() a .bin: it opens only those it reads samples from, once each.
    assert {call for call, _ in calls} == {"open"}, calls
    assert len(calls) == len(set(calls)) <= DATASETS and all(name.endswith(".bin") for _, name in calls), calls
    # Another job (another name) does not map this job's share: it reads for itself.
    assert opened_here(tmp_path, blend, uuid.uuid4().hex, monkeypatch) == (reference, False)


def record_calls(monkeypatch, data: Path) -> list[tuple[str, str]]:
    """Every os.stat, os.lstat, os.access and os.open of this process naming a file under `data`, from now on."""
    calls: list[tuple[str, str]] = []
    for name in ("stat", "lstat", "access", "open"):
        real = getattr(os, name)

        def spy(path, *args, real=real, name=name, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path).parent == data:
                calls.append((name, Path(path).name))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, spy)
    return calls


def opened_here(tmp_path: Path, blend: list, job: str, monkeypatch) -> tuple[str, bool]:
    """(digest, from_share) of this test process opening the blend as a process of `job`."""
    monkeypatch.setenv("CORPUSFORGE_NODE_SHARE_JOB", job)
    train, _, _ = build_gpt_datasets(
        blend, seq_length=32, split="1", seed=7, num_samples=(300, 0, 0), cache_dir=tmp_path / "cache",
        storage=StorageConfig(read_mode=read_mode(f"{blend[0]}.bin"), node_share_dir=str(tmp_path / "shm")),
    )  # fmt: skip
    digest = hashlib.sha256(train.read_raw(range(len(train))).text.tobytes()).hexdigest()
    return digest, isinstance(train.datasets[0].indexed._idx, memoryview)


@pytest.mark.slow
@pytest.mark.parametrize("stall", ["reading", "writing"])
def test_killed_leader_leaves_no_one_waiting_and_no_half_share(blend, reference, tmp_path, stall, monkeypatch):
    job = uuid.uuid4().hex
    leader = start(tmp_path, blend, job, "leader", stall=stall)
    deadline = time.monotonic() + TIMEOUT
    while not (tmp_path / "leader.ready").exists():
        assert leader.poll() is None, leader.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the leader never reached its stall"
        time.sleep(0.05)
    shares = list((tmp_path / "shm").glob("corpusforge-share-*.bin"))
    assert shares == []  # mid-write: only a temporary name exists
    if stall == "writing":
        assert len(list((tmp_path / "shm").glob("corpusforge-share-*.tmp"))) == 1
    waiter = start(tmp_path, blend, job, "waiter")
    time.sleep(1.0)
    assert waiter.poll() is None  # it waits on the node-local lock
    leader.send_signal(signal.SIGKILL)
    leader.communicate(timeout=TIMEOUT)
    # It reads in the dead leader's place, then writes the share, which this test process (same job) maps.
    assert result(waiter) == {"digest": reference, "from_share": False}
    assert opened_here(tmp_path, blend, job, monkeypatch) == (reference, True)
    assert list((tmp_path / "shm").glob("*.tmp")) == []  # the dead writer's temporary file was removed
    assert len(list((tmp_path / "shm").glob("corpusforge-share-*.bin"))) == 1


FIRST_BATCH = """
import json, sys
import numpy as np
import torch  # imported before the first batch, as a job has it: numba loads beside that batch (jit.py)
from corpusforge import jit
from corpusforge.data import build_gpt_datasets
from corpusforge.data.batch import assemble
from corpusforge.storage import StorageConfig

blend, cache = json.loads(sys.argv[1]), sys.argv[2]
train, _, _ = build_gpt_datasets(blend, seq_length=32, split="1", seed=7, num_samples=(300, 0, 0), cache_dir=cache,
                                 storage=StorageConfig(read_mode="mmap"))
first = train.__getitems__(list(range(5, 13)))
started = jit.started()
ids = np.arange(len(train))[::-3]
same = all(bool((a == b).all()) for a, b in zip(train.get_batch(ids).values(),
                                                  assemble(train.read_raw(ids), train.config).values()))
print(json.dumps({"started": started, "same": same, "keys": sorted(first), "tokens": first["tokens"].tolist()}))
"""


def test_a_blends_first_batch_does_not_start_numba(blend, tmp_path):
    """A fresh process's first batch of a blend (its datasets memory-mapped) comes from each dataset's own numpy path:
    no compiled kernel loaded, so no numba start-up (~0.6-1 s of CPU per rank at a job's start); the fields equal
    assemble(read_raw), the general path, for samples from every dataset of the blend."""
    proc = subprocess.run([sys.executable, "-c", FIRST_BATCH, json.dumps(blend), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["started"] is False and out["same"] is True
    assert out["keys"] == ["dataset_id", "labels", "loss_mask", "position_ids", "tokens"]
    train, _, _ = build_gpt_datasets(blend, seq_length=32, split="1", seed=7, num_samples=(300, 0, 0))
    assert out["tokens"] == train.read_raw(range(5, 13)).text[:, :32].tolist()


def test_a_blend_on_a_network_file_system_is_fetched_concurrently(blend, tmp_path, monkeypatch):
    """On a network file system (each stat and open a round trip to its metadata server) the node's reader fetches
    the .bin sizes and .idx bytes of a blend with threads: the same datasets as opened one by one, and a missing
    .idx still refused with its pair's message. Local files stand in for the network here (the fs type check is
    the part not exercised); the fetches themselves are real."""
    import numpy as np

    from corpusforge.storage import datasets as sd

    prefixes = blend[0::2]
    fetched = []
    real_fetch = sd._fetch_concurrently
    monkeypatch.setattr(sd, "_fetch_concurrently", lambda texts: fetched.append(real_fetch(texts)) or fetched[-1])
    monkeypatch.setattr(sd, "network_fs", lambda path: False)
    one_by_one = sd.open_datasets(prefixes)
    assert not fetched
    monkeypatch.setattr(sd, "network_fs", lambda path: True)
    together = sd.open_datasets(prefixes)
    assert len(fetched) == 1 and all(data is not None for data in fetched[0][2])
    for a, b in zip(one_by_one, together):
        assert a.prefix == b.prefix and a.read_mode == b.read_mode and len(a) == len(b)
        np.testing.assert_array_equal(a.sequence_lengths, b.sequence_lengths)
        np.testing.assert_array_equal(a.read_spans(np.array([0, 5]), np.array([7, 3])),
                                      b.read_spans(np.array([0, 5]), np.array([7, 3])))  # fmt: skip
    copies = []
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            copy = tmp_path / (Path(prefix).name + ext)
            copy.write_bytes(Path(prefix + ext).read_bytes())
        copies.append(str(tmp_path / Path(prefix).name))
    (tmp_path / (Path(prefixes[4]).name + ".idx")).unlink()
    with pytest.raises(FileNotFoundError) as e:
        sd.open_datasets(copies)
    assert fetched[-1] is None and Path(prefixes[4]).name in str(e.value) and ".idx" in str(e.value)
