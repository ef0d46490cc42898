"""Worker for the two-level exchange across simulated hosts: ``worker_hier_net.py MODE OUT_DIR``
under mpirun in ``hvd_zoadam.bench.netsim`` hosts, MODE ``flat`` or ``two-level``.

A 4.2 M-parameter linear layer trains 2 full-precision VARIANCE steps, then 24 steps after the
freeze (COMPRESSED, LOCAL and SYNC). Between a barrier after step 2 and one after the last step,
each rank reads its host's veth TX counter (``/sys/class/net/zeth0``, the namespace's own), so
the bytes counted are those of the 1-bit steps. The parameters must be bitwise equal on every
rank after every SYNC step. Rank r writes ``OUT_DIR/rank{r}.json``.
"""
from __future__ import annotations

import json
import os
import socket
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam  # noqa: E402

TX = "/sys/class/net/zeth0/statistics/tx_bytes"


def tx() -> int:
    with open(TX) as f:
        return int(f.read())


def main():
    mode, out = sys.argv[1], sys.argv[2]
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)
    opt = hvd_zoadam.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                          named_parameters=model.named_parameters(), transport="mpi",
                                          hierarchical=mode == "two-level", var_freeze_step=2, var_update_scaler=1,
                                          local_step_scaler=4, local_step_clipper=4, local_step_policy="steps")
    gen = torch.Generator().manual_seed(hvd.rank())
    syncs, before = 0, None
    for t in range(1, 27):
        if t == 3:
            hvd.allreduce(torch.zeros(1), name="barrier.before")
            before = tx()
        opt.zero_grad()
        x = torch.randn(16, 2048, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        if opt.schedule.kind(t).value == "sync":
            syncs += 1
            common.assert_same_on_all_ranks(hvd, [p.detach() for p in model.parameters()], f"parameters after {t}")
    hvd.allreduce(torch.zeros(1), name="barrier.after")
    sent = tx() - before
    stats = opt.comm_stats()
    with open(os.path.join(out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump({"rank": hvd.rank(), "local_rank": hvd.local_rank(), "host": socket.gethostname(),
                   "tx_bytes": sent, "syncs": syncs, "hierarchical": stats.get("hierarchical")}, f)


if __name__ == "__main__":
    main()
