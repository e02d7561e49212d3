"""parallel.offload = "nvme" when things go wrong, and its step in many chunks: a full or shared offload_dir is one
line, a state file that does not match what the run wrote is refused, never read; O_DIRECT where the file system
takes it and buffered I/O where it does not (a real ramfs); the streamed step equals torch's fused AdamW exactly, on
any thread count."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainkit import tiny_overrides, write_markov_corpus

from corpusforge.train import load_config, train
from corpusforge.train.config import ConfigError
from corpusforge.train.offload import NvmeAdamW, OffloadError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from iobench import iobench_helpers  # noqa: E402 - tests/iobench's helpers: a tmpfs mounted for a test

tmpfs = iobench_helpers.tmpfs  # the fixture: mount(size) -> a fresh tmpfs, unmounted after the test


def model() -> torch.nn.Module:
    """Parameters of awkward sizes: one longer than a chunk, some shorter than 1024 values, two decay groups."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(70, 90), torch.nn.LayerNorm(90), torch.nn.Linear(90, 33))


def groups(m: torch.nn.Module) -> list[dict]:
    ps = list(m.parameters())
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


def train_steps(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 70, generator=gen)
        m(x).square().mean().backward()
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (step + 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in m.parameters()]


def nvme(m: torch.nn.Module, directory: Path, **kw) -> NvmeAdamW:
    return NvmeAdamW(groups(m), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, directory=directory, **kw)


@pytest.mark.parametrize("where", ["disk", "ramfs"])
def test_streamed_in_many_chunks_the_step_is_torchs_fused_adamw_exactly(tmp_path, where, request):
    """8 KiB chunks through 3 buffer sets: the 6300-value matrix is cut in 4 slices, small parameters share chunks;
    after 5 steps every weight and moment equals torch.optim.AdamW(fused=True)'s, on a disk with O_DIRECT and on a
    ramfs without it."""
    directory = (request.getfixturevalue("ramfs") if where == "ramfs" else tmp_path) / "rank_00000"
    reference = model()
    expected = train_steps(reference, torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.95), fused=True))
    mine = model()
    opt = nvme(mine, directory, chunk_bytes=8192, buffers=3)
    assert len(opt.chunks) > 4 and any(s.start > 0 for c in opt.chunks for s in c.slices)
    got = train_steps(mine, opt)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert opt.direct_note == ("O_DIRECT" if where == "disk" else "buffered: O_DIRECT is refused here (EINVAL)")
    nbytes = opt.files["master"].nbytes  # each step reads and writes the three files once; the start wrote master
    assert (opt.io["read_bytes"], opt.io["write_bytes"]) == (5 * 3 * nbytes, 5 * 3 * nbytes + nbytes)


