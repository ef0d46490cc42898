"""A peer dies or stalls mid-training, under 3 ranks: ``worker_fault.py MODE [ARGS]``.

Modes where the last rank fails (the others must exit non-zero within a bounded time,
naming the collective or the dead peer):

* ``stall``/``kill``: sleeps forever, or is killed (SIGKILL), at step 5, before its backward;
* ``kill-compressed``/``kill-sync``: killed inside the 1-bit exchange of step 3 (a
  COMPRESSED step) or step 4 (a SYNC step), as it starts the alltoall of the signs, after
  the scales round;
* ``kill-save PREFIX``: checkpoints ``PREFIX2`` and ``PREFIX4`` after steps 2 and 4, and is
  killed while writing its own file of ``PREFIX4``;
* ``skip-iteration``: every rank calls ``set_iteration``; the last rank skips iteration 5
  (every rank must then raise StepMismatchError at step 5, naming it).

And the restarts: ``clean OUT`` trains steps 1-19; ``resume PREFIX OUT`` loads a checkpoint
and trains to step 19. Both write OUT/rank{r}.pt with the final parameters.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402
from hvd_zoadam import checkpoint  # noqa: E402

LAST = 19


def die(what: str):
    print(f"rank {hvd.rank()}: killed {what}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_exchange(opt, kind: str):
    """Make this rank die as it starts the signs alltoall of a ``kind`` step."""
    start = opt.transport.start

    def start_or_die(op, tensor, name, count=True):
        if name.endswith(".signs") and opt._next_kind()[1].value == kind:
            die(f"in the {kind} exchange at step {opt._next_kind()[0]} ({name})")
        return start(op, tensor, name, count)
    opt.transport.start = start_or_die


def kill_in_save():
    """Make this rank die halfway through writing its own checkpoint file of step 4."""
    save = checkpoint.atomic_save

    def save_or_die(obj, path):
        if path.endswith("4.rank%d.pt" % hvd.rank()):
            with open(path + ".partial.tmp", "wb") as f:
                f.write(b"PK\x03\x04 half a checkpoint")
                f.flush()
            die(f"while writing {path}")
        return save(obj, path)
    checkpoint.atomic_save = save_or_die


def main():
    mode = sys.argv[1]
    hvd.init()
    model = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                          named_parameters=model.named_parameters(), var_freeze_step=3,
                                          var_update_scaler=1, local_step_scaler=1000, local_step_clipper=1)
    victim = hvd.rank() == hvd.size() - 1
    first = 1
    if mode == "resume":
        first = checkpoint.load(sys.argv[2], model, opt)["step"] + 1
    elif victim and mode in ("kill-compressed", "kill-sync"):
        kill_in_exchange(opt, mode.split("-")[1])
    elif victim and mode == "kill-save":
        kill_in_save()
    for t in range(first, LAST + 1):
        if mode == "skip-iteration":
            if t == 5 and victim:
                print(f"rank {hvd.rank()}: skips iteration {t}", flush=True)
                continue
            opt.set_iteration(t)
        if t == 5 and victim and mode in ("kill", "stall"):
            print(f"rank {hvd.rank()}: {mode} at step {t}", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        opt.zero_grad()
        common.loss_fn(model, t, hvd.rank()).backward()
        opt.step()
        if mode == "kill-save" and t in (2, 4):
            checkpoint.save(f"{sys.argv[2]}{t}", model, opt, step=t)
        # every step exchanges here (freeze at 3, a sync every step after): x alike on all ranks
        if t < 5 or mode == "skip-iteration":
            common.assert_same_on_all_ranks(hvd, list(model.parameters()), f"parameters after step {t}")
    if mode in ("clean", "resume"):
        common.assert_same_on_all_ranks(hvd, list(model.parameters()), "final parameters")
        torch.save([p.detach().clone() for p in model.parameters()], os.path.join(sys.argv[-1], f"rank{hvd.rank()}.pt"))
        return
    print("TRAINING FINISHED", flush=True)
    raise AssertionError(f"rank {hvd.rank()} finished training although a peer was dead or stalled")


if __name__ == "__main__":
    main()
