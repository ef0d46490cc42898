"""Agreed skips on non-finite gradients, GradScaler, half-precision models (algorithm.md §5)."""
from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import hvd_zoadam
from conftest import run_threads
from hvd_zoadam import StepKind

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402

KNOBS = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4,
             local_step_policy="steps")


def test_a_nan_on_one_rank_skips_communicating_steps_everywhere():
    """Steps 2 (VARIANCE), 3 (COMPRESSED), 7 (SYNC) and 11 (LOCAL) get a NaN on rank 1 only."""
    poison = {2: StepKind.VARIANCE, 3: StepKind.COMPRESSED, 7: StepKind.SYNC, 11: StepKind.LOCAL}

    def body(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                              transport=transport, **KNOBS)
        log = []
        for t in range(1, 13):
            opt.zero_grad()
            loss = common.loss_fn(model, t, rank)
            kind = opt._next_kind()[1]
            if t in poison:
                assert kind is poison[t]
                if rank == 1:  # through the graph (the hooks may start the exchange during backward)
                    loss = loss + model[0].weight[0, 0] * float("nan")
            loss.backward()
            if t in poison and rank == 1:
                assert torch.isnan(model[0].weight.grad[0, 0]) and torch.isfinite(model[0].weight.grad[0, 1])
            before = [q.detach().clone() for q in model.parameters()]
            opt.step()
            moved = any(not torch.equal(a, q) for a, q in zip(before, model.parameters()))
            errors_finite = all(torch.isfinite(b.exchange.worker_error).all() and
                                torch.isfinite(b.exchange.server_error).all() for b in opt._buckets)
            log.append((t, kind, moved, errors_finite, [q.detach().clone() for q in model.parameters()],
                        opt.schedule_state()["step"]))
        return log, opt.comm_stats()
    res = run_threads(2, body)
    for (log0, stats0), (log1, stats1) in [(res[0], res[1])]:
        # VARIANCE and COMPRESSED steps exchange the gradient: skipped on both ranks. A SYNC step
        # exchanges the (finite) update: rank 1 skips its own local update, the sync goes on.
        assert stats0["skipped_steps"] == stats1["skipped_steps"] == 2
        for e0, e1 in zip(log0, log1):
            t, kind = e0[0], e0[1]
            assert e0[5] == e1[5] == t  # counters in lockstep
            assert e0[3] and e1[3]  # error buffers never hold NaN/Inf
            if t in (2, 3):
                assert not e0[2] and not e1[2]  # skipped on both ranks
            if t == 7:
                assert e0[2] and e1[2]
            if t == 11:
                assert e0[2] and not e1[2]  # a LOCAL step: only the rank with the NaN skips
            if kind is not StepKind.LOCAL and t != 11:
                assert all(torch.equal(a, b) for a, b in zip(e0[4], e1[4])), t
            assert all(torch.isfinite(q).all() for q in e0[4] + e1[4])


def _amp_run(rank, transport, scale=None, overflow_at=None, steps=10, clip=False):
    model = common.mlp()
    # Clipping the local gradients after backward() needs overlap=False without a GradScaler
    # (with one, nothing starts before scaler.step()).
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                          transport=transport, overlap=not (clip and not scale), **KNOBS)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=3) if scale else None
    scales = []
    for t in range(1, steps + 1):
        opt.zero_grad()
        loss = common.loss_fn(model, t, rank)
        if scaler:
            scaler.scale(loss).backward()
            if t == overflow_at and rank == 1:
                model[2].bias.grad[0] = float("inf")
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
    return [q.detach().clone() for q in model.parameters()], scales, opt


