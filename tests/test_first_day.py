"""What a user's first day meets: the kernel threads a launcher's ranks get, and the mistakes an
existing script makes, each caught on every rank by name (no hang, no silent divergence).

Real jobs (``torchrun`` with :mod:`hvd_zoadam.distributed`, ``horovodrun --gloo`` with
:func:`hvd_zoadam.DistributedOptimizer`) run tests/mp/worker_first_day.py with
``NUMBA_NUM_THREADS`` unset; the thread-rank and one-process tests below check the same points in
detail.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import hvd_zoadam
from conftest import load_ranks, run_job, run_threads
from hvd_zoadam.comm.select import launcher_ranks_on_this_host
from hvd_zoadam.comm.thread import ThreadGroup


@pytest.fixture(scope="module", params=["torchrun", "gloo"])
def job(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"first-day-{request.param}")
    env = {"NUMBA_NUM_THREADS": None, "HVD_ZOADAM_TIMEOUT_S": "60"}
    if request.param == "torchrun":
        env["HVD_ZOADAM_TEST_FRONT_END"] = "torch.distributed"
    run_job(request.param, 2, ["tests/mp/worker_first_day.py", str(out)], timeout_s=420, env=env)
    return request.param, load_ranks(out, 2)


def no_error(ranks, scenario):
    for r in ranks:
        assert scenario not in r["errors"], f"rank {r['rank']}:\n{r['errors'][scenario]}"


@pytest.mark.timeout(600)
def test_job_each_rank_runs_its_share_of_the_cores(job):
    _, ranks = job
    no_error(ranks, "threads")
    for r in ranks:
        share = max(1, (os.cpu_count() or 1) // 2)
        # the pool itself is of the share's size: masked threads would still spin in every parallel region
        assert r["threads"]["in_use"] == share and r["threads"]["pool"] == share, r["threads"]


@pytest.mark.timeout(600)
def test_job_ranks_that_start_from_different_parameters_are_refused_until_broadcast(job):
    _, ranks = job
    no_error(ranks, "different_init")
    for r in ranks:
        assert "the ranks start from different parameters" in r["different_init"], r["different_init"]
        assert "broadcast_parameters" in r["different_init"]
    assert ranks[0]["after_broadcast"] == ranks[1]["after_broadcast"]
    assert len(set(ranks[0]["after_broadcast"])) == 1


@pytest.mark.timeout(600)
def test_job_a_step_without_backward_on_one_rank_raises_on_every_rank_naming_it(job):
    _, ranks = job
    no_error(ranks, "no_backward")
    for r in ranks:
        assert "rank 1 called step() with no gradient at all" in r["no_backward"], r["no_backward"]


@pytest.mark.timeout(600)
def test_job_a_layer_frozen_mid_training_stays_still_and_the_rest_trains_on(job):
    _, ranks = job
    no_error(ranks, "freeze")
    record = ranks[0]["freeze"]
    assert [t for t, *_ in record] == list(range(1, 25))  # every step taken
    kinds = {kind for *_, kind, _ in record}
    assert kinds == {"variance", "compressed", "local", "sync"}, kinds
    assert all(still for _, frozen, still, _, _ in record if frozen)
    assert not any(still for _, frozen, still, _, _ in record if not frozen)  # trains again once unfrozen
    for t, frozen, _, kind, digests in record:  # ranks bitwise equal after every step but the local ones
        if kind != "local":
            assert len(set(digests)) == 1, (t, kind, digests)
    assert ranks[0]["freeze"] == ranks[1]["freeze"]


@pytest.mark.timeout(600)
def test_job_a_scheduler_on_the_wrapped_optimizer_drives_the_step_without_warnings(job):
    launcher, ranks = job
    no_error(ranks, "scheduler_on_inner")
    for r in ranks:
        got = r["scheduler_on_inner"]
        assert got["lr"] == 0.125 and got["shared"], got
        assert 0.05 < got["largest_move"] < 0.2, got  # Adam's step moves by about lr, not the first lr (1.0)
        assert got["inner_state"] > 0, got  # the wrapped optimizer's state_dict() is the real state
        ours = [w for w in r["warnings"] if "hvd_zoadam" not in w.split("(")[-1] or "UserWarning: hvd_zoadam" in w]
        torch_or_horovod = [w for w in r["warnings"] if "/torch/" in w or "/horovod/" in w or "FutureWarning" in w]
        assert torch_or_horovod == [], (launcher, torch_or_horovod, ours)


# -- the same points in one process ------------------------------------------------------------------

def two_layers(seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return net


def loss(net, t, rank):
    gen = torch.Generator().manual_seed(100 * t + rank)
    return net(torch.randn(5, 4, generator=gen)).square().mean()


def test_launcher_ranks_per_host_from_each_launchers_environment():
    assert launcher_ranks_on_this_host({}) is None
    assert launcher_ranks_on_this_host({"LOCAL_WORLD_SIZE": "8"}) == 8  # torchrun
    assert launcher_ranks_on_this_host({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4  # Open MPI
    assert launcher_ranks_on_this_host({"MPI_LOCALNRANKS": "2"}) == 2  # MPICH, Intel MPI
    assert launcher_ranks_on_this_host({"HOROVOD_LOCAL_SIZE": "3"}) == 3  # horovodrun
    assert launcher_ranks_on_this_host({"SLURM_TASKS_PER_NODE": "4(x2)"}) == 4  # srun, 4 on each of 2 nodes
    assert launcher_ranks_on_this_host({"SLURM_TASKS_PER_NODE": "4,2"}) is None  # uneven: not known here


@pytest.mark.parametrize("seeds", [(1, 2), (1, 1)])
def test_different_parameters_are_refused_on_every_rank_and_equal_ones_train(seeds):
    def body(rank, transport):
        net = two_layers(seeds[rank])
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(net.parameters()),
                                              named_parameters=net.named_parameters(), transport=transport)
        loss(net, 1, rank).backward()
        try:
            opt.step()
        except ValueError as exc:
            return str(exc)
        return "stepped"
    got = run_threads(2, body)
    if seeds[0] == seeds[1]:
        assert got == ["stepped", "stepped"]
    else:
        assert all("broadcast_parameters" in g and "different parameters" in g for g in got), got


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("at", [1, 3])
def test_a_rank_without_backward_raises_naming_itself(overlap, at):
    """At the first step every rank raises (the settings check carries it); later every rank
    raises naming rank 1, from the step's 4-byte flag: after the early exchange with overlap,
    before the exchange without."""
    def body(rank, transport):
        net = two_layers(0)
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(net.parameters()),
                                              named_parameters=net.named_parameters(),
                                              transport=transport, overlap=overlap)
        for t in range(1, at + 1):
            opt.zero_grad()
            if not (t == at and rank == 1):
                loss(net, t, rank).backward()
            try:
                opt.step()
            except (RuntimeError, ValueError) as exc:
                return f"{type(exc).__name__}: {exc}"
        return "stepped"
    got = run_threads(2, body)
    want = "ValueError: hvd_zoadam: some rank" if at == 1 else "RuntimeError: hvd_zoadam: rank 1 called"
    assert all(g.startswith(want) and "no gradient at all" in g for g in got), got


def test_a_parameter_frozen_after_construction_stays_still_and_keeps_its_state():
    """The same run with a layer frozen for a while is, on the unfrozen layer, what it would be with
    that layer's gradient at zero, and the frozen layer and its m, v and anchor do not move."""
    net = two_layers(3)
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=0.05),
                                          named_parameters=net.named_parameters(),
                                          transport=ThreadGroup(1).transports()[0],
                                          var_freeze_step=4, var_update_scaler=1, local_step_clipper=2,
                                          local_step_policy="constant")
    kinds = []
    for t in range(1, 13):
        frozen = 3 <= t <= 8
        for p in net[0].parameters():
            p.requires_grad_(not frozen)
        before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in net[0].parameters()]
        opt.zero_grad()
        loss(net, t, 0).backward()
        opt.step()
        kinds.append(opt.schedule_state()["local_step_interval"])
        for (x, state), p in zip(before, net[0].parameters()):
            assert frozen == torch.equal(x, p.detach()), t
            if frozen:
                assert all(torch.equal(v, opt.state[p][k]) for k, v in state.items()), t
    with pytest.raises(ValueError, match="requires_grad=False when the optimizer was built"):
        net2 = two_layers(1)
        net2[0].weight.requires_grad_(False)
        opt2 = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(net2.parameters()),
                                               named_parameters=net2.named_parameters(),
                                               transport=ThreadGroup(1).transports()[0])
        net2[0].weight.requires_grad_(True)
        loss(net2, 1, 0).backward()
        opt2.step()


