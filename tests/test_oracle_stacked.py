"""The stacked oracle (``hvd_zoadam.oracle.stacked``, what ``simulate_zoadam`` uses by default)
against the per-rank oracle built call by call on ``native.reference``, and the convergence
bench's batched gradients (one vmap'd call for P ranks) against one backward pass per rank.

The stacked exchange takes each scale's float64 sum of squares in another order, so it may
differ from the per-rank one in the last bit of a sum: on the fixed cases below it is bitwise
equal; the drawn cases allow a float32 rounding of difference."""
from __future__ import annotations

import argparse
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvd_zoadam.core.layout import node_shards, padded_numel, scale_segments
from hvd_zoadam.core.schedule import Schedule, StepKind
from hvd_zoadam.oracle.simulate import simulate_compressed_allreduce, simulate_hierarchical_allreduce, simulate_zoadam
from hvd_zoadam.oracle.stacked import compressed_allreduce_stacked, hierarchical_allreduce_stacked


def _buffers(n, world_size, local, gen, noise=0.1):
    """Stacked worker and server errors (per local rank l) with random, correctly padded contents."""
    local = local or 1
    nodes = world_size // local
    shards = node_shards(n, local) if local > 1 else [(0, n)]
    worker, server = [], []
    for lo, hi in shards:
        big = padded_numel(hi - lo, nodes)
        w = torch.randn(nodes, big, generator=gen) * noise
        w[:, hi - lo:] = 0
        s = torch.randn(nodes, big // nodes, generator=gen) * noise
        s.view(-1)[hi - lo:] = 0
        worker.append(w)
        server.append(s)
    return worker, server


def _per_rank(stacks, world_size, local):
    local = local or 1
    return [stacks[r % local][r // local].clone() for r in range(world_size)]


def _exchange_both(y, numels, worker, server, local):
    """One exchange through each oracle from the same buffers: (stacked result, per-rank result),
    both sides' buffers updated in their own copies; returns the copies too."""
    p = y.shape[0]
    we, se = _per_rank(worker, p, local), _per_rank(server, p, local)
    if local:
        a = hierarchical_allreduce_stacked(y, worker, server, local, numels)
        b = simulate_hierarchical_allreduce(list(y), we, se, local, numels)
    else:
        a = compressed_allreduce_stacked(y, worker[0], server[0], numels)
        b = simulate_compressed_allreduce(list(y), we, se, numels)
    return a, b, we, se


@pytest.mark.parametrize("p, local", [(2, None), (3, None), (5, None), (8, None), (16, None), (4, 2), (8, 4), (6, 3)])
def test_the_stacked_exchange_is_bitwise_the_per_rank_exchange(p, local):
    """Four tensors in blocks of 256 (segments cut by chunks and shards), errors carried over
    three exchanges from random buffers: results and both errors bit for bit; a NaN on one rank
    gives None on both and leaves every buffer as it was."""
    gen = torch.Generator().manual_seed(p * 10 + (local or 0))
    numels = scale_segments([5000, 37, 3000, 1], 256)
    n = sum(numels)
    worker, server = _buffers(n, p, local, gen)
    for _ in range(3):
        y = torch.randn(p, n, generator=gen) * torch.rand(p, 1, generator=gen) * 3
        a, b, we, se = _exchange_both(y, numels, worker, server, local)
        assert torch.equal(a, b)
        assert all(torch.equal(x, y_) for x, y_ in zip(_per_rank(worker, p, local), we))
        assert all(torch.equal(x, y_) for x, y_ in zip(_per_rank(server, p, local), se))
    y[p - 1, n // 2] = math.nan
    before = [t.clone() for t in worker + server]
    a, b, _, _ = _exchange_both(y, numels, worker, server, local)
    assert a is None and b is None
    assert all(torch.equal(x, y_) for x, y_ in zip(worker + server, before))


@st.composite
def _exchange_cases(draw):
    p = draw(st.sampled_from([2, 3, 4, 6, 8]))
    local = draw(st.sampled_from([None] + [l for l in (2, 3, 4) if p % l == 0 and p > l]))
    tensors = draw(st.lists(st.integers(1, 400), min_size=1, max_size=4))
    block = draw(st.sampled_from([None, 16, 37, 256]))
    magnitude = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e18]))
    return p, local, scale_segments(tensors, block), magnitude, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_exchange_cases())
