"""algorithm.md §4 schedules, checked against exact step lists."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_zoadam import Schedule, StepKind


def kinds(s: Schedule, last: int, lr_fn=None, freeze_lr=None) -> str:
    return "".join(s.kind(t, lr=lr_fn(t) if lr_fn else None, freeze_lr=freeze_lr).value[0]
                   for t in range(1, last + 1))


def test_variance_steps_with_kappa_2_are_1_2_4_6_8_12_16_24_32():
    s = Schedule(var_freeze_step=10 ** 6, var_update_scaler=2, local_step_scaler=10, local_step_clipper=4)
    assert s.variance_steps(40) == [1, 2, 4, 6, 8, 12, 16, 24, 32]
    assert [t for t in range(1, 41) if s.kind(t) is StepKind.VARIANCE] == [1, 2, 4, 6, 8, 12, 16, 24, 32]


def test_variance_steps_with_kappa_3_and_1():
    assert Schedule(10 ** 6, 3, 1, 1).variance_steps(50) == [1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48]
    assert Schedule(10 ** 6, 1, 1, 1).variance_steps(70) == [1, 2, 4, 8, 16, 32, 64]


def test_variance_state_counts_k_and_interval():
    """T_v = 1, 2, 4, 6, 8, ... (κ = 2): under "paper" weighting K counts the updates of v; under
    "interval" (the default) K is the last step in T_v, the sum of the intervals its updates
    stand for; variance_update_steps gives each update's interval from the K before it."""
    paper = Schedule(10 ** 6, 2, 1, 1, var_update_weighting="paper")
    assert paper.variance_state(6) == {"is_variance": True, "var_interval": 4, "var_counter": 0,
                                       "exp_avg_sq_steps": 4, "last_variance_step": 6}
    assert paper.variance_state(7) == {"is_variance": False, "var_interval": 4, "var_counter": 0,
                                       "exp_avg_sq_steps": 4, "last_variance_step": 6}
    assert paper.variance_state(8) == {"is_variance": True, "var_interval": 4, "var_counter": 1,
                                       "exp_avg_sq_steps": 5, "last_variance_step": 8}
    assert [paper.variance_update_steps(t, k) for t, k in ((1, 0), (2, 1), (4, 2), (6, 3), (8, 4))] == [1] * 5
    s = Schedule(10 ** 6, 2, 1, 1)
    assert s.var_update_weighting == "interval"
    assert s.variance_state(7)["exp_avg_sq_steps"] == 6 and s.variance_state(8)["exp_avg_sq_steps"] == 8
    steps = s.variance_steps(40)
    k, intervals = 0, []
    for t in steps:
        intervals.append(s.variance_update_steps(t, k))
        k += intervals[-1]
        assert k == s.variance_state(t)["exp_avg_sq_steps"] == t
    assert intervals == [1, 1, 2, 2, 2, 4, 4, 8, 8]
    assert s.variance_update_steps(8, 3) == 5  # after an Adam checkpoint of step 3, or skipped updates
    with pytest.raises(ValueError, match="var_update_weighting must be one of"):
        Schedule(10, 2, 1, 1, var_update_weighting="time")


def test_no_variance_step_after_the_freeze_and_sync_rule_steps_policy():
    # T_f=4, kappa=2 -> v v c v | H=1 for d=1..3, H=2 for d=4..6, H=4 for d=7..9, then H=8.
    s = Schedule(var_freeze_step=4, var_update_scaler=2, local_step_scaler=3, local_step_clipper=8,
                 local_step_policy="steps")
    assert kinds(s, 28) == "vvcv" + "sss" + "sls" + "lsl" + "llllll" + "s" + "lllllll" + "s"
    assert s.describe(4)["frozen"] is False and s.describe(5)["frozen"] is True
    assert s.describe(12)["local_step_interval"] == 4


def test_constant_policy_syncs_every_h_max_steps():
    s = Schedule(2, 1, 1000, 4, "constant")
    assert kinds(s, 18) == "vv" + "llls" * 4


def test_lr_policy_doubles_h_as_lr_halves():
    s = Schedule(2, 1, 1, 8, "lr")
    lrs = {t: 1.0 if t <= 6 else (0.5 if t <= 12 else 0.2) for t in range(1, 40)}
    got = kinds(s, 30, lr_fn=lrs.get, freeze_lr=1.0)
    # H=1 while lr == 1 (steps 3..6), H=2 at lr 0.5 (d = t-2 even -> sync), H=4 at 0.2.
    assert got[:6] == "vvssss"
    assert got[6:12] == "".join("s" if (t - 2) % 2 == 0 else "l" for t in range(7, 13))
    assert got[12:] == "".join("s" if (t - 2) % 4 == 0 else "l" for t in range(13, 31))
    assert s.local_step_interval(50, lr=0.0, freeze_lr=1.0) == 8


@settings(max_examples=60, deadline=None)
@given(tf=st.integers(1, 30), kappa=st.integers(1, 5), alpha=st.integers(1, 10), hmax=st.sampled_from([1, 2, 4, 8, 16]),
       policy=st.sampled_from(["steps", "constant"]))
def test_windows_never_exceed_the_clipper_and_gaps_never_shrink(tf, kappa, alpha, hmax, policy):
    s = Schedule(tf, kappa, alpha, hmax, policy)
    seq = [s.kind(t) for t in range(1, tf + 200)]
    var = [t for t, k in enumerate(seq, 1) if k is StepKind.VARIANCE]
    assert var[0] == 1 and all(t <= tf for t in var)
    gaps = [b - a for a, b in zip(var, var[1:])]
    assert gaps == sorted(gaps)
    syncs = [tf] + [t for t, k in enumerate(seq, 1) if k is StepKind.SYNC]
    assert all(0 < b - a <= hmax for a, b in zip(syncs, syncs[1:]))
    assert all(k in (StepKind.LOCAL, StepKind.SYNC) for k in seq[tf:])


@pytest.mark.parametrize("name", ["var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"])
@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-3, ValueError), (1.5, TypeError), (True, TypeError),
                                      ("4", TypeError)])
def test_bad_knobs_raise_naming_the_option(name, bad, exc):
    kw = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
    kw[name] = bad
    with pytest.raises(exc, match=name):
        Schedule(**kw)


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="local_step_policy"):
        Schedule(10, 2, 4, 4, "linear")


@pytest.mark.parametrize("hmax", [3, 5, 12])
def test_clipper_must_be_a_power_of_two(hmax):
    with pytest.raises(ValueError, match="local_step_clipper must be a power of 2"):
        Schedule(10, 2, 4, hmax)
