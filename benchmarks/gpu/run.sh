#!/usr/bin/env bash
# Every GPU claim of corpusforge in one command (benchmarks/gpu/run.py says what it runs and writes):
#   benchmarks/gpu/run.sh OUT_DIR            on a GPU machine, after the install line of benchmarks/gpu/wheels.sh
#   benchmarks/gpu/run.sh --smoke OUT_DIR    every part on CPU at toy sizes (tests/test_gpu_kit.py runs it)
# PYTHON picks the interpreter (default: python3, the one that holds torch on the GPU machine).
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/run.py" "$@"
