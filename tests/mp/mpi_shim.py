"""What the multi-process workers take from ``horovod.torch``, over mpi4py alone, for jobs
launched by mpirun with ``HVD_ZOADAM_TEST_FRONT_END=mpi``: the workers then build their
optimizers with :mod:`hvd_zoadam.mpi` and import no Horovod.

``DistributedOptimizer`` here is the plain data-parallel Adam baseline (gradients averaged
with ``Allreduce`` before ``step()``), the role ``hvd.DistributedOptimizer`` plays under Horovod.
"""
from __future__ import annotations

import os

from mpi4py import MPI

import hvd_zoadam.mpi as zm

COMM = MPI.COMM_WORLD


def init() -> None:
    # the launcher's view and the communicator's must agree, or every oracle comparison is off by a rank
    assert (COMM.Get_rank(), COMM.Get_size()) == (int(os.environ["OMPI_COMM_WORLD_RANK"]),
                                                  int(os.environ["OMPI_COMM_WORLD_SIZE"]))


def shutdown() -> None:
    """horovod.torch's ``shutdown()``: nothing to do under MPI (mpi4py finalizes MPI at exit; a
    barrier here would hold the other ranks when one failed after its last collective)."""


def rank() -> int:
    return COMM.Get_rank()


def size() -> int:
    return COMM.Get_size()


def mpi_enabled() -> bool:
    return True


def allgather_object(obj) -> list:
    return COMM.allgather(obj)


broadcast_parameters = zm.broadcast_parameters
broadcast_optimizer_state = zm.broadcast_optimizer_state


class _AveragedAdam:
    """``opt.step()`` after averaging every gradient over the ranks (SUM, then / world size)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def step(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    COMM.Allreduce(MPI.IN_PLACE, [p.grad.numpy(), MPI.FLOAT], op=MPI.SUM)
                    p.grad.div_(size())
        return self.optimizer.step()


def DistributedOptimizer(optimizer, named_parameters=None):  # noqa: N802 - horovod.torch's name
    return _AveragedAdam(optimizer)
