"""bench-io: what a storage path really delivers to LLM training (throughput, latency tails, stalls, hangs).

Modules, one job each, in import order (each imports only those above it): config (options), ranks (torchrun /
srun), patterns (the I/O run in worker processes), objstore (the same against s3:// and other fsspec URLs), stats
(rows), results (what a run found: rows, path notes, summaries), search (training emulation's search), guard (the
storage touched from a child with a time limit), runner (checks, workers, watchdog, cleanup), report (table, JSON,
plot).

Example:
    >>> from corpusforge.iobench import BenchConfig, run_bench
    >>> run = run_bench(BenchConfig(paths=("/mnt/lustre/me",), patterns=("seq-read", "rand-read")))
    >>> [(r.pattern, round(r.mb_s)) for r in run.results]
"""

from corpusforge.iobench.config import PATTERNS, BenchConfig, BenchConfigError
from corpusforge.iobench.runner import BenchError, Run, run_bench
from corpusforge.iobench.stats import CaseResult

__all__ = ["PATTERNS", "BenchConfig", "BenchConfigError", "BenchError", "CaseResult", "Run", "run_bench"]
