"""Runs tests/cuda (the numba.cuda kernels) under the CUDA simulator, which CI has instead of a GPU.

The simulator is chosen when numba is imported (``NUMBA_ENABLE_CUDASIM``), so it needs a
process of its own. Kept small (a few thousand elements per case): the simulator runs each
GPU thread as a Python thread.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cuda_kernels_pass_under_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", HVD_ZOADAM_CUDA_TEST_NUMEL="3000")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           str(ROOT / "tests" / "cuda")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "passed" in out and "skipped" not in out, out[-3000:]  # they ran, on the simulator
