"""hvd_zoadam against hvd.DistributedOptimizer's contract: Horovod's own optimizer test patterns with
the optimizer class swapped, resuming from an Adam checkpoint, collective names that do not depend
on how many optimizers a rank built, sparse gradients, zero_grad() between backward() and step(),
set_backward_passes_per_step, argument checks before Horovod is asked anything.

Real jobs (``horovodrun --gloo -np 2`` and ``mpirun -np 2``) run tests/mp/worker_contract.py once per
launcher; the thread-rank and one-process tests below check the same points in detail.
"""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hvd_zoadam
from conftest import load_ranks, run_job, run_threads
from hvd_zoadam.comm.protocol import CollectiveNames
from hvd_zoadam.comm.thread import ThreadGroup

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402

HOROVOD_ZERO_GRAD = "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or " \
                    "optimizer.synchronize(). This is prohibited as it can cause a race condition."


def solo():
    return ThreadGroup(1).transports()[0]


def zoadam(model, transport, cls=torch.optim.Adam, lr=common.LR, **kw):
    return hvd_zoadam.DistributedOptimizer(cls(model.parameters(), lr=lr), named_parameters=model.named_parameters(),
                                           transport=transport, **kw)


def torch_adam(cls, steps, **kw):
    """A model trained ``steps`` steps with plain torch ``cls`` on rank 0's batches; returns (model, opt)."""
    model = common.mlp()
    opt = cls(model.parameters(), lr=common.LR, **kw)
    for t in range(1, steps + 1):
        opt.zero_grad()
        common.loss_fn(model, t, 0).backward()
        opt.step()
    return model, opt


# -- real jobs -------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["gloo", "mpi"])
def job(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"contract-{request.param}")
    # a collective that never pairs must fail within seconds, not after the default 600 s
    run_job(request.param, 2, ["tests/mp/worker_contract.py", str(out)], timeout_s=420,
            env={"HVD_ZOADAM_TIMEOUT_S": "30"})
    ranks = load_ranks(out, 2)
    return request.param, ranks


def no_error(ranks, scenario):
    for r in ranks:
        assert scenario not in r["errors"], f"rank {r['rank']}:\n{r['errors'][scenario]}"


@pytest.mark.timeout(900)
def test_job_arguments_are_checked_before_horovod_is(job):
    _, ranks = job
    for r in ranks:
        assert "must be unique. Found duplicates: a" in r["before_init"], r["before_init"]


@pytest.mark.timeout(900)
def test_job_the_optimizer_is_an_instance_of_the_wrapped_class(job):
    _, ranks = job
    no_error(ranks, "is_an_adam")
    for r in ranks:
        assert r["isinstance"] == {"adam": True, "optimizer": True, "zoadam": True, "adamw": True,
                                   "adam_not_adamw": True, "lr_after_scheduler": 5e-3}


@pytest.mark.timeout(900)
def test_job_horovods_broadcast_state_no_grad_pattern(job):
    """Horovod's test_broadcast_state_no_grad with the class swapped: no dummy step (the state exists
    from construction), so no gradient appears for either parameter, and training goes on alike on
    both ranks."""
    _, ranks = job
    no_error(ranks, "broadcast_state_no_grad")
    assert all(r["broadcast_no_grad"]["no_dummy_step"] for r in ranks)
    assert torch.equal(ranks[0]["broadcast_no_grad"]["b"], ranks[1]["broadcast_no_grad"]["b"])


@pytest.mark.timeout(900)
def test_job_horovods_dynamic_requires_grad_pattern(job):
    _, ranks = job
    no_error(ranks, "dynamic_requires_grad")
    assert all(r["dynamic_requires_grad"] == (10, 10) for r in ranks)


@pytest.mark.timeout(900)
def test_job_horovods_synchronize_step_warning_pattern(job):
    _, ranks = job
    no_error(ranks, "synchronize_step_warning")
    for r in ranks:
        assert len(r["step_warning"]["first"]) == 1 and "skip_synchronize" in r["step_warning"]["first"][0]
        assert r["step_warning"]["second"] == []


@pytest.mark.timeout(900)
def test_job_zero_grad_between_backward_and_step_raises_horovods_error(job):
    _, ranks = job
    no_error(ranks, "zero_grad_between_backward_and_step")
    for r in ranks:
        res = r["zero_grad"]
        assert all(res[t] == HOROVOD_ZERO_GRAD for t in (1, 2, 3)), res
        assert "after optimizer.synchronize() but before optimizer.step()" in res["after_synchronize"]


