#!/usr/bin/env python3
"""From a fresh checkout to a running corpusforge, or to a passing test suite: one command each.

    python3 bootstrap.py example   # a venv (.venv) with the CPU build of torch and corpusforge; then the example job
    python3 bootstrap.py test      # also the test extras and Debian's storage packages; then the whole suite

Standard library only, so it runs before anything is installed, also where the system Python refuses `pip install`
(PEP 668). The work is the ecosystem's own: `venv` makes the environment, pip resolves and installs (its dry-run report
says what will be installed before anything is), dpkg says which Debian packages are missing and apt installs them.
This file only decides what is missing and prints it first.

Idempotent and quick the second time: a stamp in the venv records the hash of what shaped the last install
(pyproject.toml, the C sources, the extras, the torch choice); when it matches, pip is not called at all. Installed
Debian packages are found with one dpkg-query call.

torch: the CPU build unless told otherwise (`--torch cuda` takes PyPI's default build, CUDA on Linux x86_64;
`--torch keep` installs no torch and keeps the one the environment has). PyPI's plain `torch` is a CUDA build of
several GB on Linux x86_64, so when pip's own resolution of it brings NVIDIA packages, PyTorch's CPU index is used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TORCH = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# A real writer of Megatron's legacy TNTIDX format for the legacy tests; --no-deps: the tests use only its builder.
DEEPSPEED = "deepspeed==0.19.8"
# torchtitan's release pins datasets<4.8 (the hf extra has 5.x); its other dependencies are in the adapters extra.
TORCHTITAN = "torchtitan==0.3.0"
# The suite in 2 processes, a test file to a process at a time (pytest-xdist): much of it waits on subprocesses,
# daemons and sleeps, so 2 cores run it in about 18 minutes instead of about 30, and a file's module-scoped set-ups (a
# torchrun launch its tests share) are made once. Arguments after `test` come later and win (`-n 0`: one process).
# The 30 slowest tests are listed at the end: the suite's 25-minute budget is watched from CI's own log.
PYTEST_DEFAULTS = ("-n", "2", "--dist", "loadfile", "--durations", "30")
# The tests' real storage and schedulers: a loopback Ceph (mon, memstore OSD, RGW, MDS, ceph-fuse), fio (bench-io's
# reference), FUSE (storage that hangs on command; libfuse2 for fusepy), a one-node Slurm, loop devices with ext4.
DEBIAN_TEST_PACKAGES = (
    "ceph-mon", "ceph-osd", "radosgw", "ceph-mds", "ceph-fuse", "ceph-common", "fio", "fuse3", "libfuse2",
    "slurmctld", "slurmd", "slurm-client", "munge", "e2fsprogs", "mount",
)  # fmt: skip
EXAMPLE = (
    ["corpusforge", "preprocess", "examples/tiny-corpus.jsonl.zst", "--output-prefix", "out/tiny"],
    ["corpusforge", "inspect", "out/tiny_text_document"],
)
STAMP = "corpusforge-bootstrap.json"


class SetupError(Exception):
    """A step that cannot go on; the message is the one line (or the one command) the user needs."""


def say(line: str) -> None:
    print(f"bootstrap: {line}", flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Runs a command with its output shown; a failure names the command."""
    say("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT, **kwargs)
    if proc.returncode != 0:
        raise SetupError(f"`{shlex.join(cmd)}` exited {proc.returncode}; its output is above")
    return proc


# -- the virtual environment -----------------------------------------------------------------------------------------


def venv_python(env_dir: Path) -> Path:
    return env_dir / "bin" / "python"


def ensure_venv(env_dir: Path) -> Path:
    """The venv's python, creating the venv first when there is none (with pip, from ensurepip)."""
    python = venv_python(env_dir)
    try:
        if python.exists():
            return python
    except PermissionError as exc:  # a venv whose interpreter lives where this user cannot look (another's home)
        raise SetupError(f"{python}: this user cannot use it ({exc.strerror}); run as the user who made "
                         f"{env_dir}, or give a venv of your own with --venv DIR") from exc  # fmt: skip
    if sys.version_info < (3, 11):  # noqa: UP036 (this file runs under whatever python3 the machine has)
        raise SetupError(f"corpusforge needs Python 3.11 or newer, this is {sys.version.split()[0]}; run this file "
                         "with python3.11 (or newer)")  # fmt: skip
    say(f"creating the virtual environment {env_dir} (Python {sys.version.split()[0]})")
    try:
        venv.EnvBuilder(with_pip=True).create(env_dir)
    except subprocess.CalledProcessError as exc:  # Debian's python3 without python3-venv has no ensurepip
        shutil.rmtree(env_dir, ignore_errors=True)
        v = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise SetupError(f"Python {v} cannot make a venv here (no ensurepip): sudo apt-get install -y python{v}-venv"
                         ", then run this again") from exc  # fmt: skip
    return python


def read_stamp(env_dir: Path) -> dict:
    try:
        return json.loads((env_dir / STAMP).read_text())
    except (OSError, ValueError):
        return {}


def stamp_covers(stamp: dict, extras: str, torch: str, with_deepspeed: bool) -> bool:
    """Whether the last install already holds this one: the same files, and at least these extras and deepspeed.

    Example: after `test` (extras dev, deepspeed), `example` (no extras) installs nothing.
        >>> stamp_covers({"files": "x", "extras": ["dev"], "torch": "cpu", "deepspeed": True}, "", "cpu", False)
        False
    """
    wanted = set(filter(None, extras.split(",")))
    return (
        stamp.get("files") == files_fingerprint()
        and wanted <= set(stamp.get("extras", []))
        and stamp.get("torch") == torch
        and (stamp.get("deepspeed", False) or not with_deepspeed)
    )


def files_fingerprint() -> str:
    """The hash of the files that shape the install (pyproject.toml, the C sources)."""
    digest = hashlib.sha256()
    for path in sorted([ROOT / "pyproject.toml", *ROOT.glob("corpusforge/*.c")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def pip_plan(python: Path, args: list[str]) -> list[str]:
    """`name==version` of what `pip install ARGS` would install, from pip's own dry-run report (nothing installed)."""
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", *args],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SetupError(f"pip cannot resolve `{' '.join(args)}`: {tail}; check the network or the pip index")
    report = json.loads(proc.stdout)
    return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report.get("install", [])]


def torch_install_args(python: Path, choice: str) -> list[str]:
    """pip arguments that install torch as chosen ([] for `keep`); for `cpu`, PyTorch's CPU index where PyPI's build
    for this machine is a CUDA one (its plan holds nvidia-* packages)."""
    if choice == "keep":
        return []
    if choice == "cuda" or not any(p.startswith("nvidia-") for p in pip_plan(python, [TORCH])):
        return [TORCH]  # a CPU build already (macOS, aarch64, or a pip set up with a CPU wheel index)
    return [TORCH, "--index-url", TORCH_CPU_INDEX]


def pip_install(python: Path, what: str, args: list[str], *flags: str) -> None:
    """Says what `pip install ARGS` will install (pip's dry-run report), then installs it; nothing when nothing is
    missing."""
    plan = pip_plan(python, args)
    if not plan:
        say(f"{what}: installed")
        return
    say(f"{what}: installing {len(plan)} package(s): " + ", ".join(plan))
    run([str(python), "-m", "pip", "install", "--quiet", *flags, *args])


def ensure_python_packages(env_dir: Path, extras: str, torch: str, with_deepspeed: bool) -> Path:
    """The venv with torch and corpusforge (editable, with `extras`) installed; pip is skipped when the stamp says
    the last install already covers this one."""
    python = ensure_venv(env_dir)
    stamp = read_stamp(env_dir)
    if stamp_covers(stamp, extras, torch, with_deepspeed):
        say(f"{env_dir}: torch and corpusforge{f'[{extras}]' if extras else ''} are installed (nothing changed)")
        return python
    torch_args = torch_install_args(python, torch)
    if torch_args:
        pip_install(python, "torch", torch_args)
    # Torch first, so that packages depending on it (megatron-core, sentence-transformers) find it satisfied rather
    # than pulling another build. The editable install is always redone here: the stamp said something changed.
    target = f".[{extras}]" if extras else "."
    pip_install(python, f"corpusforge{f'[{extras}]' if extras else ''}", ["-e", target])
    if with_deepspeed:
        pip_install(
            python,
            "deepspeed and torchtitan (without their dependencies)",
            ["--no-deps", DEEPSPEED, TORCHTITAN],
            "--no-build-isolation",
        )
    kept_extras = set(filter(None, extras.split(","))) | set(stamp.get("extras", []))
    record = {
        "files": files_fingerprint(), "extras": sorted(kept_extras), "torch": torch,
        "deepspeed": with_deepspeed or bool(stamp.get("deepspeed")),
    }  # fmt: skip
    (env_dir / STAMP).write_text(json.dumps(record, indent=1) + "\n")
    return python


# -- Debian packages -------------------------------------------------------------------------------------------------


def missing_debian_packages(packages: tuple[str, ...] | list[str]) -> list[str]:
    """The packages of `packages` that dpkg does not list as installed (one dpkg-query call).

    Example:
        >>> missing_debian_packages(["coreutils", "no-such-package-here"])
        ['no-such-package-here']
    """
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\n", *packages], capture_output=True, text=True
    )
    installed = {
        line.split()[0].split(":")[0] for line in proc.stdout.splitlines() if line.split()[-1:] == ["installed"]
    }
    return [p for p in packages if p not in installed]


def has_apt() -> bool:
    return shutil.which("dpkg-query") is not None and shutil.which("apt-get") is not None


def not_debian(packages: tuple[str, ...]) -> str:
    return ("this is not a Debian or Ubuntu system (no dpkg/apt): install these with your package manager, then run "
            "the suite as root: " + " ".join(packages))  # fmt: skip


def ensure_debian_packages(packages: tuple[str, ...]) -> None:
    """Installs the missing ones with apt (run as root); says so first."""
    if not has_apt():
        raise SetupError(not_debian(packages))
    missing = missing_debian_packages(packages)
    if not missing:
        say(f"Debian packages for the tests: all {len(packages)} installed")
        return
    say(f"Debian packages: installing {len(missing)} (with what they need): " + " ".join(missing))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], env=env)
    run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=env)


