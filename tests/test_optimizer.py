"""The optimizer shell over thread-ranks: the oracle, Horovod's contract (options, frozen and unnamed
parameters, accumulation, param groups), lr schedules, layout changes, bad input."""
from __future__ import annotations

import copy
import io
import math
import sys
import warnings
from pathlib import Path

import horovod.torch as hvd
import pytest
import torch

import hvd_zoadam
from conftest import run_threads
from hvd_zoadam import Schedule, StepKind
from hvd_zoadam.comm.thread import ThreadGroup
from hvd_zoadam.oracle.simulate import simulate_zoadam

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402

KNOBS = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4,
             local_step_policy="steps")


def make(model, transport, cls=torch.optim.Adam, lr=common.LR, wd=0.0, **kw):
    opts = {**KNOBS, **kw}
    return hvd_zoadam.DistributedOptimizer(cls(model.parameters(), lr=lr, weight_decay=wd),
                                           named_parameters=model.named_parameters(), transport=transport, **opts)


def solo():
    return ThreadGroup(1).transports()[0]


def train_threads(p, steps, cls=torch.optim.Adam, wd=0.0, lr_fn=None, record=False, **kw):
    def body(rank, transport):
        model = common.mlp()
        opt = make(model, transport, cls, wd=wd, **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_fn(i + 1) / common.LR) if lr_fn else None
        trace = []
        for t in range(1, steps + 1):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            kind = opt._next_kind()[1]
            opt.step()
            if sched:
                sched.step()
            if record:
                trace.append((kind, [q.detach().clone() for q in model.parameters()]))
        return [q.detach().clone() for q in model.parameters()], opt, trace
    return run_threads(p, body)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("cls, wd", [(torch.optim.Adam, 0.0), (torch.optim.Adam, 0.05), (torch.optim.AdamW, 0.05)])
@pytest.mark.parametrize("paper_raw", [False, True], ids=["default", "paper-raw"])
def test_equals_the_simulation_bitwise(p, cls, wd, paper_raw):
    """The product against the plain-loop oracle, in hvd_zoadam's default mode and in the paper's
    raw mode (the paper's compression domain, no mask, each update of v weighing as one step)."""
    steps = 26
    flags = dict(precondition_compression=False, auto_exp_avg_mask=False,
                 var_update_weighting="paper") if paper_raw else {}
    got = train_threads(p, steps, cls, wd, **flags)
    knobs = {**KNOBS, "var_update_weighting": "paper"} if paper_raw else KNOBS
    want, kinds = common.simulate_mlp(p, steps, knobs, cls, wd, paper_raw)
    assert {k for k in kinds} == set(StepKind)
    for r in range(p):
        for a, b in zip(got[r][0], want[r]):
            assert torch.equal(a, b), (r, (a - b).abs().max())


@pytest.mark.parametrize("cls, wd", [(torch.optim.Adam, 0.0), (torch.optim.AdamW, 0.05)])
@pytest.mark.parametrize("paper_raw", [False, True], ids=["default", "paper-raw"])
def test_many_buckets_at_p1_equal_the_simulation_bitwise(cls, wd, paper_raw):
    """At P = 1 nothing is compressed, so the bucket layout cannot change a bit: buckets of ~40
    elements (the several-bucket paths of the step kinds, the scratch reuse across buckets) must
    give the one-bucket oracle's parameters exactly."""
    steps = 26
    flags = dict(precondition_compression=False, auto_exp_avg_mask=False) if paper_raw else {}
    got = train_threads(1, steps, cls, wd, bucket_cap_mb=40 * 4 / 2 ** 20, **flags)
    assert len(got[0][1]._buckets) > 3
    params0 = [q.detach().clone() for q in common.mlp().parameters()]
    want, _ = simulate_zoadam(params0, common.grads_at, world_size=1, steps=steps, schedule=Schedule(**KNOBS),
                              lr_fn=lambda t: common.LR, weight_decay=wd, decoupled=cls is torch.optim.AdamW,
                              precondition=not paper_raw, auto_mask=not paper_raw)
    for a, b in zip(got[0][0], want[0]):
        assert torch.equal(a, b), (a - b).abs().max()


