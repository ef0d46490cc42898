"""Checkpoints resume exactly (algorithm.md §6): same world size bitwise, other world sizes consistently."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_ranks, run_job, run_threads

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402
from hvd_zoadam import Schedule, StepKind  # noqa: E402
from hvd_zoadam.checkpoint import atomic_save  # noqa: E402

# With var_freeze_step=6, kappa=2, alpha=2, H_max=4: 6 is the last step before the freeze,
# 8 a SYNC step, 9 the middle of a window (steps 10 and 12 are syncs after H=2).
SAVE_AT = [6, 8, 9]
KINDS = Schedule(6, 2, 2, 4, "steps")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("save2")
    run_job("gloo", 2, ["tests/mp/worker_ckpt.py", str(out), "save", *map(str, SAVE_AT)])
    return out, load_ranks(out, 2)


def test_same_world_size_resume_is_bitwise_exact(saved, tmp_path):
    src, before = saved
    assert [KINDS.kind(s).value for s in SAVE_AT] == ["variance", "sync", "local"]
    run_job("mpi", 2, ["tests/mp/worker_ckpt.py", str(tmp_path), "resume", *map(str, SAVE_AT)],
            env={"CKPT_DIR": str(src)})
    after = load_ranks(tmp_path, 2)
    for r in range(2):
        for s in SAVE_AT:
            assert after[r][f"loaded{s}"] == before[r][f"saved{s}"]  # the schedule is never reset
            assert after[r][f"next_kind{s}"] == KINDS.kind(s + 1).value
            for a, b in zip(after[r][f"resumed{s}"], before[r]["full"]):
                assert torch.equal(a, b), (r, s)


def test_rank0_file_resumes_other_world_sizes_consistently(tmp_path):
    """Rank 0's file resumes: from P=4 onto P=1, 2, 3 (a changed world size) and onto P=4 without
    the per-rank files; the resumed ranks agree with each other, and each starts with the error
    feedback pooled from the four saving ranks (the server chunks re-cut; the mean worker error
    without the per-rank files, and with them at P' = 2, 3 the sum of its group's worker errors
    times P'/4: the ranks {0, 1} and {2, 3}, or {0, 1}, {2} and {3})."""
    src = tmp_path / "src"
    src.mkdir()
    run_job("gloo", 4, ["tests/mp/worker_ckpt.py", str(src), "save", "9"])
    saved = load_ranks(src, 4)
    owed = pooled_from_rank_files(src / "ckpt9", 4)
    only_common = tmp_path / "common"
    only_common.mkdir()
    (only_common / "ckpt9.pt").write_bytes((src / "ckpt9.pt").read_bytes())
    for np_, from_dir in ((1, src), (2, src), (3, src), (4, only_common)):
        out = tmp_path / f"p{np_}"
        out.mkdir()
        run_job("gloo" if np_ > 1 else "single", np_, ["tests/mp/worker_ckpt.py", str(out), "resume", "9"],
                env={"CKPT_DIR": str(from_dir)})
        ranks = load_ranks(out, np_)
        assert any(saved[0]["saved9"]["lr_sum"])  # saved inside a window
        groups = {2: [[0, 1], [2, 3]], 3: [[0, 1], [2], [3]]}.get(np_) if from_dir == src else None
        for rank, r in enumerate(ranks):
            assert r["loaded9"] == saved[0]["saved9"]  # step, phase, intervals, k, freeze lr, lr sums
            assert r["next_kind9"] == KINDS.kind(10).value
            assert all(torch.isfinite(p).all() for p in r["resumed9"])
            for (worker, _, n), (mean, _) in zip(r["errors9"], owed):
                # P' = 1: what the ranks owed went into the parameters (test_resume.py)
                want = mean if np_ > 1 else torch.zeros_like(mean)
                if groups:
                    want = worker_errors_of(src / "ckpt9", 4, groups[rank], np_)[:n]
                    assert not torch.equal(want, mean)
                assert torch.equal(worker[:n], want) and not worker[n:].any()
        for b, (mean, server) in enumerate(owed):
            assert mean.abs().sum() > 0 and server.abs().sum() > 0
            if np_ > 1:
                assert torch.equal(torch.cat([r["errors9"][b][1] for r in ranks])[:server.numel()], server)
            # the last step (22) is a SYNC step: identical on every rank
            assert all(torch.equal(a, b) for a, b in zip(r["resumed9"], ranks[0]["resumed9"]))
        if np_ == 4:
            # Same data, but the error feedback is pooled and the ranks continue the window from the
            # means of their parameters and momenta. Adam's sign-like steps make single weights
            # diverge by about the distance travelled, so compare what training is for: the held-out loss.
            resumed, full = eval_loss(ranks[0]["resumed9"]), eval_loss(saved[0]["full"])
            assert resumed != full and abs(resumed - full) <= 0.03 * full
    assert KINDS.kind(22) is StepKind.SYNC


def pooled_from_rank_files(prefix, world_size):
    """[(mean worker error, server errors of all ranks)] of the one bucket of the MLP, from the
    saving ranks' own files, checked against the error feedback that rank 0's file holds."""
    states = [torch.load(f"{prefix}.rank{r}.pt", weights_only=False)["rank_state"] for r in range(world_size)]
    assert all(len(st["buckets"]) == 1 for st in states)
    common_file = torch.load(f"{prefix}.pt", weights_only=False)["error_feedback"]
    workers = [st["buckets"][0]["worker_error"].double() for st in states]
    total = workers[0].clone()
    for w in workers[1:]:
        total += w
    n = sum(t.numel() for t in common_file["worker_error"].values())
    mean = (total / world_size).float()[:n]
    server = torch.cat([st["buckets"][0]["server_error"] for st in states])[:n]
    ids = sorted(common_file["worker_error"])
    assert torch.equal(torch.cat([common_file["worker_error"][i] for i in ids]), mean), \
        "rank 0's file does not hold the mean worker error"
    assert torch.equal(torch.cat([common_file["server_error"][i] for i in ids]), server), \
        "rank 0's file does not hold every rank's server chunk"
    return [(mean, server)]


def worker_errors_of(prefix, world_size, group, new_world_size):
    """(P'/P)·Σ_{i∈group} e_i of the one bucket, from the saving ranks' own files: float64 sums
    in rank order, rounded to float32."""
    states = [torch.load(f"{prefix}.rank{r}.pt", weights_only=False)["rank_state"] for r in group]
    total = torch.zeros_like(states[0]["buckets"][0]["worker_error"], dtype=torch.float64)
    for st in states:
        total += st["buckets"][0]["worker_error"].double()
    return (total * new_world_size / world_size).float()


def eval_loss(params) -> float:
    model = common.mlp()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
        return sum(common.loss_fn(model, 1000 + i, 0).item() for i in range(20)) / 20


def test_atomic_save_leaves_no_partial_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_save({"a": torch.ones(3)}, str(path))

    class Boom:
        def __reduce__(self):
            raise RuntimeError("killed mid-save")
    with pytest.raises(RuntimeError, match="killed mid-save"):
        atomic_save({"a": torch.zeros(3), "b": Boom()}, str(path))
    assert torch.equal(torch.load(path)["a"], torch.ones(3))  # the old file is intact
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # and no temporary file is left


# -- a checkpoint file is data ----------------------------------------------------------------

MARKER_NAME = "hvd_zoadam_crafted_checkpoint_ran"


class _RunsCode:
    """What a crafted checkpoint carries: unpickling it would run a shell command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save_on_threads(tmp_path, world_size=2, scheduler=None):
    """A real save of the MLP by ``world_size`` thread-ranks after 8 steps (past the freeze)."""
    from hvd_zoadam import checkpoint as ckpt_mod

    def body(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=common.LR),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              var_freeze_step=6, var_update_scaler=2)
        sched = scheduler(opt) if scheduler else None
        for t in range(1, 9):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
            if sched:
                sched.step()
        extra = {"scheduler": sched.state_dict()} if sched else {}
        ckpt_mod.save(str(tmp_path / "ckpt"), model, opt, step=8, **extra)
        return model, opt, sched
    return run_threads(world_size, body)


def _load_on_threads(prefix, world_size=2):
    """``checkpoint.load`` on every thread-rank into fresh models; returns each rank's outcome
    (the extras, or the CheckpointError)."""
    from hvd_zoadam import checkpoint as ckpt_mod

    def body(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=common.LR),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              var_freeze_step=6, var_update_scaler=2)
        try:
            return ckpt_mod.load(str(prefix), model, opt)
        except ckpt_mod.CheckpointError as exc:
            return exc
    return run_threads(world_size, body)


def _craft(path, marker):
    """Rewrite a checkpoint file with a code-running object hidden in its extras."""
    ckpt = torch.load(path, weights_only=True)
    ckpt["extra"]["note"] = _RunsCode(marker)
    torch.save(ckpt, path)


@pytest.mark.parametrize("which", ["rank", "common"])
def test_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, which):
    """A ``__reduce__`` in ``{prefix}.rank{r}.pt`` or in ``{prefix}.pt`` is refused with a
    CheckpointError on every rank, naming the file and the type; its command never runs."""
    marker = tmp_path / MARKER_NAME
    _save_on_threads(tmp_path)
    if which == "rank":
        _craft(tmp_path / "ckpt.rank1.pt", marker)
    else:  # the per-rank files are gone: every rank reads the common file
        for r in range(2):
            os.unlink(tmp_path / f"ckpt.rank{r}.pt")
        _craft(tmp_path / "ckpt.pt", marker)
    outcomes = _load_on_threads(tmp_path / "ckpt")
    assert not marker.exists(), "a crafted checkpoint ran its command"
    bad = "ckpt.rank1.pt" if which == "rank" else "ckpt.pt"
    for outcome in outcomes:
        assert isinstance(outcome, hvd_zoadam.checkpoint.CheckpointError), outcome
        assert bad in str(outcome) and "is refused: it needs a type that is not data" in str(outcome)
        assert "system" in str(outcome)  # the type, as the unpickler names it (posix.system)
    if which == "rank":
        assert all("rank 1:" in str(o) for o in outcomes)  # every rank names the rank whose file is bad


@pytest.mark.parametrize("make_scheduler", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=50),
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=4),
], ids=["StepLR", "OneCycleLR", "CosineAnnealingWarmRestarts"])
def test_a_save_with_a_schedulers_state_loads_as_data(tmp_path, make_scheduler):
    """An LR scheduler's state_dict() in the extras is data: the weights-only load takes it, and
    the scheduler restored from it gives the saved learning rate."""
    saved = _save_on_threads(tmp_path, scheduler=make_scheduler)
    outcomes = _load_on_threads(tmp_path / "ckpt")
    for (_, _, sched), extra in zip(saved, outcomes):
        assert isinstance(extra, dict), extra
        assert extra["step"] == 8 and extra["scheduler"] == sched.state_dict()
