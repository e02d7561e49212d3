"""corpusforge.executors: every task runs and reports once, a task's own error is raised as itself, a dead worker's
task is run again (a bounded number of times), and preprocess gives the same bytes on Ray as on local processes,
also when a Ray worker is SIGKILLed in the middle of the job. Ray tests start a real local Ray with 2 CPUs."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import psutil
import pytest
from test_preprocess import CLI, files_of, make_docs, run, write_jsonl

from corpusforge.executors import ExecutorError, LocalExecutor, TaskContext, make_executor
from corpusforge.executors import pool as ray_pool

RAY_BUSY = "ray::PoolWorker.run"
REPO_ROOT = Path(__file__).resolve().parents[1]


def square(item: int, ctx: TaskContext) -> int:
    if ctx.report:
        ctx.report(("started", item))
    return item * item


def fail_on_three(item: int, ctx: TaskContext) -> int:
    if item == 3:
        raise ValueError("item 3 is bad")
    return item


def die_once(item: tuple[int, str], ctx: TaskContext) -> int:
    """SIGKILL this worker the first time item 2 runs (a marker file remembers), like the OOM killer would."""
    n, directory = item
    Path(directory, f"attempt-{n}-{os.getpid()}-{time.monotonic_ns()}").touch()
    if n == 2 and not Path(directory, "died").exists():
        Path(directory, "died").touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return n


def always_die(item: int, ctx: TaskContext) -> int:
    os.kill(os.getpid(), signal.SIGKILL)
    return item


@pytest.mark.parametrize("workers", [1, 3])
def test_local_runs_every_item_once_and_streams_progress(workers):
    events = []
    with LocalExecutor(workers) as ex:
        done = list(ex.run(square, list(range(10)), events.append))
    assert sorted(done) == [(i, i * i) for i in range(10)]
    assert sorted(events) == [("started", i) for i in range(10)]
    assert ex.name == "local" and ex.workers == workers and ex.streams_progress and not ex.remote


def test_local_task_error_is_raised_as_itself_and_not_retried():
    with pytest.raises(ValueError, match="item 3 is bad"):
        with LocalExecutor(2) as ex:
            list(ex.run(fail_on_three, list(range(6))))


def test_local_worker_death_reruns_only_the_unfinished_tasks(tmp_path):
    items = [(n, str(tmp_path)) for n in range(6)]
    with LocalExecutor(2, retries=2) as ex:
        done = dict(ex.run(die_once, items))
    assert sorted(v for v in done.values()) == list(range(6))
    attempts = [p.name.split("-")[1] for p in tmp_path.glob("attempt-*")]
    assert attempts.count("2") == 2  # ran, died, ran again
    assert all(attempts.count(str(n)) in (1, 2) for n in range(6))  # others at most once more (same broken pool)


def test_local_worker_that_keeps_dying_gives_up_with_one_line():
    with pytest.raises(ExecutorError, match=r"died 2 times.*rerun with --resume") as e:
        with LocalExecutor(2, retries=1) as ex:
            list(ex.run(always_die, [1, 2, 3]))
    assert "\n" not in str(e.value)


def test_unknown_executor_and_missing_ray_are_one_line(monkeypatch, tmp_path):
    with pytest.raises(ExecutorError, match="choose one of local, ray"):
        make_executor("spark")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ExecutorError, match=r"pip install 'corpusforge\[ray\]'"):
        with make_executor("ray"):
            pass
    src = write_jsonl(tmp_path / "c.jsonl", ["x"])
    hide_ray = "import sys; sys.modules['ray'] = None; from corpusforge.cli import main; main()"
    args = ["preprocess", str(src), "--output-prefix", str(tmp_path / "o"), "--executor", "ray"]
    proc = subprocess.run([sys.executable, "-c", hide_ray, *args], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "corpusforge: error: --executor ray needs Ray, which is not installed: pip install 'corpusforge[ray]'"
    ]


def test_local_summary_names_the_executor_and_ray_address_needs_ray(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(20))
    summary = json.loads(run("preprocess", src, "--output-prefix", tmp_path / "o", "--json", "--workers", "1").stdout)
    assert summary["executor"] == "local" and summary["workers"] == 1
    proc = run("preprocess", src, "--output-prefix", tmp_path / "p", "--ray-address", "auto", check=False)
    assert proc.returncode == 2 and "--ray-address needs --executor ray" in proc.stderr


@pytest.mark.slow
def test_local_worker_killed_mid_job_reruns_its_task_and_output_is_identical(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(20000, seed=3))
    run("preprocess", src, "--output-prefix", tmp_path / "whole", "--workers", "1")
    prefix = tmp_path / "killed"
    args = ["preprocess", str(src), "--output-prefix", str(prefix), "--workers", "2", "--task-size", "200k", "--json"]
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = _kill_when_busy(proc, Path(f"{prefix}.parts"), lambda p: p.ppid() == proc.pid)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert killed, "no worker process was found to kill"
    assert files_of(f"{prefix}_text_document") == files_of(f"{tmp_path}/whole_text_document")
    assert json.loads(out)["documents"] == 20000


# ---------------------------------------------------------------------------------------------------------------
# Ray: each test starts its own local Ray instance (through the CLI: --executor ray --workers 2 -> 2 CPUs)


@pytest.fixture(scope="module")
def ray_installed():
    pytest.importorskip("ray")


@pytest.mark.slow
def test_ray_output_is_byte_identical_to_local_for_any_worker_count(tmp_path, ray_installed):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(3000, seed=1))
    outputs, summaries = [], []
    for executor, workers in (("local", 1), ("local", 2), ("ray", 2)):
        prefix = tmp_path / f"{executor}{workers}"
        args = ["--executor", executor, "--workers", workers, "--task-size", "20k", "--json", "--progress"]
        proc = run("preprocess", src, "--output-prefix", prefix, *args)
        outputs.append(files_of(f"{prefix}_text_document"))
        summaries.append(json.loads(proc.stdout))
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    local, ray = summaries[1], summaries[2]
    assert ray["executor"] == "ray" and ray["workers"] == 2 and local["executor"] == "local"
    for key in ("documents", "tokens", "input_bytes", "records", "tasks", "dtype", "tokenizer"):
        assert ray[key] == local[key], key
    # --progress into a pipe (a Slurm log): lines with shards done and MB/s across the cluster, the last at 100%
    last = [line for line in proc.stderr.splitlines() if line.startswith("corpusforge preprocess:")][-1]
    assert f"{ray['tasks']}/{ray['tasks']} shards" in last and "MB/s" in last and "100%" in last
    assert not Path(f"{tmp_path}/ray2.parts").exists() and not list(tmp_path.glob("*.removing-*"))


@pytest.mark.slow
def test_ray_worker_sigkilled_mid_job_still_gives_identical_output(tmp_path, ray_installed):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(20000, seed=2))
    run("preprocess", src, "--output-prefix", tmp_path / "whole", "--workers", "1")
    prefix = tmp_path / "killed"
    args = ["preprocess", str(src), "--output-prefix", str(prefix), "--task-size", "200k", "--json", "--workers", "2"]
    args += ["--executor", "ray"]
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # A pool actor runs under the title `ray::PoolWorker.run` while it executes a task, `ray::PoolWorker` between.
    killed = _kill_when_busy(proc, Path(f"{prefix}.parts"), lambda p: " ".join(p.cmdline()).strip() == RAY_BUSY)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert killed, "no busy Ray worker was found to kill"
    assert files_of(f"{prefix}_text_document") == files_of(f"{tmp_path}/whole_text_document")
    summary = json.loads(out)
    assert summary["executor"] == "ray" and summary["documents"] == 20000


@pytest.mark.slow
def test_ray_steps_run_on_workers_and_nodes_copy_parts_into_place(tmp_path, ray_installed):
    """submit() runs a step in a Ray worker and raises its error as itself; with merge_on_workers the workers copy
    every part into the final .bin (this process copies nothing), and the bytes equal a local run's."""
    import logging

    import ray

    from corpusforge.preprocess import PreprocessConfig, preprocess

    src = write_jsonl(tmp_path / "c.jsonl", make_docs(3000, seed=5))
    run("preprocess", src, "--output-prefix", tmp_path / "local", "--workers", "1")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        with make_executor("ray") as ex:
            assert ex.nodes == 1 and ex.workers == 2
            # /proc/self names the process that reads it
            assert ex.submit(os.readlink, "/proc/self").result(timeout=60) != str(os.getpid())
            with pytest.raises(FileNotFoundError):
                ex.submit(os.readlink, str(tmp_path / "nothing")).result(timeout=60)
        config = PreprocessConfig(
            inputs=(str(src),), output_prefix=str(tmp_path / "placed"), executor="ray", task_bytes=20_000,
            merge_on_workers=True,
        )  # fmt: skip
        stats = preprocess(config)
    finally:
        ray.shutdown()
    assert stats.tasks > 10 and stats.executor == "ray"
    assert files_of(f"{tmp_path}/placed_text_document") == files_of(f"{tmp_path}/local_text_document")
    assert not list(tmp_path.glob("*.tmp")) and not Path(f"{tmp_path}/placed.parts").exists()


