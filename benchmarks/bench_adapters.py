"""What each trainer adapter costs per sample against corpusforge's own loader, in one run.

    python benchmarks/bench_adapters.py [--tokens 2e7] [--docs 9600] [--samples 4000] [--rounds 7]
                                        [--only NAME ...] [--out benchmarks/results/adapters-<date>.json]

bench_loader's generated dataset (uint16, ~2,000-token documents), its train split, warm page cache, one process
(no workers), micro-batches of 8 samples of 2,048 tokens, the first --samples samples of rank 0 of 1, each batch
as the trainer receives it from its DataLoader; rounds alternate the order of the cases, medians reported. Each
run is timed in wall seconds and in this thread's CPU seconds (time.thread_time): every case runs in this one thread,
so its CPU time is its work, which a loaded machine (other jobs on the same cores) stretches far less than its wall
time; the ratios against the anchor are taken per round, then their median.

  corpusforge          make_loader(train, 8): the anchor, int32 torch tensors
  corpusforge int64    the anchor's batches widened to int64 (tokens, labels, position_ids) in one storage, as the
                       adapters widen them (sample_rows.widened): the anchor doing the int64 adapters' work, the
                       types Megatron-LM, transformers and torchtitan take (the adapters now read numpy fields and
                       widen those, which costs less than the anchor's torch batch and then the widening)
  megatron-lm          MegatronSamples through what Megatron-LM's build_pretraining_data_loader makes: a DataLoader
                       with Megatron's sampler and the default collate (which gives back the batch the samples were
                       cut from: sample_rows); int64 as megatron-core types them
  rows int32           the same DataLoader over the fields as read (int32) cut into those rows: the Megatron-LM
                       adapter without its int64 widening (not Megatron's types; the split of its cost)
  megatron-core        megatron-core's own GPTDataset in that same DataLoader (what the provider replaces)
  hf-trainer           TrainerSamples in a DataLoader of 8 in order with collate_rows, the adapter's data_collator
  hf default collate   the same with transformers' default_data_collator (which copies every field)
  lightning            CorpusforgeDataModule.train_dataloader() and its on_before_batch_transfer count
  grain loader         grain_loader(GrainSource(train, 8)): Grain's DataLoader over micro-batch records (numpy), with
                       its default read options (no threads: all in this thread)
  grain mapdataset     grain_dataset(source).to_iter_dataset() without read threads: the same records as a MapDataset
  grain per sample     grain_dataset(source, per_sample=True): Grain's .batch over sample records, one read a sample
  torchtitan           CorpusforgeDataLoader built as torchtitan's Trainer builds it: int64 inputs, labels masked

Each case's extra CPU time is also given against "corpusforge int64" (the anchor doing the int64 adapters' work).
Cases are a list of Case(name, make, tokens); another adapter adds its own to CASES. Every case's first batches
are checked equal to the anchor's. The target (issue 31): within 10% per sample of corpusforge's loader.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_loader as bench  # noqa: E402

from corpusforge.data import PretrainingBatchSampler, build_gpt_datasets, make_loader  # noqa: E402

BATCH = 8
INT64 = "corpusforge int64"


@dataclass(frozen=True)
class Setup:
    """What every case builds on: corpusforge's train split and how it was made."""

    train: Any
    prefix: str
    seq_length: int
    samples: int
    cache: Path


@dataclass(frozen=True)
class Case:
    """One way of reading micro-batches: `make(setup)` returns a fresh iterable of batches (made outside the
    timing); `tokens(batch)` their tokens as numpy, to check them against the anchor's."""

    name: str
    make: Callable[[Setup], Iterable[Any]]
    tokens: Callable[[Any], np.ndarray] = lambda batch: batch["tokens"].numpy()


def megatron_loader(dataset: Any) -> Iterable[Any]:
    """build_pretraining_data_loader's DataLoader (no workers): Megatron's sampler, the default collate."""
    import torch

    sampler = PretrainingBatchSampler(len(dataset), 0, BATCH, 0, 1)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0)


def megatron_lm(s: Setup) -> Iterable[Any]:
    from corpusforge.adapters.megatron_lm import MegatronSamples

    return megatron_loader(MegatronSamples(s.train, "train"))