def root_needed(packages: tuple[str, ...], pytest_args: list[str]) -> str:
    """What a non-root user is told: the one sudo line that installs the Debian packages and runs the suite.

    Example:
        >>> root_needed(("coreutils",), ["-x"]).splitlines()[-1].strip()
        'sudo python3 bootstrap.py test -x'
    """
    if not has_apt():
        return not_debian(packages)
    missing = missing_debian_packages(packages)
    why = f"{len(missing)} Debian package(s) the tests need are missing ({' '.join(missing)}), and the"
    command = shlex.join(["sudo", "python3", "bootstrap.py", "test", *pytest_args])
    return (f"{why if missing else 'The'} suite starts a loopback Ceph and mounts file systems (tmpfs, FUSE, loop "
            f"devices), so it runs as root; the Python side is set up. Run:\n    {command}")  # fmt: skip


# -- the two commands ------------------------------------------------------------------------------------------------


def in_venv(python: Path, cmd: list[str]) -> list[str]:
    """`cmd` with its console script taken from the venv (`corpusforge` -> .venv/bin/corpusforge)."""
    return [str(python.parent / cmd[0]), *cmd[1:]]


def example(args: argparse.Namespace) -> int:
    python = ensure_python_packages(args.venv, "", args.torch, with_deepspeed=False)
    for cmd in EXAMPLE:
        run(in_venv(python, cmd))
    where = args.venv.relative_to(Path.cwd()) if args.venv.is_relative_to(Path.cwd()) else args.venv
    say(f"done: the example dataset is out/tiny_text_document.bin/.idx; to use corpusforge yourself: "
        f". {where}/bin/activate, then corpusforge --help")  # fmt: skip
    return 0


