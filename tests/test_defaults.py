"""The defaults that need no knob: the freeze decided during training from the learning rate
(``var_freeze_step="auto"``, :class:`~hvd_zoadam.core.schedule.AutoFreeze`), κ and the scale block
from the world size. The decision is the same on every rank, survives a resume at another world
size, counts optimizer steps under ``backward_passes_per_step``, yields to a knob that is set, and
when it cannot decide (a learning rate still rising) waits and says so once."""
from __future__ import annotations

import copy
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

import hvd_zoadam
from conftest import run_threads
from hvd_zoadam.comm.thread import ThreadGroup
from hvd_zoadam.core.schedule import NEVER, AutoFreeze, Schedule, StepKind, var_update_interval_max
from hvd_zoadam.oracle.simulate import simulate_zoadam
from hvd_zoadam.shell.options import auto_scale_block_numel, auto_var_update_scaler, resolve_schedule

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402


def warmup_cosine(warmup: int, total: int, peak: float = common.LR):
    def lr(t):  # t = 1, 2, ...
        if t <= warmup:
            return peak * t / warmup
        return peak * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))
    return lr


def decide(rule: AutoFreeze, lr_fn, steps: int):
    state = {}
    for t in range(1, steps + 1):
        if rule.observe(state, t, lr_fn(t)) is not None:
            return state["var_freeze_step"], t
    return None, None


@pytest.mark.parametrize("warmup, beta2, kappa, want", [
    (60, 0.98, 8, 120),     # twice the warm-up
    (10, 0.98, 8, 120),     # not before v's 32 updates (4 kappa at kappa = 8)
    (200, 0.98, 8, 400),    # a long warm-up: twice it
    (60, 0.999, 8, 250),    # not before a quarter of v's horizon, 1 / (1 - beta2)
    (60, 0.98, 14, 120),    # kappa = 14: v has its 32 updates by step 56, so twice the warm-up
    (10, 0.98, 14, 56),     # and with a short warm-up, that 32nd update
    (10, 0.98, 3, 40),      # kappa = 3: 4 kappa = 12 updates, the last at step 40
])
def test_the_freeze_is_twice_the_warmup_but_not_before_vs_updates_or_a_quarter_of_its_horizon(warmup, beta2, kappa,
                                                                                               want):
    assert decide(AutoFreeze(kappa, beta2), warmup_cosine(warmup, 4 * want), 4 * want) == (want, want)


def test_a_decaying_rate_freezes_at_the_earliest_step():
    rule = AutoFreeze(8, 0.98)
    assert decide(rule, lambda t: 1e-3 * 0.99 ** t, 500) == (120, 120)


@pytest.mark.parametrize("beta2, want", [(0.98, 240), (0.999, 500)])
def test_a_rate_that_has_not_fallen_waits_for_twice_the_earliest_step(beta2, want):
    """E = 120 at beta2 = 0.98, 250 at 0.999: a constant rate, with or without a warm-up shorter
    than E, freezes at 2E; a warm-up longer than E still at twice the warm-up."""
    rule = AutoFreeze(8, beta2)
    assert decide(rule, lambda t: 1e-3, 1000) == (want, want)
    assert decide(rule, lambda t: 1e-3 * min(1.0, t / 30), 1000) == (want, want)
    assert decide(rule, lambda t: 1e-3 * min(1.0, t / 300), 1000) == (600, 600)


@pytest.mark.parametrize("drop, want", [(90, 120), (180, 180), (300, 240)])
def test_a_step_schedule_freezes_at_its_first_drop_between_the_earliest_step_and_twice_it(drop, want):
    """E = 120: a drop before E freezes at E, one between E and 2E at the drop, a later one at 2E."""
    assert decide(AutoFreeze(8, 0.98), lambda t: 1e-3 * (0.3 if t >= drop else 1.0), 1000) == (want, want)