@pytest.mark.timeout(900)
def test_job_set_backward_passes_per_step(job):
    _, ranks = job
    no_error(ranks, "set_backward_passes")
    for r in ranks:
        res = r["set_backward_passes"]
        assert res["attr"] == 2 and res["steps"] == 2
        assert "Gradients were computed more than backward_passes_per_step" in res["third_pass"]


@pytest.mark.timeout(900)
def test_job_an_optimizer_built_on_one_rank_only_does_not_hang_the_others(job):
    """Rank 0 also wraps an EMA copy it never steps (built first): the run ends, alike on both ranks."""
    _, ranks = job
    no_error(ranks, "ema_on_one_rank")
    kinds = ranks[0]["ema"]["kinds"]
    assert {"variance", "compressed", "sync"} <= set(kinds) and kinds[-1] == "sync"
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["ema"]["params"], ranks[1]["ema"]["params"]))


@pytest.mark.timeout(900)
def test_job_resume_from_a_horovod_adam_checkpoint(job):
    """hvd.DistributedOptimizer(Adam) trained, saved on rank 0, loaded by hvd_zoadam on rank 0 and
    broadcast: the first resumed step (a VARIANCE step) is Horovod's Adam step; then the run goes
    through COMPRESSED, LOCAL and SYNC steps, finite and alike on both ranks; past the freeze the
    anchor comes from the parameters at the next step even though the model was loaded after the
    optimizer."""
    _, ranks = job
    no_error(ranks, "adam_checkpoint")
    before = ranks[0]["adam_checkpoint"]["before_freeze"]
    assert before["kinds"][:2] == ["variance", "compressed"] and "sync" in before["kinds"]
    assert before["schedule"]["step"] == 13 and before["lr"] == common.LR
    for z, a in zip(before["first"]["zoadam"], before["first"]["adam"]):
        torch.testing.assert_close(z, a, rtol=1e-6, atol=1e-7)
    past = ranks[0]["adam_checkpoint"]["past_freeze"]
    assert past["kinds"][0] == "local" and past["kinds"][1] == "sync" and past["schedule"]["frozen"]
    for case in ("before_freeze", "past_freeze"):
        res = [r["adam_checkpoint"][case] for r in ranks]
        assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"])), case
        for r in res:
            assert all(torch.isfinite(p).all() for p in r["params"])
            assert max(r["losses"]) < 1.5 * r["at_save"], (case, r["losses"], r["at_save"])


@pytest.mark.timeout(900)
def test_job_sparse_as_dense_costs_what_a_dense_gradient_costs(job):
    _, ranks = job
    no_error(ranks, "sparse_as_dense")
    for r in ranks:
        dense, sparse = r["sparse"][False], r["sparse"][True]
        assert dense["variance"] == sparse["variance"] and dense["variance"]["steps"] == 4
        assert dense["variance"]["rounds"] == 7  # step 1, then an allreduce and the 4-byte flag per step
        assert not any("changed after backward" in w for w in dense["warnings"] + sparse["warnings"])
        assert torch.equal(dense["weight"], sparse["weight"])


@pytest.mark.timeout(900)
def test_job_a_rank_outside_the_process_set_is_refused(job):
    _, ranks = job
    no_error(ranks, "outside_process_set")
    assert ranks[0]["process_set"] == {"built": 1}
    assert "this rank (1) is not in the process_set" in ranks[1]["process_set"]["error"]


# -- one process, thread-ranks ----------------------------------------------------------------------

@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_a_torch_adam_checkpoint_continues_as_adam_would(cls):
    """m and v are taken over and the schedule continues at Adam's step count: the next step, a
    VARIANCE step at P = 1, is Adam's step, m and v bit for bit and the parameters to float
    rounding (the library's Adam roots round to nearest, torch's CPU sqrt not always:
    native.reference.sqrt_rn); lr and weight decay come from the checkpoint, the decay kind stays
    the optimizer's."""
    model, adam = torch_adam(cls, 3, weight_decay=0.01)
    ckpt = copy.deepcopy(adam.state_dict())
    resumed = copy.deepcopy(model)
    opt = zoadam(resumed, solo(), cls, lr=0.5, var_freeze_step=8, var_update_scaler=2)
    opt.load_state_dict(ckpt)
    assert opt.schedule_state()["step"] == 3 and opt.schedule_state()["exp_avg_sq_steps"] == 3
    assert opt.param_groups[0]["lr"] == common.LR and opt.param_groups[0]["weight_decay"] == 0.01
    assert opt._next_kind()[1] is hvd_zoadam.StepKind.VARIANCE
    for o in (adam, opt):
        o.zero_grad()
    common.loss_fn(model, 4, 0).backward()
    common.loss_fn(resumed, 4, 0).backward()
    adam.step()
    opt.step()
    for a, b in zip(model.parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(adam.state[p][key], opt.state[q][key])
                   for p, q in zip(model.parameters(), resumed.parameters())), key
    sd = opt.state_dict()  # now an hvd_zoadam checkpoint: no per-parameter "step", no marks
    assert all("step" not in s for s in sd["state"].values())
    assert set(sd["param_groups"][0]["zoadam"]) == {"step", "exp_avg_sq_steps", "freeze_lr"}