def test_local_updates_take_each_gradient_where_it_is_and_keep_the_simulations_bits(monkeypatch):
    """On the CPU with float32 parameters, LOCAL steps (with their finiteness check) and SYNC
    steps' exchange inputs run one kernel call per bucket on the parameters' flat storage,
    bitwise the oracle, and a LOCAL step moves each parameter's version counter as torch's
    in-place ops would."""
    from hvd_zoadam import native
    if not native.local_step_fused(torch.zeros(1)):
        pytest.skip("torch's CPU kernels here round lerp unfused: the torch ops run")
    calls = []
    for name in ("local_step_if_finite", "local_window_update"):
        monkeypatch.setattr(native.cpu, name, lambda *a, name=name, kernel=getattr(native.cpu, name):
                            calls.append((name, a[0].shape[0])) or kernel(*a))
    got = train_threads(2, 26, torch.optim.AdamW, 0.05)
    want, _ = common.simulate_mlp(2, 26, KNOBS, torch.optim.AdamW, 0.05)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[r][0], want[r]))
    n = sum(q.numel() for q in common.mlp().parameters())  # one bucket: each call takes it whole
    assert {(name, n) for name in ("local_step_if_finite", "local_window_update")} <= set(calls), set(calls)
    model = common.mlp()
    opt = make(model, solo())
    for t in range(1, 40):
        opt.zero_grad()
        common.loss_fn(model, t, 0).backward()
        before = [q._version for q in model.parameters()]
        local = opt._next_kind()[1] is StepKind.LOCAL
        opt.step()
        if local:
            assert all(q._version > v for q, v in zip(model.parameters(), before))
            break
    assert local


def test_a_sync_step_rebuilds_x_in_the_parameters_and_keeps_the_simulations_bits(monkeypatch):
    """On the CPU with float32 parameters a SYNC step's rebuild writes x straight into the
    parameters' flat storage, one array a bucket (no gathered x, no scatter), bitwise the
    oracle, and moves each parameter's version counter as torch's in-place ops would (one
    tensor a call, as torch before 2.5 requires)."""
    import threading

    from hvd_zoadam import native
    from hvd_zoadam.core.engine import Engine
    if not native.local_step_fused(torch.zeros(1)):
        pytest.skip("torch's CPU kernels here round lerp unfused: the SYNC step's local update gathers x")
    seen = []
    monkeypatch.setattr(native.cpu, "decompress_sync", lambda *a, kernel=native.cpu.decompress_sync:
                        seen.append(type(a[5]).__name__) or kernel(*a))

    def increment_version(t, bump=torch.autograd.graph.increment_version):  # torch < 2.5 takes one tensor
        assert isinstance(t, torch.Tensor), f"increment_version got {type(t).__name__}"
        bump(t)
    monkeypatch.setattr(torch.autograd.graph, "increment_version", increment_version)
    got = train_threads(2, 26, torch.optim.AdamW, 0.05)
    want, _ = common.simulate_mlp(2, 26, KNOBS, torch.optim.AdamW, 0.05)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[r][0], want[r]))
    assert seen and set(seen) == {"ndarray"}

    scatters, scatter = {}, Engine.scatter
    monkeypatch.setattr(Engine, "scatter", staticmethod(
        lambda flat, targets: scatters.setdefault(threading.get_ident(), []).append(len(targets))
        or scatter(flat, targets)))

    def body(rank, transport):
        model = common.mlp()
        opt = make(model, transport)
        mine, syncs = scatters.setdefault(threading.get_ident(), []), []
        for t in range(1, 40):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            before = [q._version for q in model.parameters()]
            sync = opt._next_kind()[1] is StepKind.SYNC
            mine.clear()
            opt.step()
            if sync:
                syncs.append((all(q._version > v for q, v in zip(model.parameters(), before)), len(mine)))
        return syncs

    for syncs in run_threads(2, body):
        assert syncs and all(bumped and not scattered for bumped, scattered in syncs), syncs


@pytest.mark.parametrize("beta1", [0.0, 1e-9])
def test_a_beta1_the_kernels_leave_to_torch_takes_the_gathered_path(beta1, monkeypatch):
    """β1 = 0 (or so small that 1 − β1 is 1 in float32) is left to the torch ops: the kernels
    never run, LOCAL and SYNC steps on 2-D parameters work, and the parameters are those of a
    run where the kernels are off altogether."""
    from hvd_zoadam import native

    def run():
        def body(rank, transport):
            model = common.mlp()
            opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR,
                                                                   betas=(beta1, 0.999)),
                                                  named_parameters=model.named_parameters(),
                                                  transport=transport, **KNOBS)
            seen = set()
            for t in range(1, 27):
                opt.zero_grad()
                common.loss_fn(model, t, rank).backward()
                seen.add(opt._next_kind()[1])
                opt.step()
            return [q.detach().clone() for q in model.parameters()], seen
        return run_threads(2, body)
    calls = []
    for name in ("local_step", "local_window_update"):
        monkeypatch.setattr(native.cpu, name, lambda *a, name=name: calls.append(name))
    got = run()
    assert calls == [] and {StepKind.LOCAL, StepKind.SYNC} <= got[0][1]
    monkeypatch.setattr(native, "_kernel_matches_torch", lambda: False)
    want = run()
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[r][0], want[r][0]))


