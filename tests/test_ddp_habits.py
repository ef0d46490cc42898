"""Habits a DDP or Horovod script brings along, kept: a step with no gradient on every rank changes
nothing (as ``torch.optim.Adam.step()`` without gradients), ``hvd.broadcast_optimizer_state``
leaves the gradients as it found them, and DDP's accumulation loop runs with the optimizer's
``no_sync()`` in the model's.

A real job (``horovodrun --gloo -np 2``) runs tests/mp/worker_ddp_habits.py; the thread-rank and
one-process tests below check the same points in detail, each against the same run without the
habit, bit for bit.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import hvd_zoadam
from conftest import load_ranks, run_job, run_threads
from hvd_zoadam.comm.thread import ThreadGroup

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402

STEPS = 14
KNOBS = dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=2, local_step_clipper=2,
             local_step_policy="steps")


def snapshot(net, opt) -> list:
    """Everything a step may change: parameters, per-parameter state, the counters and each
    group's window, cloned."""
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in net.parameters()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return [[p.detach().clone() for p in net.parameters()], state, repr(groups)]


def same(a, b) -> bool:
    params_a, state_a, groups_a = a
    params_b, state_b, groups_b = b
    return (all(torch.equal(x, y) for x, y in zip(params_a, params_b)) and groups_a == groups_b
            and all(s.keys() == t.keys() and all(torch.equal(s[k], t[k]) if torch.is_tensor(s[k]) else s[k] == t[k]
                                                 for k in s) for s, t in zip(state_a, state_b)))


def train(rank, transport, noop_at=(), **knobs):
    """STEPS steps of the MLP; before each step in ``noop_at`` every rank calls step() once more
    with no gradient (zero_grad(), no backward()). Returns (final parameters, kinds of the
    steps taken, [whether each no-gradient step left everything as it was])."""
    net = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=common.LR),
                                          named_parameters=net.named_parameters(), transport=transport,
                                          **{**KNOBS, **knobs})
    kinds, unchanged = [], []
    for t in range(1, STEPS + 1):
        if t in noop_at:
            before = snapshot(net, opt)
            opt.zero_grad()
            assert opt.step(lambda: 7.0) == 7.0  # the closure's loss, as torch's step returns it
            unchanged.append(same(before, snapshot(net, opt)))
        opt.zero_grad()
        common.loss_fn(net, t, rank).backward()
        opt.step()
        kinds.append(opt.schedule.kind(t).value)
    return [p.detach().clone() for p in net.parameters()], kinds, unchanged


def assert_same_run(got, want):
    (params, kinds, unchanged), (ref_params, ref_kinds, _) = got, want
    assert all(unchanged), unchanged
    assert kinds == ref_kinds
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


# the first step (its settings check compares the ranks), then VARIANCE (2), COMPRESSED (3) and
# SYNC (6; 5 is the first after the freeze) steps, whose exchange starts in backward() with
# overlap on and in step() with overlap off; and LOCAL steps (7, 9), which send nothing
@pytest.mark.parametrize("noop_at, overlap", [((1,), True), ((2,), True), ((3,), True), ((6,), True),
                                              ((1, 3, 6), True), ((7,), True), ((7, 9), False),
                                              ((2,), False), ((3,), False), ((1, 6, 7), False)])
def test_a_step_without_gradient_on_every_rank_changes_nothing(noop_at, overlap):
    ref = run_threads(2, lambda rank, transport: train(rank, transport, overlap=overlap))
    assert ref[0][1][:9] == ["variance", "variance", "compressed", "variance", "sync", "sync", "local", "sync",
                             "local"], ref[0][1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_threads(2, lambda rank, transport: train(rank, transport, noop_at, overlap=overlap))
    for rank in range(2):
        assert_same_run(got[rank], ref[rank])
    said = [str(w.message) for w in caught if "with no gradient at a LOCAL step" in str(w.message)]
    assert len(said) == (2 if 7 in noop_at else 0), said  # once a rank, not once a step


@pytest.mark.parametrize("noop_at", [(1,), (3,), (7,), (1, 6, 7, 9)])
def test_one_rank_a_step_without_gradient_changes_nothing_at_any_step(noop_at):
    """At P = 1 there is nothing to agree on: LOCAL steps (7, 9) too."""
    ref = run_threads(1, lambda rank, transport: train(rank, transport))
    assert ref[0][1][6] == ref[0][1][8] == "local"
    got = run_threads(1, lambda rank, transport: train(rank, transport, noop_at))
    assert_same_run(got[0], ref[0])


@pytest.mark.parametrize("overlap, at", [(True, 2), (False, 2), (False, 3)])
def test_one_rank_without_gradient_still_raises_on_every_rank(overlap, at):
    """Only where no rank has a gradient is the step a no-op: one rank without raises on every
    rank, naming it, at a VARIANCE (2) or COMPRESSED (3) step, whether the exchange starts in
    backward() or in step()."""
    def body(rank, transport):
        net = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=common.LR),
                                              named_parameters=net.named_parameters(), transport=transport,
                                              overlap=overlap, **KNOBS)
        for t in range(1, at + 1):
            opt.zero_grad()
            if t < at or rank == 0:
                common.loss_fn(net, t, rank).backward()
            try:
                opt.step()
            except RuntimeError as exc:
                return str(exc)
        return "stepped"
    assert all("rank 1 called step() with no gradient at all" in text for text in run_threads(2, body))


