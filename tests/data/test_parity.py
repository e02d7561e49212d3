"""Sample i here has the same tokens, labels, masks and position ids as sample i of megatron-core's own
GPTDataset / BlendedDataset, built by its BlendedMegatronDatasetBuilder on the same files."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
from loader_data import EOD, VOCAB, write_dataset

from corpusforge.data import BlendedDataset, GPTDataset, build_gpt_datasets
from corpusforge.data.gpt_dataset import count_epochs, split_ranges

mgpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
mbuilder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")


@pytest.fixture(autouse=True)
def _single_process_rank(monkeypatch):
    """megatron-core's BlendedDataset asks torch.distributed for the rank even without a process group."""
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)


class StandInTokenizer:
    """The attributes megatron-core's GPTDataset reads from a tokenizer, and nothing else."""

    def __init__(self, pad: int | None = None) -> None:
        self.eod = EOD
        self.vocab_size = VOCAB
        if pad is not None:
            self.pad = pad
        self.unique_identifiers = {"class": "StandInTokenizer", "pad": pad}


def megatron_datasets(blend, seq_length, split, seed, sizes, cache, pad=None, **options):
    """Megatron's (train, valid, test) for a blend given as [prefix, weight, ...] or [prefix, ...]."""
    names = [x for x in blend if isinstance(x, str)]
    weights = [float(x) for x in blend if not isinstance(x, str)] or None
    config = mgpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(names, weights),
        split=split,
        path_to_cache=str(cache),
        tokenizer=StandInTokenizer(pad),
        reset_position_ids=options.get("reset_position_ids", False),
        reset_attention_mask=options.get("reset_attention_mask", False),
        eod_mask_loss=options.get("eod_mask_loss", False),
        create_attention_mask=options.get("create_attention_mask", False),
        add_extra_token_to_sequence=options.get("add_extra_token_to_sequence", True),
        drop_last_partial_validation_sequence=options.get("drop_last_partial_validation_sequence", True),
    )
    return mbuilder.BlendedMegatronDatasetBuilder(mgpt.GPTDataset, list(sizes), lambda: True, config).build()


def assert_same_samples(ours, theirs, max_samples: int = 1500) -> int:
    """Compare every sample (or a seeded subset of max_samples) field by field; returns how many were compared."""
    assert (ours is None) == (theirs is None)
    if ours is None:
        return 0
    assert len(ours) == len(theirs)
    ids = np.arange(len(ours))
    if len(ids) > max_samples:
        ids = np.unique(np.r_[ids[:50], ids[-50:], np.random.default_rng(0).choice(ids, max_samples)])
    batch = ours.get_batch(ids)
    for row, i in enumerate(ids):
        ref = theirs[int(i)]
        for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "dataset_id"):
            if key in ref:
                expected = ref[key].numpy() if hasattr(ref[key], "numpy") else np.asarray(ref[key])
                np.testing.assert_array_equal(batch[key][row], expected, err_msg=f"sample {i}, {key}")
            else:
                assert key not in batch
    return len(ids)


def run_case(tmp_path, blend, seq_length, split, seed, sizes, pad=None, **options):
    theirs = megatron_datasets(blend, seq_length, split, seed, sizes, tmp_path / "megatron", pad, **options)
    ours = build_gpt_datasets(
        blend, seq_length, split, seed, sizes, tmp_path / "ours", pad_token_id=pad, eod_token_id=EOD, **options
    )
    compared = sum(assert_same_samples(o, t) for o, t in zip(ours, theirs))
    assert compared > 0
    return ours


@pytest.mark.parametrize("seed", [1234, 7, 2**31 - 1])
def test_single_dataset_same_samples(tmp_path, corpora, seed):
    ours = run_case(tmp_path, [corpora[0]], 64, "80,15,5", seed, (900, 120, 40))
    assert all(isinstance(d, GPTDataset) for d in ours)


def test_separate_final_epoch_both_ways(tmp_path, corpora):
    """Three epochs whose last supplies 5% (shuffled apart) or 95% (shuffled with the rest) of an epoch."""
    prefix = corpora[1]
    from corpusforge.indexed import IndexedDataset

    ds = IndexedDataset(prefix)
    lo, hi = split_ranges("1", len(ds))[0]
    tokens = int(ds.sequence_lengths[lo:hi].sum())
    seq = 32
    per_epoch = (tokens - 1) // seq
    for fraction in (0.05, 0.95):
        n = int((2 + fraction) * per_epoch)
        assert count_epochs(tokens, n, seq, 1) == 3
        run_case(tmp_path / str(fraction), [prefix], seq, "1", 99, (n, 0, 0))


