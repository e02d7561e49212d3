"""Shared by the Megatron-LM, HF Trainer and Lightning adapters' tests and their jobs: tiny corpora, the batches a
job trained on (one file per step), and a job killed with SIGKILL once it has written a checkpoint.

A job writes `step-NNNN.npy` (the tokens of the batch it trained at step N, 1-based) into its output directory as
it trains, and, with --block-after K, a marker file once its checkpoint after step K is written, then waits to be
killed: the test kills it there, as a node failure would, with batches already fetched ahead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
sys.path.insert(0, str(Path(__file__).parents[1] / "train"))

from loader_data import EOD, VOCAB, write_dataset  # noqa: E402
from trainkit import free_port  # noqa: E402

from corpusforge.fsutil import save_npy_atomic, write_bytes_atomic  # noqa: E402

HERE = Path(__file__).parent
SEQ = 32
MBS = 2
STEPS = 6
SAVE_EVERY = 2
KILL_AFTER = 4
__all__ = ["EOD", "VOCAB", "SEQ", "MBS", "STEPS", "SAVE_EVERY", "KILL_AFTER"]


def make_corpora(root: Path) -> list[str]:
    """Two token datasets (uint16 and int32), blended 0.6/0.4 by the tests."""
    root.mkdir(parents=True, exist_ok=True)
    return [
        write_dataset(root / "a_text_document", 200, seed=11, max_len=90),
        write_dataset(root / "b_text_document", 120, seed=12, max_len=60, dtype=np.int32),
    ]


def blend_of(corpora: list[str]) -> list:
    return [corpora[0], 0.6, corpora[1], 0.4]


def record_step(out: Path, step: int, tokens) -> None:
    """Keep the tokens a job trained on at `step` (1-based)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    save_npy_atomic(Path(out) / f"step-{step:04d}.npy", np.asarray(tokens), durable=False)


def recorded(out: Path, kind: str = "step") -> dict[int, np.ndarray]:
    """{step: tokens} of every step a job recorded (kind "loss": {step: loss})."""
    return {int(p.stem.split("-")[1]): np.load(p) for p in sorted(Path(out).glob(f"{kind}-*.npy"))}


def rank_dir(out: Path) -> Path:
    """Where this process records: `out` in a job of one process, out/rank-R for rank R of a torchrun job."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    return Path(out) if world == 1 else Path(out) / f"rank-{os.environ['RANK']}"


def record_loss(out: Path, step: int, loss: float) -> None:
    """Keep the loss a job computed at `step` (1-based)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    save_npy_atomic(Path(out) / f"loss-{step:04d}.npy", np.float64(loss), durable=False)


def record_read(out: Path, ids: list[int]) -> None:
    """Add the sample ids of one read to those a job read: a line "PID ID ID ..." appended to out/reads.txt by
    whichever process reads (DataLoader workers are processes of their own; one short write, so the lines of two
    workers do not mix)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(Path(out) / "reads.txt", "a") as f:
        f.write(" ".join(str(int(i)) for i in [os.getpid(), *ids]) + "\n")


def reads_of(out: Path) -> list[tuple[int, list[int]]]:
    """The reads record_read kept under `out`, in the order they were written: (the reading process, its ids)."""
    lines = (Path(out) / "reads.txt").read_text().splitlines()
    return [(int(pid), [int(i) for i in ids]) for pid, *ids in (line.split() for line in lines)]


def run_in_turn(main, argv: list[str]) -> None:
    """`--runs FILE`: each argument list in FILE (JSON) run by `main` in this process, in order: one torchrun launch
    for several runs, since starting one (torch and the trainer's package imported by every rank) costs more than a
    tiny run. A list holding `--wait-for PATH` waits until PATH exists first (the test makes it once it has killed
    the launch whose checkpoint that run resumes). The other arguments in `argv` go to every run."""
    import json

    at = argv.index("--runs")
    with open(argv[at + 1]) as f:
        runs = json.load(f)
    every = argv[:at] + argv[at + 2 :]
    for run in runs:
        if "--wait-for" in run:
            at = run.index("--wait-for")
            wait_for, run = Path(run[at + 1]), run[:at] + run[at + 2 :]
            while not wait_for.exists():
                time.sleep(0.05)
        main([*run, *every])


def block_until_killed(marker: Path) -> None:
    """Tell the test the checkpoint is written (the marker holds this process's pid, then those of its children:
    its DataLoader workers, fetching ahead), then wait for SIGKILL."""
    import psutil

    Path(marker).parent.mkdir(parents=True, exist_ok=True)
    pids = [os.getpid(), *(child.pid for child in psutil.Process().children())]
    write_bytes_atomic(marker, " ".join(map(str, pids)).encode(), durable=False)
    while True:
        time.sleep(1)


def job_arguments() -> argparse.ArgumentParser:
    """The options every adapter's job script takes: its corpora, index cache and output directory, the step after
    which it blocks until killed, and whether it resumes from its last checkpoint."""
    p = argparse.ArgumentParser()
    p.add_argument("--corpora", required=True)
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--block-after", type=int)
    p.add_argument("--resume", action="store_true")
    return p


def job_command(script: str, *args: str) -> list[str]:
    return [sys.executable, str(HERE / script), *args]


def torchrun_job(script: str, nproc: int, *args: str) -> list[str]:
    """`script` under torchrun, `nproc` processes on this machine (gloo ranks)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(HERE / script), *args]  # fmt: skip


