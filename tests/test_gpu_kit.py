"""The GPU kit (benchmarks/gpu/) in its smoke mode: every part runs on CPU at toy sizes and leaves a well-formed
result, so that the kit works the day a GPU is lent, without debugging on that machine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "benchmarks" / "gpu"
PARTS = {1, 2, 3, 4, 5, 6, 7}
OPTIONAL = {2, 3, 4}  # the Llama model, the RETRO model, faiss: may be skipped, with a reason


@pytest.mark.slow
def test_smoke_every_part_leaves_a_result(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run([str(KIT / "run.sh"), "--smoke", str(out), "--work", str(tmp_path / "work")], env=env,
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(list(out.iterdir())) <= 8  # what the GPU tool sends back from $OUT
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "smoke" and summary["machine"]["python"]
    assert {p["part"] for p in summary["parts"]} == PARTS
    for n in PARTS:
        result = json.loads((out / f"part{n}.json").read_text())
        assert result["part"] == n and result["smoke"] is True
        assert result["status"] in ("ok", "skip"), result
        if result["status"] == "skip":
            assert n in OPTIONAL and result["reason"].strip(), result
        else:
            assert result["headline"] and (result["figures"] or result["runs"]), result
    # the figures each claim rests on are there (values are toys on CPU)
    part1 = json.loads((out / "part1.json").read_text())
    if part1["status"] == "ok":
        assert part1["runs"]["synthetic"]["tokens_per_s"] > 0 and part1["runs"]["loader"]["tokens_per_s"] > 0
        assert part1["figures"]["flops"]["matches_trainer"] is True
    part6 = json.loads((out / "part6.json").read_text())
    assert part6["runs"]["async"]["saves"] == part6["runs"]["sync"]["saves"] >= 1


def test_a_hung_part_is_killed_and_reported(tmp_path, monkeypatch):
    """A part that outlives its limit is killed with its process group and leaves status "timeout" with the figures
    it had saved; the others still run."""
    spec = importlib.util.spec_from_file_location("gpu_kit_run", KIT / "run.py")
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    hang = tmp_path / "hang.py"
    hang.write_text(
        "import json, subprocess, sys, time\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "result = {'part': 1, 'name': 'hang', 'status': 'running', 'figures': {'so_far': 1}, 'runs': {}}\n"
        "json.dump(result, open(out, 'w'))\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    monkeypatch.setitem(kit.PARTS, 1, (str(hang), "hang"))
    monkeypatch.setitem(kit.TIMEOUT, 1, (2, 2))
    monkeypatch.setattr(kit, "MIN_START_S", 0)
    args = type("Args", (), {"out": tmp_path, "work": tmp_path / "work", "smoke": True})()
    log = kit.Log(tmp_path / "kit.log")
    result = kit.run_part(1, args, dict(os.environ), deadline=1e12, log=log)
    log.close()
    assert result["status"] == "timeout" and result["figures"] == {"so_far": 1}
    assert json.loads((tmp_path / "part1.json").read_text())["status"] == "timeout"
    child = int((tmp_path / "child.pid").read_text())  # a worker the part started is gone too (reaped by init)
    for _ in range(50):
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the part's child process {child} outlived the part's timeout")
