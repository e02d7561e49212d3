"""What fill-in-the-middle costs per sample: corpusforge's FIMDataset against its plain samples, and against
Megatron-LM's own GPTFIMDataset (and its plain GPTDataset) on the same data, in the same run.

    python benchmarks/bench_fim.py [--docs 1500] [--seq-length 2048] [--ids 200] [--rounds 5]
                                   [--mirror /work/.mirror/NVIDIA+Megatron-LM/repo] [--out FILE]
    python benchmarks/bench_fim.py --loader [--loader-batches 100] [--rounds 5]     (fim-loader-<date>.json)

Data: the code-like generated "repositories" of benchmarks/megatron_fim_reference.py, longer (3-12 files of up to
20 lines each, ~1,000-3,000 tokens a document), tokenized with the stored tokenizer of the FIM tests
(tests/data/fim_reference/tokenizer), warm page cache. Megatron's classes are those of megatron_fim_reference.py
(HEAD's fim_dataset.py and gpt_dataset.py over the installed megatron-core). Settings: Megatron's defaults
(--fim-rate 0.5 --fim-spm-rate 0.5), and the same split at the file separator with --fim-fragment-rate 0.5.

Per sample `ds[i]` for the same seeded random ids on every side (Megatron reads a sample at a time); for
corpusforge also `get_batch` of 8 ids (what its loaders call). Rounds alternate the order of the sides; medians of
the rounds, wall and CPU time of the process (single-threaded work: CPU time leaves out waiting for a core), with the
load average before each round. Writes benchmarks/results/fim-<date>.json.

--loader: plain and FIM samples (Megatron's defaults, rng="sample") through make_loader with 2 DataLoader workers,
micro-batches of 8, alternating rounds: samples/s, and CPU time a sample of the process and its workers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import megatron_fim_reference as ref  # noqa: E402
from bench_loader import machine_info  # noqa: E402

from corpusforge.data import build_gpt_datasets, make_loader  # noqa: E402
from corpusforge.data.fim import FIMConfig, FIMDataset, FIMTokenizer  # noqa: E402
from corpusforge.indexed import IndexedDatasetWriter  # noqa: E402

TOKENIZER = HERE.parent / "tests" / "data" / "fim_reference" / "tokenizer"
BATCH = 8
SETTINGS = {
    "default": {"fim_rate": 0.5, "fim_spm_rate": 0.5},
    "split": {"fim_rate": 0.5, "fim_spm_rate": 0.5, "fim_split_sample": ref.SPLIT, "fim_fragment_rate": 0.5},
}


def write_corpus(prefix: Path, docs: int) -> int:
    """Documents of 3-12 generated files joined by the file separator, then eod; returns the token count."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    split_id, eod_id = tok.token_to_id(ref.SPLIT), tok.token_to_id(ref.EOD)
    rng = np.random.default_rng(5)
    lengths, parts = [], []
    for _ in range(docs):
        files = [
            "\n".join(ref._line(rng) for _ in range(rng.integers(5, 21))) + "\n" for _ in range(rng.integers(3, 13))
        ]
        ids: list[int] = []
        for k, text in enumerate(tok.encode_batch(files, add_special_tokens=False)):
            ids += ([split_id] if k else []) + text.ids
        ids.append(eod_id)
        parts.append(np.array(ids, np.uint16))
        lengths.append(len(ids))
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(np.concatenate(parts), np.array(lengths, np.int64))
    return int(sum(lengths))


def per_sample(ds, ids: list[int]) -> None:
    for i in ids:
        ds[i]


def batched(ds, ids: list[int]) -> None:
    for k in range(0, len(ids), BATCH):
        ds.get_batch(ids[k : k + BATCH])


