"""parallel.offload: the losses of every placement are the in-memory run's, bit for bit, over 20 steps of the tiny
GPT-2 and the tiny Llama, in one process (none, cpu: FSDP2 on a world of one, nvme) and under FSDP2 with 2 gloo ranks
(none, cpu, nvme: one torchrun launch runs all six); a checkpoint of one placement resumes into another with the
uninterrupted losses."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from trainkit import run_records, tiny_overrides, torchrun_runs, write_markov_corpus

from corpusforge.train import load_config, train
from corpusforge.train.offload.state_files import MAGIC
from corpusforge.train.parallel import resolve_layout
from corpusforge.train.trainer import model_config, prepare, setup_runtime

STEPS = 20
HERE = Path(__file__).resolve().parent
FAMILIES = {"gpt2": {}, "llama": {"model.name": '"llama3-tiny"'}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_markov_corpus(tmp_path_factory.mktemp("offload-corpus") / "markov")


def overrides(corpus: str, out: Path, family: str, offload: str, **extra) -> list[str]:
    values = {"schedule.max_steps": STEPS, "checkpoint.interval": 10, "metrics.eval_interval": 0,
              "parallel.offload": f'"{offload}"', **FAMILIES[family], **extra}  # fmt: skip
    return tiny_overrides(corpus, out, **values)


def losses(out: Path) -> list[float]:
    records = run_records(out)
    return [records[s]["loss"] for s in sorted(records)]


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """{(family, placement): out_dir} of 20-step runs in this process."""
    root = tmp_path_factory.mktemp("offload-one")
    runs = {}
    for family in FAMILIES:
        for offload in ("none", "cpu", "nvme"):
            out = root / f"{family}-{offload}"
            train(load_config(None, overrides(corpus, out, family, offload)), log=lambda line: None)
            runs[family, offload] = out
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_nvme_losses_are_the_in_memory_ones_bit_for_bit(one_process, family):
    memory, nvme = losses(one_process[family, "none"]), losses(one_process[family, "nvme"])
    assert len(memory) == STEPS and memory == nvme  # floats compared exactly
    files = sorted((one_process[family, "nvme"] / "offload" / "rank_00000").glob("*.bin"))
    assert [f.name for f in files] == ["exp_avg.bin", "exp_avg_sq.bin", "master.bin"]
    assert all(f.read_bytes()[:8] == MAGIC for f in files)
    assert not (one_process[family, "none"] / "offload").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_losses_in_one_process_are_the_in_memory_ones_bit_for_bit(one_process, family):
    memory, cpu = losses(one_process[family, "none"]), losses(one_process[family, "cpu"])
    assert len(memory) == STEPS and memory == cpu  # floats compared exactly
    assert not (one_process[family, "cpu"] / "offload").exists()


def test_cpu_offload_in_one_process_is_fsdp2_on_a_world_of_one(corpus, tmp_path):
    """One process with offload "cpu": every block and the root are FSDP2 units with CPUOffloadPolicy, on a process
    group of this process alone, which the run tears down at its end (train()'s finally; here by hand)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    cfg = load_config(None, overrides(corpus, tmp_path / "out", "gpt2", "cpu"))
    layout = resolve_layout(cfg, 1, model_config(cfg))
    assert layout.fsdp and layout.world == 1
    rt = setup_runtime(cfg)
    try:
        assert rt.solo_group and dist.get_world_size() == 1 and not rt.distributed
        plan = prepare(cfg, rt, layout)
        units = [m for m in plan.model.modules() if isinstance(m, FSDPModule)]
        assert len(units) == cfg.model.n_layer + 1  # each block and the root
        assert all(isinstance(u._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy) for u in units)
        assert all(isinstance(p, DTensor) for p in plan.model.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [("nvme", "none"), ("none", "nvme"), ("cpu", "nvme"), ("nvme", "cpu")])
def test_a_checkpoint_resumes_into_the_other_placement(corpus, one_process, tmp_path, saved, resumed):
    """The step-10 checkpoint of one placement, resumed by the other: steps 11-20 are the uninterrupted run's."""
    source = one_process["gpt2", saved]
    step10 = source / "checkpoints" / "step_00000010"
    out = tmp_path / "resumed"
    train(load_config(None, overrides(corpus, out, "gpt2", resumed, **{"checkpoint.resume": f'"{step10}"'})),
          log=lambda line: None)  # fmt: skip
    assert losses(out) == losses(source)[10:]


@pytest.mark.slow
def test_fsdp2_two_ranks_every_placement_has_the_in_memory_losses(corpus, tmp_path):
    """One torchrun launch of 2 gloo ranks: none, cpu (FSDP2's CPUOffloadPolicy) and nvme for both families; then the
    nvme run's sharded checkpoint resumes in one process, in memory."""
    runs, outs = [], {}
    for family in FAMILIES:
        for offload in ("none", "cpu", "nvme"):
            outs[family, offload] = tmp_path / f"{family}-{offload}"
            runs.append(overrides(corpus, outs[family, offload], family, offload, **{"parallel.dp_shard": 2}))
    torchrun_runs(runs, 2, tmp_path, timeout=400)
    for family in FAMILIES:
        memory = losses(outs[family, "none"])
        assert len(memory) == STEPS
        assert losses(outs[family, "cpu"]) == memory, family
        assert losses(outs[family, "nvme"]) == memory, family
        ranks = sorted(p.name for p in (outs[family, "nvme"] / "offload").iterdir())
        assert ranks == ["rank_00000", "rank_00001"]  # each rank streams its own shard
    # another layout and placement: the 2-rank FSDP2 nvme checkpoint of step 10, resumed in one process in memory
    step10 = outs["gpt2", "nvme"] / "checkpoints" / "step_00000010"
    out = tmp_path / "one-process"
    train(load_config(None, overrides(corpus, out, "gpt2", "none", **{"checkpoint.resume": f'"{step10}"'})),
          log=lambda line: None)  # fmt: skip
    # the same samples; sums over 2 ranks or 1 are ordered differently, so equal to float32 rounding, not bitwise
    assert losses(out) == pytest.approx(losses(outs["gpt2", "none"])[10:], rel=1e-5)


@pytest.mark.slow
def test_killed_mid_step_then_resumed_gives_the_uninterrupted_losses(corpus, one_process, tmp_path):
    """SIGKILL in the optimizer step of step 15 (the master file written, the moments not), then a plain restart:
    it resumes from the step-10 checkpoint, logs that the killed run's files were not read, and trains steps 11-20
    with the uninterrupted run's losses."""
    out = tmp_path / "killed"
    args = overrides(corpus, out, "gpt2", "nvme")
    # the same torch threads as this process's runs: the matmuls' sums are ordered by them
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    job = subprocess.Popen([sys.executable, str(HERE / "offload_kill_job.py"), "15", *args], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    try:
        assert printed_line(job, "MIDSTEP", timeout=240), "the run never reached step 15's optimizer step"
    finally:
        job.kill()  # SIGKILL
        job.wait(30)
    header = (out / "offload" / "rank_00000" / "exp_avg.bin").read_bytes()[:24]
    assert header[8:] == (14).to_bytes(8, "little") + (1).to_bytes(8, "little")  # generation 14, mid-step
    lines: list[str] = []
    train(load_config(None, args), log=lines.append)
    assert any("resumed from" in line and "step_00000010" in line for line in lines)
    assert any("left mid-step at generation 14; not read, rebuilt" in line for line in lines)
    assert losses(out)[-10:] == losses(one_process["gpt2", "nvme"])[10:]


def printed_line(proc: subprocess.Popen, line: str, timeout: float) -> bool:
    """Whether `proc` printed `line` on stdout within `timeout` seconds."""
    found = threading.Event()

    def read() -> None:
        for text in proc.stdout:
            if text.strip() == line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    return found.wait(timeout)
