"""A process's first samples come from numpy while numba's kernels load on a thread beside them (jit.py): the same
fields as the kernels', on every read mode, with document boundaries and in blends; a fork while the load is in
flight waits for it, and load_kernels leaves the kernels loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from corpusforge.data import build_gpt_datasets
from corpusforge.data.batch import (
    _fill_bounded,
    _fill_bounded_numpy,
    _split_text,
    _split_text_numpy,
    kernel_options,
    reset_positions,
    reset_positions_numpy,
)
from corpusforge.data.gpt_dataset import GPTDatasetConfig, _gather, _gather_numpy
from corpusforge.storage import readwatch

OPTIONS = [
    {},
    {"eod_mask_loss": True, "reset_position_ids": True},
    {"pad_token_id": 7, "add_extra_token_to_sequence": False},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_numpy_gather_equals_the_kernel(corpora, tmp_path, options):
    for prefix in corpora[:2]:  # uint16 with empty documents, int32
        train = build_gpt_datasets(prefix, 64, "1", 1234, (300, 0, 0), tmp_path, eod_token_id=0, **options)[0]
        args = train._direct_args()
        slot = readwatch.slot_for(train._mapped_path)  # both mark their read there: one more, at the same offset
        ids = np.random.default_rng(0).integers(0, len(train), 40)
        for batch in (ids[:1], ids):
            ours, theirs = np.empty((2, 4, len(batch), 64), np.int32)
            reads = slot[readwatch.READS]
            assert _gather_numpy(batch, *args, ours, slot) == 0 and slot[readwatch.READS] == reads + 1
            where = slot[readwatch.OFFSET]
            assert _gather(batch, *args, theirs, slot) == 0 and slot[readwatch.READS] == reads + 2
            assert slot[readwatch.OFFSET] == where and slot[readwatch.START] == 0
            np.testing.assert_array_equal(ours, theirs)
        block = np.empty((4, 1, 64), np.int32)
        assert _gather_numpy(np.array([len(train)]), *args, block, slot) == -1


def random_boundaries(rng: np.random.Generator, b: int, s: int, columns: int) -> np.ndarray:
    """(B, columns) cu_seqlens rows as RawBatch.boundaries holds them: 0, cuts (repeated ones: empty pieces), then S."""
    cuts = np.sort(rng.integers(0, s + 1, (b, columns - 2)), axis=1)
    return np.concatenate([np.zeros((b, 1), np.int64), cuts, np.full((b, 1), s)], axis=1).astype(np.int32)


@pytest.mark.parametrize("options", [*OPTIONS, {"document_boundaries": True, "pad_token_id": 7}])
def test_numpy_twins_of_the_assemble_kernels_equal_them(options):
    """reset_positions, _fill_bounded and _split_text against their numpy twins, on random text (pad and eod ids
    among the tokens) and random boundaries (empty pieces, few columns and S + 1)."""
    rng = np.random.default_rng(3)
    config = GPTDatasetConfig(seq_length=48, eod_token_id=0, **options)
    s = config.seq_length
    text = rng.integers(0, 9, (6, s + config.extra)).astype(np.uint16)
    for columns in (2, 5, s + 1):
        cut = random_boundaries(rng, len(text), s, columns)
        theirs, ours = (np.full((len(text), s), -5, np.int32) for _ in range(2))
        reset_positions(cut, theirs)
        reset_positions_numpy(cut, ours)
        np.testing.assert_array_equal(ours, theirs)
        max_in = rng.integers(1, s, len(text)).astype(np.int32)
        theirs, ours = (np.full(len(text) * (5 * s + 2), -5, np.int32) for _ in range(2))
        _fill_bounded(text, kernel_options(config, True), cut, max_in, theirs)
        _fill_bounded_numpy(text, kernel_options(config, True), cut, max_in, ours)
        np.testing.assert_array_equal(ours, theirs)
    theirs, ours = (np.full((2, len(text), s), -5, np.int32) for _ in range(2))
    _split_text(text, config.extra, config.pad, *theirs)
    _split_text_numpy(text, config.extra, config.pad, *ours)
    np.testing.assert_array_equal(ours, theirs)


# Every read mode, a blend of a uint16 dataset with empty documents and an int32 one, with and without document
# boundaries (and an attention mask once): the ways a batch is read and assembled.
CASES = {
    f"{mode}{'-boundaries' * bounded}": (mode, {"document_boundaries": True} if bounded else {})
    for mode in ("pread", "direct", "mmap-random")
    for bounded in (False, True)
}
CASES["pread-mask"] = ("pread", {"create_attention_mask": True})

FIRST_BATCHES = """
import json, os, sys, threading
import numba.core.event
from numba.core.compiler_lock import global_compiler_lock
from corpusforge import jit
from corpusforge.data import build_gpt_datasets, make_loader
from corpusforge.data.batch import _fill_bounded, _split_text, fill_fields
from corpusforge.data.gpt_dataset import _document_boundaries, _gather, _sample_pieces
from corpusforge.storage import StorageConfig, readwatch

