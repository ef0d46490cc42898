"""Elastic training: hvd.elastic.run + TorchState, a job that grows from 2 to 3 ranks mid-run;
after the scale-up the new worker must not resume from other counters or state.

horovodrun --gloo --min-np 2 --max-np 3 with a host-discovery script that reads a file; rank 0
of the job rewrites the file from ``localhost:2`` to ``localhost:3`` after step GROW_AT. The
reset lands mid-window (after the freeze, between syncs). After it, every rank must report
the same schedule, hold error buffers sized for P = 3, leave identical parameters and
exp_avg after every sync, and the job must end (rc 0) within the timeout. The error feedback
the two first ranks owed is carried over to the three: every rank's worker error is their
mean, and the new server chunks together are their server chunks.
"""
from __future__ import annotations

import json
import stat
import sys
from collections import defaultdict

import torch

from conftest import BIN, ROOT, run_cmd
from hvd_zoadam import padded_numel

STEPS, GROW_AT = 30, 8


def _elastic_job(tmp_path, start: int, change_at: int, to: int):
    """horovodrun --gloo --min-np 2 --max-np 3 of tests/mp/worker_elastic.py on ``start`` slots
    of localhost, the discovery script's file rewritten to ``to`` slots after ``change_at``;
    returns the output folder."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost:{start}\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    out.mkdir()
    run_cmd([str(BIN / "horovodrun"), "-np", str(start), "--min-np", "2", "--max-np", "3",
             "--host-discovery-script", str(discover), "--network-interfaces", "lo", "--gloo",
             sys.executable, str(ROOT / "tests/mp/worker_elastic.py"), str(out), str(hosts), str(STEPS),
             str(change_at), str(to)], timeout_s=240)
    return out


def test_elastic_job_grows_from_two_to_three_ranks(tmp_path):
    out = _elastic_job(tmp_path, 2, GROW_AT, 3)

    outputs = [json.loads(f.read_text()) for f in sorted(out.glob("pid*.json"))]
    runs = [o["records"] for o in outputs]
    assert len(runs) == 3, "expected two first workers and one that joined"
    assert sorted(len(r) for r in runs)[-2:] == [STEPS, STEPS]   # the first two ran every step
    joined = min(runs, key=len)
    assert joined[0]["world"] == 3 and joined[-1]["step"] == STEPS - 1
    by_step = defaultdict(list)
    for run in runs:
        for rec in run:
            by_step[rec["step"]].append(rec)
    grown = [s for s in sorted(by_step) if len(by_step[s]) == 3]
    assert grown and grown[0] > GROW_AT and grown[-1] == STEPS - 1
    for s in grown:
        recs = by_step[s]
        assert {r["world"] for r in recs} == {3}
        assert sorted(r["rank"] for r in recs) == [0, 1, 2]
        # the same step, phase and intervals everywhere
        assert all(r["schedule"] == recs[0]["schedule"] for r in recs), s
        assert all(r["kind"] == recs[0]["kind"] for r in recs)
        assert len({r["lr"] for r in recs}) == 1, s
        # the frozen second moment: the joined rank's equals the others'
        assert len({r["exp_avg_sq"] for r in recs}) == 1, f"exp_avg_sq differs at step {s}"
        for r in recs:   # error buffers re-laid out for P = 3
            assert r["worker_error"] == [padded_numel(n, 3) for n in r["numel"]]
            assert r["server_error"] == [padded_numel(n, 3) // 3 for n in r["numel"]]
        if recs[0]["kind"] == "sync":
            assert len({r["params"] for r in recs}) == 1, f"params differ after the sync at step {s}"
            assert len({r["exp_avg"] for r in recs}) == 1, f"exp_avg differs after the sync at step {s}"
    syncs = [s for s in grown if by_step[s][0]["kind"] == "sync"]
    assert len(syncs) >= 3
    # local steps do drift per rank after the reset (the test would pass vacuously otherwise)
    locals_ = [s for s in grown if by_step[s][0]["kind"] == "local"]
    assert any(len({r["params"] for r in by_step[s]}) == 3 for s in locals_)
    # before the reset: two ranks, P = 2 buffers
    for s in range(GROW_AT + 1):
        assert [r["world"] for r in by_step[s]] == [2, 2]
        assert by_step[s][0]["worker_error"] == [padded_numel(n, 2) for n in by_step[s][0]["numel"]]
    check_error_feedback_carried_over(outputs, by_step, grown[0])


def check_error_feedback_carried_over(outputs, by_step, first_grown):
    """The pooled buffers after the reset against the two ranks' buffers after their last step."""
    last_two = sorted(by_step[max(s for s in by_step if s < first_grown)], key=lambda r: r["rank"])
    assert len(last_two) == 2
    after = sorted((p for o in outputs for p in o["pooled"] if p["world"] == 3), key=lambda p: p["rank"])
    assert [p["survivors"] for p in after] == [2, 2, 2]
    starts = [p for o in outputs for p in o["pooled"] if p["world"] == 2]
    assert starts and all(p["survivors"] == 0 for p in starts)  # the job's first sync: nothing owed yet
    for b, n in enumerate(last_two[0]["numel"]):
        old_w = torch.tensor([r["worker"][b] for r in last_two], dtype=torch.float64)
        assert old_w.abs().sum() > 0  # past the freeze: there is error feedback to carry
        mean = ((old_w[0] + old_w[1]) / 2).float()
        for p in after:
            assert torch.equal(torch.tensor(p["worker"][b]), mean), f"rank {p['rank']}: worker_error is not the mean"
        old_s = torch.tensor(sum((r["server"][b] for r in last_two), []))[:n]
        new_s = torch.tensor(sum((p["server"][b] for p in after), []))[:n]
        assert torch.equal(new_s, old_s), "the server chunks were not re-cut from the old ones"


