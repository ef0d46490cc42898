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
           "--variants", "zoadam,exact-both,unscaled-bound,sync-momentum-average", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == report
    rows = report["variants"]
    assert list(rows) == ["adam", "zoadam", "exact-both", "unscaled-bound", "sync-momentum-average"]
    adam = rows["adam"]["val_loss"]
    for name, row in rows.items():
        assert math.isfinite(row["val_loss"]) and 0 < row["val_loss"] < 10, name
        assert row["vs_adam"] == pytest.approx(row["val_loss"] / adam - 1, rel=0, abs=1e-12)
    # exact averages in both phases leave no error feedback; 0/1 Adam keeps some in its SYNC steps
    assert rows["exact-both"]["error_feedback"]["sync"]["worker_error_vs_result"] == 0.0
    assert rows["zoadam"]["error_feedback"]["sync"]["worker_error_vs_result"] > 0.0
    assert "by_window" in rows["zoadam"]["error_feedback"]["sync"]
    assert rows["sync-momentum-average"]["val_loss"] != rows["zoadam"]["val_loss"]
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


@pytest.mark.timeout(600)
def test_scaling_reports_flat_and_two_level_rows_with_the_formulas_bytes(tmp_path):
    """`bench scaling` at P = 2 and 16 with nodes of 8: two-level only where there are two
    nodes; Adam's bytes are 2(P−1)/P·4n a step; 0/1 Adam's flat bytes are its VARIANCE steps'
    allreduces plus its 1-bit exchanges by exchange_bytes; the JSON file holds the same report."""
    from hvd_zoadam.bench.lm import example_module
    from hvd_zoadam.comm.protocol import exchange_bytes
    from hvd_zoadam.core.layout import scale_segments
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, "-m", "hvd_zoadam.bench", "scaling", "--ranks", "2,16", "--ranks-per-node", "8",
           "--steps", "10", "--warmup", "4", "--n-layer", "1", "--n-embd", "16", "--block-size", "16",
           "--batch-size", "4", "--eval-batches", "2", "--threads", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == report
    rows = report["rows"]
    assert list(rows) == ["2", "16"]
    assert list(rows["2"]) == ["adam", "zoadam"] and list(rows["16"]) == ["adam", "zoadam", "two-level"]
    lm = example_module("train_lm")
    vocab = len(set(lm.load_corpus()))
    numels = [p.numel() for p in lm.CharGPT(vocab, 16, 1, 16, 4).parameters()]
    n = sum(numels)
    for p, by_variant in rows.items():
        p = int(p)
        allreduce = 2 * (p - 1) / p * 4 * n
        assert by_variant["adam"]["bytes_per_rank"] == pytest.approx(allreduce * 10, rel=1e-12)
        zo = by_variant["zoadam"]
        variance, onebit = zo["kinds"]["variance"], zo["kinds"]["compressed"] + zo["kinds"]["sync"]
        assert sum(zo["kinds"].values()) == 10 and zo["rounds"] == variance + 2 * onebit
        assert zo["bytes_per_rank"] == pytest.approx(variance * allreduce + onebit * exchange_bytes(
            scale_segments(numels, 256), p), rel=1e-12)
        assert zo["bytes_vs_adam"] < 1
        for row in by_variant.values():
            assert math.isfinite(row["val_loss"]) and row["vs_adam"] == pytest.approx(
                row["val_loss"] / by_variant["adam"]["val_loss"] - 1, abs=1e-12)
    two = rows["16"]["two-level"]
    assert 0 < two["between_nodes_per_rank"] < two["bytes_per_rank"]
    assert two["between_nodes_vs_adam"] == pytest.approx(
        two["between_nodes_per_rank"] / rows["16"]["adam"]["bytes_per_rank"])


