"""A real one-node Slurm on 127.0.0.1 for tests: munged, slurmctld and slurmd from Debian's packages.

`apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge`; no systemd: every daemon runs
in the foreground in a temporary directory (its own munge key and socket, its own slurm.conf, found by srun and
sbatch through SLURM_CONF) and is stopped by its pid. Auth is munge, as on real clusters; process tracking is
by process group (proctrack/pgid), so no cgroup is needed.

    from slurm_cluster import SlurmCluster
    with SlurmCluster.start("/tmp/slurm") as slurm:
        slurm.run("srun", "-n", "2", "hostname", env={...})   # a CompletedProcess; slurm.env has SLURM_CONF
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
APT_PACKAGES = "slurmctld slurmd slurm-client munge"


class SlurmUnavailable(RuntimeError):
    """The Slurm or munge programs are missing or a daemon did not come up (the message says which and why)."""


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(root: Path, host: str, cpus: int) -> str:
    """A minimal slurm.conf for one node that is also the controller; every path under `root`."""
    return f"""\
ClusterName=corpusforge-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
# no cgroup: tasks are tracked by process group, and no task plugin binds them
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """A running one-node cluster; `start()` makes one, `stop()` (or leaving the `with`) ends its daemons."""

    root: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    start_seconds: float = 0.0

    @classmethod
    def start(cls, root: str | os.PathLike, timeout: float = 60.0) -> SlurmCluster:
        """Start munged, slurmctld and slurmd under `root` and wait for the node to be idle."""
        missing = missing_programs()
        if missing:
            raise SlurmUnavailable(f"missing {missing}: apt-get install -y --no-install-recommends {APT_PACKAGES}")
        t0 = time.monotonic()
        cluster = cls(Path(root).resolve())
        try:
            cluster._start(time.monotonic() + timeout)
        except BaseException:
            cluster.stop()
            raise
        cluster.start_seconds = time.monotonic() - t0
        return cluster

    @property
    def env(self) -> dict[str, str]:
        """The caller's environment without any Slurm or torchrun variables of its own, plus SLURM_CONF."""
        drop = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        keep = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        return {**keep, "SLURM_CONF": str(self.root / "slurm.conf")}

    def run(self, *cmd: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld", "munged"):  # users first, munge last
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    # -- starting ----------------------------------------------------------------------------------------------

    def _start(self, deadline: float) -> None:
        r = self.root
        for d in ("state", "spool", "munge-key"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").mkdir(mode=0o755, exist_ok=True)  # the socket's directory: others need to reach it
        os.chmod(r / "munge-key", 0o700)
        key = r / "munge-key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)  # munged refuses a key that others can read
        host = socket.gethostname().split(".")[0]  # slurmctld and slurmd find themselves by short host name
        (r / "slurm.conf").write_text(slurm_conf(r, host, os.cpu_count() or 1))
        m = r / "munge"
        self._spawn(
            "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={m}/munge.socket",
            f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed",
        )  # fmt: skip
        self._wait(lambda: (m / "munge.socket").exists(), deadline, "munged")
        self._spawn("slurmctld", "-D", "-i")  # -i: ignore (absent) state files of an earlier run
        self._wait(lambda: self.run("sinfo", "-h", timeout=10).returncode == 0, deadline, "slurmctld")
        self._spawn("slurmd", "-D")
        self._wait(lambda: self._node_state() == "idle", deadline, "slurmd")

    def _node_state(self) -> str:
        return self.run("sinfo", "-h", "-N", "-o", "%t", timeout=10).stdout.strip()

    def _spawn(self, program: str, *args: str) -> None:
        out = open(self.root / f"{program}.out", "wb")
        self.procs[program] = subprocess.Popen(
            [program, *args], env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()

    def _wait(self, ready, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            proc = self.procs.get(what)
            if proc is not None and proc.poll() is not None:
                out = (self.root / f"{what}.out").read_text(errors="replace")[-2000:]
                raise SlurmUnavailable(f"{what} exited with {proc.returncode}: {out}{self.log(what)}")
            try:
                if ready():
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.2)
        raise SlurmUnavailable(f"{what} did not come up in time: {self.log(what)}")
