"""The examples and command-line entry points run as documented (briefly)."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, run_job

TRAIN_LM_SHORT = ["--steps", "12", "--warmup", "4", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
              "--block-size", "32", "--batch-size", "4", "--eval-interval", "6", "--eval-batches", "2",
              "--var-freeze-step", "8", "--var-update-scaler", "1", "--local-step-policy", "steps",
              "--local-step-scaler", "2", "--local-step-clipper", "2"]


def test_train_lm_runs_under_horovodrun_and_writes_its_summary(tmp_path):
    common = TRAIN_LM_SHORT
    for opt in ("zoadam", "adam"):
        run_job("gloo", 2, ["examples/train_lm.py", "--optimizer", opt, "--summary", str(tmp_path / f"{opt}.json"),
                            "--step-log", str(tmp_path / f"{opt}.jsonl"), "--tensorboard", str(tmp_path / f"tb-{opt}"),
                            *common], timeout_s=180)
    events = list((tmp_path / "tb-zoadam").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 200
    z = json.loads((tmp_path / "zoadam.json").read_text())
    a = json.loads((tmp_path / "adam.json").read_text())
    for s in (z, a):
        assert {"optimizer", "world_size", "steps", "final_train_loss", "final_val_loss", "wall_s", "steps_per_s",
                "comm_stats"} <= set(s)
        assert s["world_size"] == 2 and s["steps"] == 12 and 0 < s["final_val_loss"] < 4.5
    assert set(z["kinds"]) == {"variance", "compressed", "local", "sync"}
    assert len(z["bytes_curve"]) == 12 and z["bytes_curve"][-1] == z["comm_stats"]["bytes_sent_total"]
    assert z["comm_stats"]["bytes_sent_total"] < z["comm_stats"]["adam_equivalent_bytes"]
    assert a["comm_stats"]["bytes_sent_total"] == z["comm_stats"]["adam_equivalent_bytes"]
    lines = [json.loads(x) for x in (tmp_path / "zoadam.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 13)) and {"kind", "lr", "loss", "bytes_sent"} <= set(lines[0])
    # the freeze at 8: steps 1-8 exchange gradients, step 9 is the first sync
    assert {x["kind"] for x in lines[:8]} == {"variance", "compressed"} and lines[8]["kind"] == "sync"
    out = subprocess.run([sys.executable, "examples/compare.py", str(tmp_path / "zoadam.json"),
                          str(tmp_path / "adam.json"), "--png", str(tmp_path / "loss.png"), "--json",
                          str(tmp_path / "cmp.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "zoadam" in out.stdout and "adam" in out.stdout
    rows = json.loads((tmp_path / "cmp.json").read_text())
    assert rows[0]["bytes_vs_adam"] < 1 and rows[1]["bytes_vs_adam"] == 1
    assert (tmp_path / "loss.png").stat().st_size > 10_000


def test_info_reports_the_environment():
    out = subprocess.run([sys.executable, "-m", "hvd_zoadam.info", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["horovod"]["installed"] and rep["horovod"]["controllers"] == {"mpi": True, "gloo": True}
    assert rep["mpi"]["library"].startswith("Open MPI") and rep["mpi"]["cuda_aware"] is False
    assert rep["torch"]["version"].startswith("2.") and "horovod" in rep["auto_transport"]
    assert rep["kernels"] == "CPU tensors: Numba CPU kernels; CUDA tensors: no CUDA device here"
    text = subprocess.run([sys.executable, "-m", "hvd_zoadam.info"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120).stdout
    assert "Available Controllers" in text and "transport='auto' picks" in text


def test_train_digits_runs_and_learns(tmp_path):
    run_job("gloo", 2, ["examples/train_digits.py", "--steps", "300", "--summary", str(tmp_path / "d.json")],
            timeout_s=240)
    s = json.loads((tmp_path / "d.json").read_text())
    # a constant learning rate at β2 = 0.999: the defaults wait for its first fall or step 500 (twice
    # the earliest freeze, 250) to freeze v, so these 300 steps are VARIANCE and COMPRESSED steps
    stats = s["comm_stats"]
    assert s["test_accuracy"] > 0.85 and stats["compressed"]["steps"] > 0 and stats["sync"]["steps"] == 0


def test_amp_example_runs_with_bf16_autocast_on_cpu():
    proc = run_job("gloo", 2, ["examples/amp.py", "--steps", "40"], timeout_s=180)
    line = next(x for x in proc.stdout.splitlines() if "final_loss" in x)
    s = json.loads(line.split(":", 1)[1] if line.startswith("[") else line)
    assert s["device"] == "cpu" and s["autocast"] == "torch.bfloat16" and s["param_dtype"] == "torch.float32"
    assert s["final_loss"] < 1.0


def test_slurm_scripts_are_valid_bash_and_launch_the_main_job():
    for name in ("srun.sbatch", "mpirun.sbatch"):
        path = ROOT / "examples" / "slurm" / name
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
        text = path.read_text()
        assert "#SBATCH --ntasks-per-node" in text and "examples/train_lm.py --optimizer zoadam" in text


def test_train_lm_under_torchrun_equals_the_horovodrun_run(tmp_path):
    """The main job under torchrun (torch.distributed, no Horovod imported by hvd_zoadam) and under
    horovodrun --gloo: the same validation loss and the same bytes counted. At P = 2 every average
    is of two terms, rounded once in any order, so the two runs agree to the last bit."""
    runs = {}
    for launcher in ("gloo", "torchrun"):
        out = tmp_path / f"{launcher}.json"
        run_job(launcher, 2, ["examples/train_lm.py", "--optimizer", "zoadam", "--summary", str(out), *TRAIN_LM_SHORT],
                timeout_s=180)
        runs[launcher] = json.loads(out.read_text())
    h, t = runs["gloo"], runs["torchrun"]
    assert t["comm_stats"]["transport"] == "torch.distributed (gloo)" and \
        h["comm_stats"]["transport"].startswith("gloo")
    assert t["final_val_loss"] == h["final_val_loss"] and t["val_curve"] == h["val_curve"]
    assert t["comm_stats"]["bytes_sent_total"] == h["comm_stats"]["bytes_sent_total"]
    assert t["kinds"] == h["kinds"]
