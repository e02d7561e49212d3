"""What a bench-io run measures: one frozen dataclass, one docstring per option, and its size arithmetic."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from corpusforge.errors import CorpusforgeError
from corpusforge.iobench.mlperf import MODELS as MLPERF_MODELS

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Read and write patterns over plain files; "replay" and "train" go through corpusforge's loader.
PATTERNS = ("seq-read", "seq-write", "rand-read", "metadata", "checkpoint", "replay", "train", "offload")
DEFAULT_PATTERNS = ("seq-write", "seq-read", "rand-read", "metadata", "checkpoint", "replay")


class BenchConfigError(CorpusforgeError, ValueError):
    """A configuration that cannot run; the message is the one line a person needs."""


@dataclass(frozen=True)
class BenchConfig:
    """Options of one bench-io run (each path gets the same patterns)."""

    paths: tuple[str, ...]
    """Directories (a local or shared mount) or fsspec URLs (s3://bucket/prefix) to measure; several: side by side."""

    patterns: tuple[str, ...] = DEFAULT_PATTERNS
    """Patterns to run, in order; see PATTERNS."""

    block_sizes: tuple[int, ...] = (MiB,)
    """Request sizes of seq-read and seq-write, in bytes; several values sweep (4 KiB to 16 MiB is the useful range).
    The first is also the request size of --mlperf checkpoint writes and reads."""

    procs: tuple[int, ...] = (1,)
    """Processes per rank running each pattern at once; several values sweep."""

    file_size: int = 64 * MiB
    """Bytes per process read or written by seq-read, seq-write and rand-read."""

    layout: str = "file-per-process"
    """"file-per-process", or "shared": every process works on its own region of one shared file."""

    direct: str = "auto"
    """O_DIRECT for seq-read/seq-write/rand-read: "auto" where the file system allows it, "on" (required), "off"."""

    drop_cache: bool = True
    """Evict benchmark files from the page cache (fsync + posix_fadvise DONTNEED) before reading them."""

    sample_size: int = 8 * KiB
    """Bytes per random read: a training sample ((seq_length + 1) tokens; 4097 uint16 tokens are ~8 KiB)."""

    rand_ops: int = 20000
    """Random reads per process (fewer if `duration` runs out first)."""

    duration: float = 30.0
    """Seconds after which a read pattern stops early and reports what it measured."""

    metadata_files: int = 1000
    """Small files per process created, stat-ed, opened and deleted by the metadata pattern."""

    metadata_file_size: int = 4 * KiB
    """Bytes written into each metadata file."""

    checkpoint_size: int = 256 * MiB
    """Bytes of tensors per process (one file per rank) written and read back by the checkpoint pattern."""

    checkpoint_hidden: int = 1024
    """Hidden size of the transformer whose layer shapes the checkpoint tensors take ((h, 3h), (h, h), (h, 4h), ...)."""

    mlperf: str | None = None
    """The checkpoint pattern as MLPerf Storage v2.0's checkpointing workload for this model (llama3-8b, llama3-70b,
    llama3-405b, llama3-1t): its ranks and the files each writes (iobench/mlperf.py), fsync on every file, N
    checkpoints written, page cache dropped, N read; duration the maximum over ranks, throughput the minimum."""

    scale: float = 1.0
    """With --mlperf: the fraction of the rules' checkpoint sizes written (0 < F <= 1), to fit a test machine."""

    mlperf_processes: int = 0
    """With --mlperf: processes writing, 0 for the rules' count (8, 64, 512, 1024); fewer is MLPerf's subset mode
    (ranks 0..N-1 of the full layout, as `mlpstorage checkpointing --num-processes 8` on one host)."""

    mlperf_checkpoints: int = 10
    """With --mlperf: checkpoints written, then read back (the rules' num_checkpoints_write/read: 10)."""

    mlperf_pause: float = 5.0
    """With --mlperf: seconds of emulated compute before each checkpoint written or read, not timed (the rules'
    time_between_checkpoints: 5); the storage drains its write-back meanwhile, as it does in training."""

    dataset: str | None = None
    """Token dataset prefix (PREFIX.bin/.idx) for replay and train; None: a synthetic one is written on the path."""

    synthetic_tokens: int = 16 * MiB
    """Tokens of the synthetic dataset (uint16: 2 bytes each) when no `dataset` is given."""

    seq_length: int = 2048
    """Tokens per sample of the replayed loader."""

    micro_batch: int = 8
    """Samples per batch per process (per emulated accelerator)."""

    loader_workers: int = 0
    """DataLoader worker processes per loader (0: read in the loader's process)."""

    remote_block_size: int = 256 * MiB
    """Replay and train from an object store: bytes per ranged GET of the loader's block cache (the loader's own
    default, corpusforge.storage.StorageConfig.block_size, as Megatron-Core's S3 reader)."""

    steps: int = 50
    """Batches per process for replay and per emulated accelerator for train."""

    seed: int = 1234
    """Seed of the dataset's shuffle and of the random offsets."""

    compute_time: float = 0.1
    """Train emulation: seconds of emulated compute per step (sleep), as DLIO / MLPerf Storage do."""

    target_utilization: float = 0.9
    """Train emulation: accelerator utilisation (compute / wall, first step excluded) that counts as fed."""

    max_accelerators: int = 64
    """Train emulation: the search for the largest fed count stops here."""

    stall_seconds: float = 5.0
    """A single operation slower than this is flagged as a stall."""

    hang_seconds: float = 60.0
    """An operation still running after this long is declared hung: its workers are killed and the run goes on."""

    storage_options: tuple[tuple[str, str], ...] = ()
    """fsspec options for URLs, e.g. (("endpoint_url", "http://127.0.0.1:7480"),)."""

    check_space: bool = True
    """Refuse to start when the path has less free space than the run needs."""

    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Free-form labels copied into the JSON report (machine, note)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.paths:
            problems.append("give at least one path")
        unknown = [p for p in self.patterns if p not in PATTERNS]
        if unknown:
            problems.append(f"unknown pattern(s) {', '.join(unknown)}; choose from {', '.join(PATTERNS)}")
        if self.layout not in ("file-per-process", "shared"):
            problems.append(f"layout {self.layout!r}: choose file-per-process or shared")
        if self.direct not in ("auto", "on", "off"):
            problems.append(f"direct {self.direct!r}: choose auto, on or off")
        if any(b < 1 for b in self.block_sizes) or any(p < 1 for p in self.procs) or self.remote_block_size < 1:
            problems.append("block sizes (also --remote-block-size) and process counts must be positive")
        if self.file_size < max(self.block_sizes, default=1):
            problems.append(f"file size {self.file_size} is smaller than the largest block size")
        if self.file_size < self.sample_size:
            problems.append(f"file size {self.file_size} is smaller than the sample size {self.sample_size}")
        if self.hang_seconds <= self.stall_seconds:
            problems.append(f"hang_seconds ({self.hang_seconds}) must exceed stall_seconds ({self.stall_seconds})")
        if not 0 < self.target_utilization <= 1:
            problems.append(f"target utilisation {self.target_utilization} must be in (0, 1]")
        if self.steps < 2 and ("train" in self.patterns or "replay" in self.patterns):
            problems.append("steps must be at least 2 (the first step is excluded from the figures)")
        problems += self._mlperf_problems()
        if problems:
            raise BenchConfigError("; ".join(problems))

    def _mlperf_problems(self) -> list[str]:
        """The --mlperf options, each problem as `option: what is wrong; the fix`."""
        if self.mlperf is None:
            return (
                [] if self.scale == 1.0 else [f"--scale {self.scale:g}: applies to --mlperf only; add --mlperf MODEL"]
            )
        if self.mlperf not in MLPERF_MODELS:
            return [f"--mlperf {self.mlperf}: unknown model; choose {', '.join(MLPERF_MODELS)}"]
        problems = []
        if not 0 < self.scale <= 1:
            problems.append(
                f"--scale {self.scale:g}: not a fraction of the checkpoint size; give 0 < F <= 1 (e.g. 0.001)"
            )
        ranks = MLPERF_MODELS[self.mlperf].ranks
        if not 0 <= self.mlperf_processes <= ranks:
            problems.append(
                f"--mlperf-processes {self.mlperf_processes}: {self.mlperf} has {ranks} ranks; give 1..{ranks}, "
                "or 0 for all"
            )
        if self.mlperf_pause < 0:
            problems.append(f"--mlperf-pause {self.mlperf_pause:g}: negative; give seconds >= 0 (the rules: 5)")
        if self.mlperf_checkpoints < 1:
            problems.append(f"--mlperf-checkpoints {self.mlperf_checkpoints}: give at least 1 (the rules: 10)")
        if "checkpoint" not in self.patterns:
            problems.append(f"--mlperf {self.mlperf}: drives the checkpoint pattern; add --pattern checkpoint")
        return problems

    def mlperf_slots(self) -> int:
        """Processes (over all ranks) of the --mlperf checkpoint workload."""
        return self.mlperf_processes or MLPERF_MODELS[self.mlperf].ranks

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def bytes_needed(self, world: int = 1) -> int:
        """Peak bytes this run keeps on a local path: the read files stay for the run, the rest come and go."""
        slots = max(self.procs) * world
        reads = self.file_size * slots if {"seq-read", "rand-read"} & set(self.patterns) else 0
        passing = {
            "seq-write": self.file_size * slots,
            "offload": self.file_size * slots,  # the nvme optimizer step's three state files (iobench/offload.py)
            "checkpoint": self._checkpoint_bytes(slots),
            "metadata": self.metadata_files * max(self.metadata_file_size, 4 * KiB) * slots,
        }
        transient = max((n for p, n in passing.items() if p in self.patterns), default=0)
        loader = {"replay", "train"} & set(self.patterns) and self.dataset is None
        return reads + transient + (2 * self.synthetic_tokens + 16 * MiB if loader else 0)

    def _checkpoint_bytes(self, slots: int) -> int:
        if self.mlperf is None:
            return self.checkpoint_size * slots
        model = MLPERF_MODELS[self.mlperf]
        return model.total_bytes(self.scale, self.mlperf_slots()) * self.mlperf_checkpoints