@pytest.mark.parametrize("update_threads, reference_threads", [(1, 2), (2, 1)])
def test_the_update_on_another_thread_count_is_torchs_fused_adamw_exactly(tmp_path, update_threads, reference_threads):
    """The update runs on `update_threads` (by default one fewer than torch's, a core left to the reader and writer);
    the kernel's results do not depend on its thread count, so they equal torch's fused AdamW on another count, and
    torch's own count is given back after each step."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(reference_threads)
        reference = model()
        expected = train_steps(reference, torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.95), fused=True))
        mine = model()
        opt = nvme(mine, tmp_path / "rank_00000", chunk_bytes=8192, update_threads=update_threads)
        got = train_steps(mine, opt)
        assert torch.get_num_threads() == reference_threads
        assert f"the update on {update_threads} thread(s)" in opt.notes[0]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_state_dict_is_the_in_memory_adamws(tmp_path):
    """state_dict() of the files (memory-mapped, not copied) has the in-memory AdamW's keys and values; loading it
    into a fresh NvmeAdamW and stepping on equals stepping on in memory."""
    ref_model, mine_model = model(), model()
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, betas=(0.9, 0.95), fused=True)
    mine = nvme(mine_model, tmp_path / "a", chunk_bytes=8192)
    train_steps(ref_model, ref, 3)
    train_steps(mine_model, mine, 3)
    a, b = ref.state_dict()["state"], mine.state_dict()["state"]
    assert a.keys() == b.keys()
    for k in a:
        assert {n: torch.equal(a[k][n], b[k][n]) for n in a[k]} == {"step": True, "exp_avg": True, "exp_avg_sq": True}
    again = nvme(mine_model, tmp_path / "b", chunk_bytes=4096)
    again.load_state_dict(mine.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(train_steps(mine_model, again, 2), train_steps(ref_model, ref, 2)))


def damage(path: Path, field: str) -> None:
    with open(path, "r+b") as f:
        if field == "magic":
            f.write(b"XXXXXXXX")
        elif field == "generation":
            f.seek(8)
            f.write(struct.pack("<Q", 99))
        elif field == "mid-step":
            f.seek(16)
            f.write(struct.pack("<Q", 1))
        else:  # the layout's hash: another model's file
            f.seek(24)
            f.write(bytes(32))


OTHER = "is not this run's state file (another run or layout wrote it)"


GENERATION = "holds generation 99, this run expects 1 (another process wrote it)"


@pytest.mark.parametrize("field, why", [("magic", OTHER), ("layout", OTHER), ("generation", GENERATION),
                                        ("mid-step", "was left mid-step at generation 1")])  # fmt: skip
def test_a_state_file_that_is_not_what_the_run_wrote_is_refused(tmp_path, field, why):
    m = model()
    opt = nvme(m, tmp_path / "r")
    train_steps(m, opt, 1)
    damage(tmp_path / "r" / "exp_avg_sq.bin", field)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(OffloadError) as e:
        train_steps(m, opt, 1)
    assert str(e.value).startswith(f"{tmp_path / 'r' / 'exp_avg_sq.bin'}: {why}; not read as optimizer state")
    assert "\n" not in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))  # nothing was stepped with it


def test_two_processes_cannot_share_one_offload_dir(tmp_path):
    m = model()
    first = nvme(m, tmp_path / "r")
    lock = str(tmp_path / "r" / "LOCK")
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl,time; f=open({lock!r}, 'w'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    first.close()  # this process lets go; the other process takes the lock
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OffloadError, match="another running process uses these offload files"):
            nvme(m, tmp_path / "r")
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_full_offload_dir_is_one_line(tmp_path, tmpfs):
    """Too small at the start: refused by the plan (a dry run too) before any work, one line naming the directory;
    filled by something else after the check: the fallocate of the state files fails, one line all the same."""
    full = tmpfs("128k")
    prefix = write_markov_corpus(tmp_path / "markov", num_docs=40)
    args = tiny_overrides(
        prefix, tmp_path / "run", **{"parallel.offload": '"nvme"', "parallel.offload_dir": f'"{full}"'}
    )
    done = subprocess.run([sys.executable, "-m", "corpusforge.train", *args], capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{full}: offload_dir has" in lines[0] and "needs" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not list(full.iterdir())
    with pytest.raises(ConfigError, match=f"{full}: offload_dir has .* free, but"):
        train(load_config(None, args), dry_run=True, log=lambda line: None)
    with pytest.raises(OffloadError) as e:  # past the check (as when another job fills the disk meanwhile)
        nvme(torch.nn.Linear(512, 512), full / "rank_00000")
    assert str(e.value).startswith(f"{full / 'rank_00000'}: offload_dir has") and "\n" not in str(e.value)


def test_dry_run_shows_bytes_per_rank_for_each_placement(tmp_path):
    """Per rank: the none placement keeps 16 B per parameter on the device, cpu moves them to host memory, nvme keeps
    weights and gradients (8 B) on the device and 12 B (padded to 4 KiB runs) on disk; FSDP2 over 2 ranks halves
    them; the chosen one is marked."""
    prefix = write_markov_corpus(tmp_path / "markov", num_docs=40)
    lines: list[str] = []
    extra = {"parallel.offload": '"nvme"', "parallel.dp_shard": 2}
    report = train(load_config(None, tiny_overrides(prefix, tmp_path / "run", **extra)), dry_run=True,
                   log=lines.append, world_size=2)  # fmt: skip
    shard = report["params"] // 2
    got = report["offload_bytes"]
    assert got["none"] == {"device": 16 * shard, "host": 0, "disk": 0}
    assert got["cpu"] == {"device": 0, "host": 16 * shard, "disk": 0}
    assert got["nvme"]["device"] == 8 * shard and 12 * shard < got["nvme"]["disk"] < 12 * shard + 3 * 4096 * 2
    assert any(line.startswith("  offload nvme (chosen): per rank device") for line in lines)
    assert sum("offload " in line and "per rank" in line for line in lines) == 3
    assert not (tmp_path / "run" / "offload").exists()  # a dry run makes no files
