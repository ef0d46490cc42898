"""A host's link goes down mid-training, under ``hvd_zoadam.bench.netsim`` (tests/test_netns.py).

``worker_linkdown.py train OUT STEPS``: trains with a checkpoint ``OUT/ckpt{t}`` every 4 steps.
After step 10, rank 0 runs ``$ZO_LINK_DOWN`` (a shell command that takes the last host's link
down and, in the background, up again later) and notes the time in ``OUT/down``. Every rank that
fails writes ``OUT/rank{r}.json``: the exception's type and message and the seconds since the
link went down; a rank that finishes all STEPS fails the job.

``worker_linkdown.py resume OUT STEP STEPS``: loads ``OUT/ckpt{STEP}`` and trains to STEPS;
rank 0 writes ``OUT/resumed.json``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402
from hvd_zoadam import checkpoint  # noqa: E402


def main():
    mode, out = sys.argv[1], sys.argv[2]
    hvd.init()
    torch.set_num_threads(1)
    model = common.mlp()
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                          named_parameters=model.named_parameters(), var_freeze_step=3,
                                          var_update_scaler=1, local_step_scaler=1000, local_step_clipper=1)
    first, steps = 1, int(sys.argv[-1])
    if mode == "resume":
        first = checkpoint.load(os.path.join(out, f"ckpt{sys.argv[3]}"), model, opt)["step"] + 1
    try:
        for t in range(first, steps + 1):
            opt.zero_grad()
            common.loss_fn(model, t, hvd.rank()).backward()
            opt.step()
            if mode == "train" and t % 4 == 0:
                checkpoint.save(os.path.join(out, f"ckpt{t}"), model, opt, step=t)
            if mode == "train" and t == 10 and hvd.rank() == 0:
                with open(os.path.join(out, "down"), "w") as f:
                    f.write(repr(time.time()))
                subprocess.run(os.environ["ZO_LINK_DOWN"], shell=True, check=True)
            time.sleep(0.05)
    except Exception as exc:  # noqa: BLE001 - recorded for the test, then re-raised
        with open(os.path.join(out, "down")) as f:
            since = time.time() - float(f.read())
        with open(os.path.join(out, f"rank{hvd.rank()}.json"), "w") as f:
            json.dump({"type": type(exc).__name__, "message": str(exc), "since_down": since}, f)
        raise
    if mode == "train":
        raise AssertionError(f"rank {hvd.rank()} finished although a link was down")
    common.assert_same_on_all_ranks(hvd, list(model.parameters()), "parameters after the restart")
    if hvd.rank() == 0:
        with open(os.path.join(out, "resumed.json"), "w") as f:
            json.dump({"first": first, "last": steps, "step": opt.schedule_state()["step"]}, f)


if __name__ == "__main__":
    main()