def test(args: argparse.Namespace) -> int:
    # The venv first, as whoever runs this (a non-root user's venv stays theirs); root is needed only after it.
    python = ensure_python_packages(args.venv, "dev", args.torch, with_deepspeed=True)
    if os.geteuid() != 0:
        raise SetupError(root_needed(DEBIAN_TEST_PACKAGES, args.pytest_args))
    ensure_debian_packages(DEBIAN_TEST_PACKAGES)
    cmd = [str(python), "-m", "pytest", "-q", *PYTEST_DEFAULTS, *args.pytest_args]
    say("$ " + shlex.join(cmd))
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc == 5:  # pytest: no tests collected, which is never a pass here
        say("pytest collected no tests")
        return 1
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bootstrap.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the virtual environment (default: .venv)")
    parser.add_argument(
        "--torch", choices=("cpu", "cuda", "keep"), default=os.environ.get("CORPUSFORGE_TORCH", "cpu"),
        help="torch's build: cpu (default), cuda (PyPI's default build), keep (install none); or $CORPUSFORGE_TORCH",
    )  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("example", help="set up and run the example job: preprocess, then inspect what it wrote")
    commands.add_parser("test", help="set up everything the tests need and run the whole suite; arguments after "
                        "`test` go to pytest (-m 'not slow', -k ..., -x)")  # fmt: skip
    args, args.pytest_args = parser.parse_known_args(argv)
    if args.pytest_args and args.command != "test":
        parser.error(f"unrecognized arguments: {' '.join(args.pytest_args)}")
    args.venv = args.venv.resolve()
    try:
        return example(args) if args.command == "example" else test(args)
    except SetupError as exc:
        print(f"bootstrap: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
