#!/usr/bin/env bash
# Set-up and entry points. Every command first makes sure the virtual environment, torch and the
# extension are in place; what is already there is reused (seconds on a re-run).
#
#   ./dev.sh train [ARGS...]   the example training run (torchrun, 4 CPU processes by default)
#   ./dev.sh test [PYTEST...]  the test suite
#   ./dev.sh bench NAME        a benchmark from benchmarks/ (NAME without .py), against
#                              megatron-core 0.16.1 (set-up installs it, as the tests need it)
#   ./dev.sh setup             set-up only
#   ./dev.sh gpu               on a GPU machine, with the python and torch already there (no venv,
#                              no downloads): build in place, run the `cuda` tests, then the GPU
#                              benchmarks against megatron-core (benchmarks/gpu.py ->
#                              runs/gpu_bench.json, benchmarks/gpu_step.py -> runs/gpu_step.json,
#                              benchmarks/moe.py --device cuda -> runs/gpu_moe.json,
#                              benchmarks/fsdp.py --device cuda -> runs/gpu_fsdp.json;
#                              megatron-core from .whl/ if not installed)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${MEGATRON_EXT_VENV:-.venv}
PY="$VENV/bin/python"
# Megatron-core, the peer the compatibility tests and benchmarks run against, without its
# dependencies (TransformerEngine and apex among them); the library never imports it.
MEGATRON_CORE="megatron-core==0.16.1"

hash_of() { cat "$@" | sha256sum | cut -d' ' -f1; }

setup() {
  if [ ! -x "$PY" ]; then
    echo "[setup] creating $VENV"
    "$(command -v python3.11 || command -v python3)" -m venv "$VENV"
  fi
  local deps_hash
  deps_hash=$( (cat requirements-dev.txt; echo "$MEGATRON_CORE") | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$VENV/.deps" 2>/dev/null)" != "$deps_hash" ]; then
    echo "[setup] installing torch 2.14.1, the test tools and the peers the tests compare against"
    "$PY" -m pip install --quiet -r requirements-dev.txt
    "$PY" -m pip install --quiet --no-deps "$MEGATRON_CORE"
    echo "$deps_hash" > "$VENV/.deps"
  fi
  local src_hash meta_hash
  src_hash=$(hash_of setup.py pyproject.toml $(find csrc -type f | sort))
  # What the installation itself records (the console script, the package data): a change reinstalls.
  meta_hash=$(grep -E "entry_points|package_data" setup.py | sha256sum | cut -d' ' -f1)
  if [ ! -f "$VENV/.build" ] || [ "$(cat "$VENV/.meta" 2>/dev/null)" != "$meta_hash" ]; then
    echo "[setup] building and installing megatron_ext (C++ extension)"
    "$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
    echo "$src_hash" > "$VENV/.build"
    echo "$meta_hash" > "$VENV/.meta"
  elif [ "$(cat "$VENV/.build")" != "$src_hash" ]; then
    echo "[setup] C++ sources changed: rebuilding the extension"
    "$PY" setup.py --quiet build_ext --inplace
    echo "$src_hash" > "$VENV/.build"
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  train)
    setup
    # torchrun, ending a failed run with the workers' first `error:` line (after torchrun's report)
    exec "$PY" -m megatron_ext.training.launch --standalone --nproc-per-node "${NPROC:-4}" examples/train_gpt.py --tp 2 --pp 2 "$@"
    ;;
  test)
    setup
    exec "$PY" -m pytest "$@"
    ;;
  bench)
    setup
    exec "$PY" "benchmarks/${1:?benchmark name}.py" "${@:2}"
    ;;
  gpu)
    GPU_PY=${PYTHON:-python3}
    "$GPU_PY" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"./dev.sh gpu: torch {torch.__version__} sees no CUDA GPU")
try:
    import pytest  # noqa: F401
except ImportError:
    sys.exit("./dev.sh gpu: pytest is not installed for this python")
print(f"[gpu] torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name(0)}")
PY
    echo "[gpu] building the extension in place against this torch"
    MAX_JOBS=${MAX_JOBS:-$(nproc)} FORCE_CUDA=1 "$GPU_PY" setup.py --quiet build_ext --inplace
    echo "[gpu] pytest -m cuda"
    # A failing test or benchmark does not stop the ones after it; the command exits non-zero if
    # any failed.
    rc=0
    "$GPU_PY" -m pytest -m cuda -q -p no:cacheprovider tests "$@" || rc=$?
    # The comparison needs megatron-core; a machine without internet takes its wheel from .whl/.
    if ! "$GPU_PY" -c "import megatron.core" 2>/dev/null && ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
      echo "[gpu] installing megatron-core (and einops, if its wheel is there) from .whl/ into build/gpu_site"
      "$GPU_PY" -m pip install --quiet --no-index --no-deps --target build/gpu_site .whl/megatron_core-*.whl \
        $(ls .whl/einops-*.whl 2>/dev/null)
      export PYTHONPATH="$PWD/build/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    echo "[gpu] kernel benchmark"
    "$GPU_PY" benchmarks/gpu.py --json runs/gpu_bench.json || rc=$?
    echo "[gpu] training-step benchmark"
    "$GPU_PY" benchmarks/gpu_step.py --json runs/gpu_step.json || rc=$?
    echo "[gpu] MoE layer benchmark"
    "$GPU_PY" benchmarks/moe.py --device cuda --json runs/gpu_moe.json || rc=$?
    echo "[gpu] FSDP training-step benchmark"
    "$GPU_PY" benchmarks/fsdp.py --device cuda --json runs/gpu_fsdp.json || rc=$?
    exit "$rc"
    ;;
  *)
    echo "usage: ./dev.sh {train|test|bench NAME|setup|gpu} [ARGS...]" >&2
    exit 2
    ;;
esac
