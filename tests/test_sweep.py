"""``bench sweep``: the set-ups it draws, the learning rates it gives them, a small sweep end to
end against the runs it is made of, its resume after a kill, and its pass rule."""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from hvd_zoadam.bench import sweep

QUICK = ["--setups", "2", "--seeds", "2", "--ranks", "2", "--max-steps", "12", "--space-seed", "3"]


def test_the_draws_stay_in_the_space_and_are_the_same_every_time():
    setups = [sweep.draw(0, i) for i in range(300)]
    assert setups == [sweep.draw(0, i) for i in range(300)]
    assert sweep.draw(1, 0) != sweep.draw(0, 0)
    assert {s["workload"] for s in setups} == set(sweep.WORKLOADS)
    assert {s["beta2"] for s in setups} == set(sweep.BETA2)
    assert {s["lr_schedule"] for s in setups} == set(sweep.LR_SCHEDULES)
    assert {s["weight_decay_style"] for s in setups} == {"decoupled", "l2"}
    for s in setups:
        assert 3e-4 * 0.999 <= s["lr"] <= 1e-2 * 1.001
        assert 150 <= s["steps"] <= 2000 and 0 <= s["warmup"] <= 0.2 * s["steps"]
        assert 0 <= s["weight_decay"] <= 0.1 and 4 <= s["batch_size"] <= 64