blend, cases, root = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
COMPILED_ON = set()  # the threads numba compiled on (jit's own listener, registered first, stops the kernel thread's)


class Compiles(numba.core.event.Listener):
    def on_start(self, event):
        COMPILED_ON.add(threading.current_thread().name)

    def on_end(self, event):
        pass


numba.core.event.register("numba:compile", Compiles())
KERNELS = {"_sample_pieces": _sample_pieces, "fill_fields": fill_fields, "_gather": _gather,
           "_document_boundaries": _document_boundaries, "_fill_bounded": _fill_bounded, "_split_text": _split_text}


def build(name):
    mode, options = cases[name]
    return build_gpt_datasets(blend, 64, "1", 1234, (300, 0, 0), os.path.join(root, name),
                              StorageConfig(read_mode=mode), eod_token_id=0, eod_mask_loss=True, **options)[0]


def rows(ds):
    batches = [ds.get_batch(list(range(8))), *(ds[i] for i in range(8, 12)), ds.__getitems__(list(range(12, 20)))]
    return [{k: v.tolist() for k, v in batch.items()} for batch in batches]


def dump(name, value):
    with open(os.path.join(root, name + ".json"), "w") as f:
        json.dump(value, f)


def seen(worker):  # what a forked loader worker finds loaded
    dump("worker", {"loading": jit.loading(), "pieces": jit.ready(_sample_pieces), "fields": jit.ready(fill_fields)})


def as_lists(batch):
    return {k: v.tolist() for k, v in batch.items()}


# Two children forked before anything has started numba: a loader with a forked worker (load_kernels before the fork),
# and one reading in the process, whose handing over of its first batch asks for the kernels (the lock holds the load).
loader_pid = os.fork()
if loader_pid == 0:
    loader = make_loader(build("pread"), 4, num_workers=1, multiprocessing_context="fork", worker_init_fn=seen)
    dump("loader", [as_lists(b) for _, b in zip(range(2), loader)])
    os._exit(0)
in_process_pid = os.fork()
if in_process_pid == 0:
    global_compiler_lock.acquire()
    batches = iter(make_loader(build("direct"), 4))
    first = next(batches)
    state = {"asked": jit.loading(), "started": jit.started()}
    global_compiler_lock.release()
    jit.finish_loading()
    state["ready"] = jit.ready(_sample_pieces) and jit.ready(fill_fields)
    dump("in_process", {**state, "batches": [as_lists(first), as_lists(next(batches))]})
    os._exit(0)
datasets = {name: build(name) for name in cases}
# The background load waits on numba's compiler lock, held here: every batch below must come without it.
global_compiler_lock.acquire()
first = {name: rows(ds) for name, ds in datasets.items()}
waited = {"loading": jit.loading(), "started": jit.started(), "any_ready": any(map(jit.ready, KERNELS.values()))}
named = readwatch._slots().last_location  # the file of this thread's last read: the load must not rename it
global_compiler_lock.release()
# A fork while the load is in flight (it has just got the lock): the child finds it done, not half-held.
waited["fork_in_flight"] = jit.loading()
pid = os.fork()
if pid == 0:
    ready = all(map(jit.ready, KERNELS.values()))
    dump("child", {"loading": jit.loading(), "ready": ready, "rows": rows(datasets["pread"])})
    os._exit(0)
statuses = [os.waitpid(p, 0)[1] for p in (pid, loader_pid, in_process_pid)]
jit.finish_loading()  # the background load alone, then load_kernels as a loader calls it before it forks
after_load = {name: jit.ready(k) for name, k in KERNELS.items()}
waited["slot_kept"] = readwatch._slots().last_location is named
for ds in datasets.values():
    ds.load_kernels()
print(json.dumps({"waited": waited, "statuses": statuses, "after_load": after_load, "started": jit.started(),
                  "first": first, "again": {name: rows(ds) for name, ds in datasets.items()},
                  "must_compile": jit.must_compile(), "compiled_on": sorted(COMPILED_ON)}))
"""

# The main thread's warnings while the kernels load beside it: each block records its own warning, and the process's
# warnings state is what it was. numba's compiler enters catch_warnings thousands of times (Python's warnings state is
# one per process): the kernel thread must not compile. scipy is imported first: its import, which a cached load runs on
# that thread, holds one catch_warnings block of a few attribute lookups, not what is tested here.
WARNINGS = """
import json, sys, warnings
import scipy.linalg
from corpusforge import jit
from corpusforge.data import build_gpt_datasets
from corpusforge.data.gpt_dataset import _sample_pieces
from corpusforge.storage import StorageConfig

ds = build_gpt_datasets(json.loads(sys.argv[1]), 64, "1", 1234, (300, 0, 0), sys.argv[2],
                        StorageConfig(read_mode="pread"), eod_token_id=0, eod_mask_loss=True)[0]
