"""A real one-node Ceph cluster on 127.0.0.1 for tests: a monitor, one memstore OSD, radosgw (S3) and CephFS.

Debian's packages (`apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw ceph-mds ceph-fuse
ceph-common`), no containers, no systemd: every daemon is a child process started in the foreground (`-f`) in a
temporary directory and stopped by its pid. Auth is off, pools have size 1, the OSD keeps its objects in RAM
(memstore, capped at `memstore_bytes`), so nothing touches a disk but the config and logs.

    from ceph_cluster import CephCluster
    with CephCluster.start("/tmp/ceph") as ceph:
        ceph.s3_endpoint, ceph.access_key, ceph.secret_key  # http://127.0.0.1:PORT, path-style S3 (RGW)
        ceph.bucket("data")                                  # "s3://data" (created if needed)
        ceph.cephfs_mount                                    # a ceph-fuse mount of the file system's root
        ceph.storage_options                                 # fsspec/s3fs options for s3:// URLs

In pytest, the session fixture `ceph_cluster` (tests/conftest.py) starts one for the whole run.
Why each setting is there is said beside it; see also ceph's src/vstart.sh, which does the same for developers.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("ceph-mon", "ceph-osd", "radosgw", "ceph-mds", "ceph-fuse")
APT_PACKAGES = "ceph-mon ceph-osd radosgw ceph-mds ceph-fuse ceph-common"
ACCESS_KEY, SECRET_KEY = "corpusforge", "corpusforge-secret"


class CephUnavailable(RuntimeError):
    """The Ceph binaries are missing or a daemon did not come up (the message says which and why)."""


def missing_binaries() -> list[str]:
    """Ceph programs this module needs that are not on PATH."""
    return [b for b in (*DAEMONS, "ceph", "monmaptool", "radosgw-admin") if shutil.which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class CephCluster:
    """A running cluster; `start()` makes one, `stop()` (or leaving the `with`) ends every daemon it started."""

    root: Path
    s3_endpoint: str = ""
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    cephfs_mount: Path = Path()
    start_seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # seconds since start() at each step
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    # -- the public API ----------------------------------------------------------------------------------------

    @classmethod
    def start(cls, root: str | os.PathLike, memstore_bytes: int = 4 << 30, timeout: float = 120.0) -> CephCluster:
        """Start mon, osd, rgw, mds and a ceph-fuse mount under `root`; raises CephUnavailable on failure."""
        missing = missing_binaries()
        if missing:
            raise CephUnavailable(f"missing {missing}: apt-get install -y --no-install-recommends {APT_PACKAGES}")
        t0 = time.monotonic()
        cluster = cls(Path(root).resolve())
        cluster._t0 = t0
        try:
            cluster._start(memstore_bytes, time.monotonic() + timeout)
        except BaseException:
            cluster.stop()
            raise
        cluster.start_seconds = time.monotonic() - t0
        atexit.register(cluster.stop)  # daemons outlive their parent: end them even if the caller forgets
        return cluster

    @property
    def storage_options(self) -> dict:
        """fsspec options for s3:// URLs on this cluster (corpusforge.storage moves endpoint_url into s3fs's
        client_kwargs)."""
        return {"endpoint_url": self.s3_endpoint, "key": self.access_key, "secret": self.secret_key}

    def filesystem(self):
        """An s3fs file system on this cluster's RGW (through corpusforge.storage, as the loaders make theirs)."""
        from corpusforge.storage import filesystem

        return filesystem("s3://", self.storage_options)

    def bucket(self, name: str) -> str:
        """`s3://name`, creating the bucket if it does not exist."""
        fs = self.filesystem()
        if not fs.exists(name):
            fs.mkdir(name)
        return f"s3://{name}"

    def ceph(self, *args: str, timeout: float = 30.0) -> str:
        """Run a `ceph` CLI command against this cluster and return its stdout."""
        return self._run("ceph", *args, timeout=timeout)

    def stop(self) -> None:
        """Unmount CephFS and end every daemon this object started, by pid."""
        if self.cephfs_mount != Path() and os.path.ismount(self.cephfs_mount):
            subprocess.run(["umount", "-l", str(self.cephfs_mount)], capture_output=True)
        # SIGKILL: the OSD keeps its objects in memory (memstore) and the cluster is thrown away, so a clean
        # shutdown would only cost seconds (the MDS alone takes ~5 s to leave).
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
        self.procs.clear()

    def __enter__(self) -> CephCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- starting ------------------------------------------------------------------------------------------------

    @property
    def conf(self) -> Path:
        return self.root / "ceph.conf"

    def _write_conf(self, mon_port: int, rgw_port: int, memstore_bytes: int) -> None:
        r = self.root
        for d in ("run", "log", "mon.a", "osd.0", "mds.a", "rgw", "cephfs"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.fsid = str(uuid.uuid4())
        self.conf.write_text(f"""[global]
fsid = {self.fsid}
mon host = v1:127.0.0.1:{mon_port}
ms bind msgr2 = false
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
run dir = {r}/run
admin socket = {r}/run/$name.asok
log file = {r}/log/$name.log
pid file = {r}/run/$name.pid
keyring = {r}/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
# one OSD, a small machine: no scrubbing, fewer threads, no free-space alarms about the temp disk
# Each map change (a pool, the OSD, the fs) waits for a Paxos proposal, 1 s apart by default: RGW alone makes
# ~6 pools at start. One monitor has nobody to batch with, so propose at once.
paxos propose interval = 0.05
paxos min wait = 0.01
mon data avail warn = 1
mon data avail crit = 0
osd scrub load threshold = 0
osd max scrubs = 0
[mon.a]
mon data = {r}/mon.a
[osd.0]
osd data = {r}/osd.0
osd objectstore = memstore
# The OSD sends no monitor command at start (it is put in the CRUSH map by us, with `osd crush add`): with auth
# off its first command can leave before it has the monmap, with fsid 0000..., and it exits ('wrong fsid').
osd crush update on start = false
osd class update on start = false
memstore device bytes = {memstore_bytes}
osd memory target = 1073741824
[mds.a]
mds data = {r}/mds.a
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {r}/rgw
rgw enable usage log = false
rgw dns name = 127.0.0.1
""")

    def _start(self, memstore_bytes: int, deadline: float) -> None:
        mon_port, rgw_port = _free_port(), _free_port()
        self._write_conf(mon_port, rgw_port, memstore_bytes)
        r = self.root
        (r / "keyring").write_text("")  # auth is off; daemons still look for the file
        self._run(
            "monmaptool",
            "--create",
            "--fsid",
            self.fsid,
            "--addv",
            "a",
            f"[v1:127.0.0.1:{mon_port}]",
            str(r / "monmap"),
        )
        self._run("ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a", "--monmap", str(r / "monmap"))
        self._spawn("ceph-mon", "-i", "a")
        self.timings["mon_spawned"] = self._elapsed()
        # Everything the monitor must record, in one `ceph` process (each costs ~0.5 s of Python start-up):
        # the OSD's id, the CephFS pools and file system. Pools can be made before any OSD is up.
        osd_uuid = str(uuid.uuid4())
        # mkfs before `osd new`: the other way round the OSD boots with another fsid than the map's ('wrong fsid').
        self._run("ceph-osd", "-c", str(self.conf), "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        commands = (
            f"osd new {osd_uuid} 0\n"
            "osd crush add osd.0 1.0 root=default host=localhost\n"
            "osd pool create cephfs_metadata 8\n"
            "osd pool create cephfs_data 8\n"
            "fs new cephfs cephfs_metadata cephfs_data\n"
        )
        for attempt in range(5):
            try:
                self._run("ceph", stdin=commands, timeout=max(5.0, deadline - time.monotonic()))
                break
            except CephUnavailable as e:
                # A client that asks before it has the monmap is refused with fsid 0000... and runs no command
                # (seen in ~1 start of 3 on a loaded machine): asking again is safe.
                if "problem getting command descriptions" not in str(e) or attempt == 4:
                    raise
                time.sleep(0.5)
        self.timings["mon_commands"] = self._elapsed()
        # The MDS waits for the OSD by itself; RGW is started once the OSD is up (see _start_osd).
        self._spawn("ceph-mds", "-i", "a")
        self._start_osd(deadline)
        self.timings["osd_up"] = self._elapsed()
        self._spawn("radosgw", "-n", "client.rgw")
        self.s3_endpoint = f"http://127.0.0.1:{rgw_port}"
        self.cephfs_mount = r / "cephfs"
        self.timings["daemons_spawned"] = self._elapsed()
        self._wait(self._rgw_answers, deadline, "radosgw answering on " + self.s3_endpoint)
        self.timings["rgw_up"] = self._elapsed()
        # The S3 user (radosgw-admin talks to RADOS directly; RGW sees the user on its first request).
        self._run(
            "radosgw-admin",
            "-c",
            str(self.conf),
            "user",
            "create",
            "--uid",
            "corpusforge",
            "--display-name",
            "corpusforge tests",
            "--access-key",
            self.access_key,
            "--secret",
            self.secret_key,
        )
        self.timings["s3_user"] = self._elapsed()
        # ceph-fuse gives up at once without an active MDS; `ceph mds stat` prints "cephfs:1 {0=a=up:active}".
        self._wait(lambda: "up:active" in self.ceph("mds", "stat"), deadline, "an active MDS")
        self.timings["mds_active"] = self._elapsed()
        self._spawn("ceph-fuse", "-n", "client.admin", str(self.cephfs_mount))
        self._wait(lambda: os.path.ismount(self.cephfs_mount), deadline, "ceph-fuse mounted")
        self.timings["cephfs_mounted"] = self._elapsed()

    def _start_osd(self, deadline: float) -> None:
        """Start osd.0 and wait until the map has it up: RGW started before that sits ~10 s in a retry back-off."""
        self._spawn("ceph-osd", "-i", "0")
        up = lambda: '"num_up_osds":1' in self.ceph("osd", "stat", "-f", "json").replace(" ", "")  # noqa: E731
        self._wait(up, deadline, "osd.0 up")

    def _elapsed(self) -> float:
        return round(time.monotonic() - self._t0, 2)

    def _rgw_answers(self) -> bool:
        try:
            urllib.request.urlopen(self.s3_endpoint, timeout=2).read()
            return True
        except OSError as e:
            return getattr(e, "code", None) is not None  # an HTTP error is an answer

    # -- helpers ---------------------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CEPH_CONF": str(self.conf)}

    def _run(self, *cmd: str, timeout: float = 60.0, stdin: str | None = None) -> str:
        full = list(cmd)
        if cmd[0] in ("ceph", "radosgw-admin") and "-c" not in cmd:
            full[1:1] = ["-c", str(self.conf)]
        if cmd[0] == "ceph":
            full[1:1] = ["--connect-timeout", str(int(max(1, timeout)))]
        done = subprocess.run(full, capture_output=True, text=True, timeout=timeout, env=self._env(), input=stdin)
        failed = stdin is not None and "Error " in done.stderr  # `ceph` reading commands goes on past errors
        if done.returncode != 0 or failed:
            raise CephUnavailable(f"`{' '.join(full)}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        return done.stdout

    def _spawn(self, program: str, *args: str) -> None:
        name = f"{program}:{' '.join(args)}"
        log = open(self.root / "log" / f"{program}.stdout", "ab")
        self.procs[name] = subprocess.Popen(
            [program, "-f", "-c", str(self.conf), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._env(),
            start_new_session=True,  # a Ctrl-C in the test runner reaches pytest, which then calls stop()
        )

    def _wait(self, ready, deadline: float, what: str, poll: float = 0.1) -> None:
        error: Exception | None = None
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise CephUnavailable(
                        f"{name} exited with {proc.returncode} while waiting for {what}; see {self.root}/log"
                    )
            try:
                if ready():
                    return
            except (CephUnavailable, subprocess.TimeoutExpired, ValueError) as e:
                error = e
            time.sleep(poll)
        raise CephUnavailable(f"timed out waiting for {what} ({error}); see the logs in {self.root}/log")


if __name__ == "__main__":  # python tests/ceph_cluster.py: start, print the endpoints and the start time, stop
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ceph-") as tmp, CephCluster.start(tmp) as c:
        summary = {"s3": c.s3_endpoint, "cephfs": str(c.cephfs_mount), "start_s": round(c.start_seconds, 1)}
        print(json.dumps({**summary, "timings": c.timings}))
