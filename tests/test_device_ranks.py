"""``native/device_ranks.py`` (which ``native/device_check.sh`` runs on a GPU) on CPU tensors:
two real ranks under ``mpirun`` (``hvd_zoadam.mpi``) and under ``torchrun`` (``hvd_zoadam.distributed``
over gloo) train through every step kind to the same bits as two thread ranks in one process."""
from __future__ import annotations

import json

import pytest

from conftest import run_job


@pytest.mark.parametrize("launcher", ["mpi", "torchrun"])
def test_real_ranks_train_to_the_bits_of_thread_ranks(launcher):
    proc = run_job(launcher, 2, ["-m", "hvd_zoadam.native.device_ranks", "--launcher", launcher, "--device", "cpu"],
                   timeout_s=300)
    rep = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert rep["world_size"] == 2 and rep["launcher"] == launcher
    assert rep["kinds"] == ["compressed", "local", "sync", "variance"], rep
    assert rep["equal"] is True and rep["max_abs_diff"] == 0.0, rep
