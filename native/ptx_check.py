"""Compiles every numba.cuda kernel of :mod:`hvd_zoadam.native.cuda` to PTX for a GPU's compute
capability, on a machine without a GPU or a driver.

The CUDA simulator runs the kernels as Python, so it accepts code that numba.cuda's compiler
refuses (a shared array sized by an expression, say); this check compiles them as a GPU would,
for each input dtype, with the argument types the entry points pass.

    .venv-ptx/bin/python native/ptx_check.py --torch-site .venv/lib/python3.11/site-packages

Runs in an environment of its own (scripts/setup.sh makes ``.venv-ptx``): numba with
numba-cuda, cuda-bindings and the CUDA toolkit's NVVM and NVRTC (``nvidia-nvvm``,
``nvidia-cuda-nvrtc``), whose ``numba.cuda`` is not the project venv's simulator-only one.
``--torch-site`` appends the project venv's site-packages (torch) after its own. Prints one
line per kernel; the exit status is the number that failed.
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The kernels' argument types as the entry points of native/cuda.py pass them ("Y": the input
# gradient, float32 or its 16-bit floats viewed as int16; see cuda._arr).
PER_DTYPE = {
    "sumsq_tasks": "Y, boolean, float32[::1], int64, int64[:, ::1], float64[::1]",
    "pack_update": "Y, boolean, float32[::1], float32[::1], int64, int64[::1], float32[::1], uint8[::1]",
    "compress_fused": "Y, float32[::1], float32[::1], int64[::1], int64[:, ::1], float32[::1], uint8[::1], "
                      "uint8[:, ::1]",
    "merge_bytes": "Y, float32[::1], int64[:, ::1], int64, uint8[:, ::1], uint8[::1]",
}
SHARED = {
    "_reduce_scales": "int64[::1], float64[::1], int64[::1], int64, int64, float32[::1]",
    "_server_average": "uint8[:, ::1], float32[:, ::1], float32[::1], int64, int64[::1]",
    "_server_fused": "uint8[:, ::1], float32[:, ::1], float32[::1], int64, int64[:, ::1], int64[:, ::1], "
                     "float32[::1], uint8[::1], uint8[:, ::1]",
    "_zero_scales_outside": "int64[::1], int64, int64, float32[::1]",
    "_decompress": "uint8[::1], float32[:, ::1], int64[::1], int64, float32[::1], int64, float32[::1], float64, "
                   "float32[::1], float32[::1], float32[::1], uint8[::1], float64, boolean, float32",
    "_local_step": "float32[::1], float32[::1], float32[::1], float32[::1], uint8[::1], int32[:, ::1], int64, "
                   "float32, float32, float32, float32, float32",
    "_local_window": "float32[::1], float32[::1], float32[::1], float32[::1], uint8[::1], float32[::1], "
                     "float32[::1], int32[:, ::1], int64, float32, float32, float32, float32, float32, float32",
    "_sync_rebuild": "float32[::1], float32[::1], float32[::1], float32[::1], float32[::1], float32, float32",
    "_momentum_step": "float32[::1], float32[::1], float32[::1], float32[::1], uint8[::1], "
                      "float32, float32, float32, float32, float32",
    "_variance_step": "float32[::1], float32[::1], float32[::1], float32[::1], float32[::1], uint8[::1], "
                      "float32, float32, float32, float32, float32, float32, float32, float32",
}
Y = {"f32": "float32[::1]", "f16": "int16[::1]", "bf16": "int16[::1]"}


def jobs(nc: types.ModuleType) -> list:
    """(name, python function, signature string or None) for every kernel of the module ``nc``:
    the per-dtype ones of ``nc._kernels`` and every module-level kernel (not device function),
    so that a kernel added without a signature here fails the check instead of escaping it."""
    from numba.cuda.dispatcher import CUDADispatcher
    out = []
    for kind, y in Y.items():
        for kernel in nc._kernels(kind):
            name = kernel.py_func.__name__
            sig = PER_DTYPE.get(name)
            out.append((f"{kind}:{name}", kernel.py_func, sig and "void(" + sig.replace("Y", y) + ")"))
    for name, obj in vars(nc).items():
        if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device"):
            out.append((name, obj.py_func, SHARED.get(name) and f"void({SHARED[name]})"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="9.0", help="compute capability, major.minor (default 9.0, Hopper)")
    ap.add_argument("--torch-site", help="a site-packages folder with torch, appended to sys.path")
    args = ap.parse_args(argv)
    if args.torch_site:
        sys.path.append(args.torch_site)
    # the script's own folder would make native/cuda.py the top-level ``cuda`` (cuda-bindings')
    here = Path(__file__).resolve().parent
    sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != here]
    cc = tuple(int(x) for x in args.cc.split("."))
    from numba import config, cuda
    if config.ENABLE_CUDASIM:
        ap.error("NUMBA_ENABLE_CUDASIM is set: the simulator compiles nothing")
    from numba.cuda import dispatcher
    # A device function called by a kernel is compiled for the current device's capability;
    # with no driver there is none, so name the one asked for.
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    import native.cuda as nc
    failed = 0
    todo = jobs(nc)
    for name, fn, sig in todo:
        if sig is None:
            failed += 1
            print(f"FAIL {name}: no signature in native/ptx_check.py (PER_DTYPE or SHARED)")
            continue
        try:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
            print(f"ok   {name} ({len(ptx)} bytes of PTX)")
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {' '.join(str(exc).split())[:600]}")
    print(f"{failed} of {len(todo)} kernels failed to compile for sm_{cc[0]}{cc[1]}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
