#!/usr/bin/env bash
# Installs kernel_api (editable) and its test dependencies.
#
#   bash scripts/install.sh               install
#   bash scripts/install.sh --dry-run     print the decisions and the commands, change nothing
#   bash scripts/install.sh --which-python   print the interpreter it installs into (scripts/python runs it)
#   bash scripts/install.sh --lower-bounds   (with --dry-run or --which-python too) install into
#       ./.venv-lower-bounds, a separate environment, with every ranged dependency at its lower
#       bound (pip -c ci/lower-bounds.txt) and the cu13 extra the constraints are written for:
#       what CI tests the declared lower bounds with (.ci/run). Never into an existing environment,
#       which it would downgrade.
#
# Where: $PYTHON if set; else the active virtual or conda environment's python3; else ./.venv when
# it exists; else python3, unless that interpreter is marked externally managed (PEP 668: a
# Debian/Ubuntu system Python, where pip refuses to install) and PIP_BREAK_SYSTEM_PACKAGES is not
# set: then ./.venv is created and used. KERNEL_API_VENV=1 creates and uses ./.venv in any case.
#
# torch: an importable torch is kept (a GPU box's torch+cuda stays). Otherwise torch==$TORCH_VERSION
# comes from a local wheel when pip's find-links holds one (our CPU machines); else, on a machine
# without an NVIDIA GPU, from PyTorch's CPU index, so a CPU-only test run does not pull gigabytes
# of CUDA wheels; else from PyPI (its CUDA build). TORCH_INDEX_URL names another index (e.g.
# https://download.pytorch.org/whl/cu126 for a CUDA 12 driver).
#
# CUDA extra (the DSL's libraries, cuda-bindings and NVRTC of one CUDA major):
# KERNEL_API_CUDA=cu12|cu13|none. By default none where nvidia-cutlass-dsl is already installed
# (that stack is kept), cu12 where the driver supports CUDA 12 but not 13, else cu13 (no GPU too).
#
# The native module is built against the tvm_ffi the environment will run (--no-build-isolation,
# after installing the build requirements), so it is never refused for a version mismatch.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu
BUILD_REQUIREMENTS=("setuptools>=70.1" "apache-tvm-ffi>=0.1.15,<0.2")  # = pyproject's [build-system] requires
LOWER_BOUNDS_FILE=ci/lower-bounds.txt
MODE=install
LOWER_BOUNDS=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) MODE=dry-run ;;
    --which-python) MODE=which ;;
    --lower-bounds) LOWER_BOUNDS=1 ;;
    *) echo "usage: bash scripts/install.sh [--dry-run | --which-python] [--lower-bounds]" >&2; exit 2 ;;
  esac
done
CONSTRAINTS=()
if [ -n "$LOWER_BOUNDS" ]; then CONSTRAINTS=(-c "$LOWER_BOUNDS_FILE"); fi

