"""What the multi-process workers take from ``horovod.torch``, over ``torch.distributed`` instead,
for jobs launched by torchrun (``HVD_ZOADAM_TEST_FRONT_END=torch.distributed``): the workers
then build their optimizers with :mod:`hvd_zoadam.distributed` and import no Horovod.

``DistributedOptimizer`` here is the plain data-parallel Adam baseline (gradients averaged
with ``all_reduce`` before ``step()``), the role ``hvd.DistributedOptimizer`` plays under Horovod.
"""
from __future__ import annotations

import os

import torch.distributed as dist

import hvd_zoadam.distributed as zd


def init() -> None:
    dist.init_process_group("gloo")
    # the launcher's view and the group's must agree, or every oracle comparison is off by a rank
    assert (dist.get_rank(), dist.get_world_size()) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def shutdown() -> None:
    """The job's orderly end: every rank past its last collective, then the process groups
    destroyed. A Gloo job whose ranks exit with their groups alive can abort in the teardown
    ("terminate called without an active exception", SIGABRT) on whichever rank is last."""
    dist.barrier()
    dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank()


def size() -> int:
    return dist.get_world_size()


def mpi_enabled() -> bool:
    return False


def allgather_object(obj) -> list:
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


broadcast_parameters = zd.broadcast_parameters
broadcast_optimizer_state = zd.broadcast_optimizer_state


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
                    dist.all_reduce(p.grad)
                    p.grad.div_(size())
        return self.optimizer.step()


def DistributedOptimizer(optimizer, named_parameters=None):  # noqa: N802 - horovod.torch's name
    return _AveragedAdam(optimizer)
