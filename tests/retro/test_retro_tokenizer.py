"""build-knn decodes a dataset with the tokenizer `corpusforge preprocess` recorded for it (P.preprocess.json)."""

from __future__ import annotations

import json

import pytest

from corpusforge.preprocess import PreprocessConfig, preprocess
from corpusforge.retro.build import resolve_tokenizer
from corpusforge.tokenizers.training import train_tokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return root


def test_the_recorded_tokenizer_is_found_by_the_dataset_name(corpus):
    train_tokenizer(TEXTS * 50, 280, corpus / "tok.json", kind="bpe")
    preprocess(PreprocessConfig(inputs=(str(corpus / "in.jsonl"),), output_prefix=str(corpus / "own"),
                                tokenizer=str(corpus / "tok.json"), workers=1))  # fmt: skip
    assert resolve_tokenizer(str(corpus / "own_text_document"), None) == str(corpus / "tok.json")
    assert resolve_tokenizer(str(corpus / "own_text_document"), "o200k_base") == "o200k_base"  # given wins


def test_the_default_tokenizer_and_unknown_datasets_resolve_to_none(corpus):
    preprocess(PreprocessConfig(inputs=(str(corpus / "in.jsonl"),), output_prefix=str(corpus / "dflt"), workers=1))
    assert resolve_tokenizer(str(corpus / "dflt_text_document"), None) is None  # cl100k_base, as before
    (corpus / "dflt.preprocess.json").unlink()  # a dataset another tool wrote
    assert resolve_tokenizer(str(corpus / "dflt_text_document"), None) is None