# -- accumulation as DDP writes it ----------------------------------------------------------------

def passes(t: int, rank: int) -> int:
    """Backward passes of step ``t`` on ``rank``: varying from step to step and from rank to rank."""
    return 1 + (t * (rank + 1) + rank) % 4


def accumulate(rank, transport, no_sync: bool):
    """STEPS steps, each of ``passes(t, rank)`` micro-batches: with ``no_sync`` all but the last
    backward() inside ``opt.no_sync()`` (DDP's loop) and Horovod's default count of 1; without, no
    context and a count no step reaches (the exchange then runs in step()). Returns (parameters,
    comm_stats)."""
    net = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=common.LR),
                                          named_parameters=net.named_parameters(), transport=transport,
                                          backward_passes_per_step=1 if no_sync else 100, **KNOBS)
    for t in range(1, STEPS + 1):
        if no_sync and t == 2:  # DDP allows zero_grad() after backward() inside no_sync(): nothing started
            with opt.no_sync():
                common.loss_fn(net, 99, rank).backward()
            opt.zero_grad()
        n = passes(t, rank)
        for i in range(n):
            loss = common.loss_fn(net, 100 * t + i, rank)
            if no_sync and i < n - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()], opt.comm_stats()


def test_no_sync_accumulates_any_number_of_passes_as_ddp_does():
    """DDP's accumulation loop with the optimizer's no_sync() in the model's: the run is the run
    that accumulates the same passes with no exchange until step(), bit for bit, every rank."""
    assert {passes(t, 0) for t in range(1, STEPS + 1)} == {1, 2, 3, 4}
    assert any(passes(t, 0) != passes(t, 1) for t in range(1, STEPS + 1))
    got = run_threads(2, lambda rank, transport: accumulate(rank, transport, no_sync=True))
    want = run_threads(2, lambda rank, transport: accumulate(rank, transport, no_sync=False))
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[rank][0], want[rank][0]))
        assert got[rank][1]["bytes_sent_total"] == want[rank][1]["bytes_sent_total"]
    assert all(torch.equal(a, b) for a, b in zip(got[0][0], got[1][0]))


def test_more_passes_than_backward_passes_per_step_names_no_sync():
    net = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(net.parameters()), named_parameters=net.named_parameters(),
                                          transport=ThreadGroup(1).transports()[0],
                                          backward_passes_per_step=2)
    for i in range(2):
        common.loss_fn(net, i, 0).backward()
    with opt.no_sync():  # not counted
        common.loss_fn(net, 2, 0).backward()
    with pytest.raises(AssertionError, match=r"Increase backward_passes_per_step(.|\n)*with opt.no_sync\(\)"):
        common.loss_fn(net, 3, 0).backward()


# -- clipping as DDP writes it ---------------------------------------------------------------------

def clipped(rank, transport, scaler: str, overlap: bool):
    """STEPS steps that clip after backward() as a DDP script does (no synchronize()), through a
    GradScaler (``scaler``: "enabled", "disabled") or none ("absent"). Returns (parameters, the
    bytes sent after each step)."""
    net = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=common.LR),
                                          named_parameters=net.named_parameters(), transport=transport,
                                          overlap=overlap, **KNOBS)
    amp = None if scaler == "absent" else torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                                               enabled=scaler == "enabled")
    sent = []
    for t in range(1, STEPS + 1):
        opt.zero_grad()
        loss = common.loss_fn(net, t, rank)
        if amp is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            opt.step()
        else:
            amp.scale(loss).backward()
            amp.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            amp.step(opt)
            amp.update()
        sent.append(opt.comm_stats()["bytes_sent_total"])
    return [p.detach().clone() for p in net.parameters()], sent