@pytest.mark.timeout(600)
def test_convergence_runs_the_digits_cnn_and_reports_a_diverged_variant():
    """--workload digits at P = 2; without the bound on |g|/s (no-clip) this CNN is known to
    diverge: the row says so instead of the bench crashing."""
    cmd = [sys.executable, "-m", "hvd_zoadam.bench", "convergence", "--workload", "digits", "--ranks", "2",
           "--steps", "300", "--var-freeze-step", "50", "--var-update-scaler", "4", "--local-step-scaler", "50",
           "--local-step-clipper", "4", "--local-step-policy", "steps", "--beta2", "0.999", "--weight-decay", "0",
           "--batch-size", "32", "--threads", "1", "--variants", "zoadam,no-clip"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)["variants"]
    assert 0 < rows["adam"]["val_loss"] < 1 and 0 < rows["zoadam"]["val_loss"] < 1
    assert math.isnan(rows["no-clip"]["val_loss"]) and "diverged" in rows["no-clip"]["diverged"]


def test_the_gru_workloads_model_is_torchs_gru_and_reads_the_stdlib():
    """CharGRU's written-out recurrence equals ``torch.nn.GRU`` (two layers, batch_first) with
    the same weights, to float32 rounding; the corpus is ASCII codes of Python source."""
    import torch

    from hvd_zoadam.bench.workloads import CharGRU, stdlib_corpus
    torch.manual_seed(0)
    model = CharGRU(128, 24, 2)
    gru = torch.nn.GRU(24, 24, num_layers=2, batch_first=True)
    with torch.no_grad():
        for k in range(2):
            getattr(gru, f"weight_ih_l{k}").copy_(model.ih[k].weight)
            getattr(gru, f"bias_ih_l{k}").copy_(model.ih[k].bias)
            getattr(gru, f"weight_hh_l{k}").copy_(model.hh[k].weight)
            getattr(gru, f"bias_hh_l{k}").copy_(model.hh[k].bias)
    idx = torch.randint(128, (3, 17))
    want = model.head(gru(model.tok(idx))[0])
    torch.testing.assert_close(model(idx), want, rtol=1e-5, atol=1e-6)
    data = stdlib_corpus()
    assert data.dtype == torch.int64 and len(data) > 10 ** 6 and int(data.max()) < 128
    assert "def " in bytes(data[:200000].tolist()).decode("ascii")