class _RowsAsRead:
    """corpusforge's fields as read (int32), cut into per-sample rows that the default collate gives back: the
    Megatron-LM adapter's per-sample protocol without its int64 widening (what the widening costs is the rest)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, ids: list[int]) -> list[Any]:
        import torch

        from corpusforge.adapters.sample_rows import sample_rows

        batch = self.dataset.get_batch(np.asarray(ids, dtype=np.int64))
        return sample_rows({k: torch.from_numpy(v) for k, v in batch.items()})


def megatron_core(s: Setup) -> Iterable[Any]:
    import torch.distributed
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tokenizer:
        eod, vocab_size, unique_identifiers = bench.EOD, bench.VOCAB, {"class": "bench"}

    torch.distributed.get_rank = lambda *a, **k: 0  # megatron-core asks even without a process group
    config = GPTDatasetConfig(random_seed=bench.SEED, sequence_length=s.seq_length, blend=([s.prefix], None),
                              split=bench.SPLIT, path_to_cache=str(s.cache / "megatron"), tokenizer=Tokenizer(),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=False)  # fmt: skip
    train = BlendedMegatronDatasetBuilder(GPTDataset, [s.samples, 0, 0], lambda: True, config).build()[0]
    return megatron_loader(train)


def hf_trainer(s: Setup, default_collate: bool = False) -> Iterable[Any]:
    import torch
    from transformers import default_data_collator

    from corpusforge.adapters.hf_trainer import TrainerSamples, collate_rows

    collate = default_data_collator if default_collate else collate_rows
    return torch.utils.data.DataLoader(TrainerSamples(s.train), batch_size=BATCH, shuffle=False, drop_last=True,
                                       collate_fn=collate)  # fmt: skip


class _Counting:
    """The batches of a data module's train loader, each passed through its on_before_batch_transfer as Lightning
    does for the batch it trains on (here without a Trainer attached: the count is the hook's whole work)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __iter__(self):
        for batch in self.data.train_dataloader():
            yield self.data.on_before_batch_transfer(batch, 0)


def lightning(s: Setup) -> Iterable[Any]:
    from corpusforge.adapters.lightning import CorpusforgeDataModule

    data = CorpusforgeDataModule(s.prefix, s.seq_length, BATCH)
    data.datasets = (s.train, None, None)
    return _Counting(data)


def widened(s: Setup) -> Iterable[Any]:
    from corpusforge.adapters.sample_rows import widened as widen

    for batch in make_loader(s.train, BATCH):
        tokens, labels, positions = widen(*(batch[k].numpy() for k in ("tokens", "labels", "position_ids")))
        yield {**batch, "tokens": tokens, "labels": labels, "position_ids": positions}


def grain_case(s: Setup, kind: str) -> Iterable[Any]:
    import grain.python as grain

    from corpusforge.adapters.grain import GrainSource, grain_dataset, grain_loader

    source = GrainSource(s.train, BATCH)
    if kind == "loader":
        return grain_loader(source)
    if kind == "loader 2 threads":  # reading ahead in threads, 8 micro-batches
        return grain_loader(source, read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
    if kind == "loader grain default":  # Grain's own ReadOptions(): 16 threads, 500 records ahead
        return grain_loader(source, read_options=grain.ReadOptions())
    no_threads = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # thread_time sees all the work
    return grain_dataset(source, per_sample=kind == "per sample").to_iter_dataset(no_threads)


def torchtitan(s: Setup) -> Iterable[Any]:
    from corpusforge.adapters.torchtitan import CorpusforgeDataLoader

    config = CorpusforgeDataLoader.Config(blend=[s.prefix], split=bench.SPLIT, seed=bench.SEED, num_samples=s.samples,
                                          cache_dir=str(s.cache), eod_token_id=bench.EOD)  # fmt: skip
    return config.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=s.seq_length, local_batch_size=BATCH)


CASES: list[Case] = [
    Case("corpusforge", lambda s: make_loader(s.train, BATCH)),
    Case(INT64, widened),
    Case("megatron-lm", megatron_lm),
    Case("rows int32", lambda s: megatron_loader(_RowsAsRead(s.train))),
    Case("megatron-core", megatron_core),
    Case("hf-trainer", hf_trainer, lambda batch: batch["input_ids"].numpy()),
    Case("hf default collate", lambda s: hf_trainer(s, True), lambda batch: batch["input_ids"].numpy()),
    Case("lightning", lightning),
    *(Case(f"grain {kind}", lambda s, kind=kind: grain_case(s, kind), lambda batch: batch["tokens"])
      for kind in ("loader", "loader 2 threads", "loader grain default", "mapdataset", "per sample")),
    Case("torchtitan", torchtitan, lambda batch: batch[0]["input"].numpy()),
]  # fmt: skip


def timed(case: Case, setup: Setup, batches: int) -> tuple[float, float]:
    """(wall, thread CPU) microseconds per sample over `batches` micro-batches of a fresh iterable."""
    iterable = case.make(setup)
    t0, c0 = time.perf_counter(), time.thread_time()
    it = iter(iterable)
    for _ in range(batches):
        next(it)
    per = 1e6 / (batches * BATCH)
    return round((time.perf_counter() - t0) * per, 2), round((time.thread_time() - c0) * per, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=2e7)
    ap.add_argument("--docs", type=float, default=9600)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", nargs="*", help="case names to run (the anchor always runs)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    out = args.out or HERE / "results" / f"adapters-{date}.json"
    tokens, docs, seq = int(args.tokens), int(args.docs), args.seq_length
    prefix = HERE / "work" / "loader" / f"gen_{tokens:.0e}tok_{docs}doc_text_document".replace("+", "")
    cache = HERE / "work" / "adapters-cache"
    bench.make_dataset(prefix, tokens, docs)
    bench.warm(f"{prefix}.bin")
    train, _, _ = build_gpt_datasets(str(prefix), seq, bench.SPLIT, bench.SEED, (args.samples, 0, 0), cache,
                                     eod_token_id=bench.EOD)  # fmt: skip
    train.load_kernels()
    setup = Setup(train, str(prefix), seq, args.samples, cache)
    cases = [c for c in CASES if c.name == "corpusforge" or not args.only or c.name in args.only]
    batches = args.samples // BATCH
    anchor = [b["tokens"].numpy() for _, b in zip(range(3), make_loader(train, BATCH))]
    for case in cases:  # also the first calls, which are not throughput
        got = [case.tokens(b) for _, b in zip(range(3), case.make(setup))]
        assert all(np.array_equal(a, b) for a, b in zip(got, anchor)), f"{case.name}: not the anchor's batches"
    wall: dict[str, list[float]] = {c.name: [] for c in cases}
    cpu: dict[str, list[float]] = {c.name: [] for c in cases}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for case in cases if r % 2 == 0 else cases[::-1]:
            w, c = timed(case, setup, batches)
            wall[case.name].append(w)
            cpu[case.name].append(c)
        load.append(os.getloadavg()[0])
        print(f"round {r + 1} (cpu us/sample): " + "  ".join(f"{k} {v[-1]}" for k, v in cpu.items()), flush=True)

    def cost_of(runs: dict[str, list[float]], against: str = "corpusforge") -> dict[str, float]:
        anchor = runs[against]
        return {k: round(statistics.median(a / b - 1 for a, b in zip(v, anchor)), 4) for k, v in runs.items()
                if k != against}  # fmt: skip

    med = {k: statistics.median(v) for k, v in cpu.items()}
    cost = cost_of(cpu)
    machine = bench.machine_info()
    machine["adapter_packages"] = {
        n: importlib.metadata.version(n) for n in ("transformers", "lightning", "megatron-core", "grain", "torchtitan")
    }
    report = {
        "benchmark": "adapters",
        "machine": machine,
        "load_average_per_round": [round(x, 2) for x in load],
        "config": {"tokens": tokens, "documents": docs, "seq_length": seq, "samples": args.samples,
                   "rounds": args.rounds, "micro_batch": BATCH, "workers": 0, "read_mode": train.indexed.read_mode},
        "median_cpu_us_per_sample": med,
        "extra_cpu_time_vs_corpusforge": cost,
        # the int64 adapters (Megatron-LM, HF Trainer, torchtitan) against the anchor doing their work: int64 fields
        "extra_cpu_time_vs_corpusforge_int64": cost_of(cpu, "corpusforge int64") if INT64 in cpu else None,
        "median_wall_us_per_sample": {k: statistics.median(v) for k, v in wall.items()},
        "extra_wall_time_vs_corpusforge": cost_of(wall),
        "runs_cpu_us_per_sample": cpu,
        "runs_wall_us_per_sample": wall,
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    walls, vs_int64 = report["extra_wall_time_vs_corpusforge"], report["extra_cpu_time_vs_corpusforge_int64"] or {}
    print(f"\nmedian of {args.rounds} rounds, CPU us per sample ({args.samples} samples, batches of {BATCH}, warm):")
    for k, v in med.items():
        extra = f"  {cost[k]:+.1%} vs corpusforge (wall {walls[k]:+.1%})" if k in cost else ""
        extra += f", {vs_int64[k]:+.1%} vs {INT64}" if k in vs_int64 and k in cost else ""
        print(f"  {k:18s} {v:8.2f}{extra}")
    print(f"load average per round: {[round(x, 2) for x in load]}\nwrote {out}")


if __name__ == "__main__":
    main()
