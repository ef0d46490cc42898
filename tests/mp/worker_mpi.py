"""mpirun worker for the mpi4py front end (no Horovod): refusals by name on every rank, the
transport's averages, the broadcasts and a sub-communicator. Rank r writes
``OUT_DIR/rank{r}.pt``."""
from __future__ import annotations

import os
import sys

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402
import hvd_zoadam.mpi as zm  # noqa: E402
from hvd_zoadam.comm.mpi import MPICommTransport  # noqa: E402

COMM = MPI.COMM_WORLD


def refusal(build) -> str:
    try:
        build()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def adam(model):
    return torch.optim.AdamW(model.parameters(), lr=common.LR, weight_decay=0.01)


def scenario_refusals(out):
    model = common.mlp()
    out["unknown_option"] = refusal(lambda: zm.DistributedOptimizer(adam(model), compression="fp16"))
    out["transport"] = refusal(lambda: zm.DistributedOptimizer(adam(model), transport="gloo"))
    out["comm_type"] = refusal(lambda: zm.DistributedOptimizer(adam(model), comm="world"))
    out["comm_null"] = refusal(lambda: zm.DistributedOptimizer(adam(model), comm=MPI.COMM_NULL))
    out["root_rank"] = refusal(lambda: zm.broadcast_parameters(model.state_dict(), root_rank=COMM.Get_size()))
    out["bcast_comm"] = refusal(lambda: zm.broadcast_parameters(model.state_dict(), comm="world"))
    out["bcast_null"] = refusal(lambda: zm.broadcast_optimizer_state(adam(model), comm=MPI.COMM_NULL))
    out["comm_and_transport"] = refusal(lambda: zm.DistributedOptimizer(adam(model), comm=COMM,
                                                                        transport=MPICommTransport()))
    # a layout mismatch in broadcast_optimizer_state: refused on every rank, the root included
    other = torch.nn.Linear(6, 3 + (COMM.Get_rank() == 2))
    inner = torch.optim.AdamW(other.parameters())
    other(torch.ones(1, 6)).sum().backward()
    inner.step()
    out["state_mismatch"] = refusal(lambda: zm.broadcast_optimizer_state(inner, root_rank=0))
    from hvd_zoadam.comm.select import LOCAL_SIZE_ENV, ranks_on_this_host
    out["ranks_on_host_env"] = ranks_on_this_host(MPICommTransport())
    saved = {name: os.environ.pop(name) for name in LOCAL_SIZE_ENV if name in os.environ}
    out["ranks_on_host_split"] = ranks_on_this_host(MPICommTransport())  # Split_type over the communicator
    os.environ.update(saved)
    out["int_average"] = refusal(lambda: MPICommTransport().allreduce_average_(torch.ones(4, dtype=torch.int32),
                                                                               "ints"))
    # ranks that pass different options: the first step's settings check fails on every rank
    opt = zm.DistributedOptimizer(adam(model), model.named_parameters(), var_freeze_step=6 + COMM.Get_rank())
    common.loss_fn(model, 1, COMM.Get_rank()).backward()
    out["mismatch"] = refusal(opt.step)
    accepted = [key for key, text in out.items() if text == "accepted"]
    assert not accepted, f"rank {COMM.Get_rank()}: the MPI front end accepted what it must refuse: {accepted}"


def scenario_averages(out):
    """The transport's average of tensors of several sizes and dtypes, started together and
    waited for in order (as a VARIANCE step does), with the bytes counted."""
    transport = MPICommTransport()
    inputs = {(n, str(dtype)): common.car_input(n, COMM.Get_rank(), 0, dtype)
              for n in (0, 1, 5, 1000) for dtype in (torch.float32, torch.float64, torch.float16)}
    work = {key: x.clone() for key, x in inputs.items()}
    handles = {key: transport.start("allreduce", x, f"avg.{key[0]}.{key[1]}") for key, x in work.items()}
    out["averages"] = {key: transport.wait(h) is work[key] for key, h in handles.items()}
    out["average_inputs"], out["average_outputs"] = inputs, work
    out["average_bytes"] = sum(transport.counter.bytes_sent.values())