def test_p1_compressed_steps_use_the_raw_gradient_and_send_nothing():
    """algorithm.md §7 #2: with P = 1 COMPRESSED steps update m with g itself (DeepSpeed skipped it)."""
    (params, opt, trace), = train_threads(1, 6, record=True, var_freeze_step=100, var_update_scaler=2)
    assert [k for k, _ in trace] == [StepKind.VARIANCE, StepKind.VARIANCE, StepKind.COMPRESSED,
                                     StepKind.VARIANCE, StepKind.COMPRESSED, StepKind.VARIANCE]
    # reference: m from every step's raw gradient, v only from VARIANCE steps (1, 2, 4, 6), each
    # update weighing as the steps since the previous one (1, 1, 2, 2: "interval" weighting)
    model = common.mlp()
    x = [q.detach().clone() for q in model.parameters()]
    m = [torch.zeros_like(q) for q in x]
    v = [torch.zeros_like(q) for q in x]
    k = last = 0
    for t, (kind, _) in enumerate(trace, 1):
        g = common.grads_at(t, 0, x)
        interval = t - last if kind is StepKind.VARIANCE else 0
        k, last = k + interval, (t if interval else last)
        for i in range(len(x)):
            m[i].lerp_(g[i], 0.1)
            if kind is StepKind.VARIANCE:
                v[i].mul_(0.999 ** interval).addcmul_(g[i], g[i], value=1 - 0.999 ** interval)
            denom = (v[i].sqrt() / math.sqrt(1 - 0.999 ** k)).add_(1e-8)
            x[i].addcdiv_(m[i], denom, value=-common.LR / (1 - 0.9 ** t))
    for a, b in zip(params, x):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    stats = opt.comm_stats()
    assert stats["bytes_sent_total"] == 0 and stats["rounds_total"] == 0 and stats["compressed"]["steps"] == 2


def test_lr_schedule_down_to_zero_gives_no_nan_and_zero_lr_steps_do_not_move():
    """lr is read from param_groups each step (warm-up, cosine decay to exactly 0); lr = 0 windows neither
    divide by 0 nor move x."""
    steps = 40

    def lr_fn(t):
        if t <= 5:
            return common.LR * t / 5
        if t > 36:
            return 0.0
        return common.LR * 0.5 * (1 + math.cos(math.pi * (t - 5) / 31))
    res = train_threads(2, steps, lr_fn=lr_fn, record=True, var_freeze_step=5, local_step_scaler=2,
                        local_step_clipper=4)
    for r in range(2):
        trace = res[r][2]
        assert all(torch.isfinite(q).all() for _, ps in trace for q in ps)
        for t in range(37, steps):  # steps 38.. have lr 0 (the scheduler sets lr for step t+1 after step t)
            assert all(torch.equal(a, b) for a, b in zip(trace[t][1], trace[t - 1][1])), t
        assert all(torch.isfinite(res[r][1].state[q]["exp_avg"]).all() for q in res[r][1].state)
    for (ka, pa), (kb, pb) in zip(res[0][2], res[1][2]):
        assert ka == kb
        if ka is StepKind.SYNC:
            assert all(torch.equal(a, b) for a, b in zip(pa, pb))


def test_param_groups_with_different_lr_move_in_proportion():
    """Unnamed params in two groups get distinct names and own buffers; all-ones grads compress
    losslessly, so group 2 (lr 1e-4) moves exactly 0.1x group 1 (lr 1e-3) in every phase."""
    def body(rank, transport):
        # zeros, so that float32 spacing (|x| <= 1e-2 here) does not blur the 1e-4 steps
        w1, b1, w2, b2 = (torch.nn.Parameter(torch.zeros(*s)) for s in [(4, 3), (4,), (2, 4), (2,)])
        inner = torch.optim.Adam([{"params": [w1, b1], "lr": 1e-3}, {"params": [w2, b2], "lr": 1e-4}])
        opt = hvd_zoadam.DistributedOptimizer(inner, transport=transport, var_freeze_step=3, var_update_scaler=2,
                                              local_step_policy="steps", local_step_scaler=2, local_step_clipper=2)
        names = sorted(opt._names.values())
        sizes = [b.exchange.worker_error.numel() for b in opt._buckets]
        start = [t.detach().clone() for t in (w1, b1, w2, b2)]
        ratios = []
        for _ in range(10):
            before = [t.detach().clone() for t in (w1, b1, w2, b2)]
            for t in (w1, b1, w2, b2):
                t.grad = torch.ones_like(t)
            opt.step()
            d = [(t.detach() - b) for t, b in zip((w1, b1, w2, b2), before)]
            ratios.append((d[2] / d[0][:2, :2].mean(), d[3] / d[1][:2]))
        return names, sizes, ratios, [t.detach().clone() for t in (w1, b1, w2, b2)], start
    res = run_threads(2, body)
    names, sizes, ratios, final, start = res[0]
    assert names == ["noname.0.0", "noname.0.1", "noname.1.0", "noname.1.1"]
    assert sizes == [hvd_zoadam.padded_numel(16, 2), hvd_zoadam.padded_numel(10, 2)]
    for rw, rb in ratios:
        torch.testing.assert_close(rw, torch.full_like(rw, 0.1), rtol=1e-4, atol=0)
        torch.testing.assert_close(rb, torch.full_like(rb, 0.1), rtol=1e-4, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(final, res[1][3]))


