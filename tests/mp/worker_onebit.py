"""1-bit Adam in a real job (tests/test_onebit.py): against hvd.DistributedOptimizer(Adam) up to the
freeze, then compressed steps with a NaN on the last rank at step 7 (skipped on every rank).

argv: OUT_DIR. Writes OUT_DIR/rank{r}.pt: the largest difference from Horovod's Adam up to the
freeze, the parameters after every step, and comm_stats().
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402

hvd, _, _ = common.front_end()  # Horovod, or mpi4py alone with HVD_ZOADAM_TEST_FRONT_END=mpi
ONEBIT = hvd_zoadam.mpi.OnebitAdam if os.environ.get("HVD_ZOADAM_TEST_FRONT_END") == "mpi" else hvd_zoadam.OnebitAdam

FREEZE, STEPS, NAN_AT = 4, 10, 7


def main():
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    ours, theirs = common.mlp(), common.mlp()
    opt = ONEBIT(torch.optim.Adam(ours.parameters(), lr=1e-2), ours.named_parameters(), freeze_step=FREEZE)
    ref = hvd.DistributedOptimizer(torch.optim.Adam(theirs.parameters(), lr=1e-2),
                                   named_parameters=[("ref." + n, p) for n, p in theirs.named_parameters()])
    res = {"adam_diff": 0.0, "params": []}
    for t in range(1, STEPS + 1):
        opt.zero_grad()
        common.loss_fn(ours, t, rank).backward()
        if t == NAN_AT and rank == hvd.size() - 1:
            next(ours.parameters()).grad[0, 0] = float("nan")
        opt.step()
        common.assert_same_on_all_ranks(hvd, list(ours.parameters()), f"parameters after step {t}")
        res["params"].append([p.detach().clone() for p in ours.parameters()])
        if t <= FREEZE:
            ref.zero_grad()
            common.loss_fn(theirs, t, rank).backward()
            ref.step()
            res["adam_diff"] = max(res["adam_diff"], max((a - b).abs().max().item()
                                                         for a, b in zip(ours.parameters(), theirs.parameters())))
    res["stats"] = opt.comm_stats()
    res["horovod_imported"] = "horovod" in sys.modules
    torch.save(res, os.path.join(sys.argv[1], f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