def test_a_warmup_that_rises_in_plateaus_is_not_taken_as_over_on_its_first_plateau():
    """A warm-up stepped per epoch of 100 steps over 5 epochs: the rate rises at 101, 201, ... 401,
    stays flat 100 steps between rises; the warm-up ends at 401 and v freezes at 802."""
    lr = lambda t: 1e-3 * min(5, 1 + (t - 1) // 100) / 5  # noqa: E731
    assert decide(AutoFreeze(8, 0.98), lr, 2000) == (802, 802)


def test_a_rate_still_rising_never_freezes():
    assert decide(AutoFreeze(8, 0.98), lambda t: 1e-6 * t, 3000) == (None, None)


def test_auto_kappa_and_scale_block_follow_the_world_size():
    assert [auto_var_update_scaler(p) for p in (1, 8, 63, 64, 128)] == [8, 8, 8, 14, 14]
    assert [auto_scale_block_numel(p) for p in (1, 31, 32, 128)] == [256, 256, 64, 64]
    schedule, auto, scale = resolve_schedule(128, 0.999, var_freeze_step="auto", var_update_scaler="auto",
                                             local_step_scaler=32768, local_step_clipper=8, local_step_policy="lr",
                                             var_update_weighting="interval", scale_block_numel="auto")
    assert (schedule.var_freeze_step, schedule.var_update_scaler, auto, scale) == (NEVER, 14, AutoFreeze(14, 0.999), 64)


SCHEDULE_KNOBS = dict(var_freeze_step=400, var_update_scaler=8, local_step_scaler=32768, local_step_clipper=8,
                      local_step_policy="lr", scale_block_numel="auto")


def test_v_is_updated_at_least_once_a_half_life_of_beta2():
    """Under "interval" weighting T_v's interval stops doubling at the largest power of 2 within
    β2's half-life: 8 steps at 0.95, where the paper's T_v goes on to 16 and 32 after step 120;
    at 0.98 T_v is the paper's up to step 504, whatever the freeze; "paper" keeps the paper's."""
    assert [var_update_interval_max(b) for b in (0.9, 0.95, 0.98, 0.99, 0.995, 0.999)] == [4, 8, 32, 64, 128, 512]
    capped = resolve_schedule(8, 0.95, var_update_weighting="interval", **SCHEDULE_KNOBS)[0]
    paper = resolve_schedule(8, 0.95, var_update_weighting="paper", **SCHEDULE_KNOBS)[0]
    assert capped.var_update_interval_max == 8 and paper.var_update_interval_max == NEVER
    steps = capped.variance_steps(400)
    assert steps[:32] == paper.variance_steps(120) and steps[32:35] == [128, 136, 144] and steps[-1] == 400
    assert all(b - a <= 8 for a, b in zip(steps, steps[1:])) and paper.variance_steps(400)[-1] == 384
    assert [t for t in range(1, 401) if capped.variance_state(t)["is_variance"]] == steps
    at_98 = resolve_schedule(8, 0.98, var_update_weighting="interval", **{**SCHEDULE_KNOBS, "var_freeze_step": 504})
    assert at_98[0].variance_steps(504) == Schedule(504, 8).variance_steps(504)
    with pytest.raises(ValueError, match="var_update_interval_max must be a power of 2"):
        Schedule(400, 8, var_update_interval_max=12)


def test_the_capped_interval_trains_as_the_oracle_bitwise():
    """β2 = 0.95, κ = 1, T_f = 40: T_v = 1, 2, 4, 8, 16, 24, 32, 40 (the paper's: 1, 2, 4, 8, 16,
    32); two thread ranks equal the oracle given the same schedule, bit for bit."""
    knobs = {**SCHEDULE_KNOBS, "var_freeze_step": 40, "var_update_scaler": 1, "var_update_weighting": "interval"}

    def body(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=common.LR, betas=(0.9, 0.95)),
                                              named_parameters=model.named_parameters(), transport=transport, **knobs)
        for t in range(1, 49):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
        return [q.detach().clone() for q in model.parameters()]
    got = run_threads(2, body)
    schedule, _, scale = resolve_schedule(2, 0.95, **knobs)
    params0 = [q.detach().clone() for q in common.mlp().parameters()]
    want, kinds = simulate_zoadam(params0, common.grads_at, world_size=2, steps=48, schedule=schedule,
                                  lr_fn=lambda t: common.LR, betas=(0.9, 0.95), weight_decay=0.01, decoupled=True,
                                  scale_block_numel=scale)
    assert [t for t, k in enumerate(kinds, 1) if k is StepKind.VARIANCE] == [1, 2, 4, 8, 16, 24, 32, 40]
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[r], want[r]))


def _train(rank, transport, steps, lr_fn, passes=1, state=None, **knobs):
    """The thread ranks' MLP with AdamW under a LambdaLR of ``lr_fn``; returns (params, opt)."""
    model = common.mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=common.LR, betas=(0.9, 0.98))
    opt = hvd_zoadam.DistributedOptimizer(inner, named_parameters=model.named_parameters(), transport=transport,
                                          backward_passes_per_step=passes, **knobs)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda i: lr_fn(i + 1) / common.LR)
    first = 1
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(copy.deepcopy(state["opt"]))
        sched.load_state_dict(state["sched"])
        first = state["step"] + 1
    for t in range(first, steps + 1):
        opt.zero_grad()
        for i in range(passes):
            (common.loss_fn(model, 1000 * i + t, rank) / passes).backward()
        opt.step()
        sched.step()
    return model, opt, sched