def test_zero_element_and_tiny_parameters_work_with_three_ranks():
    """(0,), (0,5), a scalar, a 2-element tensor (fewer elements than ranks) and a Linear(3,3) at P = 3:
    no hang, zero-element parameters stay empty, the others move alike on every rank."""
    def body(rank, transport):
        with common._INIT_LOCK:
            torch.manual_seed(0)
            ps = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(0, 5)),
                  torch.nn.Parameter(torch.tensor(0.5)), torch.nn.Parameter(torch.randn(2))]
            lin = torch.nn.Linear(3, 3)
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(ps + list(lin.parameters()), lr=1e-2),
                                              transport=transport, var_freeze_step=2, var_update_scaler=1,
                                              local_step_policy="steps", local_step_scaler=1, local_step_clipper=2)
        for t in range(6):
            opt.zero_grad()
            gen = torch.Generator().manual_seed(t * 10 + rank)
            loss = (ps[2] * 3 + ps[3].sum() + lin(torch.randn(4, 3, generator=gen)).pow(2).sum()
                    + ps[0].sum() + ps[1].sum())
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in ps], opt.comm_stats()["rounds_total"]
    res = run_threads(3, body)
    for r in range(3):
        assert res[r][0][0].shape == (0,) and res[r][0][1].shape == (0, 5)
        assert torch.equal(res[r][0][2], res[0][0][2]) and torch.equal(res[r][0][3], res[0][0][3])
        assert res[r][0][2] != 0.5