def test_the_learning_rate_factors_by_hand():
    warm = sweep.lr_factor("constant", 4, 20)
    assert [warm(t) for t in (1, 2, 4, 5, 20)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    cos = sweep.lr_factor("cosine", 0, 10)
    assert cos(10) == pytest.approx(0.1) and cos(5) == pytest.approx(0.55)
    step = sweep.lr_factor("step", 2, 10)  # 8 steps after the warm-up: x0.3 from t = 6, x0.09 from t = 8
    assert [step(t) for t in (3, 5, 6, 7, 8, 10)] == [1.0, 1.0, 0.3, 0.3, 0.09, 0.09]
    with pytest.raises(ValueError, match="lr_schedule='linear'"):
        sweep.lr_factor("linear", 0, 10)


def test_a_capped_setup_keeps_its_warm_up_in_proportion():
    s = {"steps": 400, "warmup": 60}
    assert sweep.capped(s, 100) == {"steps": 100, "warmup": 15}
    assert sweep.capped(s, 0) is s and sweep.capped(s, 1000) is s


def _args(argv):
    ap = argparse.ArgumentParser()
    sweep.add_parser(ap.add_subparsers())
    return ap.parse_args(["sweep", *argv])


def test_a_small_sweep_reports_each_run_as_bench_convergence_trains_it(tmp_path):
    out = tmp_path / "sweep.json"
    report = sweep.run(_args([*QUICK, "--json", str(out), "--png", str(tmp_path / "sweep.png")]))
    assert json.loads(out.read_text())["runs"] == report["runs"]
    assert len(report["runs"]) == 2 * 2 * 2 and (tmp_path / "sweep.png").stat().st_size > 0
    setup = sweep.capped(sweep.draw(3, 1), 12)
    again = sweep.run_one(setup, 1, "zoadam", _args(QUICK))
    assert again["val_loss"] == report["runs"]["1/1/zoadam"]["val_loss"]
    assert report["summary"]["setups_done"] == 2
    for i in ("0", "1"):
        row = report["setups"][i]
        losses = [report["runs"][f"{i}/{s}/zoadam"]["val_loss"] for s in (0, 1)]
        assert row["zoadam_mean"] == pytest.approx(sum(losses) / 2)
        assert row["gap"] == pytest.approx(row["zoadam_mean"] / row["adam_mean"] - 1)


def test_a_killed_sweep_resumes_where_it_stopped_with_the_same_results(tmp_path):
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "hvd_zoadam.bench", "sweep", *QUICK, "--json", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(json.loads(out.read_text())["runs"]) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    kept = json.loads(out.read_text())["runs"]
    assert 2 <= len(kept) < 8
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    trained = [line for line in done.stderr.splitlines() if line.startswith("[sweep] set-up")]
    assert len(trained) == 8 - len(kept)
    resumed = json.loads(out.read_text())["runs"]
    assert all(resumed[k] == v for k, v in kept.items())
    whole = sweep.run(_args([*QUICK, "--json", str(tmp_path / "whole.json")]))["runs"]
    assert {k: v["val_loss"] for k, v in resumed.items()} == {k: v["val_loss"] for k, v in whole.items()}


def test_runs_trained_in_parallel_jobs_give_the_rows_of_one_process(tmp_path):
    serial = sweep.run(_args(QUICK))["runs"]
    parallel = sweep.run(_args([*QUICK, "--jobs", "2", "--json", str(tmp_path / "p.json")]))["runs"]
    assert set(parallel) == set(serial)
    for key, row in serial.items():
        assert (parallel[key]["val_loss"], parallel[key]["bytes_per_rank"]) == (row["val_loss"], row["bytes_per_rank"])
    with pytest.raises(sweep.SweepError, match="--jobs must be >= 1"):
        sweep.run(_args([*QUICK, "--jobs", "0"]))


def test_a_report_of_another_sweep_is_refused_naming_the_setting(tmp_path):
    out = tmp_path / "sweep.json"
    out.write_text(json.dumps({"settings": {**sweep._settings(_args(QUICK)), "ranks": 8}, "runs": {}}))
    with pytest.raises(sweep.SweepError, match="ranks: 8 there, 2 here"):
        sweep.run(_args([*QUICK, "--json", str(out)]))
    out.write_text("[1, 2]")
    with pytest.raises(sweep.SweepError, match="not a `bench sweep` report"):
        sweep.run(_args([*QUICK, "--json", str(out)]))


def _report(adam, zoadam, steps=400, ratio=0.1):
    runs = {}
    for s, (a, z) in enumerate(zip(adam, zoadam)):
        runs[f"0/{s}/adam"] = {"val_loss": a, "bytes_per_rank": 1.0}
        runs[f"0/{s}/zoadam"] = {"val_loss": z, "bytes_per_rank": ratio}
    setup = {"steps": steps}
    report = {"settings": {"seeds": len(adam)}, "runs": runs, "setups": {"0": {"setup": setup}}}
    sweep.summarise(report, [setup])
    return report["setups"]["0"]


def test_the_pass_rule():
    assert _report([1.0, 1.0], [1.009, 1.009])["passed"]
    assert not _report([1.0, 1.0], [1.011, 1.011])["passed"]
    wide = _report([1.0, 1.03], [1.03, 1.03])  # Adam's own spread is 3 %: a 1.5 % gap passes ...
    assert wide["allowed_gap"] == pytest.approx(0.02) and wide["passed"]
    assert not _report([1.0, 1.03], [1.05, 1.05])["passed"]  # ... but never one over 2 %
    assert _report([1.0], [1.0], steps=1000, ratio=0.15)["passed"]
    assert not _report([1.0], [1.0], steps=1000, ratio=0.16)["passed"]
    assert _report([1.0], [1.0], steps=999, ratio=0.5)["passed"]
    assert not _report([1.0], [math.nan])["passed"]


def test_a_variant_run_on_chosen_setups_reports_its_gap_and_freeze_2w_freezes_where_it_says(tmp_path):
    report = sweep.run(_args([*QUICK, "--only", "1", "--variants", "exact-compressed,freeze-2w"]))
    assert sorted(k for k in report["runs"] if k.startswith("0/")) == []
    row = report["setups"]["1"]
    assert set(row["variants"]) == {"exact-compressed", "freeze-2w"}
    losses = [report["runs"][f"1/{s}/freeze-2w"]["val_loss"] for s in (0, 1)]
    assert row["variants"]["freeze-2w"] == pytest.approx(sum(losses) / 2 / row["adam_mean"] - 1)
    setup = {"workload": "mlp", "lr": 3e-3, "beta2": 0.95, "steps": 12, "warmup": 2, "lr_schedule": "constant",
             "weight_decay": 0.0, "weight_decay_style": "decoupled", "batch_size": 4}
    assert sweep.freeze_without_floor(setup) == 5  # max(2 * 2, ceil(0.25 / 0.05))
    assert sweep.run_one(setup, 0, "freeze-2w", _args(QUICK))["frozen_at"] == 6
    assert sweep.run_one(setup, 0, "zoadam", _args(QUICK))["frozen_at"] is None  # the floor: 120 steps
    assert sweep.run_one(setup, 0, "freeze-at-3", _args(QUICK))["frozen_at"] == 4
    with pytest.raises(sweep.SweepError, match="unknown \\['exact'\\]"):
        sweep.run(_args([*QUICK, "--variants", "exact"]))


def test_the_markdown_table_has_a_row_per_finished_setup_with_its_numbers():
    setup = {"workload": "mlp", "lr": 0.00325, "beta2": 0.98, "steps": 431, "warmup": 59, "lr_schedule": "constant",
             "weight_decay": 0.008, "weight_decay_style": "l2", "batch_size": 6}
    report = {"setups": {
        "0": {"setup": setup, "adam_mean": 1.30429, "adam_spread": 0.0137, "zoadam_mean": 1.31162,
              "zoadam_spread": 0.0155, "gap": 0.00562, "bytes_vs_adam": 0.13055, "frozen_at": [241, 241],
              "passed": True},
        "1": {"setup": {**setup, "weight_decay_style": "decoupled"}, "adam_mean": 2.0, "adam_spread": 0.0,
              "zoadam_mean": 1.9, "zoadam_spread": 0.0, "gap": -0.05, "bytes_vs_adam": 0.2,
              "frozen_at": [None, None], "passed": False},
        "3": {"setup": setup, "passed": False, "diverged": True},
        "2": {"setup": setup}},  # not finished: no row
        "settings": {"seeds": 2},
        "runs": {"3/0/adam": {"val_loss": 1.0}, "3/1/adam": {"val_loss": 3.0},
                 "3/0/zoadam": {"val_loss": math.nan}, "3/1/zoadam": {"val_loss": 2.0}}}
    lines = sweep.table(report).splitlines()
    assert len(lines) == 5 and lines[0].startswith("| # | model |")
    assert lines[4].endswith("| 6 | 2.0000 ± 100.0 % | diverged (1 of 2 seeds) | | | | **no** |"), lines[4]
    assert lines[2] == ("| 0 | mlp | 431 (59) | constant | 0.00325 | 0.98 | 0.008 L2 | 6 | 1.3043 ± 1.4 % | "
                        "1.3116 ± 1.6 % | +0.56 % | 0.131 | 240 | yes |")
    assert lines[3].endswith("| 0.008 AdamW | 6 | 2.0000 ± 0.0 % | 1.9000 ± 0.0 % | −5.00 % | 0.200 | — | **no** |"), \
        lines[3]
