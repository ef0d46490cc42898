"""hvd.broadcast_optimizer_state (frozen parameters, empty state, non-tensor options) and the cross-rank
settings check.

Usage: ``worker_bcast.py OUT_DIR`` under 2 ranks.
"""
from __future__ import annotations

import copy
import os
import sys
import time

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402


def model_with_frozen_layer():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def train(model, opt, first, last):
    for t in range(first, last + 1):
        opt.zero_grad()
        gen = torch.Generator().manual_seed(t * 31 + hvd.rank())
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()


def snapshot(opt):
    return {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())},
            "groups": copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]),
            "errors": [b.exchange.worker_error.clone() for b in opt._buckets]}


def frozen_and_broadcasts(out):
    model = model_with_frozen_layer()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    frozen = [p.clone() for p in model[0].parameters()]
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(), var_freeze_step=3,
                                          var_update_scaler=1, local_step_scaler=1000, local_step_clipper=1)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    once = snapshot(opt)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    twice = snapshot(opt)
    train(model, opt, 1, 6)
    before = snapshot(opt)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after = snapshot(opt)
    common.assert_same_on_all_ranks(hvd, [t for d in after["state"].values() for t in d.values()],
                                    "optimizer state after hvd.broadcast_optimizer_state")
    train(model, opt, 7, 8)
    out["frozen"] = {"unchanged": all(torch.equal(a, b) for a, b in zip(frozen, model[0].parameters())),
                     "frozen_in_state": any(p in opt.state for p in model[0].parameters()),
                     "once": once, "twice": twice, "before": before, "after": after,
                     "final": [p.detach().clone() for p in model.parameters()]}


def corrupt_then_broadcast(out):
    model = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                          named_parameters=model.named_parameters(), var_freeze_step=3,
                                          var_update_scaler=2, local_step_scaler=1000, local_step_clipper=1)
    for t in range(1, 6):
        opt.zero_grad()
        common.loss_fn(model, t, hvd.rank()).backward()
        opt.step()
    if hvd.rank() == 1:
        opt.param_groups[0]["lr"] = 0.5
        opt.param_groups[0]["zoadam"].update(step=999, exp_avg_sq_steps=0, freeze_lr=None)
        opt.param_groups[0]["lr_sum"] = 7
        next(iter(opt.state.values()))["exp_avg"].fill_(3.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["corrupt"] = {"groups": copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                               for g in opt.param_groups]),
                      "state": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}}
    opt.zero_grad()
    common.loss_fn(model, 6, hvd.rank()).backward()
    opt.step()  # step 6 is a SYNC step (H = 1 throughout): parameters agree again
    out["corrupt"]["after"] = [p.detach().clone() for p in model.parameters()]


def root_changes_exp_avg_sq_then_broadcast(out):
    """After the freeze rank 0 alone changes v (zeros on a few coordinates, the rest scaled, as
    a load of another checkpoint would) and broadcasts its state. Horovod's broadcast writes the
    other ranks' v without moving its version counter: their next SYNC steps must still use the
    broadcast v (its mask and its denominators), or the parameters part."""
    model = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                          named_parameters=model.named_parameters(), var_freeze_step=3,
                                          var_update_scaler=1, local_step_scaler=1000, local_step_clipper=1)

    def steps(first, last):
        for t in range(first, last + 1):
            opt.zero_grad()
            common.loss_fn(model, t, hvd.rank()).backward()
            opt.step()  # H = 1 throughout: every step after the freeze is a SYNC step
    steps(1, 6)
    if hvd.rank() == 0:
        v = next(iter(opt.state.values()))["exp_avg_sq"]
        v.view(-1)[:5].zero_()
        v.mul_(4.0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    steps(7, 9)
    out["root_v"] = [p.detach().clone() for p in model.parameters()]


def mismatches(out):
    res = {}
    cases = {
        "freeze": lambda r: dict(var_freeze_step=3 if r == 0 else 5),
        "clipper": lambda r: dict(local_step_clipper=4 if r == 0 else 8),
    }
    for name, kw in cases.items():
        model = common.mlp()
        opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                              named_parameters=model.named_parameters(), **kw(hvd.rank()))
        res[name] = check(model, opt)
    model = common.mlp().double() if hvd.rank() == 1 else common.mlp()
    res["dtype"] = check(model, hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                                                named_parameters=model.named_parameters()))
    model = common.mlp()
    if hvd.rank() == 1:
        model.extra = torch.nn.Parameter(torch.zeros(3))
    res["extra"] = check(model, hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                                                named_parameters=model.named_parameters()))
    out["mismatch"] = res


def check(model, opt):
    start = time.perf_counter()
    x = torch.randn(4, 6, dtype=next(model.parameters()).dtype)
    model[2](model[1](model[0](x))).sum().backward() if isinstance(model, torch.nn.Sequential) else None
    try:
        opt.step()
        return {"error": None, "seconds": time.perf_counter() - start}
    except ValueError as exc:
        return {"error": str(exc), "seconds": time.perf_counter() - start}


def explicit_transports(out):
    """transport='mpi' and transport='gloo' either work (the MPI, the Gloo controller) or raise at
    construction, naming why."""
    model = torch.nn.Linear(4, 2)
    for name in ("mpi", "gloo"):
        try:
            opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters()), transport=name)
            out[f"explicit_{name}"] = {"ok": opt.comm_stats()["transport"]}
        except ValueError as exc:
            out[f"explicit_{name}"] = {"error": str(exc)}


def main():
    hvd.init()
    out = {"rank": hvd.rank()}
    explicit_transports(out)
    frozen_and_broadcasts(out)
    corrupt_then_broadcast(out)
    root_changes_exp_avg_sq_then_broadcast(out)
    mismatches(out)
    torch.save(out, os.path.join(sys.argv[1], f"rank{hvd.rank()}.pt"))


if __name__ == "__main__":
    main()
