"""bootstrap.py, the README's two set-up commands: what it finds missing, what it tells a non-root user, and that a
second run installs nothing. The first run of both commands is `.ci/run` itself, on a fresh machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bootstrap  # noqa: E402

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian system")


@needs_dpkg
def test_missing_debian_packages_are_those_dpkg_does_not_list():
    assert bootstrap.missing_debian_packages(["coreutils", "corpusforge-no-such-package", "bash"]) == [
        "corpusforge-no-such-package"
    ]
    assert bootstrap.missing_debian_packages(bootstrap.DEBIAN_TEST_PACKAGES) == []  # installed by bootstrap itself


def test_root_needed_names_the_missing_packages_and_the_one_sudo_line():
    message = bootstrap.root_needed(("coreutils", "corpusforge-no-such-package"), ["-m", "not slow"])
    first, second = message.splitlines()
    if shutil.which("dpkg-query"):
        assert first.startswith("1 Debian package(s) the tests need are missing (corpusforge-no-such-package)")
    assert second.strip() == "sudo python3 bootstrap.py test -m 'not slow'"


@needs_dpkg
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to become another user")
def test_a_non_root_user_gets_the_one_sudo_line_and_exit_1(tmp_path):
    """`bootstrap.py test` run by a real unprivileged user (nobody) in an environment already set up: exit 1, no
    pytest, and the one sudo line."""
    env_dir = Path(sys.prefix)
    stamp = bootstrap.read_stamp(env_dir)
    if not stamp:
        pytest.skip(f"{env_dir} was not made by bootstrap.py (no {bootstrap.STAMP}); CI's is")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if subprocess.run([*nobody, "test", "-e", str(bootstrap.venv_python(env_dir))]).returncode != 0:
        pytest.skip(f"{env_dir}'s interpreter is where nobody cannot look (a pyenv under /root); CI's is Debian's")
    proc = subprocess.run(
        [*nobody, sys.executable, str(ROOT / "bootstrap.py"),
         "--venv", str(env_dir), "--torch", stamp["torch"], "test", "-x"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "pytest" not in proc.stdout
    sudo_lines = [line.strip() for line in proc.stderr.splitlines() if "sudo" in line]
    assert sudo_lines == ["sudo python3 bootstrap.py test -x"], proc.stderr


def test_the_stamp_covers_a_smaller_install_and_not_a_changed_one():
    files = bootstrap.files_fingerprint()
    after_test = {"files": files, "extras": ["dev"], "torch": "cpu", "deepspeed": True}
    assert bootstrap.stamp_covers(after_test, "", "cpu", False)  # `example` after `test`: nothing to install
    assert bootstrap.stamp_covers(after_test, "dev", "cpu", True)
    assert not bootstrap.stamp_covers({**after_test, "files": "0" * 64}, "", "cpu", False)  # pyproject.toml changed
    assert not bootstrap.stamp_covers({**after_test, "torch": "cuda"}, "", "cpu", False)
    after_example = {"files": files, "extras": [], "torch": "cpu", "deepspeed": False}
    assert not bootstrap.stamp_covers(after_example, "dev", "cpu", True)
    assert not bootstrap.stamp_covers({}, "", "cpu", False)


def test_the_readme_opens_with_the_two_commands_that_ci_runs():
    """The README's first shell block is exactly the two bootstrap commands, and .ci/run reads that block."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands == ["python3 bootstrap.py example", "python3 bootstrap.py test"]
    assert "README.md" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow
def test_a_second_run_installs_nothing_and_runs_the_example(tmp_path):
    """In an environment that bootstrap.py made (CI's), `example` again calls no pip and runs the job."""
    env_dir = Path(sys.prefix)
    stamp = bootstrap.read_stamp(env_dir)
    if not stamp:
        pytest.skip(f"{env_dir} was not made by bootstrap.py (no {bootstrap.STAMP}); CI's is")
    before = json.dumps(stamp, sort_keys=True)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bootstrap.py"), "--venv", str(env_dir), "--torch", stamp["torch"], "example"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing changed" in proc.stdout
    assert "installing" not in proc.stdout and "pip install" not in proc.stdout
    assert "corpusforge inspect out/tiny_text_document" in proc.stdout.replace(str(env_dir / "bin") + "/", "")
    assert json.dumps(bootstrap.read_stamp(env_dir), sort_keys=True) == before