@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_matches_the_unscaled_run(clip):
    """Loss x 1024 through GradScaler gives the unscaled run's parameters (1e-5 relative)."""
    plain = run_threads(2, lambda r, t: _amp_run(r, t, clip=clip))
    scaled = run_threads(2, lambda r, t: _amp_run(r, t, scale=1024.0, clip=clip))
    for r in range(2):
        assert len(set(scaled[r][1])) > 1  # the scale really changed during the run
        for a, b in zip(scaled[r][0], plain[r][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grad_scaler_overflow_on_one_rank_keeps_ranks_in_lockstep():
    res = run_threads(2, lambda r, t: _amp_run(r, t, scale=2.0 ** 10, overflow_at=3, steps=12))
    (p0, s0, o0), (p1, s1, o1) = res
    assert s1[2] == s0[2] / 4  # rank 1 backed off (0.5) while rank 0 grew (x2 after 3 clean steps)
    assert o0.comm_stats()["skipped_steps"] == o1.comm_stats()["skipped_steps"] == 1
    assert o0.schedule_state() == o1.schedule_state()
    assert o0._next_kind()[1] is StepKind.LOCAL  # step 13
    assert all(torch.isfinite(q).all() for q in p0 + p1)


def test_synchronize_before_scaler_step_is_refused_with_the_fix():
    def body(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), transport=transport, **KNOBS)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(common.loss_fn(model, 1, rank)).backward()
        opt.synchronize()
        with pytest.raises(RuntimeError, match="scaler.unscale_"):
            with opt.skip_synchronize():
                scaler.step(opt)
        return True
    assert run_threads(2, body) == [True, True]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_train_with_fp32_internals(dtype):
    """bf16 trains with no loss scaler demanded, fp16/bf16 on CPU hit no missing Half kernels; the
    internals are fp32."""
    def run(rank, transport, dt):
        with common._INIT_LOCK:
            torch.manual_seed(3)
            model = torch.nn.Linear(32, 8).to(dt)
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), transport=transport,
                                              var_freeze_step=2, var_update_scaler=1, local_step_policy="steps",
                                              local_step_scaler=2, local_step_clipper=2)
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(64, 32, generator=gen), torch.randn(64, 8, generator=gen)
        for _ in range(10):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x.to(dt)).float(), y)
            loss.backward()
            opt.step()
        final = torch.nn.functional.mse_loss(model(x.to(dt)).float(), y).item()
        return final, [q.detach().clone() for q in model.parameters()], opt
    half = run_threads(2, lambda r, t: run(r, t, dtype))
    full = run_threads(2, lambda r, t: run(r, t, torch.float32))
    for r in range(2):
        loss_h, params_h, opt_h = half[r]
        assert all(q.dtype == dtype for q in params_h)
        assert all(b.exchange.worker_error.dtype == torch.float32 and b.exp_avg.dtype == torch.float32
                   for b in opt_h._buckets)
        assert abs(loss_h - full[r][0]) <= 0.05 * full[r][0]
        assert all(torch.equal(a, b) for a, b in zip(params_h, half[0][1]))  # step 10 is a SYNC step