say() { if [ "$MODE" != which ]; then echo "install.sh: $*"; fi; }
run() {
  if [ "$MODE" = dry-run ]; then
    printf 'would run:'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

# Each probe starts with "# probe: NAME" (the tests answer them with a stand-in interpreter).
externally_managed() {
  "$1" -c '# probe: externally-managed
import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
print(1 if sys.prefix == sys.base_prefix and os.path.isfile(marker) else 0)' 2>/dev/null || echo 0
}
has_torch() { "$1" -c '# probe: torch
import torch' >/dev/null 2>&1; }
has_cutlass_dsl() { "$1" -c '# probe: cutlass-dsl
import importlib.metadata as m; m.version("nvidia-cutlass-dsl")' >/dev/null 2>&1; }

# The driver's CUDA major ("" without a usable NVIDIA GPU).
driver_cuda_major() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || return 0
  nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1
}

# A torch==$TORCH_VERSION wheel in a find-links folder of pip's configuration or $PIP_FIND_LINKS.
local_torch_wheel() {
  local links dir wheel
  links="${PIP_FIND_LINKS:-} $("$1" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr '\n' ' ')"
  for dir in $links; do
    dir=${dir#file://}
    for wheel in "$dir"/torch-"$TORCH_VERSION"[+-]*.whl; do
      if [ -f "$wheel" ]; then
        echo "$wheel"
        return 0
      fi
    done
  done
}

# --- which interpreter ---
CREATE_VENV=""
if [ -n "$LOWER_BOUNDS" ]; then
  PY=.venv-lower-bounds/bin/python WHY="--lower-bounds: a separate environment at the lower bounds"
  if [ ! -x "$PY" ]; then CREATE_VENV=python3; fi
elif [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON WHY="\$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
  PY=python3 WHY="the active environment (${VIRTUAL_ENV:-${CONDA_PREFIX}})"
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python WHY="./.venv exists"
elif [ "${KERNEL_API_VENV:-}" = 1 ]; then
  PY=.venv/bin/python WHY="KERNEL_API_VENV=1" CREATE_VENV=python3
elif [ -z "${PIP_BREAK_SYSTEM_PACKAGES:-}" ] && [ "$(externally_managed python3)" = 1 ]; then
  PY=.venv/bin/python WHY="python3 is externally managed (PEP 668) and no environment is active" CREATE_VENV=python3
else
  PY=python3 WHY="python3 on PATH"
fi
if [ "$MODE" = which ]; then
  echo "$PY"
  exit 0
fi
say "python: $PY ($WHY)"

if [ -n "$CREATE_VENV" ]; then
  VENV_DIR=${PY%/bin/python}
  RUNNER="scripts/python runs it"
  if [ -n "$LOWER_BOUNDS" ]; then RUNNER="run it as $PY"; fi
  say "venv: creating ./$VENV_DIR with $CREATE_VENV ($RUNNER; or: source $VENV_DIR/bin/activate)"
  if ! run "$CREATE_VENV" -m venv "$VENV_DIR"; then
    echo "install.sh: '$CREATE_VENV -m venv $VENV_DIR' failed; on Debian/Ubuntu install the venv module first" \
         "(sudo apt install python3-venv), or set PYTHON to an interpreter you may install into" >&2
    exit 1
  fi
fi

# A dry run does not create the venv: it is taken as fresh (nothing installed), and pip's
# configuration is read with the interpreter that would create it.
fresh() { [ -n "$CREATE_VENV" ] && [ "$MODE" = dry-run ]; }
PIP_PROBE=$PY
if fresh; then PIP_PROBE=$CREATE_VENV; fi

# --- torch ---
if ! fresh && has_torch "$PY"; then
  say "torch: keeping the installed torch"
else
  TORCH_ARGS=("torch==$TORCH_VERSION")
  WHEEL=$(local_torch_wheel "$PIP_PROBE" || true)
  CUDA_MAJOR=$(driver_cuda_major)
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    TORCH_ARGS+=(--index-url "$TORCH_INDEX_URL") FROM="\$TORCH_INDEX_URL"
  elif [ -n "$WHEEL" ]; then
    FROM="the local wheel $WHEEL"
  elif [ -z "$CUDA_MAJOR" ]; then
    TORCH_ARGS+=(--index-url "$CPU_INDEX") FROM="PyTorch's CPU index (no NVIDIA GPU here)"
  else
    FROM="PyPI (CUDA build; set TORCH_INDEX_URL for another CUDA version)"
  fi
  say "torch: installing ${TORCH_ARGS[0]} from $FROM"
  run "$PY" -m pip install -q "${TORCH_ARGS[@]}"
fi

# --- CUDA extra ---
CUDA=${KERNEL_API_CUDA:-auto}
if [ -n "$LOWER_BOUNDS" ]; then
  if [ "$CUDA" != auto ] && [ "$CUDA" != cu13 ]; then
    echo "install.sh: --lower-bounds installs the cu13 extra ($LOWER_BOUNDS_FILE pins its bounds), not '$CUDA'" >&2
    exit 2
  fi
  CUDA=cu13
fi
case "$CUDA" in
  cu12|cu13|none) WHY="KERNEL_API_CUDA"; if [ -n "$LOWER_BOUNDS" ]; then WHY="--lower-bounds"; fi ;;
  auto)
    if ! fresh && has_cutlass_dsl "$PY"; then
      CUDA=none WHY="nvidia-cutlass-dsl is installed: keeping its CUDA stack"
    else
      CUDA_MAJOR=${CUDA_MAJOR-$(driver_cuda_major)}
      if [ "$CUDA_MAJOR" = 12 ]; then
        CUDA=cu12 WHY="the driver supports CUDA 12"
      elif [ -n "$CUDA_MAJOR" ]; then
        CUDA=cu13 WHY="the driver supports CUDA $CUDA_MAJOR"
      else
        CUDA=cu13 WHY="no NVIDIA GPU: compile-only for sm_90a"
      fi
    fi ;;
  *) echo "install.sh: KERNEL_API_CUDA must be cu12, cu13, none or auto, not '$CUDA'" >&2; exit 2 ;;
esac
EXTRAS=dev
if [ "$CUDA" != none ]; then EXTRAS="$CUDA,dev"; fi
say "cuda extra: $CUDA ($WHY)"

if [ -n "$LOWER_BOUNDS" ]; then say "constraints: $LOWER_BOUNDS_FILE (every ranged dependency at its lower bound)"; fi
run "$PY" -m pip install -q ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} "${BUILD_REQUIREMENTS[@]}"
run "$PY" -m pip install -q ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} --no-build-isolation -e ".[$EXTRAS]"
if [ -n "$LOWER_BOUNDS" ] && [ "$MODE" = install ]; then
  say "installed into $PY at the lower bounds: run things with it (e.g. $PY -m pytest -q)"
elif [ "$PY" != python3 ] && [ "$MODE" = install ]; then
  say "installed into $PY: run things with scripts/python (e.g. scripts/python -m pytest -q) or activate it"
fi
