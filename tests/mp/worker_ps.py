"""Two process sets {0,1} and {2,3} each train their own model with no cross-talk.

Usage: ``worker_ps.py OUT_DIR`` under 4 ranks.
"""
from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402


def main():
    sets = [hvd.ProcessSet([0, 1]), hvd.ProcessSet([2, 3])]
    hvd.init(process_sets=sets)
    rank = hvd.rank()
    mine = sets[0] if rank < 2 else sets[1]
    torch.manual_seed(100 + (rank // 2))  # each set its own initial model, alike within the set
    model = torch.nn.Linear(8, 4)
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                          named_parameters=model.named_parameters(), process_set=mine,
                                          var_freeze_step=2, var_update_scaler=1, local_step_policy="steps",
                                          local_step_scaler=2, local_step_clipper=2)
    kinds = []
    for t in range(1, 9):
        opt.zero_grad()
        gen = torch.Generator().manual_seed(7 * t + rank)
        x = torch.randn(16, 8, generator=gen)
        model(x).pow(2).mean().backward()
        kinds.append(opt._next_kind()[1].value)
        opt.step()
    # fail fast here too: one model per set, bitwise alike inside it, different across sets;
    # one schedule everywhere
    params = list(model.parameters())
    common.assert_same_on_all_ranks(hvd, params, "parameters inside a process set", process_set=mine)
    everywhere = common.digests_by_rank(hvd, params)
    assert everywhere[0] != everywhere[2], f"the two process sets trained the same model: {everywhere}"
    assert len({tuple(k) for k in hvd.allgather_object(kinds)}) == 1, "ranks disagree on the step kinds"
    torch.save({"rank": rank, "params": [p.detach().clone() for p in model.parameters()], "kinds": kinds,
                "stats": opt.comm_stats()}, os.path.join(sys.argv[1], f"rank{rank}.pt"))
    hvd.barrier()  # a rank that exits shuts Horovod down for everyone: wait for the other set


if __name__ == "__main__":
    main()