def test_frozen_parameters_get_no_state_and_stay_put():
    """requires_grad=False params hold no buffers and stay put; an all-frozen model is refused."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for q in model[0].parameters():
        q.requires_grad_(False)
    frozen = [q.clone() for q in model[0].parameters()]
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), transport=solo(),
                                          var_freeze_step=3)
    assert all(q not in opt.state for q in model[0].parameters())
    assert sum(b.numel for b in opt._buckets) == 18
    for t in range(6):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(frozen, model[0].parameters()))
    with pytest.raises(ValueError, match="nothing to optimize"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model[0].parameters()), transport=solo())


def test_state_dict_round_trip_resumes_exactly_and_keeps_the_schedule():
    def run(steps, model, opt, start=1):
        for t in range(start, start + steps):
            opt.zero_grad()
            common.loss_fn(model, t, 0).backward()
            opt.step()
    model_a = common.mlp()
    opt_a = make(model_a, solo())
    run(20, model_a, opt_a)

    model_b = common.mlp()
    opt_b = make(model_b, solo())
    run(9, model_b, opt_b)  # mid-window, past the freeze
    buf = io.BytesIO()
    torch.save({"model": model_b.state_dict(), "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    assert not any(isinstance(v, (hvd_zoadam.comm.transport.Transport,))
                   for v in ckpt["opt"]["param_groups"][0].values())
    model_c = common.mlp()
    opt_c = make(model_c, solo())
    model_c.load_state_dict(ckpt["model"])
    opt_c.load_state_dict(ckpt["opt"])
    assert opt_c.schedule_state() == opt_b.schedule_state()
    assert opt_c._next_kind() == opt_b._next_kind()
    run(11, model_c, opt_c, start=10)
    for a, b in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(a, b)


def test_synchronize_then_clip_then_step_uses_the_clipped_gradient():
    """Horovod's clipping pattern; synchronize() is idempotent and a second step() warns."""
    def body(rank, transport):
        model = common.mlp()
        opt = make(model, transport, var_freeze_step=100)
        common.loss_fn(model, 1, rank).backward()
        opt.synchronize()
        opt.synchronize()  # no second exchange
        avg = [q.grad.clone() for q in model.parameters()]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        clipped = [q.grad.clone() for q in model.parameters()]
        before = [q.detach().clone() for q in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
        moved = [q.detach() - b for q, b in zip(model.parameters(), before)]
        common.loss_fn(model, 2, rank).backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.step()
        return avg, clipped, moved, [str(x.message) for x in w], opt.comm_stats()["variance"]["rounds"]
    res = run_threads(2, body)
    for avg, clipped, moved, warns, rounds in res:
        assert all(torch.equal(a, b) for a, b in zip(avg, res[0][0]))  # the averaged gradient
        assert rounds == 3  # one allreduce per step, plus step 2's "gradients changed?" check (overlap armed)
        assert any("skip_synchronize" in w for w in warns)
        # first Adam step: x moves by -lr·ĝ/(|ĝ| + eps), with ĝ the clipped average
        for mv, g, a in zip(moved, clipped, avg):
            torch.testing.assert_close(mv, -common.LR * g / (g.abs() + 1e-8), rtol=1e-4, atol=1e-9)
        assert any(not torch.allclose(mv, -common.LR * a / (a.abs() + 1e-8), rtol=1e-4, atol=1e-9)
                   for mv, a in zip(moved, avg))


def test_backward_passes_per_step_counts_and_zero_grad_resets():
    """backward_passes_per_step: one pass too many raises Horovod's accumulation error text; zero_grad()
    clears a partial window; a partial window steps; the step counter counts optimizer steps."""
    model = common.mlp()
    opt = make(model, solo(), backward_passes_per_step=2)
    for t in range(2):
        common.loss_fn(model, t, 0).backward()
    with pytest.raises(AssertionError, match="Gradients were computed more than backward_passes_per_step"):
        common.loss_fn(model, 3, 0).backward()
    opt.zero_grad()  # a partial/aborted window is cleared
    for t in range(2):
        common.loss_fn(model, t, 0).backward()
    opt.step()
    opt.zero_grad()
    common.loss_fn(model, 5, 0).backward()
    opt.step()  # a partial window of 1 pass steps fine
    assert opt.schedule_state()["step"] == 2


def test_add_param_group_after_training_keeps_existing_state():
    """add_param_group after training: new params get zero buffers of their own padded size; old state
    is untouched."""
    def body(rank, transport):
        model = common.mlp()
        opt = make(model, transport)
        for t in range(1, 8):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
        snap = {k: v.clone() for b in opt._buckets for k, v in
                (("m", b.exp_avg), ("v", b.exp_avg_sq), ("we", b.exchange.worker_error))}
        with common._INIT_LOCK:
            torch.manual_seed(7)  # the new layer starts alike on every rank, as after a broadcast
            extra = torch.nn.Linear(3, 3)
        opt.add_param_group({"params": list(extra.parameters())})
        new = opt._buckets[-1]
        same = all(torch.equal(snap[k], v) for b in opt._buckets[:-1] for k, v in
                   (("m", b.exp_avg), ("v", b.exp_avg_sq), ("we", b.exchange.worker_error)))
        for t in range(8, 12):
            opt.zero_grad()
            (common.loss_fn(model, t, rank) + extra(torch.ones(3)).sum()).backward()
            opt.step()
        return same, new.names, new.exchange.worker_error.numel(), [q.detach().clone() for q in extra.parameters()]
    res = run_threads(2, body)
    for same, names, size, extra in res:
        assert same and names == ["noname.1.0", "noname.1.1"] and size == hvd_zoadam.padded_numel(12, 2)
    # step 11 is a SYNC step for these knobs: the new params agree across ranks
    assert all(torch.equal(a, b) for a, b in zip(res[0][3], res[1][3]))


def test_memory_report_matches_the_documented_formula_and_does_not_grow():
    """Optimizer memory: (4 + 1/P)·n floats plus < 8P padding per bucket, plus a bounded scratch, the same
    at step 20 as at step 6."""
    p = 2

    def body(rank, transport):
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.randn(1000, 1000, generator=torch.Generator().manual_seed(0)) * 0.01)
        model.b = torch.nn.Parameter(torch.zeros(1000))
        model.v = torch.nn.Parameter(torch.zeros(3))
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), transport=transport,
                                              var_freeze_step=3, local_step_clipper=4, scale_block_numel=2048)
        seen = []
        for t in range(1, 21):
            opt.zero_grad()
            gen = torch.Generator().manual_seed(t + 100 * rank)
            (model.w.sum() * torch.randn(1, generator=gen) + model.b.sum() + model.v.sum()).backward()
            opt.step()
            if t in (6, 20):
                held = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                           if v.untyped_storage().data_ptr() not in ())
                seen.append((opt.memory_bytes(), held))
        return seen
    n = 1_001_003
    for seen in run_threads(p, body):
        (m6, held6), (m20, held20) = seen
        assert m6 == m20
        big = hvd_zoadam.padded_numel(n, p)
        assert m6["state"] == 3 * 4 * n and held6 == 3 * 4 * n
        assert m6["error_buffers"] == 4 * (big + big // p) and big - n < 8 * p
        assert m6["state"] + m6["error_buffers"] <= (4 + 1 / p) * 4 * n + 4 * 8 * p * 2
        nseg = -(-1_000_000 // 2048) + 2  # scale blocks: worker scales + server scales, 4 bytes each
        # four shared float32 buffers, the bucket's exchange input (P > 1), packed bytes, the two
        # messages (signs and scales), the server's packed chunk and its staged error (N/P floats),
        # on the CPU the kept denominators (n floats), and what the two rounds' messages are read
        # into (each round's messages whole and their signs again, N/8 bytes each, and scales)
        assert m6["scratch"] <= 5 * 4 * big + 4 * n + 6 * (big // 8) + 2 * (big // (8 * p)) + 4 * (big // p) \
            + 8 * nseg + 24 * p * nseg + 64 * p
        assert m6["gradient_storage"] == 4 * n


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(op="adasum"), ValueError, "Adasum"),
    (dict(groups=-1), ValueError, "groups should be a non-negative integer"),
    (dict(num_groups=-1), ValueError, "num_groups must be a non-negative int"),
    (dict(backward_passes_per_step=0), ValueError, "backward_passes_per_step must be > 0"),
    (dict(gradient_predivide_factor=0.0), ValueError, "gradient_predivide_factor"),
    (dict(var_freeze_step=0), ValueError, "var_freeze_step"),
    (dict(local_step_clipper=2.5), TypeError, "local_step_clipper"),
    (dict(local_step_policy="cosine"), ValueError, "local_step_policy"),
    (dict(transport="nccl"), ValueError, "transport"),
    (dict(bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
    (dict(compression="topk"), ValueError, "compression"),
])
def test_bad_arguments_are_rejected_at_construction(kwargs, exc, match):
    if kwargs.get("op") == "adasum":
        kwargs["op"] = hvd.Adasum
    model = common.mlp()
    with pytest.raises(exc, match=match):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), **kwargs)