def test_drawn_layouts_give_the_per_rank_exchange_to_a_rounding(case):
    """World sizes, nodes, tensor sizes, blocks and magnitudes drawn: two exchanges in a row
    agree with the per-rank oracle to float32 rounding (the scales' sums may differ in the last
    float64 bit), relative to the inputs' magnitude."""
    p, local, numels, magnitude, seed = case
    gen = torch.Generator().manual_seed(seed)
    n = sum(numels)
    worker, server = _buffers(n, p, local, gen, noise=0.1 * magnitude)
    for _ in range(2):
        y = torch.randn(p, n, generator=gen) * magnitude
        a, b, we, se = _exchange_both(y, numels, worker, server, local)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * magnitude)
        for x, y_ in zip(_per_rank(worker, p, local) + _per_rank(server, p, local), we + se):
            torch.testing.assert_close(x, y_, rtol=1e-5, atol=1e-5 * magnitude)


def _same_params(a, b) -> bool:
    """Whether two oracle results (per rank, a list of tensors) are equal bit for bit."""
    return all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _quadratic_case(world_size, steps=30):
    """Three tensors, rank r's gradient that of ½|x − c_r|² plus noise from (step, rank)."""
    torch.manual_seed(7)
    params = [torch.randn(300), torch.randn(20, 11), torch.randn(5)]
    centres = [[torch.randn_like(p) for p in params] for _ in range(world_size)]

    def grad_fn(step, rank, xs):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        return [x - c + 0.3 * torch.randn(x.shape, generator=g) for x, c in zip(xs, centres[rank])]
    schedule = Schedule(var_freeze_step=8, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4,
                        local_step_policy="steps")
    kw = dict(world_size=world_size, steps=steps, schedule=schedule, lr_fn=lambda t: 0.01 * min(1.0, t / 5),
              betas=(0.9, 0.98), weight_decay=0.01, scale_block_numel=64)
    return params, grad_fn, kw


@pytest.mark.parametrize("p, options", [(2, {}), (5, {}), (8, {"ranks_per_node": 4}), (4, {"precondition": False,
                                        "auto_mask": False}), (3, {"server_exact": True}), (4, {"exact": ("sync",)}),
                                        (3, {"decoupled": True})])
def test_simulate_zoadam_stacked_is_bitwise_the_per_rank_oracle(p, options):
    """30 steps through every kind: the final x of every rank bit for bit, and the kinds."""
    params, grad_fn, kw = _quadratic_case(p)
    a, kinds_a = simulate_zoadam(params, grad_fn, stacked=True, **kw, **options)
    b, kinds_b = simulate_zoadam(params, grad_fn, stacked=False, **kw, **options)
    assert kinds_a == kinds_b and len(set(kinds_a)) == 4
    assert _same_params(a, b)


def test_a_batched_gradient_function_gives_what_the_per_rank_one_gives():
    """``batched_grad_fn`` (float32[P, n] in, float32[P, n] out) and ``grad_fn`` of the same
    gradients give the same run, bit for bit; giving both, or neither, is a TypeError."""
    params, grad_fn, kw = _quadratic_case(4)
    numels = [p.numel() for p in params]

    def batched(step, xs):
        rows = []
        for r in range(xs.shape[0]):
            views = [c.view_as(p) for c, p in zip(xs[r].split(numels), params)]
            rows.append(torch.cat([g.reshape(-1) for g in grad_fn(step, r, views)]))
        return torch.stack(rows)
    a, _ = simulate_zoadam(params, batched_grad_fn=batched, **kw)
    b, _ = simulate_zoadam(params, grad_fn, **kw)
    assert _same_params(a, b)
    with pytest.raises(TypeError, match="exactly one of grad_fn and batched_grad_fn"):
        simulate_zoadam(params, grad_fn, batched_grad_fn=batched, **kw)
    with pytest.raises(TypeError, match="exactly one of grad_fn and batched_grad_fn"):
        simulate_zoadam(params, **kw)


def test_an_exchange_that_meets_a_non_finite_scale_stops_the_oracle_by_name():
    """A NaN gradient on one rank at a COMPRESSED step: FloatingPointError naming the phase and
    the step, from both exchanges."""
    params, grad_fn, kw = _quadratic_case(3, steps=6)

    def poisoned(step, rank, xs):
        grads = grad_fn(step, rank, xs)
        if step == 3 and rank == 1:
            grads[0][5] = math.nan
        return grads
    for stacked in (True, False):
        with pytest.raises(FloatingPointError, match="non-finite scale in the compressed exchange of step 3"):
            simulate_zoadam(params, poisoned, stacked=stacked, **kw)


