"""The chaos run: a seeded fault injector and a supervisor that restarts from the latest complete
checkpoint (``python -m hvd_zoadam.bench chaos``); the short run needs root (simulated hosts)."""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import pytest
import torch

from conftest import run_cmd
from hvd_zoadam.bench import chaos


def _args(**kw):
    ap = argparse.ArgumentParser()
    chaos.add_parser(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["chaos"])
    vars(args).update(kw)
    return args


def test_an_attempts_faults_are_replayed_from_the_seed_and_end_at_the_first_that_kills():
    args = _args(steps=500, mean_gap=20, ranks=3, timeout=8.0)
    for seed in range(40):
        plan = chaos.plan_attempt(random.Random(seed), 100, 10, args, 3)
        assert plan == chaos.plan_attempt(random.Random(seed), 100, 10, args, 3)
        assert 1 <= len(plan) <= 4
        steps = [f["step"] for f in plan]
        assert steps == sorted(steps) and 100 < steps[0] and steps[-1] <= 100 + 40 * len(plan)
        assert all(f["kind"].startswith("link") for f in plan[:-1])
        for f in plan:
            assert f["kind"] in chaos.KINDS and 0 <= f["rank"] < 3
            if f["kind"] == "link-down":
                assert 4.0 <= f["seconds"] <= 12.0
    assert len(chaos.plan_attempt(random.Random(0), 100, 1, args, 3)) == 1  # the budget of faults left
    assert chaos.plan_attempt(random.Random(3), 499, 4, args, 3)[-1]["step"] == 500  # never past the end
    assert {f["rank"] for seed in range(40) for f in chaos.plan_attempt(random.Random(seed), 0, 4, args, 2)} == {0, 1}


def test_the_restart_takes_the_newest_checkpoint_with_every_ranks_file(tmp_path):
    def files(step, world, ranks):
        for r in ranks:
            torch.save({"model": {}, "optimizer": {}, "extra": {}, "rank_state": {"world_size": world, "rank": r}},
                       tmp_path / f"s{step:07d}.rank{r}.pt")
    files(25, 3, [0, 1, 2])
    files(50, 3, [0, 1, 2])
    files(75, 3, [0, 2])  # a rank died inside this save
    (tmp_path / "s0000075.rank1.pt.killed.tmp").write_bytes(b"x")
    assert chaos.latest_complete(tmp_path, set()) == (50, str(tmp_path / "s0000050"))
    assert chaos.latest_complete(tmp_path, {str(tmp_path / "s0000050")}) == (25, str(tmp_path / "s0000025"))
    files(100, 3, [0, 1, 2])
    files(100, 2, [0, 1])  # a restart at 2 ranks saved the same step again: rank 2's file is stale
    assert chaos.latest_complete(tmp_path, set()) == (100, str(tmp_path / "s0000100"))
    files(125, 2, [0])
    files(125, 3, [1])  # rank 1's file is another job's
    assert chaos.latest_complete(tmp_path, set()) == (100, str(tmp_path / "s0000100"))
    (tmp_path / "s0000150.rank0.pt").write_bytes(b"not a checkpoint")
    assert chaos.latest_complete(tmp_path, set()) == (100, str(tmp_path / "s0000100"))
    assert chaos.latest_complete(tmp_path / "none", set()) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="ip netns needs root")
@pytest.mark.timeout(900)
def test_a_short_chaos_run_loses_nothing_and_ends_bitwise_equal(tmp_path):
    """Up to 8 faults over 400 steps on 3 simulated hosts (seed 0 draws kills, a failing save and
    link faults): no checkpoint fails to load, no rank hangs, and every rank's final parameters
    equal the uninterrupted run's bit for bit."""
    out = tmp_path / "chaos.json"
    run_cmd([sys.executable, "-m", "hvd_zoadam.bench", "chaos", "--steps", "400", "--faults", "8", "--mean-gap", "25",
             "--seed", "0", "--json", str(out)], timeout_s=850)
    report = json.loads(out.read_text())
    # How many of the seed's faults fire depends on timing: a link-down outlasting the collective
    # timeout ends its attempt early or not, and the next attempt's plan is drawn after it (the same
    # seed has given 6 faults with 2 restarts, both link-downs, and 8 with 2 to 5 kills or failing saves). At least
    # two restarts, each from a checkpoint, in every case.
    assert report["faults_injected"] >= 6 and report["restarts"] >= 2
    assert report["checkpoints_failed_to_load"] == 0 and report["hangs"] == 0
    assert report["bitwise_equal"] and report["max_abs_diff"] == 0.0
    assert report["val_loss"] == report["val_loss_uninterrupted"]
    assert report["failed_attempts"] == []  # every failed attempt had a fault that fired


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_world_size_trains_on_the_same_global_batch(world_size):
    """What --resize relies on: the mean over the ranks of their gradients at any world size is
    the gradient of the data-ranks' global batch (3 batches of 32 rows here)."""
    model = chaos._model()

    def mean_grad(p, data_ranks=3):
        grads = []
        for r in range(p):
            model.zero_grad()
            chaos._loss(model, 17, r, p, data_ranks).backward()
            grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
        return torch.stack(grads).mean(0)

    torch.testing.assert_close(mean_grad(world_size), mean_grad(3), rtol=1e-5, atol=1e-7)
