"""Checkpoint/resume jobs (algorithm.md §6).

``worker_ckpt.py OUT_DIR save STEP [STEP ...]``: a full run of common.CKPT_STEPS steps, and for
each STEP a run that saves a checkpoint after STEP steps. ``worker_ckpt.py OUT_DIR resume STEP
[STEP ...]``: fresh processes load each checkpoint and run to common.CKPT_STEPS.
"""
from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402
from hvd_zoadam import checkpoint  # noqa: E402

KNOBS = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4,
             local_step_policy="steps")


def build():
    model = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=common.LR, weight_decay=0.01),
                                          named_parameters=model.named_parameters(), **KNOBS)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    return model, opt, sched


def run(model, opt, sched, first, last):
    for t in range(first, last + 1):
        opt.zero_grad()
        common.loss_fn(model, t, hvd.rank()).backward()
        opt.step()
        sched.step()


def main():
    hvd.init()
    out, mode, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3:]]
    rank, world = hvd.rank(), hvd.size()
    res = {"rank": rank, "size": world}
    if mode == "save":
        model, opt, sched = build()
        run(model, opt, sched, 1, common.CKPT_STEPS)
        res["full"] = [p.detach().clone() for p in model.parameters()]
        for s in steps:
            model, opt, sched = build()
            run(model, opt, sched, 1, s)
            checkpoint.save(os.path.join(out, f"ckpt{s}"), model, opt, scheduler=sched.state_dict(), step=s)
            res[f"saved{s}"] = opt.schedule_state()
    else:
        src = os.environ["CKPT_DIR"]
        for s in steps:
            model, opt, sched = build()
            extra = checkpoint.load(os.path.join(src, f"ckpt{s}"), model, opt)
            sched.load_state_dict(extra["scheduler"])
            res[f"loaded{s}"] = opt.schedule_state()
            res[f"errors{s}"] = [(b.exchange.worker_error.clone(), b.exchange.server_error.clone(), b.numel)
                                 for b in opt._buckets]
            assert res[f"loaded{s}"]["step"] == extra["step"], "a load must restore the schedule, never reset it"
            # (parameters may differ per rank: a save mid-window keeps each rank's local steps)
            states = hvd.allgather_object(res[f"loaded{s}"])
            assert all(st == states[0] for st in states), f"ckpt{s}: ranks resumed different schedules: {states}"
            res[f"next_kind{s}"] = opt._next_kind()[1].value
            run(model, opt, sched, extra["step"] + 1, common.CKPT_STEPS)
            res[f"resumed{s}"] = [p.detach().clone() for p in model.parameters()]
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