@pytest.mark.parametrize("scaler", [10 ** 6, 1], ids=["variance", "variance+compressed"])
def test_gradients_changed_after_backward_are_exchanged_as_they_are_at_step(scaler):
    """With overlap (the default) the hooks start a VARIANCE step's allreduce, and a COMPRESSED
    step's worker side and round 1, during backward(). A gradient clipped afterwards without
    synchronize() on ONE rank is not silently left out: the ranks agree, drop the early result,
    exchange the clipped gradients (bitwise as with overlap=False) and warn once, naming the
    fix; from then on the hooks start nothing, so no later step is exchanged twice. Horovod's
    pattern (synchronize, clip, skip_synchronize) needs no second exchange."""
    kinds = [hvd_zoadam.Schedule(var_freeze_step=100, var_update_scaler=scaler, local_step_scaler=32768,
                                 local_step_clipper=16).kind(t) for t in range(1, 6)]
    n_var, n_comp = kinds.count(StepKind.VARIANCE), kinds.count(StepKind.COMPRESSED)
    assert kinds[0] is StepKind.VARIANCE and n_comp == (2 if scaler == 1 else 0)

    def body(rank, transport, overlap, pattern):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                              transport=transport, overlap=overlap, var_freeze_step=100,
                                              var_update_scaler=scaler)
        during_backward = []  # COMPRESSED rounds started by the hooks, per step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(1, 6):
                opt.zero_grad()
                before = opt.transport.counter.rounds["compressed"]  # comm_stats() is updated by step()
                common.loss_fn(model, t, rank).backward()
                during_backward.append(opt.transport.counter.rounds["compressed"] - before)
                if pattern == "horovod":
                    opt.synchronize()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
                    with opt.skip_synchronize():
                        opt.step()
                else:
                    if rank == 1:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
                    opt.step()
        stats = opt.comm_stats()
        return ([q.detach().clone() for q in model.parameters()], [str(w.message) for w in caught],
                stats["variance"], opt._warned_changed, stats["compressed"], len(opt._buckets), during_backward)
    late = run_threads(2, lambda r, tr: body(r, tr, True, "late"))
    plain = run_threads(2, lambda r, tr: body(r, tr, False, "late"))
    # (warnings.catch_warnings is process-wide: the two thread-ranks' records mix)
    assert any("changed after backward()" in w and "opt.synchronize()" in w and "overlap=False" in w
               for r in range(2) for w in late[r][1])
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(late[r][0], plain[r][0]))
        assert late[r][3] is True  # both ranks redid the exchange and warned
        # Every exchange step after the first sends its 4-byte flag, overlap on or off; step 2, the
        # first armed one, adds its early round(s) to the redo; from then on no exchange starts
        # during backward(), every step is as with overlap=False
        nb = late[r][5]
        assert late[r][2]["rounds"] == 2 * n_var - 1 + (1 if kinds[1] is StepKind.VARIANCE else 0)
        assert plain[r][2]["rounds"] == 2 * n_var - 1
        assert late[r][4]["rounds"] == n_comp * (2 * nb + 1) + (nb if kinds[1] is StepKind.COMPRESSED else 0)
        assert plain[r][4]["rounds"] == n_comp * (2 * nb + 1)
    hvd_pattern = run_threads(2, lambda r, tr: body(r, tr, True, "horovod"))
    for r in range(2):
        assert not any("changed after backward()" in w for w in hvd_pattern[r][1]) and not hvd_pattern[r][3]
        assert hvd_pattern[r][2]["rounds"] == 1 + (n_var - 1) * 2  # the early allreduce and the flag
        nb = hvd_pattern[r][5]
        assert hvd_pattern[r][4]["rounds"] == n_comp * (1 + 2 * nb)  # the flag and two rounds per bucket
        # round 1 of every bucket of a COMPRESSED step started inside backward(); nothing without overlap
        assert hvd_pattern[r][6] == [nb if k is StepKind.COMPRESSED else 0 for k in kinds]
        assert plain[r][6] == [0] * 5



@pytest.mark.parametrize("pattern", ["plain", "clip-on-one-rank", "lr-changed", "inf-on-one-rank"])
def test_a_sync_steps_exchange_starts_in_backward_and_a_late_change_is_exchanged_as_it_is(pattern):
    """Past the freeze the hooks take a SYNC step's local update on copies of x and m and start
    each bucket's round 1 during backward(), except at the first step after the freeze (which
    sets the anchor in step()). The parameters equal overlap=False bit for bit; a gradient
    clipped after backward() on one rank, or a learning rate changed between backward() and
    step(), is exchanged as it is at step() on every rank. A parameter made infinite on one
    rank skips every later SYNC exchange on every rank, and then the other rank keeps its
    local update, which ``step()`` takes after the skip when the hooks started the exchange."""
    knobs = dict(var_freeze_step=2, var_update_scaler=1, local_step_scaler=32768, local_step_clipper=1)
    kinds = [hvd_zoadam.Schedule(**knobs).kind(t, lr=common.LR) for t in range(1, 9)]
    assert kinds[2:] == [StepKind.SYNC] * 6

    def body(rank, transport, overlap):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=common.LR),
                                              transport=transport, overlap=overlap,
                                              bucket_cap_mb=40 * 4 / 2 ** 20, **knobs)
        during_backward = []  # SYNC rounds started by the hooks, per step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for t in range(1, 9):
                opt.zero_grad()
                before = opt.transport.counter.rounds["sync"]
                if pattern == "inf-on-one-rank" and t == 5 and rank == 1:
                    with torch.no_grad():
                        next(model.parameters()).view(-1)[0] = float("inf")
                common.loss_fn(model, t, rank).backward()
                during_backward.append(opt.transport.counter.rounds["sync"] - before)
                if pattern == "clip-on-one-rank" and t == 5 and rank == 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
                if pattern == "lr-changed" and t == 6:
                    for group in opt.param_groups:
                        group["lr"] = group["lr"] * 0.5
                opt.step()
        return ([q.detach().clone() for q in model.parameters()], during_backward, len(opt._buckets),
                opt._warned_changed, opt.comm_stats()["skipped_steps"])

    early = run_threads(2, lambda r, tr: body(r, tr, True))
    plain = run_threads(2, lambda r, tr: body(r, tr, False))
    for r in range(2):
        nan_here = r == 1 and pattern == "inf-on-one-rank"
        assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) if nan_here else torch.equal(a, b)
                   for a, b in zip(early[r][0], plain[r][0]))
        nb = early[r][2]
        assert nb >= 3
        # step 3 is the first after the freeze; a change (step 5 or 6) ends the early starts
        changed = {"clip-on-one-rank": 5, "lr-changed": 6}.get(pattern, 8)
        assert early[r][1] == [0, 0, 0] + [nb] * (changed - 3) + [0] * (8 - changed)
        assert plain[r][1] == [0] * 8
        assert early[r][3] is (pattern in ("clip-on-one-rank", "lr-changed"))  # both ranks redid the exchange
        assert early[r][4] == plain[r][4] == (4 if pattern == "inf-on-one-rank" else 0)  # steps 5-8 skipped
    if pattern == "inf-on-one-rank":  # rank 0 kept its local update at steps 5-8
        assert all(torch.isfinite(q).all() for q in early[0][0])