SHRINK_AT = 10


def test_elastic_job_that_loses_a_rank_carries_the_survivors_error_feedback_and_finishes(tmp_path):
    """The discovery script drops one of three slots after step SHRINK_AT (mid-run, past the
    freeze): the rank on it is stopped, the two survivors reset to P = 2 and finish every step.
    Their worker errors become the mean of the survivors' own, the server chunks are re-cut
    from the survivors' chunks at their old places, and the dropped rank's chunk (what it owed
    as a server) restarts at zero, as algorithm.md §6 says; parameters agree after every sync."""
    out = _elastic_job(tmp_path, 3, SHRINK_AT, 2)

    outputs = [json.loads(f.read_text()) for f in sorted(out.glob("pid*.json"))]
    assert len(outputs) == 2, "the two survivors write their records; the stopped rank never finishes"
    runs = [o["records"] for o in outputs]
    assert [len(r) for r in runs] == [STEPS, STEPS]
    by_step = defaultdict(list)
    for run in runs:
        for rec in run:
            by_step[rec["step"]].append(rec)
    shrunk = [s for s in sorted(by_step) if by_step[s][0]["world"] == 2]
    assert shrunk and shrunk[0] > SHRINK_AT and shrunk[-1] == STEPS - 1
    for s in range(shrunk[0]):
        assert {r["world"] for r in by_step[s]} == {3}
    for s in shrunk:
        recs = by_step[s]
        assert sorted(r["rank"] for r in recs) == [0, 1] and recs[0]["schedule"] == recs[1]["schedule"]
        for r in recs:
            assert r["worker_error"] == [padded_numel(n, 2) for n in r["numel"]]
        if recs[0]["kind"] == "sync":
            assert recs[0]["params"] == recs[1]["params"], f"params differ after the sync at step {s}"
    assert sum(by_step[s][0]["kind"] == "sync" for s in shrunk) >= 3
    # the carried error feedback, against the survivors' buffers after their last step at P = 3
    last = {r["pid"]: r for r in by_step[shrunk[0] - 1]}
    survivors = [last[o["records"][0]["pid"]] for o in outputs]
    after = sorted((p for o in outputs for p in o["pooled"] if p["world"] == 2), key=lambda p: p["rank"])
    assert [p["survivors"] for p in after] == [2, 2]
    for b, n in enumerate(survivors[0]["numel"]):
        old_w = torch.tensor([r["worker"][b] for r in survivors], dtype=torch.float64)
        assert old_w.abs().sum() > 0
        mean = ((old_w[0] + old_w[1]) / 2).float()
        for p in after:
            assert torch.equal(torch.tensor(p["worker"][b]), mean), f"rank {p['rank']}: worker_error is not the mean"
        chunk = padded_numel(n, 3) // 3
        want = torch.zeros(padded_numel(n, 3))
        for r in survivors:  # each survivor's old chunk at its old place; the dropped rank's stays 0
            want[r["rank"] * chunk:(r["rank"] + 1) * chunk] = torch.tensor(r["server"][b])
        new_s = torch.tensor(sum((p["server"][b] for p in after), []))[:n]
        assert torch.equal(new_s, want[:n]), "the server chunks were not re-cut from the survivors' old ones"
        dropped = ({0, 1, 2} - {r["rank"] for r in survivors}).pop()
        assert want[dropped * chunk:(dropped + 1) * chunk].abs().sum() == 0
