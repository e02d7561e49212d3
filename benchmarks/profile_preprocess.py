"""Where `corpusforge preprocess` spends its time, against the raw tokenizer call on the same texts.

    python benchmarks/profile_preprocess.py [--size-mb 100] [--workers 2] [--out benchmarks/results/...json]

Two views, both from CPU time as well as wall clock: on a shared machine the wall clock of a short step is mostly
other people's jobs, while CPU seconds are the work itself.

1. stages, one process each, single-threaded, first call (the tokenizer's word cache starts cold, as in a run):
   JSON parsing with orjson (what the raw call's caller pays before it), the compiled field extractor, gigatoken on
   a list of str and on the extractor's joined bytes (BytesSource), appending EOD tokens, writing the .bin/.idx.
2. one `preprocess()` run with `--workers` worker processes, hooked from here (no hook in the library): the
   parent's serial phases (tokenizer load and warm-up, the texts extracted meanwhile on a thread, planning, pool
   start, the final merge and commit), each task's start, end and CPU time and its worker, and the tail: how long
   the first worker to run out of tasks waited for the last.

Writes JSON beside the table it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from make_corpus import CorpusSpec, ensure_corpus  # noqa: E402


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def clock(fn) -> tuple[object, float, float]:
    """fn()'s result, its wall seconds and its CPU seconds (this process, all threads)."""
    c0, w0 = cpu(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - w0, cpu() - c0


# ---------------------------------------------------------------------------------------------------------------
# 1. stages, each in a fresh process


def stage(name: str, corpus: str) -> dict:
    """One stage on the whole corpus, in this (fresh) process; its inputs are prepared before the clock starts."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    import numpy as np
    import orjson

    from corpusforge import indexed, jsonl_field, sources
    from corpusforge.preprocess import append_eod
    from corpusforge.tokenizers import load_tokenizer

    data = Path(corpus).read_bytes()
    blocks, pos = [], 0
    while pos < len(data):  # the blocks a task reads (sources.BLOCK_BYTES of whole lines)
        end = min(pos + sources.BLOCK_BYTES, len(data))
        end = data.rfind(b"\n", pos, end) + 1 or len(data)
        blocks.append(memoryview(data)[pos:end])
        pos = end
    tok = load_tokenizer("cl100k_base", threads=False)
    tok.encode_batch(["warm up"])
    if name == "orjson_parse":
        run = lambda: [orjson.loads(line)["text"] for line in data.splitlines()]  # noqa: E731
    elif name == "extract_field":
        run = lambda: [jsonl_field.extract_field(b, "text") for b in blocks]  # noqa: E731
    elif name in ("encode_list", "encode_joined"):
        from gigatoken import BytesSource
        from preprocess_variants import gigatoken_tokenizer

        raw = gigatoken_tokenizer()
        raw.encode_batch(["warm up"], parallel=False)
        if name == "encode_list":
            texts = [orjson.loads(line)["text"] for line in data.splitlines()]
            run = lambda: raw.encode_batch(texts, parallel=False)  # noqa: E731
        else:
            joined = [jsonl_field.extract_field(b, "text")[2].data for b in blocks]
            run = lambda: [raw.encode_batch(BytesSource(j, separator=b"\xff"), parallel=False) for j in joined]  # noqa: E731
    elif name in ("append_eod", "write"):
        encoded = [tok.encode_batch(jsonl_field.extract_field(b, "text")[2]) for b in blocks]
        if name == "append_eod":
            run = lambda: [append_eod(f, n, tok.eod_id) for f, n in encoded]  # noqa: E731
        else:

            def run():
                w = indexed.IndexedDatasetWriter(f"/tmp/profile-{os.getpid()}_text_document", np.int32)
                for f, n in encoded:
                    w.add_documents(f, n)
                w.finalize(durable=False)
                w.discard()
    else:
        raise SystemExit(f"unknown stage {name}")
    _, wall, cpu_s = clock(run)
    return {"stage": name, "wall_s": round(wall, 4), "cpu_s": round(cpu_s, 4)}


STAGES = ["orjson_parse", "extract_field", "encode_list", "encode_joined", "append_eod", "write"]


# ---------------------------------------------------------------------------------------------------------------
# 2. a timeline of one run


_T0 = 0.0
_RUN_TASK = None


def _timed_task(job, item, ctx):
    """preprocess's _run_task, in the worker; its pid, clock and CPU ride back with the result."""
    c0, w0 = cpu(), time.perf_counter()
    result = _RUN_TASK(job, item, ctx)
    # TaskStats is a dataclass: an extra attribute rides back with it through pickle
    result._profile = (os.getpid(), item.index, item.size, w0 - _T0, time.perf_counter() - _T0, cpu() - c0)
    return result


def timeline(corpus: str, workers: int) -> dict:
    from corpusforge import preprocess as pp

    t0 = time.perf_counter()
    events: dict[str, list] = {}

    def hook(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            c0, w0 = cpu(), time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                events.setdefault(label, []).append((w0 - t0, time.perf_counter() - t0, cpu() - c0))

        setattr(owner, name, wrapper)

    global _T0, _RUN_TASK
    _T0, _RUN_TASK = t0, pp._run_task
    pp._run_task = _timed_task  # a module-level function: the pool pickles it by name
    hook(pp, "_tokenizer", "tokenizer load")
    hook(pp.sources, "prefetch_blocks", "extract ahead (thread; its CPU counts every thread)")
    hook(pp, "write_json_atomic", "json writes (fsync)")
    hook(pp, "_prepare_parts", "plan tasks")
    hook(pp, "_run_tasks", "tasks")
    hook(pp._PartMerger, "finish", "merge finish")
    hook(pp, "_commit", "commit")
    results: list = []
    original_run_tasks = pp.run_tasks

    def run_tasks(*args, **kwargs):
        run = original_run_tasks(*args, **kwargs)
        results.extend(run.ran)
        return run

    pp.run_tasks = run_tasks
    out = Path(f"/tmp/profile-preprocess-{os.getpid()}")
    config = pp.PreprocessConfig(inputs=(corpus,), output_prefix=str(out), tokenizer="cl100k_base",
                                 append_eod=False, workers=workers)  # fmt: skip
    (stats, wall, cpu_s) = clock(lambda: pp.preprocess(config))
    for suffix in ("_text_document.bin", "_text_document.idx", ".preprocess.json"):
        Path(f"{out}{suffix}").unlink(missing_ok=True)
    tasks = sorted((r._profile for r in results), key=lambda t: t[1])
    by_worker: dict[int, list] = {}
    for pid, _, _, start, end, c in tasks:
        by_worker.setdefault(pid, []).append((start, end, c))
    ends = sorted(max(e for _, e, _ in ts) for ts in by_worker.values())
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "seconds": stats.seconds,
        "wall_s": wall,
        "parent_cpu_s": cpu_s,
        "workers_cpu_s": children.ru_utime + children.ru_stime,
        "phases": {k: [[round(x, 4) for x in e] for e in v] for k, v in events.items()},
        "first_task_start_s": min(t[3] for t in tasks),
        "tasks": [dict(zip(("pid", "index", "bytes", "start_s", "end_s", "cpu_s"), t)) for t in tasks],
        "worker_busy_cpu_s": {str(pid): sum(c for _, _, c in ts) for pid, ts in by_worker.items()},
        "tail_wait_s": ends[-1] - ends[0],
    }


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage in this process
    ap.add_argument("--timeline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    if a.stage:
        print(json.dumps(stage(a.stage, a.corpus)))
        return
    if a.timeline:
        print(json.dumps(timeline(a.corpus, a.workers)))
        return
    corpus, _ = ensure_corpus(CorpusSpec(size_mb=a.size_mb))
    me = [sys.executable, __file__, "--corpus", str(corpus)]
    stages = []
    for name in STAGES:  # a fresh process each: every one starts with a cold tokenizer cache
        r = json.loads(subprocess.run([*me, "--stage", name], capture_output=True, text=True, check=True).stdout)
        stages.append(r)
        print(f"{name:16s} cpu {r['cpu_s']:6.3f} s   wall {r['wall_s']:6.3f} s", flush=True)
    run = subprocess.run([*me, "--timeline", "--workers", str(a.workers)], capture_output=True, text=True, check=True)
    tl = json.loads(run.stdout)
    print(f"preprocess: {tl['seconds']:.3f} s ({tl['wall_s']:.3f} s wall); parent CPU {tl['parent_cpu_s']:.3f} s, "
          f"workers CPU {tl['workers_cpu_s']:.3f} s; first task at {tl['first_task_start_s']:.3f} s, "
          f"tail wait {tl['tail_wait_s']:.3f} s")  # fmt: skip
    for phase, spans in tl["phases"].items():
        total_wall = sum(e - s for s, e, _ in spans)
        total_cpu = sum(c for _, _, c in spans)
        print(f"    {phase:20s} x{len(spans):<3d} wall {total_wall:6.3f} s  cpu {total_cpu:6.3f} s")
    for pid, c in tl["worker_busy_cpu_s"].items():
        print(f"    worker {pid}: {c:.3f} s CPU in its tasks")
    report = {"corpus": str(corpus), "workers": a.workers, "load_average": os.getloadavg(), "stages": stages,
              "timeline": tl}  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
