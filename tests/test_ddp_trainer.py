"""examples/train_torchrun.py, a DDP trainer with its habits (accumulation with ``no_sync()``,
clipping after ``backward()``), under torchrun with ``--optimizer ddp`` and ``--optimizer zoadam``."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT, run_job

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


RESUME_ARGS = ["--steps", "40", "--warmup", "4", "--accumulate", "2", "--clip", "1.0", "--width", "32",
               "--length", "32"]
# 0/1 Adam's resume from rank 0's optimizer state restarts each rank's error buffers at zero:
# measured 0.002 off the uninterrupted run's validation loss at this size (about 2.5); the
# tolerance leaves ten times that.
ZOADAM_RESUME_TOLERANCE = 0.02


def summary_of(job) -> dict:
    return json.loads([line for line in job.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", ["ddp", "zoadam"])
def test_the_ddp_trainer_resumes_from_rank_0s_checkpoint_where_it_stopped(optimizer, tmp_path):
    """Interrupted at half the steps (--stop-at, checkpoints every 10 iterations and at the stop),
    then resumed on every rank from rank 0's file, against the uninterrupted run: the resumed run
    starts at the saved iteration and ends with the optimizer's step count the uninterrupted run
    ends with. Under DDP the resumed run is the uninterrupted one bit for bit (the model's hash and
    the validation loss's bits): the data of an iteration does not depend on where the run
    started. Under 0/1 Adam each rank's error buffers restart at zero, so the final validation
    loss is within ZOADAM_RESUME_TOLERANCE of the uninterrupted run's."""
    ckpt = tmp_path / "ckpt.pt"
    script = ["examples/train_torchrun.py", "--optimizer", optimizer, *RESUME_ARGS]
    full = summary_of(run_job("torchrun", 2, script, timeout_s=400))
    stopped = summary_of(run_job("torchrun", 2, [*script, "--ckpt", str(ckpt), "--ckpt-every", "10",
                                                 "--stop-at", "20"], timeout_s=400))
    assert ckpt.is_file() and (stopped["iter"], stopped["schedule_step"]) == (20, 20), stopped
    resumed = summary_of(run_job("torchrun", 2, [*script, "--ckpt", str(ckpt), "--resume"], timeout_s=400))
    assert (resumed["first_iter"], resumed["iter"], resumed["steps"]) == (20, 40, 20), resumed
    assert resumed["schedule_step"] == full["schedule_step"] == 40, (resumed, full)
    if optimizer == "ddp":
        assert resumed["model_sha256"] == full["model_sha256"], (resumed, full)
        assert resumed["final_val_loss_hex"] == full["final_val_loss_hex"], (resumed, full)
    else:
        assert sum(resumed["steps_by_kind"].values()) == 20, resumed
        assert abs(resumed["final_val_loss"] - full["final_val_loss"]) < ZOADAM_RESUME_TOLERANCE, (resumed, full)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,message", [
    (["--resume"], "--resume and --ckpt-every need --ckpt PATH"),
    (["--ckpt-every", "5"], "--resume and --ckpt-every need --ckpt PATH"),
    (["--ckpt", "ckpt.pt", "--ckpt-every", "-1"], "--ckpt-every must be >= 0"),
    (["--steps", "40", "--stop-at", "41"], "--stop-at must be between 1 and --steps (40)"),
    (["--ckpt", "missing.pt", "--resume"], "--resume: no checkpoint at --ckpt missing.pt"),
])
def test_the_ddp_trainer_names_the_option_at_fault(argv, message, tmp_path):
    """Checkpoint options that cannot work stop the script before any process group starts, with
    argparse's usage error naming the option and what to do."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_torchrun.py"), *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and message in proc.stderr, (proc.returncode, proc.stderr)


@pytest.mark.timeout(600)
def test_a_model_compiled_block_by_block_trains_under_torchrun_as_eager():
    """--compile blocks (each block's forward through torch.compile, as large-model trainers
    compile, so that gradients are ready block by block and the exchange overlaps the backward)
    under torchrun with 0/1 Adam: with the aot_eager backend (Dynamo and AOTAutograd, without
    inductor's kernels, which round otherwise) the model ends with eager's bits."""
    args = ["examples/train_torchrun.py", "--optimizer", "zoadam", "--steps", "12", "--warmup", "2", "--width", "32",
            "--length", "32"]
    runs = {}
    for compile_args in ([], ["--compile", "blocks", "--compile-backend", "aot_eager"]):
        job = run_job("torchrun", 2, [*args, *compile_args], timeout_s=280)
        runs[bool(compile_args)] = json.loads([line for line in job.stdout.splitlines() if line.startswith("{")][-1])
    assert runs[True]["model_sha256"] == runs[False]["model_sha256"], runs
    assert runs[True]["final_val_loss_hex"] == runs[False]["final_val_loss_hex"]
