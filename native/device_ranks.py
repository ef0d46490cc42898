"""Real ranks on one device against the same ranks as threads of one process, bit for bit.

    mpirun -np 2 python -m hvd_zoadam.native.device_ranks --launcher mpi --device cuda
    torchrun --standalone --nproc-per-node 1 -m hvd_zoadam.native.device_ranks --launcher torchrun --device cuda

Each rank trains a small MLP on data of its own for ``--steps`` steps of 0/1 Adam, through every
step kind (VARIANCE, COMPRESSED, LOCAL, SYNC), over the launcher's front end:
``hvd_zoadam.mpi`` (``mpirun``; CUDA tensors handed to a CUDA-aware MPI or staged through pinned
host buffers) or ``hvd_zoadam.distributed`` (``torchrun``; NCCL for CUDA, gloo for the CPU).
Rank 0 then trains the same world size as thread ranks in its own process (the thread
transport, the same device and kernels) and compares every parameter bit for bit. Rank 0
prints one JSON line: ``launcher``, ``device``, ``world_size``, ``kinds`` (the step kinds
taken), ``equal``, ``max_abs_diff`` and, under MPI, ``mpi_cuda_aware``; exits 1 when the
parameters differ. ``native/device_check.sh`` runs it on a GPU, and on the CPU without one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hvd_zoadam.comm.transport import Transport

KNOBS = dict(var_freeze_step=8, var_update_scaler=2, local_step_policy="steps", local_step_scaler=2,
             local_step_clipper=4, bucket_cap_mb=0.01)


def initial_state() -> dict:
    """The model's starting weights, the same on every rank (made from a generator of its own,
    so that thread ranks building at once draw the same values)."""
    gen = torch.Generator().manual_seed(1234)
    shapes = {"0.weight": (64, 32), "0.bias": (64,), "2.weight": (8, 64), "2.bias": (8,)}
    return {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}


def model(device: str) -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    m.load_state_dict(initial_state())
    return m.to(device)


def train(build: Callable[[torch.nn.Module], torch.optim.Optimizer], rank: int, steps: int,
          device: str) -> tuple[list[torch.Tensor], list[str]]:
    """``steps`` steps on rank ``rank``'s data with the optimizer ``build(model)`` returns.
    Returns the parameters (on the CPU) and the kinds of the steps taken."""
    m = model(device)
    opt = build(m)
    kinds = []
    for step in range(1, steps + 1):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 32, generator=gen).to(device), torch.randn(16, 8, generator=gen).to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        kinds.append(opt._next_kind()[1].value)
        opt.step()
    return [p.detach().cpu() for p in m.parameters()], kinds


def as_threads(world_size: int, steps: int, device: str) -> list[torch.Tensor]:
    """Rank 0's parameters after the same training with ``world_size`` thread ranks."""
    import hvd_zoadam.distributed as zd
    from hvd_zoadam.comm.thread import run_ranks

    def rank_body(rank: int, transport: Transport):
        return train(lambda m: zd.DistributedOptimizer(
            torch.optim.AdamW(m.parameters(), lr=1e-2), m.named_parameters(), transport=transport, **KNOBS),
            rank, steps, device)[0]
    return run_ranks(world_size, rank_body, timeout_s=300)[0]


def launched(launcher: str, device: str):
    """(rank, world size, build, barrier, report extras) under the launcher's front end."""
    if launcher == "mpi":
        from mpi4py import MPI

        import hvd_zoadam.mpi as zm
        from hvd_zoadam.comm.mpi import mpi_cuda_aware
        comm = MPI.COMM_WORLD
        extra = {"mpi_cuda_aware": mpi_cuda_aware(), "mpi": MPI.Get_library_version().split("\x00")[0].splitlines()[0]}
        return (comm.Get_rank(), comm.Get_size(), lambda m: zm.DistributedOptimizer(
            torch.optim.AdamW(m.parameters(), lr=1e-2), m.named_parameters(), **KNOBS), comm.Barrier, extra)
    import torch.distributed as dist

    import hvd_zoadam.distributed as zd
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return (dist.get_rank(), dist.get_world_size(), lambda m: zd.DistributedOptimizer(
        torch.optim.AdamW(m.parameters(), lr=1e-2), m.named_parameters(), **KNOBS), dist.barrier,
        {"backend": dist.get_backend()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launcher", choices=["mpi", "torchrun"], required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("device_ranks: --device cuda, but torch sees no CUDA device")
    rank, world_size, build, barrier, extra = launched(args.launcher, args.device)
    params, kinds = train(build, rank, args.steps, args.device)
    barrier()
    if rank != 0:
        return 0
    want = as_threads(world_size, args.steps, args.device)
    diff = max(float((a - b).abs().max()) for a, b in zip(params, want))
    equal = all(torch.equal(a, b) for a, b in zip(params, want))
    print(json.dumps({"launcher": args.launcher, "device": args.device, "world_size": world_size,
                      "steps": args.steps, "kinds": sorted(set(kinds)), "equal": equal, "max_abs_diff": diff,
                      **extra}))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
