"""1-bit Adam (algorithm="onebit"): Adam before the freeze, the in-process oracle after it, bit for bit."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import run_threads

sys.path.insert(0, str(Path(__file__).parent / "mp"))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402
from hvd_zoadam import checkpoint  # noqa: E402
from hvd_zoadam.oracle.simulate import simulate_onebit  # noqa: E402

FREEZE, STEPS, LR = 4, 12, 1e-2


def _build(transport, cls=torch.optim.Adam, wd=0.0):
    model = common.mlp()
    opt = hvd_zoadam.OnebitAdam(cls(model.parameters(), lr=LR, weight_decay=wd), model.named_parameters(),
                                freeze_step=FREEZE, transport=transport)
    return model, opt


def _run(world_size, cls=torch.optim.Adam, wd=0.0):
    def body(rank, transport):
        model, opt = _build(transport, cls, wd)
        rec = {"params": []}
        for t in range(1, STEPS + 1):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
            rec["params"].append([p.detach().clone() for p in model.parameters()])
            if t == FREEZE:
                b = opt._buckets[0]
                rec["freeze"] = (b.exp_avg.clone(), b.exp_avg_sq.clone())
        b = opt._buckets[0]
        rec.update(exp_avg=b.exp_avg.clone(), worker_error=b.exchange.worker_error.clone(),
                   server_error=b.exchange.server_error.clone(), stats=opt.comm_stats())
        return rec
    return run_threads(world_size, body)


@pytest.mark.parametrize("cls,wd", [(torch.optim.Adam, 0.0), (torch.optim.AdamW, 0.01), (torch.optim.Adam, 0.01)])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_onebit_adam_is_adam_then_the_oracle_bit_for_bit(world_size, cls, wd):
    out = _run(world_size, cls, wd)
    # parameters bitwise identical across ranks after every step
    for rec in out[1:]:
        for a, b in zip(rec["params"], out[0]["params"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    # up to the freeze: torch's Adam/AdamW on the exact average of the ranks' gradients
    ref = common.mlp()
    adam = cls(ref.parameters(), lr=LR, weight_decay=wd)
    for t in range(1, FREEZE + 1):
        grads = [common.grads_at(t, r, [p.detach() for p in ref.parameters()]) for r in range(world_size)]
        for p, *gs in zip(ref.parameters(), *grads):
            p.grad = sum(gs[1:], gs[0].clone()) / world_size
        adam.step()
        for p, q in zip(ref.parameters(), out[0]["params"][t - 1]):
            torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-7)
    # after it: the in-process simulation from the optimizer's state at the freeze, bit for bit
    m0, v0 = out[0]["freeze"]
    x, m, we, se = simulate_onebit(out[0]["params"][FREEZE - 1], m0, v0, common.grads_at, world_size=world_size,
                                   first_step=FREEZE + 1, steps=STEPS, exp_avg_sq_steps=FREEZE, lr_fn=lambda t: LR,
                                   weight_decay=wd, decoupled=cls is torch.optim.AdamW)
    final = torch.cat([p.reshape(-1) for p in out[0]["params"][-1]])
    assert torch.equal(final, x) and torch.equal(out[0]["exp_avg"], m)
    assert not torch.equal(final, torch.cat([p.reshape(-1) for p in out[0]["params"][FREEZE]]))
    if world_size > 1:
        for r, rec in enumerate(out):
            assert torch.equal(rec["worker_error"], we[r]) and torch.equal(rec["server_error"], se[r])
        assert we[0].abs().sum() > 0
        stats = out[0]["stats"]
        # two rounds a step (one bucket) and the step's 4-byte flag
        assert stats["compressed"]["steps"] == STEPS - FREEZE and stats["compressed"]["rounds"] == 3 * (STEPS - FREEZE)
        assert stats["local"]["steps"] == stats["sync"]["steps"] == 0


def test_onebit_checkpoint_resume_is_bitwise():
    def body(rank, transport, tmp=[None]):
        import tempfile
        if rank == 0:
            tmp[0] = tempfile.mkdtemp()
        transport.allgather_object(None, "t")
        prefix = f"{tmp[0]}/ckpt"
        model, opt = _build(transport)
        for t in range(1, STEPS + 1):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
            if t == 7:
                checkpoint.save(prefix, model, opt, step=t)
        full = [p.detach().clone() for p in model.parameters()]
        model, opt = _build(transport)
        first = checkpoint.load(prefix, model, opt)["step"] + 1
        for t in range(first, STEPS + 1):
            opt.zero_grad()
            common.loss_fn(model, t, rank).backward()
            opt.step()
        return all(torch.equal(a, b) for a, b in zip(full, model.parameters()))
    assert all(run_threads(2, body))


def test_zoadam_knobs_are_refused_under_onebit():
    model = common.mlp()
    with pytest.raises(ValueError, match=r"local_step_scaler=8 is a 0/1 Adam knob; algorithm='onebit'"):
        hvd_zoadam.OnebitAdam(torch.optim.Adam(model.parameters()), freeze_step=3, local_step_scaler=8,
                              transport=hvd_zoadam.comm.thread.ThreadGroup(1).transports()[0])
    with pytest.raises(ValueError, match="algorithm must be 'zoadam'"):
        hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), algorithm="2bit")


@pytest.mark.parametrize("launcher,front_end", [("gloo", None), ("mpi", None), ("mpi", "mpi")],
                         ids=["gloo", "mpi", "mpi-alone"])
def test_onebit_adam_in_a_real_job(launcher, front_end, tmp_path):
    """horovodrun --gloo -np 2 / mpirun -np 2, and mpirun -np 2 through hvd_zoadam.mpi.OnebitAdam
    without Horovod: equal to data-parallel Adam up to the freeze (float tolerance), identical on
    both ranks after every step, and a NaN on one rank at a compressed step skips that step on both."""
    from conftest import load_ranks, run_job
    run_job(launcher, 2, ["tests/mp/worker_onebit.py", str(tmp_path)],
            env={"HVD_ZOADAM_TEST_FRONT_END": front_end} if front_end else None)
    ranks = load_ranks(tmp_path, 2)
    for r in ranks:
        assert r["horovod_imported"] is (front_end is None)
        assert r["stats"]["transport"].startswith("mpi" if launcher == "mpi" else "gloo")
        assert r["adam_diff"] < 1e-6
        assert all(torch.equal(a, b) for a, b in zip(r["params"][6], r["params"][5]))  # step 7 skipped
        assert not all(torch.equal(a, b) for a, b in zip(r["params"][7], r["params"][6]))
        assert r["stats"]["compressed"]["steps"] == 6 and r["stats"]["skipped_steps"] == 1