def test_a_scheduler_on_the_wrapped_adam_survives_a_load_and_warns_nothing():
    net = two_layers(0)
    inner = torch.optim.Adam(net.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = hvd_zoadam.DistributedOptimizer(inner, named_parameters=net.named_parameters(),
                                          transport=ThreadGroup(1).transports()[0])
    opt.load_state_dict(opt.state_dict())  # what broadcast_optimizer_state does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(1, 4):
            opt.zero_grad()
            loss(net, t, 0).backward()
            opt.step()
            schedule.step()
    assert opt.param_groups[0]["lr"] == 0.125 and opt.param_groups[0] is inner.param_groups[0]
    assert inner.state_dict()["state"][0]["exp_avg"].data_ptr() == opt.state[net[0].weight]["exp_avg"].data_ptr()


def test_no_warning_of_torchs_at_construction_under_torch_distributed(tmp_path):
    """The check for a DistributedDataParallel wrapper scans live objects without reading their
    attributes (torch.distributed.reduce_op warns when read)."""
    import torch.distributed as dist

    import hvd_zoadam.distributed as zd
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        net = two_layers(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = zd.DistributedOptimizer(torch.optim.AdamW(net.parameters()), net.named_parameters())
            loss(net, 1, 0).backward()
            opt.step()
    finally:
        dist.destroy_process_group()


def test_step_inside_skip_synchronize_without_synchronize_runs_it_and_warns_once():
    net = two_layers(0)
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(net.parameters()), named_parameters=net.named_parameters(),
                                          transport=ThreadGroup(1).transports()[0])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for t in (1, 2):
            opt.zero_grad()
            loss(net, t, 0).backward()
            with opt.skip_synchronize():
                opt.step()
    assert opt.schedule_state()["step"] == 2
    assert sum("skip_synchronize() without a prior" in str(w.message) for w in seen) == 1


def test_horovods_names_parameter_names_and_num_groups():
    net = two_layers(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(net.parameters()),
                                              named_parameters=net.named_parameters(),
                                              num_groups=2, transport=ThreadGroup(1).transports()[0])
    assert any(issubclass(w.category, DeprecationWarning) and "num_groups" in str(w.message) for w in seen)
    assert opt._parameter_names == {p: n for n, p in net.named_parameters()}
    net = two_layers(0)
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(net.parameters()), named_parameters=net.named_parameters(),
                                          groups=[[net[0].weight, net[0].bias]],
                                          transport=ThreadGroup(1).transports()[0])
    loss(net, 1, 0).backward()
    opt.step()
    net = two_layers(0)
    with pytest.raises(ValueError, match="A parameter can only appear once in groups"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(net.parameters()), groups=[[net[0].weight], [net[0].weight]],
                                        transport=ThreadGroup(1).transports()[0])
