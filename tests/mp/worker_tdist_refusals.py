"""torchrun worker: the torch.distributed front end refuses bad input by name on every rank.
Rank r writes ``OUT_DIR/rank{r}.pt`` with each refusal's message."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402
import hvd_zoadam.distributed as zd  # noqa: E402


def refusal(build) -> str:
    try:
        build()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def main():
    dist.init_process_group("gloo")
    rank, out = dist.get_rank(), {}
    model = common.mlp()
    wrapped = [torch.nn.parallel.DistributedDataParallel(model)]
    out["ddp"] = refusal(lambda: zd.DistributedOptimizer(torch.optim.AdamW(wrapped[0].parameters()),
                                                         wrapped[0].named_parameters()))
    wrapped.clear()
    from hvd_zoadam.comm.torch_distributed import TorchDistributedTransport
    out["cuda_over_gloo"] = refusal(lambda: TorchDistributedTransport().check_device(torch.device("cuda", 0)))
    # ranks that pass different options: the first step's settings check fails on every rank
    model = common.mlp()
    opt = zd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=common.LR), model.named_parameters(),
                                  var_freeze_step=6 + rank)
    common.loss_fn(model, 1, rank).backward()
    try:
        opt.step()
        out["mismatch"] = "accepted"
    except ValueError as exc:
        out["mismatch"] = str(exc)
    assert out["mismatch"] != "accepted", "ranks with different options took a step together"
    torch.save(out, os.path.join(sys.argv[1], f"rank{rank}.pt"))
    dist.barrier()  # an orderly end: a Gloo rank that exits with its group alive can abort in the teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