def timed(fn, ds, ids: list[int]) -> tuple[float, float]:
    """(wall, CPU) microseconds per sample; the CPU time of this process does not count waiting for a core, which
    on a shared machine moves the wall time by 2x from round to round."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn(ds, ids)
    return (time.perf_counter() - t0) / len(ids) * 1e6, (time.process_time() - c0) / len(ids) * 1e6


def through_loader(ds, batches: int) -> tuple[float, float]:
    """(samples/s wall, CPU us a sample of this process and its workers) of `batches` micro-batches of 8 through
    make_loader with 2 workers, after 4 batches of start-up; the workers' CPU time is counted once they have exited."""
    import gc
    import resource

    it = iter(make_loader(ds, micro_batch_size=BATCH, num_workers=2))
    for _ in range(4):
        next(it)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(it)
    wall = time.perf_counter() - t0
    del it
    gc.collect()  # the iterator's workers exit: their CPU time is in RUSAGE_CHILDREN from then on
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() - c0 + (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    n = batches * BATCH
    return n / wall, cpu / n * 1e6


def loader_run(args, plain, fim_tok, out: Path) -> None:
    """--loader: plain and FIM (Megatron's defaults, rng="sample") samples through the loader, alternating."""
    sides = {"plain": plain, "fim default": FIMDataset(plain, FIMConfig(**SETTINGS["default"]), fim_tok)}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    load = []
    for r in range(args.rounds):
        load.append(round(os.getloadavg()[0], 2))
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            runs[name].append(tuple(round(x, 1) for x in through_loader(sides[name], args.loader_batches)))
        print(f"round {r + 1} (load {load[-1]}): {runs}", flush=True)
    med = {k: {"samples_per_s": statistics.median(x for x, _ in v), "cpu_us_per_sample": statistics.median(
        c for _, c in v)} for k, v in runs.items()}  # fmt: skip
    report = {"benchmark": "fim-loader", "machine": machine_info(), "load_average_per_round": load,
              "config": {"tokens_per_sample": args.seq_length, "micro_batch_size": BATCH, "num_workers": 2,
                         "batches": args.loader_batches, "rounds": args.rounds, "fim": SETTINGS["default"]},
              "median": med, "runs": runs}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for k, v in med.items():
        print(f"  {k:12s} {v['samples_per_s']:9.0f} samples/s   {v['cpu_us_per_sample']:8.1f} CPU us/sample")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=1500)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--ids", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mirror", type=Path, default=ref.MIRROR)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--loader", action="store_true", help="plain and FIM samples through make_loader, 2 workers")
    ap.add_argument("--loader-batches", type=int, default=100)
    args = ap.parse_args()
    kind = "fim-loader" if args.loader else "fim"
    out = args.out or HERE / "results" / f"{kind}-{dt.datetime.now(dt.UTC):%Y-%m-%d}.json"
    seq = args.seq_length
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        prefix = work / "fim_bench_text_document"
        tokens = write_corpus(prefix, args.docs)
        samples = tokens // seq - 2
        if args.loader:  # more than one epoch where the loader reads more than the corpus holds
            samples = max(samples, (args.loader_batches + 16) * BATCH)
        fim_tok = FIMTokenizer(TOKENIZER)
        eod, pad = fim_tok.token_id(ref.EOD), fim_tok.token_id(ref.PAD)
        plain = build_gpt_datasets(str(prefix), seq, "100,0,0", ref.SEED, (samples, None, None),
                                   eod_token_id=eod, pad_token_id=pad)[0]  # fmt: skip
        if args.loader:
            return loader_run(args, plain, fim_tok, out)
        commit = ref.subprocess.run(["git", "-C", str(args.mirror), "rev-parse", "HEAD"], check=True,
                                    capture_output=True, text=True).stdout.strip()  # fmt: skip
        classes = ref.megatron_fim_classes(args.mirror, commit, work)
        mtok = ref.megatron_tokenizer(TOKENIZER)
        plan = {"corpusforge plain": (per_sample, plain), "corpusforge plain batched": (batched, plain)}
        import megatron.core.datasets.gpt_dataset as head_gpt  # HEAD's, registered by megatron_fim_classes

        mplain = ref.build_megatron((head_gpt.GPTDataset, _plain_config(head_gpt)), mtok, prefix, work / "c-plain",
                                    seq, {}, {}, samples=samples)  # fmt: skip
        plan["megatron plain"] = (per_sample, mplain)
        for name, fim in SETTINGS.items():
            for rng in ("sample", "megatron"):
                cfg = FIMConfig(**fim, rng=rng)
                plan[f"corpusforge fim {name} rng={rng}"] = (per_sample, FIMDataset(plain, cfg, fim_tok))
            ds = FIMDataset(plain, FIMConfig(**fim), fim_tok)
            plan[f"corpusforge fim {name} batched"] = (batched, ds)
            plan[f"megatron fim {name}"] = (
                per_sample,
                ref.build_megatron(classes, mtok, prefix, work / f"c-{name}", seq, fim, {}, samples=samples),
            )
        ids = np.random.default_rng(0).integers(0, samples, args.ids).tolist()
        for fn, ds in plan.values():  # first calls are not throughput (numba, torch)
            fn(ds, ids[:16])
        runs: dict[str, list[float]] = {k: [] for k in plan}
        cpu_runs: dict[str, list[float]] = {k: [] for k in plan}
        load = []
        for r in range(args.rounds):
            load.append(round(os.getloadavg()[0], 2))
            for name in list(plan) if r % 2 == 0 else list(plan)[::-1]:
                fn, ds = plan[name]
                wall, cpu = timed(fn, ds, ids)
                runs[name].append(round(wall, 1))
                cpu_runs[name].append(round(cpu, 1))
            print(f"round {r + 1} (load {load[-1]}): " + "  ".join(f"{k} {v[-1]}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_runs.items()}
    ratios = {}
    for kind, m in (("wall", med), ("cpu", cpu_med)):
        for name in SETTINGS:
            cf = m[f"corpusforge fim {name} rng=sample"]
            ratios[f"{kind} {name}: corpusforge fim / plain (per sample)"] = round(cf / m["corpusforge plain"], 2)
            ratios[f"{kind} {name}: corpusforge fim / plain (batched)"] = round(
                m[f"corpusforge fim {name} batched"] / m["corpusforge plain batched"], 2
            )
            ratios[f"{kind} {name}: megatron fim / megatron plain"] = round(
                m[f"megatron fim {name}"] / m["megatron plain"], 2
            )
            ratios[f"{kind} {name}: megatron fim / corpusforge fim (speed-up)"] = round(
                m[f"megatron fim {name}"] / cf, 2
            )
    report = {
        "benchmark": "fim",
        "machine": machine_info(),
        "megatron_lm_commit": commit,
        "load_average_per_round": load,
        "config": {"documents": args.docs, "tokens": tokens, "seq_length": seq, "samples": samples, "ids": args.ids,
                   "rounds": args.rounds, "batch": BATCH, "settings": SETTINGS, "read_mode": plain.indexed.read_mode},
        "median_us_per_sample": med,
        "median_cpu_us_per_sample": cpu_med,
        "ratios": ratios,
        "runs": runs,
        "cpu_runs": cpu_runs,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nmedian of {args.rounds} rounds, us per sample ({args.ids} random ids, seq_length {seq}):")
    for k, v in med.items():
        print(f"  {k:40s} {v:10.1f} wall {cpu_med[k]:10.1f} CPU")
    for k, v in ratios.items():
        print(f"  {k}: {v}x")
    print(f"wrote {out}")


def _plain_config(head_gpt):
    """Megatron's GPTDatasetConfig, taking (and dropping) the FIM-only keyword the builder passes."""

    def make(**kw):
        kw.pop("fim_extra_tokens", None)
        return head_gpt.GPTDatasetConfig(**kw)

    return make


if __name__ == "__main__":
    main()
