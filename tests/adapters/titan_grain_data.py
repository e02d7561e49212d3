"""The Grain and torchtitan adapter tests' data: the loader tests' three generated token datasets (tests/data/
loader_data.py), blended as those tests blend them. Imported by the tests and by their subprocesses."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))

from loader_data import EOD, write_dataset  # noqa: E402

WEIGHTS = (0.5, 0.3, 0.2)


def write_corpora(root: Path | str) -> str:
    """Three datasets of different sizes and dtypes (one with empty documents) under `root`; returns root."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    write_dataset(root / "a_text_document", 400, seed=1, empty_every=37)
    write_dataset(root / "b_text_document", 250, seed=2, max_len=120, dtype=np.int32)
    write_dataset(root / "c_text_document", 120, seed=3, max_len=600)
    return str(root)


def blend(root: Path | str) -> list:
    """[prefix, weight, ...] of the three datasets."""
    names = ("a_text_document", "b_text_document", "c_text_document")
    return [x for name, w in zip(names, WEIGHTS) for x in (str(Path(root) / name), w)]


def blend_config(root: Path | str, **changes) -> dict:
    """CorpusforgeDataLoader.Config fields for the blend: 400 train samples, EOD tokens without loss."""
    fields = {"blend": [str(x) for x in blend(root)], "split": "90,8,2", "num_samples": 400,
              "cache_dir": str(Path(root) / "cache"), "eod_token_id": EOD, "eod_mask_loss": True}  # fmt: skip
    return {**fields, **changes}


def build_train(root: Path | str, num_samples: int = 400, **options):
    """The blend's train split as corpusforge builds it for the same fields (the reference)."""
    from corpusforge.data import build_gpt_datasets

    options = {"eod_token_id": EOD, "eod_mask_loss": True, **options}
    train, _, _ = build_gpt_datasets(blend(root), seq_length=32, split="90,8,2", num_samples=(num_samples, 0, 0),
                                     cache_dir=Path(root) / "cache", **options)  # fmt: skip
    return train