def pid_of_task(item: int, ctx: TaskContext) -> tuple[int, int]:
    return item, os.getpid()


@pytest.mark.slow
def test_ray_driver_runs_its_share_of_tasks_while_its_workers_start(ray_installed):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this test module
    # workers slow to come up (a warm-up that sleeps 3 s): the driver runs a worker's share of the 9 tasks (3 of
    # them, as one of 2 + 1 workers) instead of waiting, and the Ray workers the rest
    with make_executor("ray", workers=2, warm_up=partial(time.sleep, 3)) as ex:
        done = dict(ex.run(pid_of_task, list(range(9))))
    assert sorted(item for item, _ in done.values()) == list(range(9))
    ran_here = [item for item, (_, pid) in done.items() if pid == os.getpid()]
    assert len(ran_here) == 3, ran_here


def _kill_when_busy(proc: subprocess.Popen, parts: Path, is_worker, timeout: float = 120) -> list[int]:
    """Once at least one part is done, SIGKILL one descendant of `proc` for which is_worker(process) holds;
    returns the pids killed (empty if the job ended first)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if list(parts.glob("*.done.json")):
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if is_worker(child):
                        child.send_signal(signal.SIGKILL)
                        return [child.pid]
                except psutil.Error:  # gone meanwhile
                    continue
        time.sleep(0.005)
    return []


@pytest.mark.slow
def test_ray_driver_killed_then_resume_on_ray_redoes_only_missing_parts(tmp_path, ray_installed):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(20000, seed=4))
    run("preprocess", src, "--output-prefix", tmp_path / "whole", "--workers", "1")
    prefix = tmp_path / "killed"
    args = ["preprocess", str(src), "--output-prefix", str(prefix), "--task-size", "200k", "--workers", "2"]
    args += ["--executor", "ray"]
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    parts = Path(f"{prefix}.parts")
    deadline = time.time() + 120
    while time.time() < deadline and len(list(parts.glob("*.done.json"))) < 2:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started, as when an allocation ends
    proc.wait()
    done_before = len(list(parts.glob("*.done.json")))
    assert 2 <= done_before < len(json.loads((parts / "manifest.json").read_text())["tasks"])
    assert not Path(f"{prefix}_text_document.bin").exists()

    summary = json.loads(run(*args, "--resume", "--json").stdout)
    assert summary["tasks_resumed"] >= done_before and summary["executor"] == "ray"
    assert files_of(f"{prefix}_text_document") == files_of(f"{tmp_path}/whole_text_document")


# ---------------------------------------------------------------------------------------------------------------
# Ray's worker pool: on a cluster that outlives the job (`ray start`), the next job finds the workers started


def test_pool_slots_spread_over_nodes_one_per_cpu():
    nodes = [
        {"NodeID": "b", "Alive": True, "Resources": {"CPU": 2.0}},
        {"NodeID": "a", "Alive": True, "Resources": {"CPU": 1.0}},
        {"NodeID": "c", "Alive": False, "Resources": {"CPU": 8.0}},
        {"NodeID": "d", "Alive": True, "Resources": {}},  # no CPU: runs nothing
    ]
    assert ray_pool.slots(nodes, 3) == [("a", 0), ("b", 0), ("b", 1)]
    assert ray_pool.slots(nodes, 2) == [("a", 0), ("b", 0)]  # fewer workers than CPUs: still on both nodes
    assert ray_pool.slots(nodes, 4) == [("a", 0), ("b", 0), ("b", 1), ("a", 3)]


@pytest.fixture(scope="module")
def ray_cluster(ray_installed):
    """A running Ray cluster of 2 CPUs (`ray start --head`, as under Slurm), in its own process group and temp
    directory; yields its address. Stopped by signalling that group (`ray stop` would end every Ray here)."""
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="cfray", dir="/tmp")  # short: Ray's socket paths live under it
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=2", "--block", f"--temp-dir={temp}"]
    cmd += ["--include-dashboard=false", "--disable-usage-stats"]
    # Token authentication off, as for the loopback Ceph: a driver finds the token only under the default temp dir.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    address = f"127.0.0.1:{port}"
    probe = f"import logging, ray; ray.init(address={address!r}, logging_level=logging.ERROR); ray.shutdown()"
    deadline = time.time() + 120
    try:
        while True:
            time.sleep(2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                if subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=20).returncode == 0:
                    break
            assert proc.poll() is None and time.time() < deadline, "ray start --head did not come up"
        yield address
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # Ray drains for up to 30 s on SIGTERM: not needed here
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _new_driver(address: str, body: str) -> str:
    """Run `body` in a new Python process connected to the cluster at `address` (a new Ray job); its stdout."""
    code = f"import logging, os, ray\nray.init(address={address!r}, logging_level=logging.ERROR, log_to_driver=False)\n"
    proc = subprocess.run([sys.executable, "-c", code + body], capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _pool_names_alive(address: str) -> set[str]:
    body = "print(' '.join(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)))"
    return set(_new_driver(address, body).split())


@pytest.mark.slow
def test_ray_pool_outlives_the_job_and_the_next_job_runs_on_the_same_workers(tmp_path, ray_cluster):
    """Two CLI runs on a running cluster give local's bytes; between them, and in-process jobs, the pool's worker
    processes stay, and the second job's warm-up answer (the tokenizer's facts) comes from a warm worker."""
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(3000, seed=6))
    run("preprocess", src, "--output-prefix", tmp_path / "local", "--workers", "1")
    for name in ("first", "second"):
        args = ["--executor", "ray", "--ray-address", ray_cluster, "--task-size", "20k", "--json"]
        summary = json.loads(run("preprocess", src, "--output-prefix", tmp_path / name, *args).stdout)
        assert summary["executor"] == "ray" and summary["workers"] == 2
        assert files_of(f"{tmp_path}/{name}_text_document") == files_of(f"{tmp_path}/local_text_document")
    pool = {n for n in _pool_names_alive(ray_cluster) if n.startswith(f"worker-{ray_pool.code_fingerprint()}-")}
    assert len(pool) == 2, pool

    body = (
        "from corpusforge.executors import make_executor\n"
        "with make_executor('ray', warm_up=os.getpid) as ex:\n"
        "    warm = ex.warm_result(timeout=10)\n"
        "    pids = sorted({pid for _, pid in ex.run(lambda i, ctx: os.getpid(), list(range(8)))})\n"
        "print(warm, *pids)\n"
    )
    (warm1, *pids1), (warm2, *pids2) = (_new_driver(ray_cluster, body).split() for _ in range(2))
    assert pids1 == pids2 and len(pids1) == 2 and warm2 in pids2  # the same two processes, warm at once


@pytest.mark.slow
def test_ray_pool_ends_itself_when_idle_and_replaces_an_actor_that_ended(ray_cluster):
    import logging

    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this test module
    ray.init(address=ray_cluster, logging_level=logging.ERROR, log_to_driver=False)
    try:
        with make_executor("ray", keep_workers=0.5) as ex:
            names = {name for name, _ in ex._names}
            ray.kill(ex._actors[0], no_restart=True)  # as if it ended idle just as this job called it
            done = dict(ex.run(square, list(range(6))))
        assert done == {i: i * i for i in range(6)}
        assert names <= _pool_names_alive(ray_cluster)
        deadline = time.time() + 30  # kept 5 s at least (a job's first task must reach it), then it ends itself
        while names & _pool_names_alive(ray_cluster) and time.time() < deadline:
            time.sleep(1)
        assert not names & _pool_names_alive(ray_cluster)
        with make_executor("ray", keep_workers=0) as ex:  # not kept at all: ended when the job ends
            names = {name for name, _ in ex._names}
            assert dict(ex.run(square, [3])) == {3: 9}
        deadline = time.time() + 10
        while names & _pool_names_alive(ray_cluster) and time.time() < deadline:
            time.sleep(0.5)
        assert not names & _pool_names_alive(ray_cluster)
    finally:
        ray.shutdown()


def node_of_task(item: int, ctx: TaskContext) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


@pytest.mark.slow
def test_ray_pool_spreads_over_two_nodes_and_each_node_copies_parts(tmp_path, ray_installed):
    """Two raylets on this machine (ray.cluster_utils: real node processes, as `ray start` on two hosts): one pool
    actor per node CPU, tasks on both nodes, and copy steps from both; the bytes equal a local run's."""
    import logging

    import ray
    import ray.cloudpickle
    from ray.cluster_utils import Cluster

    from corpusforge.preprocess import PreprocessConfig, preprocess

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this test module
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(3000, seed=7))
    run("preprocess", src, "--output-prefix", tmp_path / "local", "--workers", "1")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
        with make_executor("ray", keep_workers=0) as ex:
            assert ex.nodes == 2 and ex.workers == 2
            assert len({node for _, node in ex._names}) == 2  # one slot on each node
            ran_on = {node for _, node in ex.run(node_of_task, list(range(8)))}
            copied_on = {ex.submit(lambda _: ray.get_runtime_context().get_node_id(), i).result(60) for i in range(4)}
        assert ran_on == copied_on == {name_node[1] for name_node in ex._names}
        config = PreprocessConfig(
            inputs=(str(src),), output_prefix=str(tmp_path / "two"), executor="ray", task_bytes=20_000,
            ray_keep_workers=0,
        )  # fmt: skip
        stats = preprocess(config)  # two nodes: the nodes copy the parts into place (merge_on_workers)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert stats.executor == "ray" and stats.workers == 2
    assert files_of(f"{tmp_path}/two_text_document") == files_of(f"{tmp_path}/local_text_document")
