"""What a run reports: log lines, metrics.jsonl, TensorBoard when installed, MFU against a per-device peak.

Names say what they measure: `data_wait_ms_p50/p99` is the time a step sat in `next(loader)` (per rank, over the
log interval), `tokens_per_s` counts the tokens of optimizer steps over wall time, `mfu` is model FLOPs per second
over the device's dense bf16 peak (the convention of PaLM's MFU, not hardware FLOPs utilisation).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

# Dense (no sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors' data sheets. Matched against
# torch.cuda.get_device_name() by substring, first match wins, so the more specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("H20", 148e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A30", 165e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
]


def peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, None when the table does not know it.

    Example:
        >>> peak_flops("NVIDIA H100 80GB HBM3")
        989000000000000.0
    """
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def percentiles_ms(seconds: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds of a list of durations in seconds."""
    if not seconds:
        return 0.0, 0.0
    p50, p99 = np.percentile(np.asarray(seconds) * 1e3, [50, 99])
    return float(p50), float(p99)


def format_line(m: dict[str, Any]) -> str:
    """One log line from a step's metrics."""
    parts = [
        f"step {m['step']:>6}/{m['max_steps']}",
        f"loss {m['loss']:.4f}",
        f"lr {m['lr']:.3e}",
        f"grad_norm {m['grad_norm']:.3f}",
        f"tok/s {m['tokens_per_s']:,.0f}",
    ]
    if m.get("mfu") is not None:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    waits = m["data_wait_ms"]  # per rank: [p50, p99]
    worst = max(range(len(waits)), key=lambda r: waits[r][1])
    if len(waits) <= 2:
        parts.append("data_wait p50/p99 " + " ".join(f"r{r} {a:.2f}/{b:.2f}ms" for r, (a, b) in enumerate(waits)))
    else:
        p50 = max(w[0] for w in waits)
        parts.append(f"data_wait p50 {p50:.2f}ms, p99 {waits[worst][1]:.2f}ms (worst r{worst})")
    return " | ".join(parts)


class MetricsWriter:
    """Appends one JSON object per event to `{out_dir}/metrics.jsonl` (rank 0 only) and mirrors scalars to
    TensorBoard when it is installed and enabled."""

    def __init__(self, out_dir: str | Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.file = None
        self.tb = None
        if not enabled:
            return
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.file = open(Path(out_dir) / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional: pip install 'corpusforge[tensorboard]'
                SummaryWriter = None  # noqa: N806
            if SummaryWriter is not None:
                self.tb = SummaryWriter(os.fspath(Path(out_dir) / "tensorboard"))

    def write(self, kind: str, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"kind": kind, **record}) + "\n")
        if self.tb is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step" and value is not None:
                    self.tb.add_scalar(f"{kind}/{key}", value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, optionally of one kind ("train", "valid", "checkpoint", "summary")."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind]
