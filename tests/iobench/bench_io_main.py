"""`corpusforge bench-io` as a script, for torchrun in the tests (torchrun starts a script, not a console entry)."""

from corpusforge.cli.bench_io import bench_io_cmd

if __name__ == "__main__":
    bench_io_cmd()