def test_an_adam_checkpoint_past_the_freeze_freezes_and_anchors_at_the_next_step():
    """t >= var_freeze_step: v is frozen at once (the lr at the freeze is the checkpoint's); the
    anchor is the parameters at the next step, loaded after the optimizer; steps stay finite."""
    model, adam = torch_adam(torch.optim.Adam, 10)
    ckpt = copy.deepcopy(adam.state_dict())
    resumed = common.mlp(seed=7)
    opt = zoadam(resumed, solo(), var_freeze_step=6, local_step_policy="constant", local_step_clipper=2)
    opt.load_state_dict(ckpt)
    resumed.load_state_dict(model.state_dict())  # after the optimizer
    assert opt.schedule_state()["frozen"] and opt.schedule_state()["freeze_lr"] == common.LR
    v = [opt.state[p]["exp_avg_sq"].clone() for p in resumed.parameters()]
    kinds = []
    for t in range(11, 17):
        opt.zero_grad()
        common.loss_fn(resumed, t, 0).backward()
        if t == 11:
            x11 = [p.detach().clone() for p in resumed.parameters()]
        kinds.append(opt._next_kind()[1].value)
        opt.step()
        if t == 11:
            assert all(torch.equal(opt.state[p]["anchor"], x) for p, x in zip(resumed.parameters(), x11))
    assert kinds == ["local", "sync"] * 3
    assert all(torch.equal(a, opt.state[p]["exp_avg_sq"]) for a, p in zip(v, resumed.parameters()))
    assert all(torch.isfinite(p).all() for p in resumed.parameters())


def test_an_adam_checkpoint_0_1_adam_cannot_continue_is_refused_before_anything_changes():
    _, adam = torch_adam(torch.optim.Adam, 2)
    sd = adam.state_dict()
    for key in ("amsgrad", "maximize"):
        bad = copy.deepcopy(sd)
        bad["param_groups"][0][key] = True
        model = common.mlp()
        opt = zoadam(model, solo())
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(ValueError, match=f"cannot take over this Adam checkpoint.*{key}=True"):
            opt.load_state_dict(bad)
        after = opt.state_dict()
        assert after["param_groups"] == before["param_groups"]
        assert all(torch.equal(after["state"][i][k], before["state"][i][k]) for i in before["state"]
                   for k in before["state"][i])


def test_a_loaded_lr_and_a_scheduler_built_after_the_load_take_effect():
    """After load_state_dict (torch's loader makes new param-group dicts), the step reads the
    loaded lr, and an LR scheduler built on the optimizer afterwards drives it."""
    model = common.mlp()
    opt = zoadam(model, solo(), var_freeze_step=100)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.0
    opt.load_state_dict(sd)
    common.loss_fn(model, 1, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # lr 0: nothing moves
    opt.param_groups[0]["lr"] = common.LR
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.0 if i >= 1 else 1.0)
    for t in (2, 3):
        opt.zero_grad()
        common.loss_fn(model, t, 0).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        sched.step()
        moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert moved == (t == 2)


def test_collective_names_depend_on_the_layout_only():
    """However many optimizers a process built over a layout, the names are the same; another
    layout (names, shapes) gets other names."""
    def prefix(model):
        return zoadam(model, solo())._collectives.prefix
    first = prefix(common.mlp())
    assert prefix(common.mlp()) == prefix(common.mlp()) == first
    assert prefix(torch.nn.Linear(6, 16)) != first
    assert CollectiveNames.for_layout([(0, "w", (2,), "torch.float32")], 2).prefix \
        != CollectiveNames.for_layout([(0, "w", (2,), "torch.float32")], 3).prefix


