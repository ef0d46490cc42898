"""The numba.cuda kernels compile for a GPU, checked on a machine without one.

The CUDA simulator (tests/gpu under ``tests/test_cuda_simulator.py``) runs the kernels as
Python and accepts code that numba.cuda's compiler refuses: a shared array sized by
``BLOCK + 16`` ran there and failed to compile on an H200. ``native/ptx_check.py`` compiles
every kernel to PTX for sm_90 with NVVM, in the venv that scripts/setup.sh makes for it
(``.venv-ptx``: numba-cuda replaces numba.cuda, so it cannot share the project venv).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PTX_PY = Path(os.environ.get("VENV_PTX", ROOT / ".venv-ptx")) / "bin" / "python"


def test_every_cuda_kernel_compiles_to_ptx_for_a_gpu():
    assert PTX_PY.exists(), f"{PTX_PY} is missing: run scripts/setup.sh (make setup), which makes it"
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "PYTHONPATH")}
    torch_site = str(Path(torch.__file__).resolve().parent.parent)
    proc = subprocess.run([str(PTX_PY), str(ROOT / "native" / "ptx_check.py"), "--torch-site", torch_site],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "0 of 22 kernels failed to compile for sm_90" in out, out[-3000:]
    assert sum(line.startswith("ok ") for line in out.splitlines()) == 22, out[-3000:]