def warned(fn) -> tuple:
    """``(fn()'s result, the texts of the warnings its thread-ranks gave)``: recorded around the
    whole run, since warnings.catch_warnings is process-wide."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught]


@pytest.mark.parametrize("scaler", ["absent", "disabled", "enabled"])
def test_clipping_after_backward_exchanges_at_most_one_step_twice(scaler):
    """Clipping between backward() and step(), as DDP scripts do: the parameters are those of
    overlap=False (the gradient exchanged as the script leaves it), at most one step sends its
    exchange twice (the first whose exchange started during backward(); none under an enabled
    GradScaler, which starts nothing there), and hvd_zoadam warns at most once per rank."""
    got, texts = warned(lambda: run_threads(2, lambda rank, transport: clipped(rank, transport, scaler, True)))
    want, ref_texts = warned(lambda: run_threads(2, lambda rank, transport: clipped(rank, transport, scaler, False)))
    for rank in range(2):
        params, sent = got[rank]
        ref_params, ref_sent = want[rank]
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
        per_step = [b - a for a, b in zip([0, *ref_sent], ref_sent)]
        extra = sent[-1] - ref_sent[-1]
        assert 0 <= extra <= max(per_step) + 64, (extra, per_step)  # one step again, and its 4-byte flags
        if scaler == "enabled":
            assert extra == 0
    assert not ref_texts, ref_texts
    if scaler == "enabled":
        assert not texts, texts
    else:  # once per rank, not once per step
        assert len(texts) == 2 and all("from now on this optimizer starts no exchange" in w for w in texts), texts


# -- torch.compile ---------------------------------------------------------------------------------

def compiled(rank, transport, what: str):
    """9 steps with ``what`` compiled (``torch.compile``, backend aot_eager: Dynamo and AOTAutograd,
    which is where hooks and the optimizer meet the compiler, without a C++ toolchain's time):
    "nothing", "model", or "step" (the model and ``opt.step``). Returns (parameters, bytes sent)."""
    net = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=common.LR),
                                          named_parameters=net.named_parameters(), transport=transport, **KNOBS)
    forward = net if what == "nothing" else torch.compile(net, backend="aot_eager")
    step = torch.compile(opt.step, backend="aot_eager") if what == "step" else opt.step
    for t in range(1, 10):
        opt.zero_grad()
        x, y = common.batch(t, rank)
        torch.nn.functional.mse_loss(forward(x), y).backward()
        step()
    return [p.detach().clone() for p in net.parameters()], opt.comm_stats()["bytes_sent_total"]


@pytest.mark.parametrize("what", ["model", "step"])
def test_torch_compile_of_the_model_or_the_step_trains_as_eager(what):
    """A compiled model (its backward hooks still start the exchanges) and a compiled opt.step
    (a graph break: the step runs as written) train bit for bit as without torch.compile."""
    torch._dynamo.reset()
    got = run_threads(2, lambda rank, transport: compiled(rank, transport, what), timeout_s=300)
    want = run_threads(2, lambda rank, transport: compiled(rank, transport, "nothing"))
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[rank][0], want[rank][0]))
        assert got[rank][1] == want[rank][1]


# -- a real job ------------------------------------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("launcher", ["gloo", "torchrun"], ids=["horovodrun", "torchrun"])
def test_job_horovods_habits_broadcast_then_a_step_without_gradient(tmp_path, launcher):
    """Under horovodrun (and torchrun, with hvd_zoadam.distributed's broadcasts):
    broadcast_optimizer_state leaves every p.grad None (hvd_zoadam's state exists from
    construction, so Horovod's function runs no dummy zero-gradient step, as for an optimizer
    that has stepped); a step() right after it, and more at later steps (a LOCAL step among
    them), with no gradient on any rank, change nothing, with overlap on and off: the run is
    the run without them, bit for bit."""
    env = {"HVD_ZOADAM_TIMEOUT_S": "30"}
    if launcher == "torchrun":
        env["HVD_ZOADAM_TEST_FRONT_END"] = "torch.distributed"
    run_job(launcher, 2, ["tests/mp/worker_ddp_habits.py", str(tmp_path)], timeout_s=420, env=env)
    ranks = load_ranks(tmp_path, 2)
    for r in ranks:
        assert not r["errors"], r["errors"]
        assert r["grads_after_broadcast"] == [None] * 4, r["grads_after_broadcast"]
        assert r["unchanged"] == [True] * 10, r["unchanged"]
        assert r["digests"] == r["digests_overlap_off"] == r["reference_digests"]
        assert {"compressed", "local", "sync", "variance"} <= set(r["kinds"])
    assert ranks[0]["digests"] == ranks[1]["digests"]
