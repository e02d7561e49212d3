"""prepare-cache: the index caches built offline. With --megatron, megatron-core's own files, byte for byte: its
BlendedMegatronDatasetBuilder pointed at them finds every file and writes none. With --config, the trainer's own
dataset build afterwards finds every entry and writes none."""

from __future__ import annotations

import json
import os
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from loader_data import write_dataset

from corpusforge.data.cache import CacheMismatchError
from corpusforge.data.prepare_cache import (
    MegatronCacheConfig,
    megatron_num_samples,
    megatron_split_matrix,
    prepare_megatron_cache,
    prepare_train_cache,
)

VOCAB = 1000


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("prepare")
    return [
        write_dataset(root / "a_text_document", 300, seed=11, empty_every=41),
        write_dataset(root / "b_text_document", 200, seed=12, max_len=150, dtype=np.int32),
        write_dataset(root / "c_text_document", 120, seed=13, max_len=500),
    ]


def state(directory: Path) -> dict[str, tuple[int, int]]:
    """name -> (size, mtime_ns) of every file in `directory` (not below it)."""
    return {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(directory) if e.is_file()}


def megatron_build(data_path: list[str], split: str, seq_length: int, seed: int, sizes, cache: Path):
    """megatron-core's own builder, with Megatron-LM's NullTokenizer, blend read as Megatron-LM reads --data-path."""
    import torch.distributed
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    torch.distributed.get_rank = lambda *a, **k: 0  # its BlendedDataset asks even without a process group
    tokenizer = build_tokenizer(Namespace(tokenizer_type="NullTokenizer", vocab_size=VOCAB, tokenizer_metadata=None))
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=get_blend_from_list(data_path), split=split,
        path_to_cache=str(cache), tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False,
    )  # fmt: skip
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, config).build()


CASES = {
    "one dataset": (lambda s: [s[0]], "90,7,3", 64),
    "weighted blend": (lambda s: ["0.5", s[0], "0.3", s[1], "0.2", s[2]], "80,15,5", 32),
    "blend by lengths": (lambda s: list(s), "70,20,10", 48),
}


