"""Fixtures of the bench-io tests (defined in iobench_helpers, next to the helpers they use)."""

from iobench_helpers import slowfs, slurm, throttled_disk, tmpfs  # noqa: F401 - pytest finds fixtures by name here
