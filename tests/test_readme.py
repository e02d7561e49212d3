"""The README's Python example runs as written, on the bundled example, from a fresh directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_from_python_block_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### From Python", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the block's relative paths, as from the checkout
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "869 documents, 976741 tokens; batch (8, 256)"
    assert (tmp_path / "out" / "py_text_document.idx").is_file()