def test_masks_and_options(tmp_path, corpora):
    """reset_position_ids, reset_attention_mask, eod_mask_loss, the attention mask, and a pad id found in the data."""
    run_case(
        tmp_path,
        [corpora[2]],
        48,
        "90,10",
        5,
        (300, 30, 0),
        pad=7,
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=True,
        create_attention_mask=True,
    )


def test_no_extra_token_and_partial_validation_sample(tmp_path, corpora):
    run_case(
        tmp_path,
        [corpora[0]],
        50,
        "70,30",
        11,
        (200, None, None),
        add_extra_token_to_sequence=False,
        drop_last_partial_validation_sequence=False,
    )
    run_case(
        tmp_path / "extra",
        [corpora[0]],
        50,
        "70,30",
        11,
        (200, None, None),
        drop_last_partial_validation_sequence=False,
    )


@pytest.mark.parametrize("seed", [1234, 3])
def test_blend_of_three_same_samples(tmp_path, corpora, seed):
    blend = [corpora[0], 0.5, corpora[1], 0.3, corpora[2], 0.2]
    ours = run_case(tmp_path, blend, 64, "80,15,5", seed, (2000, 150, 40))
    assert all(isinstance(d, BlendedDataset) for d in ours)
    counts = np.bincount(ours[0].dataset_index, minlength=3) / len(ours[0])
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=2e-3)


def test_blend_without_weights(tmp_path, corpora):
    """Weighted by the datasets' lengths: capped at a size for train, every sample once (exhaustive) for valid."""
    run_case(tmp_path, list(corpora), 64, "85,15", 17, (500, None, None))


def test_larger_dataset_default_split(tmp_path):
    """The default split 969,30,1 on 3000 documents, and sample counts that need several epochs."""
    prefix = write_dataset(tmp_path / "big_text_document", 3000, seed=4, max_len=100)
    run_case(tmp_path, [prefix], 128, "969,30,1", 1234, (4000, 200, 10))


# ---------------------------------------------------------------------------------------------------------------
# the index builders against megatron-core's compiled helpers, on many random inputs


@pytest.fixture(params=["c", "numba", "numpy"])
def index_kernels(request, monkeypatch):
    """The index builders every way: the C sample index (where pip built it), their numba kernels, and the numpy
    code used before a kernel is loaded."""
    from corpusforge.data import gpt_dataset

    if request.param == "c":
        assert gpt_dataset._sample_index is not None, "corpusforge._sample_index is not built: pip install -e ."
    else:
        monkeypatch.setattr(gpt_dataset, "_sample_index", None)
    if request.param == "numba":
        monkeypatch.setattr(gpt_dataset, "_COMPILED_FROM", 0)
    elif request.param == "numpy":
        monkeypatch.setattr(gpt_dataset, "_COMPILED_FROM", 1 << 62)
        monkeypatch.setattr(gpt_dataset, "ready", lambda kernel: False)
        monkeypatch.setattr(gpt_dataset, "started", lambda: False)
    return request.param


