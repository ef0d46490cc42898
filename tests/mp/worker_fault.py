"""A peer dies or stalls mid-training: ``worker_fault.py kill|stall`` under 3 ranks.

The last rank is killed (SIGKILL) or sleeps forever at step 5; the others must exit
non-zero within a bounded time, naming the stalled collective.
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


def main():
    mode = sys.argv[1]
    hvd.init()
    model = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                          named_parameters=model.named_parameters(), var_freeze_step=3,
                                          var_update_scaler=1, local_step_scaler=1000, local_step_clipper=1)
    for t in range(1, 20):
        if t == 5 and hvd.rank() == hvd.size() - 1:
            print(f"rank {hvd.rank()}: {mode} at step {t}", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        opt.zero_grad()
        common.loss_fn(model, t, hvd.rank()).backward()
        opt.step()
        if t < 5:  # every step exchanges here (freeze at 3, a sync every step after): x alike on all ranks
            common.assert_same_on_all_ranks(hvd, list(model.parameters()), f"parameters after step {t}")
    print("TRAINING FINISHED", flush=True)
    raise AssertionError(f"rank {hvd.rank()} finished training although a peer was dead or stalled")


if __name__ == "__main__":
    main()
