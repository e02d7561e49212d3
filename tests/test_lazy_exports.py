"""corpusforge.train and corpusforge.retro import their public names on first use (corpusforge/lazy_exports.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_names_resolve_on_first_use_and_unknown_ones_fail_by_name() -> None:
    probe = "\n".join(
        [
            "import sys",
            "import corpusforge.train as t, corpusforge.retro as r",
            "assert 'torch' not in sys.modules and 'numba' not in sys.modules",
            "assert {'GPT', 'train', 'load_config'} <= set(dir(t)) and 'BuildConfig' in r.__all__",
            "from corpusforge.train import TrainConfig",
            "from corpusforge.retro import BuildConfig",
            "assert 'torch' not in sys.modules and 'numba' not in sys.modules  # configs only",
            "from corpusforge.train import GPT",
            "assert 'torch' in sys.modules and t.GPT is GPT and 'GPT' in vars(t)  # kept after the first use",
        ]
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import corpusforge.retro

    with pytest.raises(AttributeError, match="module 'corpusforge.retro' has no attribute 'nope'"):
        corpusforge.retro.nope  # noqa: B018