def test_unsupported_optimizers_and_options_name_what_is_supported():
    model = common.mlp()
    with pytest.raises(TypeError, match="torch.optim.Adam.*AdamW"):
        hvd_zoadam.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), amsgrad=True), transport=solo())
    with pytest.raises(ValueError, match="maximize"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), maximize=True), transport=solo())
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), transport=solo())
    with pytest.raises(TypeError, match="already an hvd_zoadam optimizer"):
        hvd_zoadam.DistributedOptimizer(opt)
    # what hvd.DistributedOptimizer returns: a dynamic subclass of the optimizer living in Horovod's module
    horovod_cls = type("Adam", (torch.optim.Adam,), {"__module__": "horovod.torch.optimizer"})
    horovod_wrapped = horovod_cls(common.mlp().parameters())
    with pytest.raises(TypeError, match="already wrapped by hvd.DistributedOptimizer"):
        hvd_zoadam.DistributedOptimizer(horovod_wrapped)
    with pytest.raises(ValueError, match="already optimized by another"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), transport=solo())


def test_a_parameter_on_neither_the_cpu_nor_cuda_is_refused_by_name():
    model = torch.nn.Linear(3, 2, device="meta")
    with pytest.raises(TypeError, match=r"parameter 'weight' is on meta: hvd_zoadam runs on CPU and CUDA tensors"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                        named_parameters=model.named_parameters(), transport=solo())


def test_named_parameters_checks_follow_horovod():
    model = common.mlp()
    with pytest.raises(ValueError, match="should be a sequence of tuples"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=[1, 2],
                                        transport=solo())
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="must be unique. Found duplicates: a"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                        named_parameters=[("a", q) for _, q in named], transport=solo())
    with pytest.raises(ValueError, match="were not named"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=named[:2],
                                        transport=solo())


def test_sparse_gradients_are_refused_or_densified_on_request():
    """Sparse gradients (Embedding(sparse=True)) are refused naming sparse_as_dense=True, or densified
    with it."""
    for dense in (False, True):
        emb = torch.nn.Embedding(20, 4, sparse=True)
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(emb.parameters()), sparse_as_dense=dense,
                                              transport=solo())
        emb(torch.tensor([1, 2])).sum().backward()
        if dense:
            opt.step()
            assert emb.weight.grad is not None
        else:
            with pytest.raises(ValueError, match="sparse_as_dense=True"):
                opt.step()


def test_fp16_compression_applies_to_variance_steps_and_predivide_is_honoured():
    """compression=hvd.Compression.fp16 (halves the VARIANCE steps' bytes) and gradient_predivide_factor
    are supported, with the documented meaning."""
    base = train_threads(2, 10)
    fp16 = train_threads(2, 10, compression=hvd.Compression.fp16)
    pre = train_threads(2, 10, gradient_predivide_factor=2.0)
    for r in range(2):
        for a, b, c in zip(base[r][0], fp16[r][0], pre[r][0]):
            torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-3)
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)
    # each overlapped VARIANCE step also sends one int32 "gradients changed?" flag (4 bytes at P = 2)
    sf, sb = fp16[0][1].comm_stats()["variance"], base[0][1].comm_stats()["variance"]
    flags = sb["rounds"] - sb["steps"]
    assert flags == sf["rounds"] - sf["steps"] > 0
    assert (sf["bytes_sent"] - 4 * flags) * 2 == pytest.approx(sb["bytes_sent"] - 4 * flags, abs=4)


def test_layout_mismatch_raises_on_every_rank_naming_both_values():
    """A per-rank config typo (var_freeze_step 3 vs 5) fails fast at the first step on every rank,
    naming both values, instead of hanging."""
    def body(rank, transport):
        model = common.mlp()
        opt = make(model, transport, var_freeze_step=3 if rank == 0 else 5)
        common.loss_fn(model, 1, rank).backward()
        with pytest.raises(ValueError, match=r"schedule.var_freeze_step: this rank \(\d\) has [35], rank \d has [35]"):
            opt.step()
        return True
    assert run_threads(2, body) == [True, True]


