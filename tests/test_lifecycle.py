"""An optimizer's life: resumes that follow an LR scheduler, and rebuilding on the same model.

Thread-ranks (tests/conftest.py::run_threads) over the shared MLP of tests/mp/common.py.
"""
import gc
import sys
from pathlib import Path

import torch

import hvd_zoadam
from conftest import run_threads

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402

KNOBS = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4,
             local_step_policy="steps")
STEPS, SAVE_AT = 18, 9


def _build(transport):
    model = common.mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=common.LR, weight_decay=0.01)
    opt = hvd_zoadam.DistributedOptimizer(inner, named_parameters=model.named_parameters(), transport=transport,
                                          **KNOBS)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, rank, steps):
    for t in steps:
        opt.zero_grad()
        common.loss_fn(model, t, rank).backward()
        opt.step()
        sched.step()


def test_resume_follows_the_lr_scheduler_bitwise():
    """Saved mid-run (model, optimizer, rank state, scheduler) and resumed into freshly built
    objects, the run ends bitwise where the uninterrupted one does, at every rank: the loaded
    param groups are the ones the next steps read, so the scheduler's lr changes take effect."""
    def body(rank, transport):
        model, opt, sched = _build(transport)
        _train(model, opt, sched, rank, range(1, STEPS + 1))
        straight = [q.detach().clone() for q in model.parameters()]

        model, opt, sched = _build(transport)
        _train(model, opt, sched, rank, range(1, SAVE_AT + 1))
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
                 "rank": opt.rank_state_dict(), "sched": sched.state_dict()}
        model, opt, sched = _build(transport)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        opt.load_rank_state_dict(saved["rank"])
        sched.load_state_dict(saved["sched"])
        lr_after_load = opt.param_groups[0]["lr"]
        _train(model, opt, sched, rank, range(SAVE_AT + 1, STEPS + 1))
        return straight, [q.detach().clone() for q in model.parameters()], lr_after_load

    for straight, resumed, lr_after_load in run_threads(2, body):
        assert lr_after_load == common.LR * 0.5 ** (SAVE_AT // 4)
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_a_dropped_optimizer_frees_its_parameters_for_a_new_one():
    """As with hvd.DistributedOptimizer, a model can get a new optimizer once the old one is
    dropped (its backward hooks hold it weakly and are removed with it); while the old one
    lives, a second optimizer over the same parameters is refused."""
    def body(rank, transport):
        model = common.mlp()
        first = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                                named_parameters=model.named_parameters(), transport=transport)
        try:
            hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                            named_parameters=model.named_parameters(), transport=transport)
            refused = False
        except ValueError as exc:
            refused = "already optimized by another hvd_zoadam optimizer" in str(exc)
        first.zero_grad()
        common.loss_fn(model, 1, rank).backward()
        first.step()
        del first
        gc.collect()
        second = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                                 named_parameters=model.named_parameters(), transport=transport)
        second.zero_grad()
        common.loss_fn(model, 2, rank).backward()
        second.step()
        return refused, second.comm_stats()["variance"]["steps"], len(second._hook_handles)

    for refused, steps, hooks in run_threads(2, body):
        assert refused and steps == 1
        assert hooks == sum(1 for _ in common.mlp().parameters())


def test_one_rank_skips_a_step_whose_gradient_is_not_finite():
    """At P = 1 a VARIANCE or COMPRESSED step with a NaN/Inf gradient (an fp16 overflow under
    GradScaler, say) is skipped as at P > 1: x, m and v stay as they were, the step counts as
    skipped, and the next finite step trains on."""
    def body(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                              named_parameters=model.named_parameters(), transport=transport,
                                              **KNOBS)
        seen = []
        for t in (1, 2, 3):  # steps 1 and 2: VARIANCE; 3: COMPRESSED (KNOBS' kappa = 2)
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            kind = opt._next_kind()[1].value
            before = [q.detach().clone() for q in model.parameters()] + \
                [v.clone() for st in opt.state.values() for v in (st["exp_avg"], st["exp_avg_sq"])]
            if t != 1:
                next(model.parameters()).grad.view(-1)[0] = float("inf") if t == 2 else float("nan")
            opt.step()
            after = [q.detach().clone() for q in model.parameters()] + \
                [v.clone() for st in opt.state.values() for v in (st["exp_avg"], st["exp_avg_sq"])]
            seen.append((kind, all(torch.equal(a, b) for a, b in zip(before, after)),
                         all(bool(torch.isfinite(a).all()) for a in after)))
        return seen, opt.comm_stats()["skipped_steps"]

    (seen, skipped), = run_threads(1, body)
    assert [k for k, _, _ in seen] == ["variance", "variance", "compressed"]
    assert [unchanged for _, unchanged, _ in seen] == [False, True, True]
    assert all(finite for _, _, finite in seen) and skipped == 2