before = (list(warnings.filters), warnings.showwarning)
jit.load_in_background(ds.load_kernels)
loops = lost = 0
while jit.loading():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn("from the main thread")
    loops, lost = loops + 1, lost + (len(seen) != 1)
jit.finish_loading()
# The main thread's blocks left nothing behind (an import on the kernel thread may add filters of its own: awkward's)
always = ("always", None, Warning, None, 0)
kept = all(f in warnings.filters for f in before[0]) and (always in before[0] or always not in warnings.filters)
print(json.dumps({"loops": loops, "lost": lost, "same": kept and warnings.showwarning is before[1],
                  "must_compile": jit.must_compile(), "ready": jit.ready(_sample_pieces)}))
"""


def fresh_process(script: str, cache: Path, *args: str) -> dict:
    """The JSON `script` prints, run in a fresh process whose numba cache is `cache`."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          cwd=Path.cwd(), env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_first_batches_come_from_numpy_while_the_kernels_load_then_the_same_from_them(corpora, tmp_path):
    """In a fresh process whose background load is held up (numba's compiler lock taken): the first batches of every
    case (get_batch, ds[i], __getitems__) come anyway, with no kernel loaded; then the load ends (a fork meanwhile
    waits for it: the child reads with the kernels), load_kernels leaves every kernel loaded, and the same batches,
    read again through the kernels, are equal bit for bit; the load, calling the gathers of memory-mapped datasets,
    leaves the file named in the process's readwatch slot as this thread's last read left it. A child forked before
    numba started runs the loader with a forked worker: load_kernels loads the kernels before that fork (the worker
    finds them), the same batches; another runs it without workers: handing over its first batch (8 samples, fewer than
    a process reads before it asks for the kernels itself) asks for the kernels, the same batches.

    Twice, with a numba cache of its own: empty first (the kernel thread meets a compile, stops, and the kernels
    compile on the main thread, the same batches), then as the first run left it (nothing compiles at all).

    Before and after them: a main thread entering catch_warnings over and over while the kernels load beside it
    records each of its warnings, and leaves the process's filters and showwarning as it found them (none of its
    blocks' left behind, none of the others' lost), with the cache empty (the kernel thread stops at its first compile,
    which on that thread lost the main thread's warnings: a pytest.warns block saw none) and filled."""
    blend = [1, corpora[0], 2, corpora[1]]  # uint16 with empty documents, int32
    cache = tmp_path / "numba-cache"
    empty = fresh_process(WARNINGS, cache, json.dumps(blend), str(tmp_path / "empty"))
    assert (empty["must_compile"], empty["ready"], empty["lost"], empty["same"]) == (True, False, 0, True), empty
    cold = fresh_process(FIRST_BATCHES, cache, json.dumps(blend), json.dumps(CASES), str(tmp_path / "cold"))
    assert cold["must_compile"] is True and cold["compiled_on"] == ["MainThread"], cold["compiled_on"]
    assert cold["statuses"] == [0, 0, 0] and cold["started"] is True
    for name in CASES:
        assert cold["first"][name] == cold["again"][name], name

    root = tmp_path / "run"
    fresh = fresh_process(FIRST_BATCHES, cache, json.dumps(blend), json.dumps(CASES), str(root))
    assert fresh["must_compile"] is False and fresh["compiled_on"] == []
    waited = {"loading": True, "started": False, "any_ready": False, "fork_in_flight": True, "slot_kept": True}
    assert fresh["waited"] == waited
    assert fresh["statuses"] == [0, 0, 0] and fresh["started"] is True
    assert all(fresh["after_load"].values()), fresh["after_load"]
    for name in CASES:
        assert fresh["first"][name] == fresh["again"][name] == cold["first"][name], name
    child = json.loads((root / "child.json").read_text())
    assert child["loading"] is False and child["ready"] is True and child["rows"] == fresh["first"]["pread"]

    worker = json.loads((root / "worker.json").read_text())
    assert worker == {"loading": False, "pieces": True, "fields": True}, worker
    in_process = json.loads((root / "in_process.json").read_text())
    assert (in_process["asked"], in_process["started"], in_process["ready"]) == (True, False, True), in_process
    for name, batches in (("pread", json.loads((root / "loader.json").read_text())), ("direct", in_process["batches"])):
        first = fresh["first"][name][0]  # get_batch of samples 0..7
        for step, batch in enumerate(batches):
            assert batch == {k: v[step * 4 : step * 4 + 4] for k, v in first.items()}, (name, step)
    filled = fresh_process(WARNINGS, cache, json.dumps(blend), str(tmp_path / "filled"))
    assert (filled["must_compile"], filled["ready"], filled["lost"], filled["same"]) == (False, True, 0, True), filled
    assert filled["loops"] > 0, filled  # the main thread did run beside the load