def test_ranks_on_different_transports_fail_naming_both():
    """Ranks whose rounds would go over different transports (e.g. "auto" resolved on hosts that
    differ) fail at the first step on every rank, naming both, instead of hanging."""
    def body(rank, transport):
        if rank == 1:
            transport.name = "gloo"  # this rank's rounds would go elsewhere
        model = common.mlp()
        opt = make(model, transport)
        common.loss_fn(model, 1, rank).backward()
        with pytest.raises(ValueError, match=r"transport: this rank \(\d\) has '?(thread|gloo)'?, rank \d has.*"
                                             r"pass the same explicit transport on every rank"):
            opt.step()
        return True
    assert run_threads(2, body) == [True, True]


def test_a_replaced_or_resized_parameter_is_refused_by_name():
    """A parameter replaced by, or resized to, another shape is refused by name: never use a buffer of the
    old length."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                          named_parameters=model.named_parameters(), transport=solo())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    model[0].weight = torch.nn.Parameter(torch.randn(5, 4))
    opt.param_groups[0]["params"][0] = model[0].weight
    with pytest.raises(ValueError, match="not the ones hvd_zoadam laid out"):
        opt.step()
    model2 = torch.nn.Linear(4, 4)
    opt2 = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model2.parameters()),
                                           named_parameters=model2.named_parameters(), transport=solo())
    model2.weight.data = torch.zeros(5, 4)
    with pytest.raises(ValueError, match=r"'weight' changed shape from \(4, 4\) to \(5, 4\)"):
        opt2.step()


def test_two_optimizers_over_one_model():
    """Two optimizers over disjoint parts of one model work; a part left un-stepped fails at the next backward
    naming the parameter."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt_a = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model[0].parameters()),
                                            named_parameters=model[0].named_parameters(prefix="a"), transport=solo())
    opt_b = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model[1].parameters()),
                                            named_parameters=model[1].named_parameters(prefix="b"), transport=solo())
    for _ in range(3):
        opt_a.zero_grad()
        opt_b.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt_a.step()
        opt_b.step()
    assert opt_a.schedule_state()["step"] == opt_b.schedule_state()["step"] == 3
    model(torch.ones(2, 4)).sum().backward()
    opt_b.step()  # only B steps: A's gradients were computed and never consumed
    with pytest.raises(AssertionError, match=r"parameter 'a\.(weight|bias)'"):
        model(torch.ones(2, 4)).sum().backward()


@pytest.mark.parametrize("ordered", [False, True], ids=["by-name", "by-order"])
def test_a_gradient_missing_on_one_rank_counts_as_zero(ordered):
    """algorithm.md §5: a parameter with no gradient on some rank takes part as zeros, in lockstep;
    its hook never fires there, so that rank's hooks start fewer exchanges than the other's.
    Collectives paired by name (Horovod) or by order (MPI, torch.distributed) pair up alike."""
    def grads(step, rank, xs):
        full = common.grads_at(step, rank, xs)
        if rank == 1:
            full[2] = torch.zeros_like(full[2])  # the second layer's weight gets no gradient on rank 1
        return full

    got = run_threads(2, lambda rank, transport: _train_without_a_gradient_on(1, rank, transport), ordered=ordered)
    params0 = [q.detach().clone() for q in common.mlp().parameters()]
    want, _ = simulate_zoadam(params0, grads, world_size=2, steps=14, schedule=Schedule(**KNOBS),
                              lr_fn=lambda t: common.LR)
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[r], want[r]))


def _train_without_a_gradient_on(last: int, rank, transport, **kw) -> list:
    """14 steps of the MLP where the second layer's weight takes no part in rank ``last``'s
    graph (no gradient, no hook there). Returns the parameters."""
    model = common.mlp()
    opt = make(model, transport, **kw)
    for t in range(1, 15):
        opt.zero_grad()
        if rank == last:
            x, y = common.batch(t, rank)
            out = torch.nn.functional.linear(model[1](model[0](x)), model[2].weight.detach(), model[2].bias)
            torch.nn.functional.mse_loss(out, y).backward()
            assert model[2].weight.grad is None
        else:
            common.loss_fn(model, t, rank).backward()
        opt.step()
    return [q.detach().clone() for q in model.parameters()]


def test_a_gradient_missing_on_one_rank_with_several_buckets_pairs_by_order():
    """Several buckets, 3 ranks whose collectives pair by order: the last rank's hooks stop at
    the bucket of its missing gradient, and synchronize() starts the rest before the flag;
    the parameters equal overlap=False's on every rank, bit for bit."""
    few = 40 * 4 / 2 ** 20  # 40 floats: one bucket per tensor or two
    on, off = (run_threads(3, lambda rank, transport: _train_without_a_gradient_on(2, rank, transport,
                                                                                   bucket_cap_mb=few, overlap=overlap),
                           ordered=True) for overlap in (True, False))
    for r in range(3):
        assert all(torch.equal(a, b) for a, b in zip(on[r], off[r]))
        assert all(torch.equal(a, b) for a, b in zip(on[r], on[0]))


