"""Flat storage: each bucket's parameters are views of one buffer, and after a step their
gradients too, so that a step's kernels cover a bucket and nothing is gathered or scattered.
What breaks such a view (``p.data = t``, autograd's fresh ``.grad`` after
``zero_grad(set_to_none=True)``) is noticed by its data pointer and made a view again, with
the values the user put there; training stays bitwise the oracle's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hvd_zoadam
from hvd_zoadam import Schedule, StepKind
from hvd_zoadam.comm.thread import ThreadGroup
from hvd_zoadam.core import bucket
from hvd_zoadam.oracle.simulate import simulate_zoadam

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402

KNOBS = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4,
             local_step_policy="steps")


def make(model, **kw):
    return hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=common.LR, weight_decay=0.05),
                                           named_parameters=model.named_parameters(),
                                           transport=ThreadGroup(1).transports()[0], **{**KNOBS, **kw})


def storages(model) -> set:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def train(model, opt, steps, set_to_none=True, between=None):
    for t in range(1, steps + 1):
        opt.zero_grad(set_to_none=set_to_none)
        common.loss_fn(model, t, 0).backward()
        opt.step()
        if between is not None:
            between(t, model)
    return [p.detach().clone() for p in model.parameters()]


def test_the_parameters_of_a_bucket_are_views_of_one_buffer_with_their_values():
    model = common.mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = make(model)
    assert len(storages(model)) == len(opt._engine.buckets) == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.is_contiguous() and p.shape == a.shape for a, p in zip(before, model.parameters()))


def test_gradients_become_views_of_the_buckets_gradient_storage_and_set_to_none_still_empties_them():
    model = common.mlp()
    opt = make(model)
    train(model, opt, 3, set_to_none=False)
    engine = opt._engine
    assert all(bucket.grads_in_storage(b) for b in engine.buckets)
    grads = [p.grad for p in model.parameters()]
    train(model, opt, 2, set_to_none=False)  # backward accumulates into the same views
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_is_bitwise_the_same_whatever_zero_grad_does(set_to_none):
    a, b = common.mlp(), common.mlp()
    want = train(a, make(a), 30, set_to_none=True)
    got = train(b, make(b), 30, set_to_none=set_to_none)
    assert all(torch.equal(x, y) for x, y in zip(want, got))


def test_a_parameter_whose_data_is_replaced_takes_its_new_values_and_becomes_a_view_again():
    """``p.data = t`` mid-training (a re-initialisation, a module's ``_apply``) is the same as
    writing t into p: the step after it uses t, and p is a view of its bucket's buffer again."""
    def replace(t, model):
        if t == 8:
            first = next(model.parameters())
            first.data = torch.full_like(first, 0.25)

    def write(t, model):
        if t == 8:
            next(model.parameters()).detach().fill_(0.25)

    a, b = common.mlp(), common.mlp()
    opt = make(a)
    got = train(a, opt, 20, between=replace)
    want = train(b, make(b), 20, between=write)
    assert all(torch.equal(x, y) for x, y in zip(want, got))
    assert len(storages(a)) == len(opt._engine.buckets)


def test_loading_a_state_dict_into_the_model_keeps_the_views():
    a = common.mlp()
    opt = make(a)
    train(a, opt, 4)
    a.load_state_dict(common.mlp().state_dict())
    assert len(storages(a)) == len(opt._engine.buckets)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), common.mlp().parameters()))


def _with_transposed_first_weight(model):
    """``model`` with its first weight's data given transposed strides (same values)."""
    first = next(model.parameters())
    first.data = first.data.t().contiguous().t()
    return model


def test_a_non_contiguous_parameter_keeps_its_strides_and_the_oracles_bits():
    """A bucket holding a parameter that is not contiguous (channels_last, a transpose) keeps
    no flat storage: its x is gathered and scattered as before, and the memory format the
    user chose stays. Its result is the oracle's to the last bit, the oracle's gradients taken
    on the same transposed layout: BLAS may take another path for a transposed weight (MKL
    does on AMD EPYC), so the contiguous model's bits are no reference here."""
    def grads_at(step, rank, params):
        model = _with_transposed_first_weight(common.mlp())
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(v)  # copy_ keeps p's strides
        assert not next(model.parameters()).is_contiguous()
        common.loss_fn(model, step, rank).backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    model = _with_transposed_first_weight(common.mlp())
    got = train(model, make(model), 20)
    assert not next(model.parameters()).is_contiguous()
    params0 = [q.detach().clone() for q in common.mlp().parameters()]
    want, _ = simulate_zoadam(params0, grads_at, world_size=1, steps=20, schedule=Schedule(**KNOBS),
                              lr_fn=lambda t: common.LR, weight_decay=0.05, decoupled=True)
    for x, y in zip(want[0], got):
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("kind", [StepKind.COMPRESSED, StepKind.LOCAL])
def test_a_gradient_that_is_not_finite_skips_the_step_at_one_rank(kind, set_to_none):
    """At P = 1 a NaN in the flat gradients (read in place, or copied in) leaves x, m and v as
    they were. (A SYNC step skips only its local update: the window's update is still sent,
    and x and m rebuilt from it, algorithm.md §5.)"""
    model = common.mlp()
    opt = make(model)
    for t in range(1, 40):
        opt.zero_grad(set_to_none=set_to_none)
        common.loss_fn(model, t, 0).backward()
        if opt._next_kind()[1] is kind and t > 2:
            break
        opt.step()
    assert opt._next_kind()[1] is kind
    next(model.parameters()).grad[0, 0] = float("nan")
    held = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
            for p in model.parameters()]
    opt.step()
    for p, (x, m, v) in zip(model.parameters(), held):
        assert torch.equal(p, x) and torch.equal(opt.state[p]["exp_avg"], m)
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
