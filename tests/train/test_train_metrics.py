"""Metrics: the peak-FLOPS table, data-wait percentiles, log lines, metrics.jsonl and TensorBoard."""

from __future__ import annotations

import pytest

from corpusforge.train.metrics import MetricsWriter, format_line, peak_flops, percentiles_ms, read_metrics


@pytest.mark.parametrize(
    "name, flops",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_table(name, flops):
    assert peak_flops(name) == flops


def test_percentiles_and_log_line():
    assert percentiles_ms([0.001] * 99 + [0.1]) == (pytest.approx(1.0), pytest.approx(1.99))
    m = {"step": 10, "max_steps": 100, "loss": 3.25, "lr": 6e-4, "grad_norm": 0.5, "tokens_per_s": 123456.0,
         "mfu": 0.4, "data_wait_ms": [[0.1, 0.2], [0.1, 0.3]]}  # fmt: skip
    line = format_line(m)
    assert "step     10/100" in line and "mfu 40.0%" in line and "r1 0.10/0.30ms" in line
    many = format_line({**m, "mfu": None, "data_wait_ms": [[0.1, 0.2], [0.1, 5.0], [0.2, 0.3]]})
    assert "mfu" not in many and "p99 5.00ms (worst r1)" in many


def test_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    writer.write("train", {"step": 1, "loss": 2.0, "data_wait_ms": [[0.1, 0.2]]})
    writer.close()
    assert read_metrics(tmp_path / "metrics.jsonl", "train") == [
        {"kind": "train", "step": 1, "loss": 2.0, "data_wait_ms": [[0.1, 0.2]]}
    ]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
