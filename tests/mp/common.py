"""Deterministic models, data and inputs shared by the multi-process workers and the pytest side."""
from __future__ import annotations

import hashlib
import os
import threading

import torch

CAR_SIZES = [0, 1, 2, 19, 22, 72, 1000, 4099]
CAR_CALLS = 3


def car_input(n: int, rank: int, call: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * n + 100 * call + rank)
    return (torch.randn(n, generator=gen) * (1 + rank)).to(dtype)


_INIT_LOCK = threading.Lock()  # thread-ranks share torch's global RNG


def mlp(seed: int = 1234) -> torch.nn.Module:
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 + 7919 * step + rank)
    x = torch.randn(8, 6, generator=gen)
    y = torch.randn(8, 3, generator=gen)
    return x, y


def loss_fn(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return torch.nn.functional.mse_loss(model(x), y)


def grads_at(step: int, rank: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradient of rank ``rank``'s loss at step ``step`` for the MLP with parameters ``params``."""
    model = mlp()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    model.zero_grad()
    loss_fn(model, step, rank).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def simulate_mlp(p: int, steps: int, knobs: dict, cls=torch.optim.Adam, wd: float = 0.0, paper_raw: bool = False):
    """The oracle of the thread-rank MLP runs: ``simulate_zoadam`` from ``mlp()``'s initial
    parameters with :func:`grads_at`, constant LR; ``paper_raw`` runs the paper's plain algorithm:
    it turns off hvd_zoadam's preconditioned compression and automatic momentum mask.
    Returns (params per rank, kinds)."""
    from hvd_zoadam import Schedule
    from hvd_zoadam.oracle.simulate import simulate_zoadam
    params0 = [q.detach().clone() for q in mlp().parameters()]
    return simulate_zoadam(params0, grads_at, world_size=p, steps=steps, schedule=Schedule(**knobs),
                           lr_fn=lambda t: LR, weight_decay=wd, decoupled=cls is torch.optim.AdamW,
                           precondition=not paper_raw, auto_mask=not paper_raw)


TRAIN = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4,
             local_step_policy="steps")
TRAIN_STEPS = 24
LR = 1e-2

CKPT_STEPS = 22


def assert_same_on_all_ranks(hvd, tensors, what: str, process_set=None) -> None:
    """Fail this job at once (non-zero exit, naming ``what``) when ``tensors`` differ across ranks.

    The pytest side checks the saved results against the oracle; this makes a cross-rank
    divergence stop the job where it happens instead of surfacing as a later mismatch.
    """
    digests = digests_by_rank(hvd, tensors, process_set)
    assert len(set(digests)) == 1, f"{what}: not bitwise identical across ranks (digests by rank: {digests})"


def digests_by_rank(hvd, tensors, process_set=None) -> list:
    """A short digest of ``tensors`` from every rank of ``process_set`` (default: all), in rank order."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    if process_set is None:
        return hvd.allgather_object(h.hexdigest()[:12])
    mine = torch.tensor(list(h.digest()[:6]), dtype=torch.uint8).view(1, 6)
    return [bytes(row.tolist()).hex() for row in hvd.allgather(mine, process_set=process_set)]


def front_end():
    """``(hvd, DistributedOptimizer, transport class)`` for a worker: Horovod's module, the
    Horovod front end and ``MPITransport``; or, when ``HVD_ZOADAM_TEST_FRONT_END`` is
    ``torch.distributed`` (jobs launched by torchrun), the stand-in of ``tdist_shim.py``, the
    front end of :mod:`hvd_zoadam.distributed` and its transport, with no Horovod imported;
    when it is ``mpi`` (jobs launched by mpirun), those of ``mpi_shim.py`` and
    :mod:`hvd_zoadam.mpi`, with no Horovod imported either."""
    if os.environ.get("HVD_ZOADAM_TEST_FRONT_END") == "mpi":
        import mpi_shim

        import hvd_zoadam.mpi
        from hvd_zoadam.comm.mpi import MPICommTransport
        return mpi_shim, hvd_zoadam.mpi.DistributedOptimizer, MPICommTransport
    if os.environ.get("HVD_ZOADAM_TEST_FRONT_END") == "torch.distributed":
        import tdist_shim

        import hvd_zoadam.distributed
        from hvd_zoadam.comm.torch_distributed import TorchDistributedTransport
        return tdist_shim, hvd_zoadam.distributed.DistributedOptimizer, TorchDistributedTransport
    import horovod.torch as hvd

    import hvd_zoadam
    from hvd_zoadam.comm.mpi import MPITransport
    return hvd, hvd_zoadam.DistributedOptimizer, MPITransport
