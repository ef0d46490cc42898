#!/usr/bin/env bash
# Device check of the numba.cuda kernels, for a machine with an NVIDIA GPU.
#
#   bash native/device_check.sh            # from the repository root, in the project's venv
#   PYTHON=python3 bash native/device_check.sh   # or with a Python that has torch and numba-cuda
#
# Runs tests/gpu on CUDA tensors: the kernels at full size (up to NUMEL elements per case; CI
# runs the same tests under the CUDA simulator at ~3000) and the optimizer with CUDA parameters
# on 1-3 thread-ranks against the simulation oracle (a failure is reported and the benchmarks
# still run); then `bench kernels --device cuda` at 2^24 elements for fp32, fp16 and bf16
# inputs, and `bench step --device cuda` (each step kind against AdamW(foreach) on a ~100 M-
# parameter GPT, P = 1), and float32 kernels from 2^16 to 2^26 elements. Without a GPU it says
# so and exits 0. Needs torch with CUDA, numba's CUDA target (numba-cuda on newer
# numba), pytest and hypothesis; not Horovod. Takes under 10 minutes; the
# results land in $OUT when it is set, else in /tmp/hvd_zoadam_device_check.
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
    echo "device_check: no GPU here; every part of this check needs one and is skipped (make test runs the" \
         "same tests under numba's CUDA simulator)" | tee -a "$OUT/env.txt"
    exit 0
fi
cat "$OUT/env.txt"

HVD_ZOADAM_CUDA_TEST_NUMEL=$NUMEL HVD_ZOADAM_CUDA_TEST_EXAMPLES=${EXAMPLES:-20} \
    timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -v --tb=short -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$OUT/tests.txt" \
    || echo "device_check: TESTS FAILED (see $OUT/tests.txt); the benchmarks run anyway" | tee -a "$OUT/tests.txt"

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
# the optimizer step at P = 1 on the GPU, each kind against AdamW(foreach) (no Horovod needed)
timeout 150 "$PY" -m hvd_zoadam.bench step --device cuda --n-layer 8 --n-embd 1024 --iters 10 --repeats 5 \
    --json "$OUT/step_cuda.json" >"$LOGS/step_cuda.log" 2>&1 \
    || { tail -5 "$LOGS/step_cuda.log"; echo "device_check: bench step FAILED"; }
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
f = pathlib.Path(sys.argv[1]) / "step_cuda.json"
if not f.exists():
    sys.exit(0)
rep = json.loads(f.read_text())
print("step, %d params on %s: AdamW(foreach) %.2f ms;" % (rep["params"], rep.get("gpu"), rep["adamw_foreach_ms"]),
      ", ".join("%s %.2fx" % (k, v["vs_adamw_foreach"]) for k, v in rep["kinds"].items()))
PY
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("kernels_cuda_*.json")):
    rep = json.loads(f.read_text())
    print(rep["dtype"], rep["numel"], "copy %.0f GB/s" % rep["copy_GBps"],
          ", ".join("%s %.2fx (traffic %.2fx)%s" % (k, v["vs_copy"], v["traffic_vs_copy"],
                                                   "" if v.get("met", True) else " (below 0.6x)")
                    for k, v in rep["kernels"].items()))
PY
