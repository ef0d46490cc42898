"""Checkpoints resume exactly (algorithm.md §6): same world size bitwise, other world sizes consistently."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_ranks, run_job

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402

from hvd_zoadam import Schedule, StepKind  # noqa: E402
from hvd_zoadam.checkpoint import atomic_save  # noqa: E402

# With var_freeze_step=6, kappa=2, alpha=2, H_max=4: 6 is the last step before the freeze,
# 8 a SYNC step, 9 the middle of a window (steps 10 and 12 are syncs after H=2).
SAVE_AT = [6, 8, 9]
KINDS = Schedule(6, 2, 2, 4)


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
    """Rank 0's file alone resumes: from P=4 onto P=1, 2, 3 (a changed world size) and onto P=4 without
    the per-rank files; the resumed ranks agree with each other, and each starts with the error
    feedback pooled from the four saving ranks (the mean worker error, the server chunks re-cut)."""
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
        for r in ranks:
            assert r["loaded9"] == saved[0]["saved9"]  # step, phase, intervals, k, freeze lr, lr sums
            assert r["next_kind9"] == KINDS.kind(10).value
            assert all(torch.isfinite(p).all() for p in r["resumed9"])
            for (worker, _, n), (mean, _) in zip(r["errors9"], owed):
                assert torch.equal(worker[:n], mean) and not worker[n:].any()
        for b, (mean, server) in enumerate(owed):
            assert mean.abs().sum() > 0 and server.abs().sum() > 0
            assert torch.equal(torch.cat([r["errors9"][b][1] for r in ranks])[:server.numel()], server)
            # the last step (22) is a SYNC step: identical on every rank
            assert all(torch.equal(a, b) for a, b in zip(r["resumed9"], ranks[0]["resumed9"]))
        if np_ == 4:
            # Same data, but error feedback restarted and ranks 1-3 lost their window progress (rank 0's
            # x was loaded everywhere). Adam's sign-like steps make single weights diverge by about the
            # distance travelled, so compare what training is for: the held-out loss (1% apart here).
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