def test_ranks_decide_the_same_freeze_and_train_as_the_oracle_bitwise():
    """No knob set: two thread ranks with a warm-up of 10 decide T_f = 120 (v's 32 updates), and
    the parameters equal the oracle's (which decides it the same way) bit for bit."""
    lr_fn = warmup_cosine(10, 140)
    got = run_threads(2, lambda r, t: _train(r, t, 140, lr_fn))
    states = [opt.schedule_state() for _, opt, _ in got]
    assert states[0]["var_freeze_step"] == states[1]["var_freeze_step"] == 120
    assert got[0][1].comm_stats()["sync"]["steps"] > 0 and got[0][1].comm_stats()["local"]["steps"] > 0
    schedule, auto, scale = resolve_schedule(2, 0.98, **{k: v for k, v in hvd_zoadam.distributed.KNOBS.items()
                                                         if k in ("var_freeze_step", "var_update_scaler",
                                                                  "local_step_scaler", "local_step_clipper",
                                                                  "local_step_policy", "var_update_weighting",
                                                                  "scale_block_numel")})
    params0 = [q.detach().clone() for q in common.mlp().parameters()]
    want, kinds = simulate_zoadam(params0, common.grads_at, world_size=2, steps=140, schedule=schedule, lr_fn=lr_fn,
                                  betas=(0.9, 0.98), weight_decay=0.01, decoupled=True, scale_block_numel=scale,
                                  auto_freeze=auto)
    assert kinds[119] is not StepKind.LOCAL and kinds[120] in (StepKind.LOCAL, StepKind.SYNC)
    for r in range(2):
        for a, b in zip(got[r][0].parameters(), want[r]):
            assert torch.equal(a.detach(), b), (r, (a.detach() - b).abs().max())


@pytest.mark.parametrize("at", [15, 130])  # before the decision (step 120) and after it
def test_a_resume_at_another_world_size_keeps_the_decision(at):
    lr_fn = warmup_cosine(10, 160)
    whole = run_threads(2, lambda r, t: _train(r, t, 150, lr_fn))[0][1].schedule_state()
    model, opt, sched = run_threads(2, lambda r, t: _train(r, t, at, lr_fn))[0]
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": at}
    for p in (1, 3):
        resumed = run_threads(p, lambda r, t: _train(r, t, 150, lr_fn, state=saved))
        assert {opt.schedule_state()["var_freeze_step"] for _, opt, _ in resumed} == {whole["var_freeze_step"]}


def test_backward_passes_per_step_counts_optimizer_steps():
    lr_fn = warmup_cosine(10, 140)
    got = run_threads(2, lambda r, t: _train(r, t, 125, lr_fn, passes=2))
    assert [opt.schedule_state()["var_freeze_step"] for _, opt, _ in got] == [120, 120]


def test_a_knob_that_is_set_wins():
    lr_fn = warmup_cosine(10, 140)
    got = run_threads(2, lambda r, t: _train(r, t, 60, lr_fn, var_freeze_step=30, var_update_scaler=2))
    for _, opt, _ in got:
        assert opt.schedule_state()["var_freeze_step"] == 30 and opt.schedule.var_update_scaler == 2
        assert "lr_rise_step" not in opt.param_groups[0]["zoadam"]


