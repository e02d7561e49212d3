"""corpusforge.iobench.config and the size arithmetic of the checkpoint pattern."""

from __future__ import annotations

import pytest

from corpusforge.iobench.config import BenchConfig, BenchConfigError, GiB, KiB, MiB
from corpusforge.iobench.patterns import checkpoint_shapes
from corpusforge.sizes import human_bytes, parse_size


def test_parse_size():
    assert [parse_size(t) for t in ("4k", "1M", "16MiB", "2G", "512", "1.5k")] == [
        4096,
        MiB,
        16 * MiB,
        2 * GiB,
        512,
        1536,
    ]
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")


def test_human_bytes():
    assert [human_bytes(n) for n in (512, 4096, 1536, 16 * MiB)] == ["512 B", "4 KiB", "1.5 KiB", "16 MiB"]


@pytest.mark.parametrize(
    "over, message",
    [
        ({"patterns": ("seq-read", "warp")}, "unknown pattern"),
        ({"layout": "striped"}, "layout"),
        ({"direct": "maybe"}, "direct"),
        ({"stall_seconds": 5.0, "hang_seconds": 5.0}, "hang_seconds"),
        ({"file_size": 4 * KiB, "block_sizes": (MiB,)}, "smaller than the largest block"),
        ({"paths": ()}, "at least one path"),
    ],
)
def test_bad_config_is_one_line(over, message):
    with pytest.raises(BenchConfigError, match=message):
        BenchConfig(**{"paths": ("/tmp",), **over})


def test_bytes_needed_counts_read_files_and_the_largest_transient():
    c = BenchConfig(
        paths=("/x",), patterns=("seq-read", "checkpoint"), procs=(1, 4), file_size=MiB, checkpoint_size=3 * MiB
    )
    assert c.bytes_needed() == 4 * MiB + 4 * 3 * MiB
    assert c.bytes_needed(world=2) == 2 * c.bytes_needed()


def test_checkpoint_shapes_are_layer_shaped_and_exact():
    shapes = checkpoint_shapes(64 * MiB, 1024)
    assert shapes[:4] == [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]
    assert sum(r * c * 4 for r, c in shapes) == 64 * MiB
    small = checkpoint_shapes(MiB, 128)
    assert sum(r * c * 4 for r, c in small) == MiB