def _fault_opt(transport):
    model = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), transport=transport,
                                          named_parameters=model.named_parameters(), var_freeze_step=3,
                                          var_update_scaler=1, local_step_scaler=1000, local_step_clipper=1)
    return model, opt


def test_ranks_at_different_steps_fail_on_every_rank_naming_both_steps():
    """Rank 0 resumes from its state after step 4, rank 1 from its state after step 5 (each loaded
    "its latest" file): at the next exchange both raise StepMismatchError at once, not at a timeout."""
    from hvd_zoadam.comm.protocol import StepMismatchError

    def body(rank, transport):
        model, opt = _fault_opt(transport)
        saved = {}
        for t in range(1, 6):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
            saved[t] = opt.state_dict()
        model, opt = _fault_opt(transport)
        opt.load_state_dict(saved[4 + rank])
        opt.zero_grad()
        common.loss_fn(model, 6, rank).backward()
        with pytest.raises(StepMismatchError) as info:
            opt.step()
        return str(info.value)

    start = time.monotonic()
    messages = run_threads(2, body, timeout_s=30)
    assert time.monotonic() - start < 20
    for m in messages:
        assert "different optimizer steps: steps 5 and 6" in m and "call step()" in m
        assert "(rank 0 at step 5, rank 1 at step 6)" in m  # a tie: both named


def test_a_rank_that_skips_an_iteration_leaves_the_others_a_named_timeout():
    """Rank 1 skips one whole iteration: the counters still agree step by step, so the ranks pair
    up until rank 0's last step, a SYNC step whose first collective (the "gradients changed after
    backward?" flag of the exchange the hooks started) ends within the timeout, naming itself."""
    from hvd_zoadam.comm.transport import CollectiveTimeoutError

    def body(rank, transport):
        model, opt = _fault_opt(transport)
        for t in range(1, 9):
            if t == 5 and rank == 1:
                continue
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
        return opt.schedule_state()["step"]

    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"the allgather 'zoadam\.[0-9a-f]+\.step_flags\.8' did "
                                                     r"not complete within 5 s"):
        run_threads(2, body, timeout_s=5)
    assert time.monotonic() - start < 15