def test_a_rate_that_keeps_rising_waits_and_warns_once(caplog):
    """Earliest T_f at kappa = 1, beta2 = 0.98: max(8, 13) = 13 (v's fourth update is at step 8); at
    step 4 x 13 = 52 with the rate still rising, rank 0 warns once, and v is not frozen."""
    model = common.mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.98))
    opt = hvd_zoadam.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                          transport=ThreadGroup(1).transports()[0], var_update_scaler=1)
    with caplog.at_level(logging.INFO, logger="hvd_zoadam"):
        for t in range(1, 81):
            for group in opt.param_groups:
                group["lr"] = 1e-5 * t
            opt.zero_grad()
            common.loss_fn(model, t, 0).backward()
            opt.step()
    warned = [r for r in caplog.records if "has not frozen v by step 52" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert opt.schedule_state()["var_freeze_step"] is None and not opt.schedule_state()["frozen"]


def test_the_decision_is_logged_once_on_rank_0(caplog):
    lr_fn = warmup_cosine(10, 140)
    with caplog.at_level(logging.INFO, logger="hvd_zoadam"):
        run_threads(2, lambda r, t: _train(r, t, 130, lr_fn))
    decided = [r.getMessage() for r in caplog.records if "v freezes after step" in r.getMessage()]
    assert decided == ["hvd_zoadam: v freezes after step 120 (var_freeze_step='auto': twice the warm-up, the "
                       "learning rate's last rise at step 10, and at least 120 steps, or 240 while the rate has "
                       "not fallen)"]


def test_schedule_with_a_decided_freeze_is_the_plain_schedule():
    base = Schedule(NEVER, 8, 32768, 8, "lr")
    rule = AutoFreeze(8, 0.98)
    assert rule.schedule(base, {}) is base
    assert rule.schedule(base, {"var_freeze_step": 120}) == Schedule(120, 8, 32768, 8, "lr")


def test_a_schedule_and_every_front_end_read_one_set_of_defaults():
    """The defaults live in one place, ``SCHEDULE_DEFAULTS``: the public :class:`Schedule`'s fields
    and every front end's ``DistributedOptimizer`` read them, so ``Schedule(T_f, κ,
    var_update_interval_max=var_update_interval_max(β2))`` predicts the step kinds of an
    optimizer given that T_f and κ and no other knob (the longest interval of T_v is no knob:
    the optimizer derives it from β2)."""
    import dataclasses
    import inspect

    from hvd_zoadam.core.schedule import SCHEDULE_DEFAULTS
    from hvd_zoadam.shell import horovod, mpi, torch_distributed
    fields = {f.name: f.default for f in dataclasses.fields(Schedule)
              if f.default is not dataclasses.MISSING and f.name != "var_update_interval_max"}
    assert fields == SCHEDULE_DEFAULTS
    assert SCHEDULE_DEFAULTS["local_step_policy"] == "lr"
    for front_end in (horovod.DistributedOptimizer, torch_distributed.DistributedOptimizer):
        params = inspect.signature(front_end).parameters
        assert {name: params[name].default for name in SCHEDULE_DEFAULTS} == SCHEDULE_DEFAULTS, front_end.__module__
    assert {name: mpi.KNOBS[name] for name in SCHEDULE_DEFAULTS} == SCHEDULE_DEFAULTS
    knobs = {name: torch_distributed.KNOBS[name] for name in SCHEDULE_DEFAULTS}
    schedule, _, _ = resolve_schedule(2, 0.98, var_freeze_step=120, var_update_scaler="auto",
                                      scale_block_numel="auto", **knobs)
    assert schedule == Schedule(120, 8, var_update_interval_max=var_update_interval_max(0.98)) != Schedule(120, 8)
    lr = warmup_cosine(60, 400)
    assert [schedule.kind(t, lr(t), lr(120)) for t in range(1, 401)] == \
        [Schedule(120, 8).kind(t, lr(t), lr(120)) for t in range(1, 401)]  # the cap (32) acts after 504


@pytest.mark.parametrize("decay", [False, True])
def test_a_constant_rate_that_froze_v_late_gets_a_word_once(caplog, decay):
    """Earliest T_f at kappa = 1, beta2 = 0.98: 13. With a rate that has not fallen v freezes at
    twice that, 26, and from step 2 x 26 = 52 schedule_state()["risk"] says so with what to set
    (twice T_f), rank 0 logging it once; a rate that decays after the freeze gets no word."""
    model = common.mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    opt = hvd_zoadam.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                          transport=ThreadGroup(1).transports()[0], var_update_scaler=1)
    risks = []
    with caplog.at_level(logging.INFO, logger="hvd_zoadam"):
        for t in range(1, 71):
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (0.98 ** max(0, t - 27) if decay else 1.0)
            opt.zero_grad()
            common.loss_fn(model, t, 0).backward()
            opt.step()
            risks.append(opt.schedule_state()["risk"])
    assert opt.schedule_state()["var_freeze_step"] == 26
    words = [r for r in caplog.records if "set var_freeze_step=52" in r.getMessage()]
    if decay:
        assert risks == [None] * 70 and words == []
    else:
        assert risks[:51] == [None] * 51 and all(r and "set var_freeze_step=52" in r for r in risks[51:])
        assert len(words) == 1 and words[0].levelno == logging.WARNING


@pytest.mark.parametrize("beta2", [0.95, 0.98])
def test_beta2_of_095_gets_a_word_once_from_the_first_step(caplog, beta2):
    """The sweep's other risky regime: beta2 <= 0.95 under the defaults. schedule_state()["risk"]
    says so from the first step and rank 0 logs it once; beta2 = 0.98 gets no word."""
    model = common.mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, beta2))
    opt = hvd_zoadam.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                          transport=ThreadGroup(1).transports()[0])
    risks = []
    with caplog.at_level(logging.INFO, logger="hvd_zoadam"):
        for t in range(1, 4):
            opt.zero_grad()
            common.loss_fn(model, t, 0).backward()
            opt.step()
            risks.append(opt.schedule_state()["risk"])
    words = [r for r in caplog.records if "Prefer beta2 >= 0.98" in r.getMessage()]
    if beta2 == 0.95:
        assert all(r and r.startswith("beta2=0.95: over a random sweep") for r in risks), risks
        assert len(words) == 1 and words[0].levelno == logging.WARNING
    else:
        assert risks == [None] * 3 and words == []
