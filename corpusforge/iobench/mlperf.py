"""MLPerf Storage v2.0's checkpointing workload: the four Llama 3 models, which files each rank writes, and the metric.

What the rules fix (mlcommons/storage, Submission_guidelines.md section 2.2, identical on `main` at caa90c9c7d6a
and on `v2.0-branch` at 0bfbd3aa477; the model files are configs/dlio/workload/llama3_{8b,70b,405b,1t}.yaml):

    model         layers  hidden  ffn    heads kv  TPxPPxDP  ZeRO  processes  checkpoint ("Table 2")
    llama3-8b     32      4096    14336  32    8   1x1x8     3     8          105 GB
    llama3-70b    80      8192    28672  128   8   8x1x8     3     64         912 GB
    llama3-405b   126     16384   53248  128   8   8x32x2    1     512        5.29 TB
    llama3-1t     128     25872   98304  192   32  8x64x2    1     1024       18 TB

vocabulary 128256, weights fp16, optimizer state fp32, fsync on every file, 10 checkpoints written then 10 read
(num_checkpoints_write / num_checkpoints_read), the page cache cleared between the writes and the reads. Per
checkpoint "the metric for duration is the maximum time across all GPUs, the metric for throughput is the minimum
across all GPUs"; a submission runs five times and reports the mean. "GB" in Table 2 is GiB: mlpstorage/config.py's
LLM_SIZE_BY_RANK gives (model, optimizer) as (15, 90), (130, 781), (755, 4533), (2571, 15426), DLIO's /1024**3 sums.
DLIO's arithmetic below gives 105, 911, 5292 GiB for the first three; for llama3-1t it gives 15,427 GiB (2,204 of
weights, 13,223 of optimizer state), which is LLM_SIZE_BY_RANK's optimizer figure alone: the 18 TB of Table 2
(2571 + 15426) is not what the 1T configuration writes (config.py: "These need to be updated with actual values").
bench-io writes what DLIO writes.

How the bytes fall on the ranks is DLIO's (argonne-lcf/dlio_benchmark, branch mlperf_storage_v2.0 at 392621b2304,
which mlpstorage v2.0 pins in pyproject.toml): dlio_benchmark/checkpointing/base_checkpointing.py. Each rank
holds the layers of its pipeline stage (embedding with stage 0; lm_head and the final norm with the last stage),
its tensor-parallel slice of the big matrices, divided again over the data-parallel ranks under ZeRO-3; under ZeRO-1
only data-parallel rank 0 writes weights (one file per layer when PP > 1). Every rank writes its optimizer shard:
3 x (parameters / (DP x TP x PP)) + 3 x 5h fp32 values. main.py's _checkpoint_write/_checkpoint_read and
utils/statscounter.py time each checkpoint per rank after a barrier, throughput = whole checkpoint / that rank's
duration: the minimum over ranks is the whole checkpoint over the maximum duration. The rules' "subset" mode (one
host of 8 processes for a bigger model) keeps the full DP and runs ranks 0..N-1 only.

The 5 s of emulated compute before each checkpoint (time_between_checkpoints) are bench-io's --mlperf-pause, not
timed. Files hold raw tensor bytes, not torch.save's zip container (a few KiB per file).

Example:
    >>> MODELS["llama3-8b"].ranks, round(MODELS["llama3-8b"].total_bytes() / 2**30)
    (8, 105)
    >>> MODELS["llama3-8b"].rank_files(0, scale=0.001)
    [('zero_pp_rank_0_mp_rank_0_model_states', 2007040), ('zero_pp_rank_0_mp_rank_0_optim_states', 12042240)]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

VOCAB = 128256  # Llama 3's vocabulary (every llama3_*.yaml)
WEIGHT_BYTES, OPTIMIZER_BYTES = 2, 4  # model_datatype fp16, optimizer_datatype fp32
CHECKPOINTS = 10  # num_checkpoints_write = num_checkpoints_read in every llama3_*.yaml
ALIGN = 4096  # scaled files are whole 4 KiB blocks, so that fio and O_DIRECT can write the same sizes


@dataclass(frozen=True)
class LlamaCheckpoint:
    """One row of the rules' Table 2, and the files its ranks write (DLIO's layout)."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    tp: int
    pp: int
    dp: int
    zero: int
    table_size: str  # as the rules print it

    @property
    def ranks(self) -> int:
        """Processes of a CLOSED submission: TP x PP x DP."""
        return self.tp * self.pp * self.dp

    def parameters(self) -> int:
        """BaseCheckpointing.get_num_parameters: embedding, lm_head, the final norm, and per layer two norms, qkv
        (GQA: h x (h + 2 kv_dim)), the output projection and the gated MLP (3 x h x ffn)."""
        h = self.hidden
        kv = h // self.heads * self.kv_heads
        layer = h + h * (h + 2 * kv) + h * h + h + 2 * self.ffn * h + self.ffn * h
        return 2 * VOCAB * h + layer * self.layers + h

    def _layer_range(self, stage: int) -> range:
        """get_layer_index: layer 0 is the embedding, 1..L the transformer layers, L+1 lm_head, L+2 the norm."""
        per, extra = divmod(self.layers, self.pp)
        if stage < extra:
            start = stage * (per + 1) + 1
            end = start + per
        else:
            start = extra * (per + 1) + (stage - extra) * per + 1
            end = start + per - 1
        if stage == self.pp - 1:
            end = self.layers + 2
        if stage == 0:
            start = 0
        return range(start, end + 1)

    def _layer_bytes(self, index: int) -> int:
        """get_layer_parameters x fp16: a layer's tensors on one rank (integer division, as DLIO's)."""
        h, tp = self.hidden, self.tp
        shard = self.dp if self.zero >= 3 else 1
        kv = h // self.heads * self.kv_heads
        if index in (0, self.layers + 1):
            sizes = [h * VOCAB // tp // shard]
        elif index == self.layers + 2:
            sizes = [h // shard]
        else:
            sizes = [
                h // shard,
                h * (h + 2 * kv) // tp // shard,
                h * h // tp // shard,
                h // shard,
                h * 2 * self.ffn // tp // shard,
                h * self.ffn // tp // shard,
            ]
        return sum(sizes) * WEIGHT_BYTES

    @cache  # noqa: B019 - a handful of frozen instances, called once per rank
    def rank_files_full(self, rank: int) -> tuple[tuple[str, int], ...]:
        """(file name, bytes) that `rank` writes per checkpoint at full size, in DLIO's order and names."""
        mp = self.tp * self.pp
        stage, dp_rank, mp_rank = (rank // self.tp) % self.pp, rank // mp, rank % mp
        layers = self._layer_range(stage)
        files = []
        if self.zero >= 3:
            model = sum(self._layer_bytes(i) for i in layers)
            files.append((f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank}_model_states", model))
        elif dp_rank == 0 and self.pp > 1:
            files += [(f"layer_{i}-model_{mp_rank}_model_states", self._layer_bytes(i)) for i in layers]
        elif dp_rank == 0:
            files.append((f"model_{mp_rank}_model_states", sum(self._layer_bytes(i) for i in layers)))
        shard = self.parameters() // (self.dp * mp)
        files.append((f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank}_optim_states", 3 * (shard + 5 * self.hidden) * 4))
        return tuple(files)

    def rank_files(self, rank: int, scale: float = 1.0) -> list[tuple[str, int]]:
        """rank_files_full with every size times `scale`, rounded down to whole 4 KiB blocks (at least one)."""
        return [(name, scaled(size, scale)) for name, size in self.rank_files_full(rank)]

    def total_bytes(self, scale: float = 1.0, processes: int | None = None) -> int:
        """Bytes of one checkpoint over ranks 0..processes-1 (default: all, the CLOSED run)."""
        n = self.ranks if processes is None else processes
        return sum(size for r in range(n) for _, size in self.rank_files(r, scale))


def scaled(size: int, scale: float) -> int:
    """`size` times `scale`, down to whole 4 KiB blocks, at least one block."""
    return size if scale == 1 else max(ALIGN, int(size * scale) // ALIGN * ALIGN)


MODELS = {
    m.name: m
    for m in (
        LlamaCheckpoint("llama3-8b", 32, 4096, 14336, 32, 8, tp=1, pp=1, dp=8, zero=3, table_size="105 GB"),
        LlamaCheckpoint("llama3-70b", 80, 8192, 28672, 128, 8, tp=8, pp=1, dp=8, zero=3, table_size="912 GB"),
        LlamaCheckpoint("llama3-405b", 126, 16384, 53248, 128, 8, tp=8, pp=32, dp=2, zero=1, table_size="5.29 TB"),
        LlamaCheckpoint("llama3-1t", 128, 25872, 98304, 192, 32, tp=8, pp=64, dp=2, zero=1, table_size="18 TB"),
    )
}
