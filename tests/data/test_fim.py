"""Fill-in-the-middle samples equal Megatron-LM's own GPTFIMDataset's, sample for sample.

The reference samples in tests/data/fim_reference/ were made by benchmarks/megatron_fim_reference.py, which runs
Megatron-LM's fim_dataset.py and gpt_dataset.py of the commit in reference.json on the stored corpus and tokenizer
(regenerate: docs/loaders.md, "Fill-in-the-middle"). These tests need neither the Megatron-LM source nor a network.
"""

from __future__ import annotations

import functools
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from corpusforge.data import build_gpt_datasets, make_loader
from corpusforge.data.fim import FIMConfig, FIMDataset, FIMTokenizer, with_fim
from corpusforge.errors import ArgumentError
from corpusforge.indexed import IndexedDatasetWriter

REFERENCE = Path(__file__).parent / "fim_reference"
MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
FIELDS = ("tokens", "labels", "loss_mask", "position_ids")
FIM_OPTIONS = ("fim_rate", "fim_spm_rate", "fim_split_sample", "fim_fragment_rate", "fim_no_prefix")  # Megatron's names
META = json.loads((REFERENCE / "reference.json").read_text())
CASES = [(name, mode) for name in META["settings"] for mode in META["rng_modes"]]


@pytest.fixture(scope="module")
def reference():
    with np.load(REFERENCE / "samples.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def tokenizer() -> FIMTokenizer:
    return FIMTokenizer(REFERENCE / "tokenizer")


@pytest.fixture(scope="module")
def corpus(reference, tmp_path_factory) -> str:
    """The stored corpus as a token dataset (.bin/.idx are not kept in git)."""
    prefix = tmp_path_factory.mktemp("fim") / "fim_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(reference["corpus/tokens"], reference["corpus/lengths"])
    return str(prefix)


def setting(name: str) -> tuple[int, dict, dict]:
    """(seq_length, FIMConfig options, GPTDatasetConfig mask options) of a stored setting."""
    s = META["settings"][name]
    fim = {k: v for k, v in s.items() if k in FIM_OPTIONS}
    masks = {k: v for k, v in s.items() if k in ("reset_position_ids", "eod_mask_loss")}
    return s["seq_length"], fim, masks


def plain_dataset(corpus: str, tokenizer: FIMTokenizer, name: str):
    seq_length, _, masks = setting(name)
    train, _, _ = build_gpt_datasets(
        corpus,
        seq_length,
        META["split"],
        META["seed"],
        (META["samples"], None, None),
        eod_token_id=tokenizer.token_id(META["fim_tokens"]["eod"]),
        pad_token_id=tokenizer.token_id(META["fim_tokens"]["pad"]),  # Megatron's tokenizer pad: the FIM pad here
        **masks,
    )
    return train


@functools.cache
def setting_tokenizer(directory: str, engine: str = "auto") -> FIMTokenizer:
    return FIMTokenizer(REFERENCE / directory, engine=engine)


def fim_dataset(corpus, tokenizer, name: str, mode: str, **changes) -> FIMDataset:
    """The setting's FIM dataset, with its own tokenizer directory (Megatron's special tokens differ by setting)."""
    _, fim, _ = setting(name)
    directory = META["settings"][name]["tokenizer"]
    tok = tokenizer if directory == "tokenizer" else setting_tokenizer(directory)
    return FIMDataset(plain_dataset(corpus, tokenizer, name), FIMConfig(**{**fim, "rng": mode, **changes}), tok)


def assert_equal_to_reference(batch: dict, reference: dict, name: str, mode: str, ids) -> None:
    for key in FIELDS:
        expected = reference[f"{name}/{mode}/{key}"][ids]
        np.testing.assert_array_equal(np.asarray(batch[key]), expected, err_msg=f"{name}, rng={mode}: {key}")


def test_reference_is_megatron_heads_and_covers_the_edge_cases(reference, tokenizer):
    """The stored samples come from the commit the brief names, and hold every case the rewrite has: PSM and SPM,
    fragments rewritten after a split token, samples padded (re-encoded shorter) and cut (sentinels added), and
    samples left alone; otherwise equality with them would prove little."""
    assert META["megatron_lm_commit"] == MEGATRON_COMMIT
    ids = {role: tokenizer.token_id(t) for role, t in META["fim_tokens"].items()}
    split_id = tokenizer.token_id(META["settings"]["split"]["fim_split_sample"])
    counts = np.zeros(5, np.int64)
    for n, m in CASES:
        if n == "off":
            continue
        text = reference[f"{n}/{m}/text"]
        starts = text[:, :-1] == ids["prefix"]
        counts += [
            (starts & (text[:, 1:] == ids["suffix"])).any(1).sum(),  # SPM (or PSM with an empty prefix)
            (starts & (text[:, 1:] != ids["suffix"])).any(1).sum(),  # PSM
            ((text[:, :-1] == split_id) & (text[:, 1:] == ids["prefix"])).any(1).sum(),  # a fragment rewritten
            (text[:, -1] == ids["pad"]).sum(),  # re-encoded shorter: padded to the sample length
            (~(text == ids["prefix"]).any(1)).sum(),  # left alone
        ]
    assert (counts > 20).all(), counts
    # special tokens' text inside documents: encoded as text there, Megatron's re-encoding makes it the token
    text = tokenizer.decode(reference["corpus/tokens"])
    assert sum(text.count(t) for t in META["fim_tokens"].values()) > 10
    np.testing.assert_array_equal(reference["off/megatron/text"], reference["off/sample/text"])


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_samples_equal_megatrons(reference, corpus, tokenizer, name, mode):
    """Every field of samples 0..N-1, read in order (Megatron's order for rng="megatron"), equals what Megatron's
    own GPTFIMDataset returned, and so does the rewritten text."""
    ids = np.arange(META["samples"])
    assert_equal_to_reference(fim_dataset(corpus, tokenizer, name, mode).get_batch(ids), reference, name, mode, ids)
    fresh = fim_dataset(corpus, tokenizer, name, mode)
    text = fresh.rewrite(ids, fresh.dataset.read_raw(ids).text)
    np.testing.assert_array_equal(text, reference[f"{name}/{mode}/text"], err_msg=f"{name}, rng={mode}: text")


@pytest.mark.parametrize("name", ["mixed", "split_no_prefix", "named_specials"])
def test_the_reference_encoder_gives_the_same_samples_as_the_fast_one(reference, corpus, tokenizer, name):
    """FIMTokenizer encodes with gigatoken where that gives Megatron's ids; tokenizers alone gives the same."""
    assert tokenizer._fast is not None  # the fast path is the one the other tests check
    slow = setting_tokenizer(META["settings"][name]["tokenizer"], "reference")
    assert slow._fast is None and slow._bytes is None
    _, fim, _ = setting(name)
    ids = np.arange(META["samples"])
    ds = FIMDataset(plain_dataset(corpus, tokenizer, name), FIMConfig(**fim), slow)
    assert_equal_to_reference(ds.get_batch(ids), reference, name, "sample", ids)


def test_the_special_tokens_are_transformers_all_special_tokens(reference, corpus, tokenizer):
    """Decoding drops the tokens transformers counts as special for the files (tokenizer_config.json's), as
    Megatron's tokenizer does: with only eod and pad named, the FIM tokens' and <file_sep>'s text is kept and moved
    by the rewrite; taking every added token as special there gives other samples."""
    named = setting_tokenizer("tokenizer_named")
    assert set(named.special_tokens) == {META["fim_tokens"]["eod"], META["fim_tokens"]["pad"]}
    assert len(tokenizer.special_tokens) == 6
    ids = np.arange(META["samples"])
    _, fim, _ = setting("named_specials")
    every = FIMDataset(plain_dataset(corpus, tokenizer, "named_specials"), FIMConfig(**fim), tokenizer)
    assert not np.array_equal(every.get_batch(ids)["tokens"], reference["named_specials/sample/tokens"])
    given = FIMTokenizer(REFERENCE / "tokenizer_named", special_tokens=tokenizer.special_tokens)
    assert given.special_ids == tokenizer.special_ids


@pytest.mark.slow  # DataLoader workers: 3 s at load 5, 23 s at load 17 on 2 cores
def test_rng_sample_is_the_same_in_any_order_and_through_workers(reference, corpus, tokenizer):
    """rng="sample": a sample is the same read alone, in a shuffled batch, after pickling, or by DataLoader
    workers."""
    name, mode = "split", "sample"
    ds = fim_dataset(corpus, tokenizer, name, mode)
    shuffled = np.random.default_rng(3).permutation(META["samples"])
    assert_equal_to_reference(ds.get_batch(shuffled), reference, name, mode, shuffled)
    one = ds[7]
    for key in FIELDS:
        np.testing.assert_array_equal(one[key].numpy(), reference[f"{name}/{mode}/{key}"][7])
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets
    assert_equal_to_reference(copy.get_batch(shuffled), reference, name, mode, shuffled)
    loader = make_loader(ds, micro_batch_size=4, num_workers=2)
    batches = [b for _, b in zip(range(META["samples"] // 4), loader)]
    got = {k: np.concatenate([b[k].numpy() for b in batches]) for k in FIELDS}
    assert_equal_to_reference(got, reference, name, mode, np.arange(len(got["tokens"])))


def test_rng_megatron_depends_on_the_read_order_as_megatrons_does(reference, corpus, tokenizer):
    """rng="megatron" draws as samples are read: read backwards, the samples are not Megatron's in-order ones
    (Megatron's would not be either), while a fresh dataset read in order gives them again."""
    name, mode = "mixed", "megatron"
    ids = np.arange(META["samples"])
    backwards = fim_dataset(corpus, tokenizer, name, mode).get_batch(ids[::-1])
    assert not np.array_equal(backwards["tokens"][::-1], reference[f"{name}/{mode}/tokens"])
    in_order = fim_dataset(corpus, tokenizer, name, mode)
    firsts = [in_order.get_batch(ids[k : k + 5]) for k in range(0, len(ids), 5)]  # batches of 5 continue the draws
    got = {k: np.concatenate([b[k] for b in firsts]) for k in FIELDS}
    assert_equal_to_reference(got, reference, name, mode, ids)


@pytest.mark.parametrize(
    "change",
    [
        {"fim_spm_rate": 0.0},
        {"fim_fragment_rate": 1.0},
        {"fim_rate": 0.5},
        {"fim_no_prefix": "#!"},
        {"seed": 99},
        {"rng": "megatron"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_each_option_changes_the_samples(reference, corpus, tokenizer, change):
    """The comparison sees each option: changed, the samples no longer equal Megatron's for the stored setting."""
    ids = np.arange(META["samples"])
    ds = fim_dataset(corpus, tokenizer, "split", "sample", **change)
    assert not np.array_equal(ds.get_batch(ids)["tokens"], reference["split/sample/tokens"])


def test_bad_options_and_tokenizers_are_one_line_errors(corpus, tokenizer, tmp_path):
    for bad, words in [
        ({"fim_rate": 1.5}, "within [0, 1]"),
        ({"fim_spm_rate": -0.1}, "within [0, 1]"),
        ({"fim_split_sample": "<file_sep>"}, "needs fim_fragment_rate"),
        ({"rng": "numpy"}, "sample, megatron"),
    ]:
        with pytest.raises(ArgumentError, match=None) as e:
            FIMConfig(**bad)
        assert words in str(e.value) and "\n" not in str(e.value)
    train = plain_dataset(corpus, tokenizer, "psm")
    with pytest.raises(ArgumentError, match="no token '<fim_hole>'") as e:
        FIMDataset(train, FIMConfig(fim_middle_token="<fim_hole>"), tokenizer)
    assert "tokenizer.json" in str(e.value)
    bounded = build_gpt_datasets(corpus, 64, META["split"], 1, (8, None, None), document_boundaries=True)[0]
    with pytest.raises(ArgumentError, match="turn document_boundaries off"):
        FIMDataset(bounded, FIMConfig(), tokenizer)
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer.json").write_bytes((REFERENCE / "tokenizer" / "tokenizer.json").read_bytes())
    (named / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "unk_token": "<unk>"}))
    assert FIMTokenizer(named).special_tokens == ("<|endoftext|>",)  # <unk>: not in the vocabulary, no id has it
    with pytest.raises(ArgumentError, match="no token '<nope>'"):
        FIMTokenizer(named, special_tokens=["<nope>"])
    (named / "tokenizer_config.json").write_text("{")
    with pytest.raises(ArgumentError, match="tokenizer_config.json: not readable JSON"):
        FIMTokenizer(named)
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"model": ')
    with pytest.raises(ArgumentError, match="not a Hugging Face tokenizer.json") as e:
        FIMTokenizer(broken)
    assert str(broken) in str(e.value)
    with pytest.raises(ArgumentError, match="not a Hugging Face tokenizer.json"):
        FIMTokenizer(tmp_path / "missing")


def test_fingerprint_carries_the_options_and_with_fim_wraps_each_split(corpus, tokenizer):
    """A loader state saved with other FIM options is refused (the fingerprint differs); with_fim(None) is a no-op."""
    train = plain_dataset(corpus, tokenizer, "psm")
    a = with_fim((train, None, None), FIMConfig(fim_rate=0.5), REFERENCE / "tokenizer" / "tokenizer.json")
    b = with_fim(train, FIMConfig(fim_rate=0.6), tokenizer)
    assert a[1] is None and a[2] is None and isinstance(a[0], FIMDataset)
    assert a[0].fingerprint != b.fingerprint != train.fingerprint
    assert with_fim(train, None, tokenizer) is train
    state = make_loader(a[0], micro_batch_size=2).state_dict()
    with pytest.raises(ValueError, match="fim_rate"):
        make_loader(b, micro_batch_size=2).load_state_dict(state)


def test_blends_take_rng_sample_and_refuse_rng_megatron(corpus, tokenizer):
    """Over a blend, rng="sample" rewrites each blend sample by its index (the dataset ids pass through);
    rng="megatron" is refused, since Megatron draws per dataset of a blend."""
    eod = tokenizer.token_id(META["fim_tokens"]["eod"])
    blend = build_gpt_datasets([corpus, 0.5, corpus, 0.5], 64, META["split"], 7, (40, None, None), eod_token_id=eod)[0]
    with pytest.raises(ArgumentError, match="over a blend"):
        FIMDataset(blend, FIMConfig(rng="megatron"), tokenizer)
    ds = FIMDataset(blend, FIMConfig(fim_rate=1.0), tokenizer)
    ids = np.arange(40)
    batch = ds.get_batch(ids)
    np.testing.assert_array_equal(batch["dataset_id"], blend.get_batch(ids)["dataset_id"])
    assert (batch["tokens"] == tokenizer.token_id(META["fim_tokens"]["prefix"])).any(1).all()
    np.testing.assert_array_equal(ds.get_batch(ids[::-1])["tokens"][::-1], batch["tokens"])


def test_byte_level_decoding_equals_tokenizers_on_any_ids(reference, tokenizer):
    """The byte-table decode (ByteLevel files) gives tokenizers' own decode for any ids: random ones (special ids,
    bytes cut inside characters, invalid UTF-8) and windows of the corpus."""
    slow = FIMTokenizer(REFERENCE / "tokenizer", engine="reference")
    assert tokenizer._bytes is not None and slow._bytes is None
    rng = np.random.default_rng(0)
    vocab = slow._tok.get_vocab_size()
    for n in rng.integers(0, 200, 1500):
        ids = rng.integers(0, vocab, n)
        assert tokenizer.decode(ids) == slow.decode(ids), ids.tolist()
    tokens = reference["corpus/tokens"]
    for start in range(0, len(tokens) - 300, 211):
        assert tokenizer.decode(tokens[start : start + 300]) == slow.decode(tokens[start : start + 300])


def test_a_resumed_loader_gives_the_uninterrupted_samples(corpus, tokenizer):
    """rng="sample": a loader stopped after 3 batches and resumed from its state (on another world size too) serves
    what the uninterrupted one serves."""
    ds = fim_dataset(corpus, tokenizer, "split", "sample")
    whole = [b["tokens"].numpy() for _, b in zip(range(6), make_loader(ds, micro_batch_size=4))]
    first = make_loader(ds, micro_batch_size=4)
    for _, _b in zip(range(3), first):
        pass
    state = first.state_dict()
    resumed = make_loader(fim_dataset(corpus, tokenizer, "split", "sample"), micro_batch_size=4)
    resumed.load_state_dict(state)
    rest = [b["tokens"].numpy() for _, b in zip(range(3), resumed)]
    np.testing.assert_array_equal(np.concatenate(rest), np.concatenate(whole[3:]))
    halves = [make_loader(ds, micro_batch_size=2, dp_rank=r, dp_world_size=2) for r in (0, 1)]
    for loader in halves:
        loader.load_state_dict({**state})
    step = [next(iter(loader))["tokens"].numpy() for loader in halves]
    np.testing.assert_array_equal(np.concatenate(step), whole[3])