@pytest.mark.timeout(300)
def test_scaling_runs_the_gru_workload():
    """``bench scaling --workload gru`` end to end at tiny settings: Adam and 0/1 Adam at P = 2,
    finite losses near ln 128 after a few steps, and 0/1 Adam's bytes below Adam's."""
    cmd = [sys.executable, "-m", "hvd_zoadam.bench", "scaling", "--workload", "gru", "--ranks", "2",
           "--steps", "8", "--warmup", "2", "--n-layer", "1", "--n-embd", "8", "--block-size", "8",
           "--batch-size", "2", "--eval-batches", "1", "--beta2", "0.999", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    row = report["rows"]["2"]
    assert list(row) == ["adam", "zoadam"]
    for name in row:
        assert 3.5 < row[name]["val_loss"] < 5.5, name  # ln 128 = 4.85: barely trained
    assert 0 < row["zoadam"]["bytes_vs_adam"] < 1
    assert report["settings"]["beta2"] == 0.999


@pytest.mark.timeout(600)
def test_convergence_takes_adams_row_from_an_earlier_report_with_the_same_settings(tmp_path):
    """--baseline-json: Adam's row is the earlier report's (not trained again: its wall time and
    the file are in the row), other 0/1 Adam knobs may differ, and the gaps are to that Adam;
    settings that decide Adam's path (--lr; --ranks, --oracle, --eval-every) differing, or a file
    that is not a report, is an error naming each, before any training."""
    tiny = ["--ranks", "2", "--steps", "8", "--warmup", "3", "--n-layer", "1", "--n-embd", "16", "--block-size", "16",
            "--batch-size", "4", "--eval-batches", "2", "--threads", "1"]
    bench = [sys.executable, "-m", "hvd_zoadam.bench", "convergence"]
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    proc = subprocess.run(bench + tiny + ["--variants", "zoadam", "--json", str(first)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    adam = json.loads(first.read_text())["variants"]["adam"]
    proc = subprocess.run(bench + tiny + ["--variants", "zoadam", "--scale-block-numel", "32", "--baseline-json",
                                          str(first), "--json", str(second)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(second.read_text())["variants"]
    assert rows["adam"]["baseline_json"] == str(first)
    assert (rows["adam"]["val_loss"], rows["adam"]["wall_s"]) == (adam["val_loss"], adam["wall_s"])
    assert f"P=2 adam: val loss {adam['val_loss']:.4f} (from {first})" in proc.stderr
    assert rows["zoadam"]["vs_adam"] == pytest.approx(rows["zoadam"]["val_loss"] / adam["val_loss"] - 1, abs=1e-12)
    proc = subprocess.run(bench + tiny + ["--lr", "0.001", "--baseline-json", str(first)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and "lr: 0.002 there, 0.001 here" in proc.stderr, proc.stderr[-2000:]
    assert "val loss" not in proc.stderr
    other = ["--ranks", "4"] + tiny[2:] + ["--oracle", "per-rank", "--eval-every", "4"]
    proc = subprocess.run(bench + other + ["--baseline-json", str(first)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    for named in ("eval_every: 0 there, 4 here", "oracle: 'batched' there, 'per-rank' here", "ranks: 2 there, 4 here"):
        assert named in proc.stderr
    junk = tmp_path / "junk.json"
    junk.write_bytes(b"\x80\x04K\x01.")  # a pickle, which is not JSON
    proc = subprocess.run(bench + tiny + ["--baseline-json", str(junk)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 2 and "not a `bench convergence` report" in proc.stderr, proc.stderr[-2000:]


def _stub_training(monkeypatch, stop_at):
    """``convergence``'s workload and training replaced by stubs: each row is {"val_loss": P,
    "bytes_per_rank": 8.0}, and the row ``stop_at`` = (P, name) raises KeyboardInterrupt."""
    import torch

    from hvd_zoadam.bench import convergence
    from hvd_zoadam.bench.workloads import Workload
    work = Workload(model=torch.nn.Linear(2, 2), batch=None, loss=None, val_batches=[], lr_fn=None)
    monkeypatch.setattr(convergence, "build", lambda *a: work)

    def row(name, work, init, args):
        if (args.ranks, name) == stop_at:
            raise KeyboardInterrupt
        return {"val_loss": float(args.ranks), "bytes_per_rank": 8.0}
    monkeypatch.setattr(convergence, "_variant_row", row)
    return convergence


def test_convergence_and_scaling_keep_their_finished_rows_in_the_json(tmp_path, monkeypatch):
    """A convergence run stopped after Adam's row keeps that row in its --json; a scaling run
    stopped inside its second P keeps the first P's rows (the training is stubbed)."""
    import argparse

    import torch
    out = tmp_path / "partial.json"
    convergence = _stub_training(monkeypatch, (2, "zoadam"))
    args = argparse.Namespace(threads=torch.get_num_threads(), workload="lm", variants="zoadam", json=str(out),
                              ranks=2)
    with pytest.raises(KeyboardInterrupt):
        convergence.run(args, None)
    assert json.loads(out.read_text())["variants"] == {"adam": {"val_loss": 2.0, "bytes_per_rank": 8.0}}
    convergence = _stub_training(monkeypatch, (4, "zoadam"))
    args = argparse.Namespace(threads=torch.get_num_threads(), workload="lm", json=str(out), ranks="2,4",
                              ranks_per_node=8)
    with pytest.raises(KeyboardInterrupt):
        convergence.run_scaling(args, None)
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["2"] and rows["2"]["zoadam"]["vs_adam"] == 0.0
