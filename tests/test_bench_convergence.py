"""``python -m hvd_zoadam.bench convergence`` runs and reports what it says (tiny settings)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_convergence_reports_each_variant_against_adam(tmp_path):
    out = tmp_path / "conv.json"
    cmd = [sys.executable, "-m", "hvd_zoadam.bench", "convergence", "--ranks", "2", "--steps", "12", "--warmup", "4",
           "--n-layer", "1", "--n-embd", "16", "--eval-batches", "2", "--threads", "1",
           "--variants", "zoadam,exact-both,unscaled-bound", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == report
    rows = report["variants"]
    assert list(rows) == ["adam", "zoadam", "exact-both", "unscaled-bound"]
    adam = rows["adam"]["val_loss"]
    for name, row in rows.items():
        assert math.isfinite(row["val_loss"]) and 0 < row["val_loss"] < 10, name
        assert row["vs_adam"] == pytest.approx(row["val_loss"] / adam - 1, rel=0, abs=1e-12)
    # exact averages in both phases leave no error feedback; 0/1 Adam keeps some in its SYNC steps
    assert rows["exact-both"]["error_feedback"]["sync"]["worker_error_vs_result"] == 0.0
    assert rows["zoadam"]["error_feedback"]["sync"]["worker_error_vs_result"] > 0.0
    assert "by_window" in rows["zoadam"]["error_feedback"]["sync"]
    assert "P=2 zoadam: val loss" in proc.stderr


@pytest.mark.timeout(600)
def test_convergence_curves_and_steps_to_adams_loss(tmp_path):
    """--eval-every: every variant's curve ends at its final loss, the target is Adam's loss at
    its first evaluation at or after 2/3 of the steps, and Adam reaches it there; the two-level
    variant at P = 4 and the earlier bound run too."""
    cmd = [sys.executable, "-m", "hvd_zoadam.bench", "convergence", "--ranks", "4", "--steps", "12", "--warmup", "4",
           "--n-layer", "1", "--n-embd", "16", "--eval-batches", "2", "--threads", "1", "--eval-every", "3",
           "--variants", "zoadam,two-level,k-bound,steps-policy"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    rows = report["variants"]
    adam = rows["adam"]
    assert [t for t, _ in adam["curve"]] == [3, 6, 9, 12]
    assert report["target_val_loss"] == adam["curve"][2][1]  # step 9 >= 2/3 of 12 steps
    assert adam["steps_to_target"] <= 9
    for name, row in rows.items():
        assert row["curve"][-1] == [12, row["val_loss"]], name
        assert row["steps_to_target"] is None or row["steps_to_target"] in (3, 6, 9, 12)
    assert rows["two-level"]["val_loss"] != rows["zoadam"]["val_loss"]