@pytest.mark.parametrize("workload", ["lm", "digits", "gru"])
def test_the_benchs_batched_gradients_and_losses_equal_one_pass_per_rank(workload):
    """The char LM, the digits CNN and the GRU at P = 3 ranks with different parameters: the vmap'd
    gradients and validation losses equal the per-rank backward and forward passes to float32
    rounding, and each rank draws its own batches."""
    from hvd_zoadam.bench import convergence, workloads
    from hvd_zoadam.bench.lm import example_module
    args = argparse.Namespace(ranks=3, seed=5, n_layer=1, n_embd=16, n_head=4, block_size=16, batch_size=4,
                              eval_batches=2, eval_every=0, warmup=2, steps=10, lr=1e-3)
    work = workloads.build(workload, example_module, args)
    names = [n for n, _ in work.model.named_parameters()]
    base = torch.cat([p.detach().reshape(-1) for p in work.model.parameters()])
    xs = base + 0.05 * torch.randn(3, base.numel(), generator=torch.Generator().manual_seed(1))
    numels = [p.numel() for p in work.model.parameters()]
    shapes = [p.shape for p in work.model.parameters()]
    per_rank = convergence._grad_fn(work, names, args)
    batched = convergence._batched_grad_fn(work, names, args)
    for step in (1, 2):
        want = torch.stack([torch.cat([g.reshape(-1) for g in per_rank(
            step, r, [c.view(s) for c, s in zip(xs[r].split(numels), shapes)])]) for r in range(3)])
        got = batched(step, xs)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        assert not torch.allclose(got[0], got[1])
    losses = convergence._val_losses(work, names, xs)
    want = [convergence._val_loss(work, names, [[c.view(s) for c, s in zip(xs[r].split(numels), shapes)]])
            for r in range(3)]
    assert losses == pytest.approx(want, rel=1e-5)


def test_the_benchs_vmap_chunks_give_the_same_gradients_and_losses_to_the_last_bit():
    """``--vmap-chunk-size``: the char LM at P = 5 with different parameters per rank, two ranks
    per vmap'd call (three calls, the last one short) against all five at once: the gradients
    and validation losses are bitwise equal, and every rank's gradient is its own."""
    from hvd_zoadam.bench import convergence, workloads
    from hvd_zoadam.bench.lm import example_module
    args = argparse.Namespace(ranks=5, seed=5, n_layer=1, n_embd=16, n_head=4, block_size=16, batch_size=4,
                              eval_batches=2, eval_every=0, warmup=2, steps=10, lr=1e-3)
    work = workloads.build("lm", example_module, args)
    names = [n for n, _ in work.model.named_parameters()]
    base = torch.cat([p.detach().reshape(-1) for p in work.model.parameters()])
    xs = base + 0.05 * torch.randn(5, base.numel(), generator=torch.Generator().manual_seed(2))
    whole = convergence._batched_grad_fn(work, names, argparse.Namespace(**vars(args), vmap_chunk_size=0))
    chunked = convergence._batched_grad_fn(work, names, argparse.Namespace(**vars(args), vmap_chunk_size=2))
    calls = []
    work.model.register_forward_pre_hook(lambda module, inputs: calls.append(inputs[0].shape))
    for step in (1, 2):
        want = whole(step, xs)
        assert len(calls) == 1
        got = chunked(step, xs)
        assert len(calls) == 4  # chunks of 2, 2 and 1 ranks
        calls.clear()
        assert torch.equal(got, want)
        assert not torch.allclose(got[3], got[4])
    assert convergence._val_losses(work, names, xs, 2) == convergence._val_losses(work, names, xs)


def test_the_sync_momentum_average_ablation_starts_at_the_second_sync():
    """``sync_momentum_average``: 0 is 0/1 Adam bit for bit; with a > 0 nothing changes until
    a SYNC step has a previous one to average with, and x moves apart the step after it."""
    params, grad_fn, kw = _quadratic_case(3)
    base, kinds = simulate_zoadam(params, grad_fn, **kw)
    syncs = [t for t, kind in enumerate(kinds, 1) if kind is StepKind.SYNC]
    zero, _ = simulate_zoadam(params, grad_fn, sync_momentum_average=0.0, **kw)
    assert _same_params(base, zero)
    for steps, same in ((syncs[1], True), (syncs[1] + 1, False)):
        kw["steps"] = steps
        a, _ = simulate_zoadam(params, grad_fn, **kw)
        b, _ = simulate_zoadam(params, grad_fn, sync_momentum_average=0.5, **kw)
        assert _same_params(a, b) is same, steps
