"""Fixtures of the loader tests: tiny generated token datasets."""

from __future__ import annotations

import numpy as np
import pytest
from loader_data import write_dataset


@pytest.fixture(scope="session")
def corpora(tmp_path_factory) -> list[str]:
    """Three datasets of different sizes and dtypes (one with empty documents), shared by the tests."""
    root = tmp_path_factory.mktemp("corpora")
    return [
        write_dataset(root / "a_text_document", 400, seed=1, empty_every=37),
        write_dataset(root / "b_text_document", 250, seed=2, max_len=120, dtype=np.int32),
        write_dataset(root / "c_text_document", 120, seed=3, max_len=600),
    ]