def test_a_load_between_backward_and_step_drains_the_same_collectives_on_every_rank():
    """A load_state_dict between backward and step moves the schedule, so the hooks' window is
    stale and is drained; with a missing gradient on rank 1 its hooks started fewer exchanges,
    and the rest are started before the drain: collectives paired by order still pair."""
    def body(rank, transport):
        with common._INIT_LOCK:  # the same model on every rank
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        opt = make(model, transport, bucket_cap_mb=16 * 4 / 2 ** 20)
        saved = None
        for t in range(1, 8):
            opt.zero_grad()
            h = model[1](model[0](torch.full((3, 4), 0.1 * t)))
            w2 = model[2].weight.detach() if rank == 1 else model[2].weight  # no gradient on rank 1
            torch.nn.functional.linear(h, w2, model[2].bias).sum().backward()
            if t == 2:
                saved = copy.deepcopy(opt.state_dict())
            if t == 4:
                opt.load_state_dict(saved)  # the window the hooks opened for step 4 is now stale
            opt.step()
        return opt.schedule_state()["step"], len(opt._buckets)
    assert [r[0] for r in run_threads(2, body, timeout_s=20, ordered=True)] == [5, 5]


def test_step_log_writes_one_json_line_per_step(tmp_path):
    import json
    log = tmp_path / "steps-{rank}.jsonl"

    def body(rank, transport):
        model = common.mlp()
        opt = make(model, transport, step_log=str(log))
        for t in range(1, 11):
            opt.zero_grad()
            loss = common.loss_fn(model, t, rank)
            loss.backward()
            opt.log_loss(loss)
            opt.step()
        return opt.comm_stats()
    stats = run_threads(2, body)
    for r in range(2):
        lines = [json.loads(x) for x in (tmp_path / f"steps-{r}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(1, 11))
        assert [x["kind"] for x in lines[:6]] == ["variance", "variance", "compressed", "variance", "compressed",
                                                  "variance"]
        assert all(isinstance(x["loss"], float) and x["lr"] == common.LR and x["skipped"] is False for x in lines)
        assert lines[-1]["bytes_sent"] == stats[r]["bytes_sent_total"] and \
            lines[-1]["rounds"] == stats[r]["rounds_total"]
        assert all(a["bytes_sent"] <= b["bytes_sent"] for a, b in zip(lines, lines[1:]))


@pytest.mark.parametrize("variant", ["A", "B"])
def test_accumulation_window_that_does_not_divide_the_epoch(variant):
    """backward_passes_per_step=4, 10 micro-batches per epoch, 2 epochs. Gradients of the
    passes made are summed (torch and Horovod semantics), so a partial window of 2 passes steps
    with 2g; variant B drops the partial window: zero_grad() alone raises Horovod's error (with
    P > 1, between backward() and step()), set_backward_passes_per_step() forgets the passes
    and zero_grad() then drops them."""
    def grad_of(model):
        return [torch.full_like(q, 0.25) for q in model.parameters()]

    def body(rank, transport):
        model = common.mlp()
        opt = make(model, transport, backward_passes_per_step=4, var_freeze_step=3)
        ref = common.mlp()
        ref_opt = make(ref, ThreadGroup(1).transports()[0], var_freeze_step=3)
        seen = []
        for _ in range(2):
            for i in range(10):
                (sum((q * g).sum() for q, g in zip(model.parameters(), grad_of(model)))).backward()
                passes = i % 4 + 1
                if passes == 4 or (variant == "A" and i == 9):
                    seen.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]).clone())
                    opt.step()
                    opt.zero_grad()
                    for q, g in zip(ref.parameters(), grad_of(ref)):
                        q.grad = g * passes
                    ref_opt.step()
            if variant == "B":
                with pytest.raises(AssertionError, match=r"zero_grad\(\) was called after loss.backward\(\)"):
                    opt.zero_grad()
                opt.set_backward_passes_per_step(4)
                opt.zero_grad()
        return opt.schedule_state()["step"], seen, [q.detach().clone() for q in model.parameters()], \
            [q.detach().clone() for q in ref.parameters()]
    for steps, seen, got, want in run_threads(2, body):
        assert steps == (6 if variant == "A" else 4)
        if variant == "A":
            assert torch.allclose(seen[2], torch.full_like(seen[2], 0.5))  # the partial window: 2 passes x 0.25
        assert all(torch.allclose(s, torch.full_like(s, 1.0)) for k, s in enumerate(seen) if k % 3 != 2
                   or variant == "B")
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