def lightning_launched_job(script: str, nproc: int, *args: str) -> list[str]:
    """`script` as a plain `python script.py ... --devices nproc`, whose Lightning Trainer starts the other nproc - 1
    processes itself (its _SubprocessScriptLauncher runs the same command line again with LOCAL_RANK set)."""
    return ["env", "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={free_port()}", *job_command(script, *args),
            "--devices", str(nproc)]  # fmt: skip


def start_job(command: list[str], log: Path) -> subprocess.Popen:
    """`command` started in a process group of its own (stop_job ends all of it: ranks, launchers, workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 ranks on 2 cores: a thread pool each would only contend
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_job(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group start_job made for `proc`, and reap `proc`."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left of it
        pass
    proc.wait(timeout=30)


def finish_job(proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Wait for `proc` to end well (its whole group killed after `timeout` seconds: a hung collective fails the
    test)."""
    try:
        proc.wait(timeout=timeout)
    finally:
        stop_job(proc)
    assert proc.returncode == 0, f"job exit {proc.returncode}: {Path(log).read_text()[-4000:]}"


def marked_workers(marker: Path) -> list[int]:
    """The pids of the processes a job's rank had started (its DataLoader workers) when it wrote `marker`."""
    return [int(pid) for pid in Path(marker).read_text().split()[1:]]


def kill_ranks_at_markers(proc: subprocess.Popen, markers: list[Path], log: Path, timeout: float = 180) -> None:
    """SIGKILL every rank of the torchrun job `proc` once each has written its marker (its pid, after its part of
    the checkpoint), as a node failure would; torchrun then ends (fail if it ends or stalls before), and so must the
    ranks' DataLoader workers, within 30 s (torch's own look for a dead parent every 5 s)."""
    deadline = time.monotonic() + timeout
    try:
        while not all(Path(m).exists() for m in markers):
            tail = Path(log).read_text()[-3000:]
            if proc.poll() is not None:
                raise AssertionError(f"job ended ({proc.returncode}) before its checkpoint: {tail}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no checkpoint markers after {timeout} s: {tail}")
            time.sleep(0.05)
        for marker in markers:
            os.kill(int(Path(marker).read_text().split()[0]), signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            stop_job(proc)
    assert proc.returncode != 0, "the launch ended well after its ranks were killed"
    workers = [pid for marker in markers for pid in marked_workers(marker)]
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in workers), f"workers of killed ranks still run: {workers}"


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_at_marker(proc: subprocess.Popen, marker: Path, log: Path, timeout: float = 180) -> None:
    """SIGKILL `proc` once it has written `marker` (fail if it ends or stalls before)."""
    deadline = time.monotonic() + timeout
    try:
        while not Path(marker).exists():
            if proc.poll() is not None:
                tail = Path(log).read_text()[-3000:]
                raise AssertionError(f"job ended ({proc.returncode}) before its checkpoint: {tail}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no checkpoint marker after {timeout} s: {Path(log).read_text()[-3000:]}")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        stop_job(proc)
    assert proc.returncode == -signal.SIGKILL


