"""The Slurm scripts of examples/slurm/, submitted with ``sbatch`` to a one-host Slurm.

The fixture starts munged, slurmctld and slurmd on this machine (its 2 CPUs, one node, ports of
their own) from a configuration in a temporary folder, and stops them afterwards. Each script
then runs a shortened char-LM job on 2 ranks: ``mpirun.sbatch`` (mpirun inside the allocation),
``srun.sbatch`` (srun --mpi=pmix) and ``torchrun.sbatch`` (srun + torchrun, no Horovod). The
tests skip, saying why, where Slurm cannot start (not installed, not root, no idle node).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

SHORT = ("--warmup 4 --n-layer 1 --n-embd 32 --n-head 2 --block-size 32 --batch-size 4 --eval-interval 6 "
         "--eval-batches 2 --var-freeze-step 8 --var-update-scaler 1 --local-step-policy steps --local-step-scaler 2 "
         "--local-step-clipper 2")
SCRIPTS = {"mpirun": ["--ntasks-per-node=2", "--cpus-per-task=1"],
           "srun": ["--ntasks-per-node=2", "--cpus-per-task=1"],
           "torchrun": ["--ntasks-per-node=1", "--cpus-per-task=2"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(folder: Path, host: str) -> str:
    return f"""ClusterName=zoadamtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=zoadam Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _start_munge() -> None:
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
        return
    for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        os.makedirs(d, exist_ok=True)
    subprocess.run(["munged", "--force"], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "sinfo") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm cannot start here: {', '.join(missing)} not installed (apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("Slurm cannot start here: a one-host slurmd needs root")
    folder = tmp_path_factory.mktemp("slurm")
    (folder / "state").mkdir()
    (folder / "spool").mkdir()
    host = socket.gethostname().split(".")[0]
    (folder / "slurm.conf").write_text(_conf(folder, host))
    env = dict(os.environ, SLURM_CONF=str(folder / "slurm.conf"))
    _start_munge()
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([daemon], env=env, capture_output=True, timeout=30)
    deadline = time.monotonic() + 40
    state = ""
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip()
        if state == "idle":
            break
        time.sleep(1)
    try:
        if state != "idle":
            logs = "".join((folder / f).read_text()[-1500:] for f in ("slurmctld.log", "slurmd.log")
                           if (folder / f).exists())
            pytest.skip(f"Slurm cannot start here: the node is {state or 'absent'!r} after 40 s\n{logs}")
        yield env, folder
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
        for pid_file in ("slurmd.pid", "slurmctld.pid"):
            path = folder / pid_file
            if path.exists():
                try:
                    os.kill(int(path.read_text().strip()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass


@pytest.fixture(scope="module")
def runs(slurm):
    """Each script submitted with ``sbatch --wait``: {name: (exit code, output, summary or None)}."""
    env, folder = slurm
    env = dict(env, STEPS="12", TRAIN_ARGS=SHORT, MPIRUN_ARGS="--allow-run-as-root --oversubscribe",
               RANKS_PER_NODE="2", OMP_NUM_THREADS="1", VENV=str(Path(sys.executable).parent.parent),
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    out = {}
    for name, shape in SCRIPTS.items():
        log = folder / f"{name}.out"
        try:
            proc = subprocess.run(["sbatch", "--wait", "--parsable", "--nodes=1", *shape, f"--output={log}",
                                   "--export=ALL", f"examples/slurm/{name}.sbatch"], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            out[name] = (None, log.read_text() if log.exists() else "", None)
            continue
        job = proc.stdout.strip().split(";")[0]
        summary = ROOT / "runs" / f"slurm-{job}" / "zoadam.json"
        out[name] = (proc.returncode, (log.read_text() if log.exists() else "") + proc.stderr,
                     json.loads(summary.read_text()) if summary.exists() else None)
        shutil.rmtree(summary.parent, ignore_errors=True)
    return out


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_each_slurm_script_finishes_its_shortened_job(runs, name):
    code, log, summary = runs[name]
    assert code == 0, f"sbatch {name}.sbatch exited {code}\n{log[-3000:]}"
    assert summary is not None and summary["world_size"] == 2 and summary["steps"] == 12, log[-3000:]
    assert math.isfinite(summary["final_val_loss"])
    want = "torch.distributed" if name == "torchrun" else "mpi"
    assert summary["comm_stats"]["transport"].startswith(want)


def test_the_three_launches_train_the_same_model(runs):
    """mpirun, srun and srun + torchrun: the same validation loss (at P = 2 every average is of two
    terms, rounded once in any order)."""
    losses = {name: s["final_val_loss"] for name, (_, _, s) in runs.items() if s is not None}
    assert len(losses) == 3 and len(set(losses.values())) == 1, losses
