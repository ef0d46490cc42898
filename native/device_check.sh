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
# parameter GPT, P = 1). Needs torch with CUDA, numba's CUDA target (numba-cuda on newer
# numba), pytest and hypothesis; not Horovod. Takes well under 5 minutes; the
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

"$PY" - <<'PY' | tee "$OUT/env.txt"
import numba, torch
from numba import cuda
assert torch.cuda.is_available(), "torch sees no CUDA device"
assert cuda.is_available(), "numba's CUDA target sees no device (install numba-cuda / the CUDA toolkit's NVVM)"
print("torch", torch.__version__, "cuda", torch.version.cuda, "numba", numba.__version__,
      "gpu", torch.cuda.get_device_name())
PY

HVD_ZOADAM_CUDA_TEST_NUMEL=$NUMEL HVD_ZOADAM_CUDA_TEST_EXAMPLES=${EXAMPLES:-20} \
    timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -v --tb=short -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$OUT/tests.txt" \
    || echo "device_check: TESTS FAILED (see $OUT/tests.txt); the benchmarks run anyway" | tee -a "$OUT/tests.txt"

for dtype in float32 float16 bfloat16; do
    timeout 90 "$PY" -m hvd_zoadam.bench kernels --device cuda --numel 16777216 --dtype "$dtype" --repeats 20 \
        --json "$OUT/kernels_cuda_$dtype.json" >"$LOGS/kernels_cuda_$dtype.log" 2>&1 \
        || { tail -5 "$LOGS/kernels_cuda_$dtype.log"; echo "device_check: bench kernels $dtype FAILED"; }
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
    print(rep["dtype"], "copy %.0f GB/s" % rep["copy_GBps"],
          ", ".join("%s %.2fx (traffic %.2fx)%s" % (k, v["vs_copy"], v["traffic_vs_copy"],
                                                   "" if v.get("met", True) else " (below 0.6x)")
                    for k, v in rep["kernels"].items()))
PY