@pytest.mark.parametrize("case", CASES)
def test_megatron_finds_every_file_and_writes_none(tmp_path, sets, case):
    pytest.importorskip("megatron.core.datasets.gpt_dataset")
    paths, split, seq = CASES[case]
    data_path = paths(sets)
    config = MegatronCacheConfig(tuple(data_path), str(tmp_path / "ours"), seq, split=split, seed=77,
                                 train_iters=30, global_batch_size=8, eval_iters=2, eval_interval=10,
                                 vocab_size=VOCAB)  # fmt: skip
    sizes = megatron_num_samples(config)
    assert sizes == (240, 64, 16)
    stats = prepare_megatron_cache(config)
    ours = tmp_path / "ours"
    before = state(ours)
    megatron_files = sorted(n for n in before if not n.startswith("."))
    assert stats.written_files == len(megatron_files)
    datasets = megatron_build(data_path, split, seq, 77, sizes, ours)
    assert state(ours) == before  # found every file, wrote none, touched none
    # and the same bytes as the files megatron-core writes itself for the same arguments
    megatron_build(data_path, split, seq, 77, sizes, tmp_path / "theirs")
    theirs = sorted(os.listdir(tmp_path / "theirs"))
    assert megatron_files == theirs
    for name in theirs:
        assert (ours / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
    kinds = {n.split("-")[1] for n in theirs}
    assert kinds == ({"GPTDataset"} if case == "one dataset" else {"GPTDataset", "BlendedDataset"})
    assert len([d for d in datasets if d is not None]) == 3


def test_megatron_rerun_writes_only_what_is_missing(tmp_path, sets):
    config = MegatronCacheConfig((sets[0], sets[1]), str(tmp_path), 32, split="80,20", train_samples=100,
                                 valid_samples=10, test_samples=0, vocab_size=VOCAB)  # fmt: skip
    first = prepare_megatron_cache(config)
    files = sorted(p for p in os.listdir(tmp_path) if p.endswith(".npy"))
    before = state(tmp_path)
    victim = files[3]
    (tmp_path / victim).unlink()
    (tmp_path / (victim.rsplit("-", 2)[0] + "-x.npy.123.abcd.tmp")).write_bytes(b"partial")  # a killed write
    again = prepare_megatron_cache(config)
    after = state(tmp_path)
    assert sorted(after) == sorted(before)  # the leftover is gone, the victim is back
    assert (tmp_path / victim).stat().st_size == before[victim][0]
    changed = {n for n in after if after[n] != before[n]}
    assert victim in changed and len(changed) == 2  # the array and its entry's description
    assert again.written_files == 2 and first.written_files == again.written_files + again.found_files


def test_megatron_refuses_changed_data(tmp_path, sets):
    prefix = write_dataset(tmp_path / "d_text_document", 100, seed=5)
    config = MegatronCacheConfig((prefix,), str(tmp_path / "cache"), 32, split="1", train_samples=50,
                                 valid_samples=0, test_samples=0, vocab_size=VOCAB)  # fmt: skip
    prepare_megatron_cache(config)
    write_dataset(tmp_path / "d_text_document", 100, seed=6)  # same name, other documents
    with pytest.raises(CacheMismatchError) as e:
        prepare_megatron_cache(config)
    line = str(e.value)
    assert "\n" not in line and "written for other data" in line and "--data-cache-path" in line


def test_megatron_split_matrix_and_samples_as_megatron():
    pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    for split in ("969, 30, 1", "99,1", "1", "70,20,10", "0,1,0", "33,33,34"):
        assert megatron_split_matrix(split) == convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    # training.py: train_samples given -> train_iters = train_samples // global_batch_size
    config = MegatronCacheConfig(("a",), "c", 8, train_samples=1000, global_batch_size=16, eval_iters=3,
                                 eval_interval=20)  # fmt: skip
    assert megatron_num_samples(config) == (1000, (62 // 20 + 1) * 3 * 16, 48)


def test_cli_megatron_json_and_one_line_errors(tmp_path, sets):
    from corpusforge.cli import main

    runner = CliRunner()
    args = ["prepare-cache", "--megatron", "--data-path", "0.6", sets[0], "0.4", sets[2], "--split", "90,10,0",
            "--seq-length", "32", "--seed", "3", "--train-samples", "200", "--global-batch-size", "4",
            "--eval-iters", "2", "--eval-interval", "10", "--vocab-size", str(VOCAB),
            "--data-cache-path", str(tmp_path / "c"), "--json"]  # fmt: skip
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (
        summary["samples"] == {"train": 200, "valid": (50 // 10 + 1) * 2 * 4, "test": 8}
        and summary["written_files"] > 0
    )
    again = json.loads(runner.invoke(main, args).stdout)
    assert again["written_files"] == 0 and again["found_files"] == summary["written_files"]
    bad = runner.invoke(main, ["prepare-cache", "--megatron", "--data-path", sets[0], "--seq-length", "32",
                               "--data-cache-path", str(tmp_path / "c")])  # fmt: skip
    assert bad.exit_code == 1
    assert bad.stderr.count("\n") == 1 and "--global-batch-size" in bad.stderr
    neither = runner.invoke(main, ["prepare-cache"])
    assert neither.exit_code != 0 and "--config" in neither.stderr


def test_config_cache_is_what_the_trainer_maps(tmp_path, sets):
    """After prepare-cache --config, the trainer's own dataset build (train/data.py) finds every entry: no file is
    written, none is touched."""
    pytest.importorskip("torch")
    from corpusforge.cli import main
    from corpusforge.data.cache import wait_for_index_caches
    from corpusforge.train.config import load_config
    from corpusforge.train.data import build_data

    config = tmp_path / "run.toml"
    blend = json.dumps([sets[0], 0.7, sets[2], 0.3])
    config.write_text(
        f'out_dir = "{tmp_path / "run"}"\n[model]\nseq_length = 32\nvocab_size = {VOCAB}\n'
        f'[data]\npath = {blend}\nsplit = "90,10,0"\n'
        "[schedule]\nmicro_batch_size = 2\nglobal_batch_tokens = 128\nmax_steps = 20\n"
    )
    overrides = ["metrics.eval_interval=5", "metrics.eval_batches=2"]
    result = CliRunner().invoke(main, ["prepare-cache", "--config", str(config), *overrides, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    cache = Path(summary["cache_dir"])
    assert cache == tmp_path / "run" / "index-cache" and summary["written_files"] > 0
    before = state(cache)
    cfg = load_config(str(config), overrides)
    data = build_data(cfg, rank=0, world_size=1)
    wait_for_index_caches()
    assert state(cache) == before  # every entry found: nothing written, nothing rewritten
    assert data.train_samples == 20 * 128 // 32
    second = prepare_train_cache(cfg)
    assert second.written_files == 0 and second.found_files == summary["written_files"]


KILLED_RUN = """
import os, signal, sys
import corpusforge.data.prepare_cache as pc
write, count = pc._Writer._write, [0]

def dying_write(self, path, content):  # SIGKILL once `after` files are complete: no cleanup runs
    if count[0] >= int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    count[0] += 1
    return write(self, path, content)

pc._Writer._write = dying_write
pc._WRITERS = 1
prefixes = sys.argv[3:]
pc.prepare_megatron_cache(pc.MegatronCacheConfig(tuple(prefixes), sys.argv[1], 32, split="80,20", train_samples=300,
                                                 valid_samples=20, test_samples=0, vocab_size=1000))
"""


@pytest.mark.parametrize(
    "target, after",
    [("shared", 0), ("shared", 5), ("shared", 13), ("shared", 24), ("fresh", 5), ("fresh", 29)],
)  # 22 arrays, then the descriptions (shared); 30 files, then one rename (fresh)
def test_megatron_killed_run_then_rerun_equals_an_uninterrupted_one(tmp_path, sets, target, after):
    """Killed by SIGKILL after `after` files: into a directory holding other files (each file renamed into it, the
    descriptions last), or into a fresh one (filled aside, published by one rename: nothing under its name)."""
    import subprocess
    import sys

    whole = tmp_path / "whole"
    config = MegatronCacheConfig(tuple(sets), str(whole), 32, split="80,20", train_samples=300, valid_samples=20,
                                 test_samples=0, vocab_size=VOCAB)  # fmt: skip
    prepare_megatron_cache(config)
    killed = tmp_path / "killed"
    if target == "shared":
        killed.mkdir()
        (killed / "other-run.npy").write_bytes(b"another run's file")
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN, str(killed), str(after), *sets], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    stages = [p for p in tmp_path.iterdir() if p.name.startswith(".killed.")]
    if target == "fresh":  # nothing under the final name; the stage is left, and removed by the rerun
        assert not killed.exists() and len(stages) == 1 and len(os.listdir(stages[0])) == after
    else:
        assert stages == []
        left = {n for n in os.listdir(killed) if not n.startswith(".")} - {"other-run.npy"}
        if after < 22:  # killed among the arrays: no entry looks complete to megatron-core
            assert left and not any(n.endswith("-description.txt") for n in left) or after == 0
    prepare_megatron_cache(dataclasses_replace(config, data_cache_path=str(killed)))
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".killed.")] == []
    names = sorted(n for n in os.listdir(whole) if not n.startswith("."))
    extra = ["other-run.npy"] if target == "shared" else []
    assert sorted(n for n in os.listdir(killed) if not n.startswith(".")) == sorted(names + extra)
    for name in names:
        assert (killed / name).read_bytes() == (whole / name).read_bytes(), name


def test_megatron_cache_filled_by_another_writer_meanwhile_is_completed_file_by_file(tmp_path, sets):
    """A cache directory empty at the start, into which another writer puts a file while prepare-cache stages its
    own: the staged files are moved in one by one (nothing of the other writer's is replaced or lost), and the
    result is the uninterrupted run's files; no stage is left."""
    config = MegatronCacheConfig(tuple(sets), str(tmp_path / "whole"), 32, split="80,20", train_samples=300,
                                 valid_samples=20, test_samples=0, vocab_size=VOCAB)  # fmt: skip
    prepare_megatron_cache(config)
    cache = tmp_path / "cache"
    cache.mkdir()

    def another_writer(stage: str, done: int, total: int) -> None:
        if done == 3:
            (cache / "theirs.npy").write_bytes(b"another writer's file")

    stats = prepare_megatron_cache(dataclasses_replace(config, data_cache_path=str(cache)), progress=another_writer)
    names = sorted(n for n in os.listdir(tmp_path / "whole") if not n.startswith("."))
    assert sorted(n for n in os.listdir(cache) if not n.startswith(".")) == sorted([*names, "theirs.npy"])
    assert (cache / "theirs.npy").read_bytes() == b"another writer's file" and stats.written_files == len(names)
    for name in names:
        assert (cache / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert os.listdir(cache / ".corpusforge") == os.listdir(tmp_path / "whole" / ".corpusforge")
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".cache.")] == []


def test_megatron_failed_first_run_leaves_nothing(tmp_path, sets):
    """An error while the files are written (here: from the progress callback) leaves no cache directory and no
    stage: every file appears under its final name whole, or not at all."""
    config = MegatronCacheConfig(tuple(sets), str(tmp_path / "cache"), 32, split="80,20", train_samples=300,
                                 valid_samples=20, test_samples=0, vocab_size=VOCAB)  # fmt: skip

    def failing(stage: str, done: int, total: int) -> None:
        if done == 4:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        prepare_megatron_cache(config, progress=failing)
    assert os.listdir(tmp_path) == []


def dataclasses_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def test_blend_kernel_in_c_equals_its_numba_twin():
    """corpusforge/_blend.c (built by pip install) and blended._fill_blocks (numba: the fallback where it is not
    built) give the same blending indices, for weights with ties, near-ties and spreads, and for exhaustive blends
    where datasets leave the race; test_parity.py checks whichever is in use against helpers.cpp."""
    from corpusforge.data import blended

    if blended._blend is None:
        pytest.skip("corpusforge._blend is not built (pip install -e . builds it)")
    rng = np.random.default_rng(3)
    for k, size in ((1, 50), (2, 999), (7, 5000), (64, 20_000), (700, 40_000)):
        for weights in (rng.uniform(0.5, 1.5, k), np.ones(k), 1.0 + rng.integers(0, 3, k) * 2.0**-52,
                        np.exp(rng.uniform(-9, 0, k))):  # fmt: skip
            for limits, n in ((np.full(k, np.iinfo(np.int64).max), size), (rng.integers(1, 60, k), None)):
                n = int(limits.sum()) if n is None else n
                w = np.asarray(blended.normalize(weights) if n == size else limits / float(n))
                ours = np.zeros(n, np.int16), np.zeros(n, np.int64)
                blended._blend.fill_blocks(*ours, w, limits.astype(np.int64))
                twin = np.zeros(n, np.int16), np.zeros(n, np.int64)
                blended._fill_blocks(*twin, w, limits.astype(np.int64), n)
                np.testing.assert_array_equal(ours[0], twin[0], err_msg=f"{k} datasets, {n} samples")
                np.testing.assert_array_equal(ours[1], twin[1])


def test_sample_index_in_c_equals_its_numba_and_numpy_twins():
    """corpusforge/_sample_index.c (built by pip install), gpt_dataset._sample_starts (numba) and
    _sample_starts_numpy (the two fallbacks where it is not built) give the same bytes: documents shorter and longer
    than a sample, empty documents, with and without the extra token, samples past the stream's end (an undropped
    partial sample), both row dtypes, and enough documents for several gathered blocks; test_parity.py checks the
    one in use against helpers.cpp. A document index past the lengths is refused, not read."""
    from corpusforge.data import gpt_dataset

    if gpt_dataset._sample_index is None:
        pytest.skip("corpusforge._sample_index is not built (pip install -e . builds it)")
    rng = np.random.default_rng(5)
    cases = [(rng.integers(0 if c % 3 else 1, rng.integers(2, 400), size=rng.integers(1, 60)), c) for c in range(40)]
    cases += [(rng.integers(0, high, size=20_000), c) for c, high in enumerate((10, 300, 2))]
    for lengths, c in cases:
        lengths = lengths.astype(np.int32)
        documents = np.tile(np.arange(len(lengths), dtype=np.int32), 1 + c % 3)
        rng.shuffle(documents)
        tokens = int(lengths[documents].sum())
        seq = int(rng.integers(1, max(2, tokens // 3)))
        for extra in (0, 1):
            for samples in (max(0, tokens - extra) // seq, max(0, tokens - extra) // seq + 1 + c % 4):
                for dtype in (np.int32, np.int64):
                    ours, numba_rows, numpy_rows = (np.full((samples + 1, 2), -7, dtype) for _ in range(3))
                    gpt_dataset._sample_index.fill(lengths, documents, seq, samples, extra, ours)
                    gpt_dataset._sample_starts(lengths, documents, seq, samples, extra, numba_rows)
                    gpt_dataset._sample_starts_numpy(lengths, documents, seq, samples, extra, numpy_rows)
                    where = f"case {c}, seq {seq}, extra {extra}, {samples} samples, {dtype.__name__}"
                    assert ours.tobytes() == numba_rows.tobytes(), where
                    assert ours.tobytes() == numpy_rows.tobytes(), where
    with pytest.raises(IndexError, match="document_index"):
        gpt_dataset._sample_index.fill(
            lengths, np.array([0, len(lengths)], np.int32), 4, 2, 1, np.empty((3, 2), np.int32)
        )


def test_index_build_from_a_key_stream_equals_the_randomstate_one(monkeypatch):
    """gpt_dataset.KeyStream (the compiled shuffle drawing from a seeded MT19937 key) gives numpy's RandomState
    permutations, one after another from the same stream, for arrays of every size and item type; and whole index
    builds (several epochs, a separate last epoch or not, without the extra token) are the same bytes as those drawn
    through a RandomState (the path where the compiled shuffle is not built), which test_parity.py checks against
    megatron-core."""
    from corpusforge.data import gpt_dataset

    if not gpt_dataset.KeyStream.usable(1):
        pytest.skip("corpusforge._mt19937 is not built (pip install -e . builds it)")
    for seed in (0, 1234, 2**32 - 1):
        ours, numpy_rng = gpt_dataset.KeyStream(seed), np.random.RandomState(seed)
        for n, dtype in ((1, np.int32), (2, np.uint32), (700, np.int32), (9000, np.int64), (70_000, np.uint32)):
            a = np.arange(n, dtype=dtype)
            b = a.copy()
            ours.shuffle(a)
            numpy_rng.shuffle(b)
            assert a.tobytes() == b.tobytes(), (seed, n)
    rng = np.random.default_rng(8)
    builds = []
    for case in range(30):
        lengths = rng.integers(1, 3000, size=int(rng.integers(1, 300))).astype(np.int32)
        seq = int(rng.choice([64, 2048, 777]))
        samples = int(rng.integers(1, 4 * max(1, int(lengths.sum()) // seq) + 2))
        args = (lengths, range(0, len(lengths)), samples, seq, int(rng.integers(0, 2**31)), case % 2)
        builds.append((args, gpt_dataset.build_indices(*args)))
    monkeypatch.setattr(gpt_dataset, "_mt19937", None)
    for args, keyed in builds:
        drawn = gpt_dataset.build_indices(*args)
        for name in keyed:
            assert keyed[name].tobytes() == drawn[name].tobytes() and keyed[name].dtype == drawn[name].dtype, name