@pytest.mark.parametrize("extra", [1, 0])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_index_equals_helpers_cpp(extra, drop_last, index_kernels):
    from megatron.core.datasets import helpers_cpp

    from corpusforge.data.gpt_dataset import build_sample_index, count_samples

    rng = np.random.default_rng(extra * 2 + drop_last)
    for case in range(60):
        lengths = rng.integers(0 if case % 3 else 1, rng.integers(2, 400), size=rng.integers(1, 60)).astype(np.int32)
        lengths[rng.integers(len(lengths))] = max(2, lengths.max())  # at least some tokens
        epochs = int(rng.integers(1, 4))
        doc_index = np.tile(np.arange(len(lengths), dtype=np.int32), epochs)
        rng.shuffle(doc_index)
        tokens = int(lengths.sum())
        seq = int(rng.integers(2, max(3, tokens * epochs // 3)))
        if tokens * epochs - extra < seq:
            continue
        # The raw C++ function: megatron's wrapper asserts on its own output when the last document is empty.
        ref = helpers_cpp.build_sample_idx_int32(lengths, doc_index, seq, epochs, tokens, drop_last, extra)
        n = count_samples(epochs * tokens, seq, extra, drop_last)
        ours = build_sample_index(lengths, doc_index, seq, n, extra)
        np.testing.assert_array_equal(ours, ref, err_msg=f"case {case}")
        assert ours.dtype == ref.dtype


def test_sample_index_over_many_documents_equals_helpers_cpp(index_kernels):
    """Enough documents for several of the blocks whose lengths the walk gathers at a time, and documents both
    shorter and longer than a sample."""
    from megatron.core.datasets import helpers_cpp

    from corpusforge.data.gpt_dataset import build_document_index, build_sample_index, count_samples

    rng = np.random.default_rng(11)
    for seq, high in ((16, 10), (64, 300), (7, 2)):
        lengths = rng.integers(0, high, size=20_000).astype(np.int32)
        tokens, epochs = int(lengths.sum()), 2
        doc_index = build_document_index(np.arange(len(lengths)), epochs, np.random.RandomState(seq), True)
        for extra in (1, 0):
            ref = helpers_cpp.build_sample_idx_int32(lengths, doc_index, seq, epochs, tokens, True, extra)
            ours = build_sample_index(lengths, doc_index, seq, count_samples(epochs * tokens, seq, extra, True), extra)
            np.testing.assert_array_equal(ours, ref, err_msg=f"seq {seq}, extra {extra}")


def test_blending_indices_equal_helpers_cpp():
    from megatron.core.datasets import helpers_cpp

    from corpusforge.data.blended import build_blending_indices, build_exhaustive_blending_indices, normalize

    rng = np.random.default_rng(0)
    for case in range(40):
        k = int(rng.integers(1, 12))
        weights = normalize(rng.random(k) + (0 if case % 4 else 1e-9))
        if case % 5 == 0:
            weights = normalize([1.0] * k)  # all ties
        size = int(rng.integers(0, 5000))
        ref_d, ref_s = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers_cpp.build_blending_indices(ref_d, ref_s, np.array(weights), k, size, False)
        ours_d, ours_s = build_blending_indices(weights, size)
        np.testing.assert_array_equal(ours_d, ref_d)
        np.testing.assert_array_equal(ours_s, ref_s)

        sizes = rng.integers(1, 300, size=k).astype(np.int64)
        ref_d, ref_s = np.zeros(sizes.sum(), np.int16), np.zeros(sizes.sum(), np.int64)
        helpers_cpp.build_exhaustive_blending_indices(ref_d, ref_s, sizes, k)
        ours_d, ours_s = build_exhaustive_blending_indices(sizes.tolist())
        np.testing.assert_array_equal(ours_d, ref_d)
        np.testing.assert_array_equal(ours_s, ref_s)


WEIGHT_CLASSES = {
    "random": lambda rng, k: rng.uniform(0.1, 1.0, k),
    "equal": lambda rng, k: np.ones(k),  # every comparison a tie broken by the counts, then the index
    "equal_but_one_ulp": lambda rng, k: 1.0 + rng.integers(0, 3, k) * 2.0**-52,  # errors that nearly never cross
    "few_distinct": lambda rng, k: rng.integers(1, 4, k).astype(float),
    "spread_over_decades": lambda rng, k: np.exp(rng.uniform(-9, 0, k)),
}


@pytest.mark.parametrize("weights", list(WEIGHT_CLASSES))
def test_blending_tournament_equals_helpers_cpp_scan(weights):
    """The kinetic tournament against helpers.cpp's scan over every dataset at every step, for the kinds of
    weights where a certificate could go wrong: ties, near-ties, crossings at every scale, a dataset leaving."""
    from megatron.core.datasets import helpers_cpp

    from corpusforge.data.blended import build_blending_indices, build_exhaustive_blending_indices, normalize

    rng = np.random.default_rng(len(weights))
    for k in (1, 2, 3, 5, 17, 64, 300):
        w = normalize(WEIGHT_CLASSES[weights](rng, k))
        size = int(rng.integers(1, 30_000))
        ref_d, ref_s = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers_cpp.build_blending_indices(ref_d, ref_s, np.array(w), k, size, False)
        ours_d, ours_s = build_blending_indices(w, size)
        np.testing.assert_array_equal(ours_d, ref_d, err_msg=f"{k} datasets, {size} samples")
        np.testing.assert_array_equal(ours_s, ref_s)
        sizes = np.maximum(1, np.round(np.array(w) * rng.integers(k, 20 * k))).astype(np.int64)
        ref_d, ref_s = np.zeros(sizes.sum(), np.int16), np.zeros(sizes.sum(), np.int64)
        helpers_cpp.build_exhaustive_blending_indices(ref_d, ref_s, sizes, k)
        ours_d, ours_s = build_exhaustive_blending_indices(sizes.tolist())
        np.testing.assert_array_equal(ours_d, ref_d, err_msg=f"exhaustive, sizes {sizes.tolist()[:8]}...")
        np.testing.assert_array_equal(ours_s, ref_s)


@pytest.mark.parametrize("reset_position_ids", [False, True])
@pytest.mark.parametrize("reset_attention_mask", [False, True])
def test_masks_equal_megatron(reset_position_ids, reset_attention_mask):
    import torch

    from corpusforge.data.batch import make_batch
    from corpusforge.data.gpt_dataset import GPTDatasetConfig

    rng = np.random.default_rng(1)
    text = rng.integers(0, 6, size=(5, 41)).astype(np.int32)  # many EODs (0), some adjacent
    text[0, 0] = text[1, -2] = EOD
    config = GPTDatasetConfig(
        40,
        eod_token_id=EOD,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=True,
        create_attention_mask=True,
    )
    ours = make_batch(text, config)
    for row in range(len(text)):
        tokens = torch.from_numpy(text[row, :-1]).long()
        mask, loss, pos = mgpt._get_ltor_masks_and_position_ids(
            tokens, EOD, reset_position_ids, reset_attention_mask, True, True
        )
        np.testing.assert_array_equal(ours["attention_mask"][row], mask.numpy())
        np.testing.assert_array_equal(ours["loss_mask"][row], loss.numpy())
        np.testing.assert_array_equal(ours["position_ids"][row], pos.numpy())


# ---------------------------------------------------------------------------------------------------------------
# a split shorter than one sample: repeated over as many epochs as its samples need, as megatron-core repeats it


def write_lengths(prefix, lengths: list[int], seed: int) -> str:
    """A dataset of documents of exactly these lengths (random tokens, EOD last), for splits of a known size."""
    from corpusforge.indexed import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=sum(lengths))
    tokens[np.cumsum(lengths) - 1] = EOD
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(tokens, np.array(lengths))
    return str(prefix)


SEQ = 64
# the test split's documents (split "50,0,50" of ten documents: the last five, or those given and the rest empty)
SHORT_SPLITS = {
    "under_seq_length": [40, 20],
    "seq_length": [40, 24],  # 64 tokens: a sample reads 65
    "seq_length_plus_1": [40, 25],  # exactly one sample per epoch: no warning
    "many_short_documents": [5, 9, 3, 12, 7],
    "one_token": [1],
}
SEEDS = [1, 1234, 7, 99, 2**31 - 1]  # one per shape


@pytest.mark.parametrize("blend", [False, True])
@pytest.mark.parametrize("shape", sorted(SHORT_SPLITS))
def test_split_shorter_than_one_sample_repeats_like_megatron(tmp_path, shape, blend):
    from corpusforge.data.gpt_dataset import ShortSplitWarning

    test_docs = SHORT_SPLITS[shape]
    seed = SEEDS[sorted(SHORT_SPLITS).index(shape)]
    prefixes = [
        write_lengths(tmp_path / f"d{i}", [150] * 5 + test_docs + [0] * (5 - len(test_docs)), seed + i)
        for i in range(2 if blend else 1)
    ]
    spec = [prefixes[0], 0.6, prefixes[1], 0.4] if blend else prefixes
    tokens = sum(test_docs)
    sizes = (40, 0, 9)
    short = tokens < SEQ + 1
    with pytest.warns(ShortSplitWarning) if short else _no_short_split_warning():
        ours = run_case(tmp_path, spec, SEQ, "50,0,50", seed, sizes)
    for part in ours[2].datasets if blend else [ours[2]]:  # the same samples as megatron-core's, from repeats
        epochs = count_epochs(tokens, part.num_samples, SEQ, 1)
        assert epochs > 1 and len(part.document_index) == 5 * epochs


@pytest.mark.parametrize("sizes", [(40, 0, None), (40, 0, 0)])
def test_split_shorter_than_one_sample_with_no_count_gives_what_megatron_gives(tmp_path, sizes):
    """One pass (no sample count) over a split shorter than a sample: no samples, as in megatron-core."""
    from corpusforge.data.gpt_dataset import ShortSplitWarning

    prefix = write_lengths(tmp_path / "d", [150] * 5 + [40, 20, 0, 0, 0], 3)
    warned = pytest.warns(ShortSplitWarning, match="one pass over it gives 0 sample")
    with warned if sizes[2] is None else nullcontext():
        ours = run_case(tmp_path, [prefix], SEQ, "50,0,50", 5, sizes)
    assert len(ours[2]) == 0


def test_split_shorter_than_one_sample_says_how_often_it_repeats(tmp_path):
    """The issue's case: a 2-document test split of 209 tokens at seq_length 256, repeated 9 times for 7 samples."""
    from corpusforge.data.gpt_dataset import ShortSplitWarning

    prefix = write_lengths(tmp_path / "d", [300] * 98 + [150, 59], 0)
    with pytest.warns(ShortSplitWarning) as caught:
        ours = run_case(tmp_path, [prefix], 256, "98,0,2", 1, (50, 0, 7))
    (line,) = [str(w.message) for w in caught if "test split" in str(w.message)]
    assert "holds 209 tokens, fewer than one sample of 257: it is repeated 9 times for its 7 samples" in line
    assert "\n" not in line and prefix in line
    assert len(ours[2]) == 7


@pytest.mark.parametrize("blend", [False, True])
def test_split_without_tokens_is_an_error_not_a_endless_loop(tmp_path, blend):
    """megatron-core loops forever on a split with no tokens and a sample count (seen: a blend of 500 datasets of
    200 documents at split 969,30,1 spun for 13 CPU-minutes); corpusforge refuses it with one line, at once."""
    prefixes = [write_lengths(tmp_path / f"d{i}", [50] * 200, i) for i in range(2)]
    spec = [prefixes[0], 0.5, prefixes[1], 0.5] if blend else prefixes[:1]
    with pytest.raises(ValueError, match=r"the test split \(sequences \[200, 200\) of 200.*holds 0 tokens") as e:
        build_gpt_datasets(spec, 64, "969,30,1", 1, (100, 10, 5), tmp_path / "cache", eod_token_id=EOD)
    assert "\n" not in str(e.value) and "loop forever" in str(e.value)


class _no_short_split_warning:
    def __enter__(self):
        import warnings

        from corpusforge.data.gpt_dataset import ShortSplitWarning

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", ShortSplitWarning)

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


# ---------------------------------------------------------------------------------------------------------------
# the per-sample and batched torch calls (ds[i], ds.__getitems__), on both read paths: copied in one compiled call
# from the memory map (mmap modes) or read by spans and assembled (pread)

OPTION_SETS = {
    "default": {},
    "eod_mask_reset_positions_pad_in_data": {"eod_mask_loss": True, "reset_position_ids": True, "pad": 7},
    "no_extra_token_partial_validation": {
        "add_extra_token_to_sequence": False,
        "drop_last_partial_validation_sequence": False,
    },
    "partial_validation_padded": {"drop_last_partial_validation_sequence": False, "pad": 5},
    # megatron-core builds each (1, S, S) mask with torch.tril: ~10 ms a sample here, so a few samples only
    "attention_mask": {"create_attention_mask": True, "eod_mask_loss": True, "compare": 12},
}


@pytest.mark.parametrize("read_mode", ["mmap-random", "pread"])
@pytest.mark.parametrize("options", list(OPTION_SETS), ids=list(OPTION_SETS))
def test_getitem_and_getitems_equal_megatron(tmp_path, corpora, options, read_mode):
    from corpusforge.data import StorageConfig

    options = dict(OPTION_SETS[options])
    pad, compare = options.pop("pad", None), options.pop("compare", None)
    blend, seq, split, sizes = [corpora[2]], 40, "70,30", (100, None, None)
    theirs = megatron_datasets(blend, seq, split, 3, sizes, tmp_path / "megatron", pad, **options)
    storage = StorageConfig(read_mode=read_mode)
    ours = build_gpt_datasets(
        blend, seq, split, 3, sizes, tmp_path / "ours", storage, pad_token_id=pad, eod_token_id=EOD, **options
    )
    for o, t in zip(ours[:2], theirs[:2]):
        assert len(o) == len(t)
        batched = {}
        for lo in range(0, len(o), 8):
            for key, value in o.__getitems__(list(range(lo, min(len(o), lo + 8)))).items():
                batched.setdefault(key, []).append(value.numpy())
        batched = {k: np.concatenate(v) for k, v in batched.items()}
        for i in range(min(len(o), compare or len(o))):
            ref, one = t[i], o[i]
            assert sorted(one) == sorted(ref)
            for key, expected in ref.items():
                np.testing.assert_array_equal(one[key].numpy(), expected.numpy(), err_msg=f"ds[{i}] {key}")
                np.testing.assert_array_equal(batched[key][i], expected.numpy(), err_msg=f"batched {i} {key}")