def killed_and_resumed(script: str, main, corpora: list[str], cache: Path, root: Path, *killed_args: str):
    """(uninterrupted, before, after): the steps recorded by `script`'s job run uninterrupted (here, by `main`), by
    the same job in its own process killed with SIGKILL after its checkpoint at KILL_AFTER, and by the job resumed
    from that checkpoint (here). The killed process runs while the uninterrupted run does."""
    base = ["--corpora", ",".join(corpora), "--cache", str(cache)]
    killed = root / "killed"
    log = root / "killed.log"
    root.mkdir(parents=True, exist_ok=True)
    command = job_command(script, *base, "--out", str(killed), "--block-after", str(KILL_AFTER), *killed_args)
    proc = start_job(command, log)
    try:
        main([*base, "--out", str(root / "uninterrupted")])
        kill_at_marker(proc, killed / "checkpointed", log)
    finally:
        stop_job(proc)
    before = recorded(killed)
    for path in killed.glob("step-*.npy"):
        path.unlink()
    main([*base, "--out", str(killed), "--resume"])
    return recorded(root / "uninterrupted"), before, recorded(killed)


def rank_records(out: Path, kind: str = "step", world: int = 2) -> list[dict[int, np.ndarray]]:
    """What each rank of a `world`-rank job under `out` recorded (record_step, record_loss)."""
    return [recorded(out / f"rank-{r}", kind) for r in range(world)]


def two_ranks_killed_and_resumed(
    script: str,
    base: list[str],
    root: Path,
    then: list[list[str]] = (),
    meanwhile: Any = None,
    killed_args: list[str] = (),
    launch: Any = torchrun_job,
) -> list[dict[int, np.ndarray]]:
    """Each rank's steps before the kill: one 2-rank launch of `script` is SIGKILLed rank by rank after its
    checkpoint at KILL_AFTER (root/killed); a second launch runs, in turn, the uninterrupted 2-rank run
    (root/uninterrupted), once the first is killed and its records cleared the killed run resumed by 2 ranks, then
    the runs `then` (arguments after `base`). `killed_args` go to the killed run and its resume only (DataLoader
    workers: the uninterrupted run reads without, so the two ways of reading are compared). `meanwhile()` runs here
    while the launches start, before the kill (what a run of `then` needs: a checkpoint of a 1-rank run). Two
    launches rather than more: each costs several seconds of CPU a rank in imports. `launch(script, 2, *args)` is
    the command of a launch (torchrun_job, lightning_launched_job)."""
    killed, resume_now = root / "killed", root / "killed-and-cleared"
    (root / "turns.json").write_text(json.dumps([
        [*base, "--out", str(root / "uninterrupted")],
        [*base, *killed_args, "--out", str(killed), "--resume", "--wait-for", str(resume_now)],
        *([*base, *run] for run in then),
    ]))  # fmt: skip
    logs = root / "killed.log", root / "turns.log"
    killed_run = [*base, *killed_args, "--out", str(killed), "--block-after", str(KILL_AFTER)]
    to_kill = start_job(launch(script, 2, *killed_run), logs[0])
    turns = start_job(launch(script, 2, "--runs", str(root / "turns.json")), logs[1])
    try:
        if meanwhile is not None:
            meanwhile()
        kill_ranks_at_markers(to_kill, [killed / f"rank-{r}" / "checkpointed" for r in range(2)], logs[0])
        before = rank_records(killed)
        for path in [*killed.glob("rank-*/*.npy"), *killed.glob("rank-*/reads.txt")]:  # its records, not markers
            path.unlink()
        resume_now.touch()
        finish_job(turns, logs[1], timeout=300)
    finally:
        for proc in (to_kill, turns):
            stop_job(proc)
    return before


def assert_resumed_exactly(uninterrupted: dict[int, np.ndarray], before: dict[int, np.ndarray],
                           after: dict[int, np.ndarray], checkpoint_step: int) -> None:  # fmt: skip
    """The killed run trained steps 1..checkpoint_step (and perhaps more, lost with it) as the uninterrupted one;
    the resumed run trained exactly steps checkpoint_step+1.. with the uninterrupted run's batches."""
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    for step in range(1, checkpoint_step + 1):
        np.testing.assert_array_equal(before[step], uninterrupted[step], err_msg=f"step {step} before the kill")
    assert sorted(after) == list(range(checkpoint_step + 1, STEPS + 1)), "the resumed run's steps"
    for step, tokens in after.items():
        np.testing.assert_array_equal(tokens, uninterrupted[step], err_msg=f"step {step} after resuming")