def scenario_broadcast(out):
    """Parameters and AdamW's state from rank 1 (every rank starts elsewhere), in place."""
    root = 1
    model = common.mlp(seed=100 + COMM.Get_rank())
    zm.broadcast_parameters(model.state_dict(), root_rank=np.int64(root))  # any integer type
    out["params"] = [p.detach().clone() for p in model.parameters()]
    inner = adam(model)
    for t in range(1, 3 + COMM.Get_rank()):  # the ranks' states differ in their step counts
        inner.zero_grad()
        common.loss_fn(model, t, COMM.Get_rank()).backward()
        inner.step()
    inner.param_groups[0]["lr"] = 0.5 + COMM.Get_rank()
    first = inner.param_groups[0]["params"][0]
    out["state_before"] = {k: v.clone() for k, v in inner.state[first].items()}
    zm.broadcast_optimizer_state(inner, root_rank=root)
    out["state"] = {k: v.clone() for k, v in inner.state[first].items()}
    out["lr"] = inner.param_groups[0]["lr"]


def scenario_checkpoint(out):
    """Save inside a window of local steps, go on to the end; then a fresh model and optimizer
    load the checkpoint and take the same steps: the same parameters to the last bit."""
    from hvd_zoadam import checkpoint

    def build():
        model = common.mlp()
        return model, zm.DistributedOptimizer(adam(model), model.named_parameters(), **common.TRAIN)

    def run(model, opt, first, last):
        for t in range(first, last + 1):
            opt.zero_grad()
            common.loss_fn(model, t, COMM.Get_rank()).backward()
            opt.step()
    prefix, saved_at = os.path.join(sys.argv[1], "ckpt"), 15
    model, opt = build()
    run(model, opt, 1, saved_at)
    out["ckpt_kind_after"] = opt._next_kind()[1].value
    checkpoint.save(prefix, model, opt, step=saved_at)
    run(model, opt, saved_at + 1, common.CKPT_STEPS)
    model2, opt2 = build()
    extra = checkpoint.load(prefix, model2, opt2)
    run(model2, opt2, extra["step"] + 1, common.CKPT_STEPS)
    out["ckpt_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def scenario_subcomm(out):
    """0/1 Adam on the even ranks' communicator only, with the odd ranks idle."""
    sub = COMM.Split(color=COMM.Get_rank() % 2, key=COMM.Get_rank())
    out["sub"] = None
    if COMM.Get_rank() % 2 == 0:
        model = common.mlp()
        opt = zm.DistributedOptimizer(adam(model), model.named_parameters(), comm=sub, **common.TRAIN)
        for t in range(1, common.TRAIN_STEPS + 1):
            opt.zero_grad()
            common.loss_fn(model, t, sub.Get_rank()).backward()
            opt.step()
        n, q = 1000, sub.Get_size()
        we, se = torch.zeros(hvd_zoadam.padded_numel(n, q)), torch.zeros(hvd_zoadam.padded_numel(n, q) // q)
        car = hvd_zoadam.compressed_allreduce(common.car_input(n, sub.Get_rank(), 0), we, se, process_set=sub)
        out["sub"] = {"size": sub.Get_size(), "final": [p.detach().clone() for p in model.parameters()],
                      "transport": opt.comm_stats()["transport"], "car": (car, we, se),
                      "car_horovod": refusal(lambda: hvd_zoadam.compressed_allreduce(
                          common.car_input(n, 0, 0), we, se, process_set=sub, transport="horovod"))}
    COMM.Barrier()


def main():
    out = {"rank": COMM.Get_rank(), "size": COMM.Get_size()}
    scenario_refusals(out)
    scenario_averages(out)
    scenario_broadcast(out)
    scenario_checkpoint(out)
    scenario_subcomm(out)
    out["horovod_imported"] = "horovod" in sys.modules
    torch.save(out, os.path.join(sys.argv[1], f"rank{COMM.Get_rank()}.pt"))


if __name__ == "__main__":
    main()
