"""torchrun worker for a job that loses a worker and restarts (``torchrun --max-restarts 1``).

``worker_tdist_restart.py OUT_DIR KILL_AT [WHO [STOP_AT]]``: 0/1 Adam on the MLP over
torch.distributed, a checkpoint (``hvd_zoadam.checkpoint.save``) every 4 steps. On the first
attempt, at step KILL_AT (0: never):

* ``WHO = rank1`` (the default): rank 1 kills itself with SIGKILL; torchrun restarts every
  worker at the same world size;
* ``WHO = node``: the worker of the agent that runs one worker (``LOCAL_WORLD_SIZE == 1``)
  SIGKILLs that agent and itself, as when a node is lost; the other agent of an elastic job
  (``--nnodes 1:2``) restarts its workers at the smaller world size.

Each restarted worker resumes from the last checkpoint. ``STOP_AT`` (default 24) ends the run
after that step. Rank r writes ``OUT_DIR/rank{r}.pt``: the final parameters, the step it
resumed after, the restart count and the world size.
"""
from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam.distributed as zd  # noqa: E402
from hvd_zoadam import checkpoint  # noqa: E402

KNOBS = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4,
             local_step_policy="steps")
STEPS, EVERY = 24, 4


def main():
    out, kill_at = sys.argv[1], int(sys.argv[2])
    who = sys.argv[3] if len(sys.argv) > 3 else "rank1"
    stop_at = int(sys.argv[4]) if len(sys.argv) > 4 else STEPS
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    # A rendezvous file per attempt: the agent's store keeps the keys of the attempt before the
    # restart, where init_process_group("gloo") over env:// would find the dead attempt's address.
    attempt = f"{os.environ['TORCHELASTIC_RUN_ID']}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'rendezvous.' + attempt)}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    model = common.mlp()
    opt = zd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=common.LR, weight_decay=0.01),
                                  model.named_parameters(), **KNOBS)
    prefix, resumed = os.path.join(out, "ckpt"), 0
    if os.path.exists(prefix + ".pt"):
        resumed = checkpoint.load(prefix, model, opt)["step"]
        assert resumed % EVERY == 0 and opt.schedule_state()["step"] == resumed, (resumed, opt.schedule_state())
    for t in range(resumed + 1, stop_at + 1):
        opt.zero_grad()
        common.loss_fn(model, t, rank).backward()
        opt.step()
        if t % EVERY == 0:
            checkpoint.save(prefix, model, opt, step=t)
        if t == kill_at and first_attempt:
            if who == "rank1" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if who == "node" and os.environ["LOCAL_WORLD_SIZE"] == "1":
                os.kill(os.getppid(), signal.SIGKILL)  # the agent: nothing restarts on this node
                os.kill(os.getpid(), signal.SIGKILL)
    torch.save({"final": [p.detach().clone() for p in model.parameters()], "resumed": resumed,
                "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "world_size": dist.get_world_size()},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