def test_thread_ranks_with_an_extra_optimizer_on_one_rank_pair_up():
    """Rank 0 builds two more optimizers over copies of the model (never stepped) before the
    main one; the main optimizers of both ranks still exchange with each other."""
    def body(rank, transport):
        model = common.mlp()
        if rank == 0:
            for _ in range(2):
                zoadam(copy.deepcopy(model), transport)
        opt = zoadam(model, transport, var_freeze_step=4, var_update_scaler=2, local_step_scaler=1000,
                     local_step_clipper=1)
        for t in range(1, 9):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    res = run_threads(2, body, timeout_s=30)
    assert all(torch.equal(a, b) for a, b in zip(res[0], res[1]))


def test_sparse_gradients_with_sparse_as_dense_cost_what_dense_ones_cost():
    """Thread-ranks, with overlap: an embedding with sparse gradients (densified) takes the rounds,
    bytes and parameters of a dense one, and no "gradients changed" warning."""
    def body(rank, transport, sparse):
        with common._INIT_LOCK, torch.random.fork_rng():  # thread-ranks share torch's global RNG
            torch.manual_seed(3)
            emb = torch.nn.Embedding(20, 4, sparse=sparse)
        opt = zoadam(emb, transport, sparse_as_dense=True, var_freeze_step=100, var_update_scaler=10 ** 6)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            for t in range(4):
                opt.zero_grad()
                emb(torch.tensor([(t + rank) % 20, (3 * t + 1) % 20, 7])).pow(2).sum().backward()
                opt.step()
        return opt.comm_stats()["variance"], opt._warned_changed, emb.weight.detach().clone(), \
            [str(w.message) for w in ws]
    dense = run_threads(2, lambda r, t: body(r, t, False))
    sparse = run_threads(2, lambda r, t: body(r, t, True))
    for d, s in zip(dense, sparse):
        assert d[0] == s[0] and d[0]["rounds"] == 7
        assert not d[1] and not s[1]
        assert torch.equal(d[2], s[2])
        assert not any("changed after backward" in w for w in s[3])


def test_zero_grad_between_backward_and_step_raises_with_ranks_and_not_alone():
    def body(rank, transport):
        model = common.mlp()
        opt = zoadam(model, transport)
        common.loss_fn(model, 1, rank).backward()
        with pytest.raises(AssertionError, match=r"zero_grad\(\) was called after loss.backward\(\)"):
            opt.zero_grad()
        opt.step()
        opt.zero_grad()
        return True
    assert run_threads(2, body) == [True, True]
    model = common.mlp()
    opt = zoadam(model, solo())  # one rank: nothing is exchanged, zero_grad() drops the passes
    common.loss_fn(model, 1, 0).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters()) and not any(opt._passes.values())


def test_set_backward_passes_per_step_sets_and_resets_the_count():
    model = common.mlp()
    opt = zoadam(model, solo())
    common.loss_fn(model, 1, 0).backward()
    opt.set_backward_passes_per_step(2)
    for t in (2, 3):
        common.loss_fn(model, t, 0).backward()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
        common.loss_fn(model, 4, 0).backward()
    for bad, exc in ((0, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="backward_passes_per_step"):
            opt.set_backward_passes_per_step(bad)
    assert opt.backward_passes_per_step == 2


def test_argument_checks_come_before_horovod():
    """No transport, no hvd.init(): the argument's error, not "Horovod has not been initialized"."""
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="must be unique. Found duplicates: a"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                        named_parameters=[("a", model.weight), ("a", model.bias)])
    with pytest.raises(ValueError, match="were not named"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                        named_parameters=iter([("w", model.weight)]))
    with pytest.raises(ValueError, match="amsgrad"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), amsgrad=True))


def test_the_optimizer_is_an_instance_of_the_wrapped_class_without_running_its_code():
    model = common.mlp()
    opt = zoadam(model, solo(), torch.optim.AdamW, var_freeze_step=3)
    assert isinstance(opt, torch.optim.AdamW) and isinstance(opt, hvd_zoadam.ZeroOneAdamOptimizer)
    assert type(opt) is type(zoadam(common.mlp(), solo(), torch.optim.AdamW))  # one class per wrapped class
    assert not isinstance(zoadam(common.mlp(), solo()), torch.optim.AdamW)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    for t in range(1, 5):
        opt.zero_grad()
        common.loss_fn(model, t, 0).backward()
        opt.step()
        sched.step()
    assert opt.schedule_state()["step"] == 4 and all("step" not in s for s in opt.state.values())
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's loader calls __setstate__
    assert opt.schedule_state()["step"] == 4
