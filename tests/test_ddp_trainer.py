"""examples/train_torchrun.py, a DDP trainer with its habits (accumulation with ``no_sync()``,
clipping after ``backward()``), under torchrun with ``--optimizer ddp`` and ``--optimizer zoadam``."""
from __future__ import annotations

import json
import math

import pytest

from conftest import run_job

ARGS = ["--steps", "40", "--warmup", "4", "--accumulate", "3", "--clip", "1.0", "--width", "32", "--length", "32"]


@pytest.mark.timeout(900)
def test_the_ddp_trainer_learns_alike_with_either_optimizer_under_torchrun():
    """Three micro-batches a step, all but the last inside no_sync() (the DDP model's, or the
    0/1 Adam optimizer's), the gradient norm clipped after backward(): both runs learn the
    language about equally (validation loss far below a uniform guess's ln 64 = 4.16, within
    0.15 of each other), every step is 0/1 Adam's and sends less than Adam, and hvd_zoadam warns
    once per rank (the first clipped step), not once a step (every warning shown)."""
    runs = {}
    for optimizer in ("ddp", "zoadam"):
        job = run_job("torchrun", 2, ["examples/train_torchrun.py", "--optimizer", optimizer, *ARGS], timeout_s=400,
                      env={"PYTHONWARNINGS": "always"})
        summary = json.loads([line for line in job.stdout.splitlines() if line.startswith("{")][-1])
        runs[optimizer] = summary, [line for line in job.stderr.splitlines() if "UserWarning: hvd_zoadam" in line]
    (ddp, ddp_warned), (zoadam, warned) = runs["ddp"], runs["zoadam"]
    assert ddp["final_val_loss"] < math.log(64) - 1.0, ddp
    assert abs(zoadam["final_val_loss"] - ddp["final_val_loss"]) < 0.15, (zoadam, ddp)
    assert sum(zoadam["steps_by_kind"].values()) == 40, zoadam
    assert zoadam["bytes_vs_adam"] < 1.0, zoadam
    assert not ddp_warned
    assert len(warned) == 2 and all("from now on this optimizer starts no exchange" in w for w in warned), warned