@pytest.mark.parametrize("skip_at, caught_at", [(3, 3), (4, 5), (11, 14)])
def test_a_rank_that_skips_an_iteration_is_named_at_the_next_exchange_with_set_iteration(skip_at, caught_at):
    """With set_iteration(), rank 1 of 3 skips iteration ``skip_at``; the schedule (freeze at 6)
    runs VARIANCE at 1, 2, 4, 6, COMPRESSED at 3, 5, SYNC at 7, 8, 10, 14 and LOCAL at 9, 11-13.
    The skip is caught at the first COMPRESSED or SYNC step from ``skip_at`` on (a VARIANCE or a
    LOCAL step announces nothing), on every rank at once, naming rank 1, both iterations and
    the optimizer step; that step is not counted."""
    from hvd_zoadam.comm.protocol import StepMismatchError

    def body(rank, transport):
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), transport=transport,
                                              named_parameters=model.named_parameters(), var_freeze_step=6,
                                              var_update_scaler=2, local_step_scaler=2, local_step_clipper=4,
                                              local_step_policy="steps")
        with pytest.raises(StepMismatchError) as info:
            for it in range(1, 20):
                if it == skip_at and rank == 1:
                    continue
                opt.set_iteration(it)
                opt.zero_grad()
                common.loss_fn(model, it, rank).backward()
                opt.step()
        return str(info.value), opt.schedule_state()["step"]

    start = time.monotonic()
    results = run_threads(3, body, timeout_s=30)
    assert time.monotonic() - start < 20
    for message, step in results:
        assert step == caught_at - 1
        assert (f"a rank skipped or repeated a whole iteration: rank 1 at iteration {caught_at + 1}, where the "
                f"other ranks are at iteration {caught_at}, all at optimizer step {caught_at}") in message


def test_set_iteration_on_some_ranks_only_is_named_and_bad_values_are_refused():
    from hvd_zoadam.comm.protocol import StepMismatchError

    def body(rank, transport):
        model, opt = _fault_opt(transport)
        with pytest.raises(StepMismatchError) as info:
            for it in range(1, 6):
                if rank == 0:
                    opt.set_iteration(it + 100)
                opt.zero_grad()
                common.loss_fn(model, it, rank).backward()
                opt.step()
        with pytest.raises(TypeError, match="takes an int, got float"):
            opt.set_iteration(1.0)
        with pytest.raises(ValueError, match=r"in \[0, 2\*\*31\), got 2147483648"):
            opt.set_iteration(2 ** 31)
        return str(info.value)

    for message in run_threads(2, body, timeout_s=30):
        assert "set_iteration() was called on rank(s) [0] only, at optimizer step 3" in message


def test_a_mismatch_names_the_odd_ranks_both_sides_of_a_tie_and_a_late_set_iteration():
    from hvd_zoadam.shell.agreement import _mismatch_message
    assert "rank 2 at iteration 6, where the other ranks are at iteration 5, all at optimizer step 5" in \
        _mismatch_message("B", [(5, 5), (5, 5), (5, 6)])
    assert "rank 0 at iteration 6, rank 1 at iteration 5, all at optimizer step 5" in \
        _mismatch_message("B", [(5, 6), (5, 5)])
    assert _mismatch_message("B", [(5, None), (6, None), (5, None)]) == \
        "B (rank 1 at step 6, the other ranks at step 5)"
    # every rank began the step announcing the same: set_iteration() came between the hooks and step()
    assert "call set_iteration() before backward()" in _mismatch_message("B", [(5, 3), (5, 3)])


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_parameter_cast_or_resized_between_steps_is_refused_by_name_on_every_rank(change):
    """The model is cast to float64 (its gradients follow) or a weight resized, on every rank,
    after three steps: step 4 raises ValueError naming the parameter on both ranks, before any
    collective (so no rank hangs)."""
    def body(rank, transport):
        model, opt = _fault_opt(transport)
        for t in range(1, 4):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
        if change == "dtype":
            model.double()
        else:
            model[0].weight.data = torch.zeros(17, 6)
        opt.zero_grad()
        if change == "dtype":
            x, y = common.batch(4, rank)
            torch.nn.functional.mse_loss(model(x.double()), y.double()).backward()
        with pytest.raises(ValueError) as info:
            opt.step()
        return str(info.value)

    for m in run_threads(2, body, timeout_s=30):
        if change == "dtype":
            assert "parameter '0.weight' changed from torch.float32 on cpu to torch.float64 on cpu" in m
        else:
            assert "'0.weight' changed shape from (16, 6) to (17, 6)" in m
