"""The MPI front end: 0/1 Adam and 1-bit Adam over mpi4py alone, without Horovod.

For jobs launched by ``mpirun``, ``srun`` or any MPI launcher that would rather not start
Horovod. Every collective goes through mpi4py on one communicator (default
``MPI.COMM_WORLD``): the 1-bit rounds as under :func:`hvd_zoadam.DistributedOptimizer`'s
``transport="mpi"``, the full-precision averages of the VARIANCE steps as a reduce-scatter and
an allgather of the same kind.
With no Horovod there is no background thread waking every ``HOROVOD_CYCLE_TIME`` on cores
the training uses (docs/performance.md measures what that thread costs). The change from a
Horovod script::

    from mpi4py import MPI                          # initialises MPI (thread level 'multiple')
    import hvd_zoadam.mpi as zm
    # hvd.init()                                    # drop Horovod
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = zm.DistributedOptimizer(opt, model.named_parameters())
    zm.broadcast_parameters(model.state_dict(), root_rank=0)
    zm.broadcast_optimizer_state(opt, root_rank=0)

Every 0/1 Adam and 1-bit Adam option has the name and default of
:func:`hvd_zoadam.distributed.DistributedOptimizer`; ``comm`` (an mpi4py intracommunicator)
takes the place of a Horovod process set. CUDA tensors go to a CUDA-aware MPI, or through
pinned host buffers (as ``transport="mpi"`` does). The full-precision average is a sum in rank
order then a division by the world size: at P = 2 it equals Horovod's to the last bit; at other
world sizes its last bit can differ (Horovod's sum follows MPI's algorithm, and it multiplies
by 1/size), as that of :mod:`hvd_zoadam.distributed` can.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from hvd_zoadam.comm.mpi import mpi_comm_unavailable_reason
from hvd_zoadam.comm.transport import Transport
from hvd_zoadam.shell.options import documents_knobs
from hvd_zoadam.shell.torch_distributed import (
    KNOBS,
    broadcast_state,
    broadcast_tensors,
    build_without_horovod,
    refuse_ddp,
)
from hvd_zoadam.shell.torch_distributed import DistributedOptimizer as _torch_distributed_optimizer

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["DistributedOptimizer", "OnebitAdam", "broadcast_parameters", "broadcast_optimizer_state"]

FRONT_END = "hvd_zoadam.mpi.DistributedOptimizer"


@documents_knobs(like=_torch_distributed_optimizer)
def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         comm: MPI.Intracomm | None = None, **options: object):
    """Wrap a ``torch.optim.Adam``/``AdamW`` into 0/1 Adam (or 1-bit Adam) over an mpi4py
    communicator, without Horovod.

    Args:
        optimizer: a plain ``torch.optim.Adam`` or ``AdamW`` over the model's parameters.
        named_parameters: ``model.named_parameters()``; the names key the settings and layout
            check across ranks (recommended; without them parameters are named by position).
        comm: the ranks that train together, an mpi4py intracommunicator (default
            ``MPI.COMM_WORLD``); every one of its ranks builds the optimizer.
        **options: the knobs below, those of :func:`hvd_zoadam.distributed.DistributedOptimizer`.

    The knobs, each winning over its default when set (``transport`` here: ``"auto"`` or
    ``"mpi"``, the same, or a :class:`~hvd_zoadam.comm.transport.Transport`; ``hierarchical``'s
    nodes: ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``, or blocks of
    ``HVD_ZOADAM_RANKS_PER_NODE`` consecutive ranks when that is set):

    {knobs}

    Returns:
        A :class:`~hvd_zoadam.shell.optimizer.ZeroOneAdamOptimizer` (or
        :class:`~hvd_zoadam.shell.optimizer.OnebitAdamOptimizer`), also an instance of
        ``type(optimizer)``, with ``synchronize()``/``skip_synchronize()`` for gradient clipping.

    Raises:
        TypeError: an option that :func:`hvd_zoadam.distributed.DistributedOptimizer` does not
            take (named), ``comm`` not an mpi4py intracommunicator, or as that function.
        ValueError: as :func:`hvd_zoadam.distributed.DistributedOptimizer` (a model wrapped
            in ``DistributedDataParallel`` included); also for ``comm`` together with a
            Transport, ``MPI.COMM_NULL``, or MPI not initialised or below
            ``MPI_THREAD_SERIALIZED``, each naming the fix.
    """
    unknown = sorted(set(options) - set(KNOBS))
    if unknown:
        raise TypeError(f"{FRONT_END}() got an unexpected keyword argument {unknown[0]!r}; its options are "
                        f"those of hvd_zoadam.distributed.DistributedOptimizer: {', '.join(KNOBS)}")
    knobs = {**KNOBS, **options}
    transport = knobs["transport"]
    if isinstance(transport, Transport):
        if comm is not None:
            raise ValueError("pass comm or a Transport instance as transport, not both: the transport "
                             "brings its own ranks")
    elif transport not in ("auto", "mpi"):
        raise ValueError(f"transport must be 'auto' or 'mpi' here (or a Transport instance), got {transport!r}; "
                         "for Horovod's collectives use hvd_zoadam.DistributedOptimizer")
    refuse_ddp(optimizer)

    def resolve():
        if isinstance(transport, Transport):
            return transport
        from hvd_zoadam.comm.select import mpi_alone_transport
        return mpi_alone_transport(_comm(comm))
    return build_without_horovod(optimizer, named_parameters, resolve, FRONT_END, knobs)


def OnebitAdam(optimizer: torch.optim.Optimizer,  # noqa: N802
               named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
               comm: MPI.Intracomm | None = None, *, freeze_step: int, **kwargs: object):
    """1-bit Adam (Tang et al., arXiv 2102.02888) over mpi4py: ``DistributedOptimizer(optimizer,
    named_parameters, comm, algorithm="onebit", var_freeze_step=freeze_step, **kwargs)`` (see
    :func:`hvd_zoadam.OnebitAdam`)."""
    return DistributedOptimizer(optimizer, named_parameters, comm, algorithm="onebit",
                                var_freeze_step=freeze_step, **kwargs)


def broadcast_parameters(params: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int = 0,
                         comm: MPI.Intracomm | None = None) -> None:
    """``hvd.broadcast_parameters`` over mpi4py: every rank's tensors become ``root_rank``'s, in
    place. ``params``: ``model.state_dict()``, ``model.named_parameters()`` or a list of
    ``(name, tensor)``, in the same order of names on every rank. ``root_rank``: a rank of
    ``comm`` (default ``MPI.COMM_WORLD``). CUDA tensors travel through host memory (set-up only).
    Collective over ``comm``.

    Raises:
        TypeError, ValueError: ``comm`` is not a usable intracommunicator, or ``root_rank`` is
            not one of its ranks.
    """
    comm = _checked_comm(comm, root_rank)
    broadcast_tensors(params, lambda tensor: _bcast_tensor(comm, tensor, root_rank))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              comm: MPI.Intracomm | None = None) -> None:
    """``hvd.broadcast_optimizer_state`` over mpi4py: every rank takes ``root_rank``'s
    ``state_dict()`` (m, v, the anchor, the schedule counters, lr and the other group
    settings), then ``load_state_dict`` of it. The error buffers stay each rank's own.
    Collective over ``comm``.

    Raises:
        TypeError, ValueError: as :func:`broadcast_parameters`; ValueError on every rank when
            the ranks' optimizers hold different state layouts (the root's and this rank's named).
    """
    from mpi4py import MPI
    comm = _checked_comm(comm, root_rank)
    broadcast_state(optimizer, root_rank, lambda obj: comm.bcast(obj, root=root_rank),
                    lambda tensor: _bcast_tensor(comm, tensor, root_rank),
                    lambda ok: comm.allreduce(ok, op=MPI.LAND))


def _comm(comm):
    """``comm``, or ``MPI.COMM_WORLD`` for None (importing mpi4py.MPI initialises MPI)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD if comm is None else comm


def _checked_comm(comm, root_rank):
    """``comm`` (None: ``MPI.COMM_WORLD``), refused by name as :class:`MPICommTransport` refuses
    it, and ``root_rank`` one of its ranks (any integer type but bool)."""
    comm = _comm(comm)
    reason = mpi_comm_unavailable_reason(comm)
    if reason is not None:
        raise ValueError(f"hvd_zoadam.mpi: {reason}")
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral) \
            or not 0 <= root_rank < comm.Get_size():
        raise ValueError(f"root_rank must be a rank of the communicator (0 to {comm.Get_size() - 1}), "
                         f"got {root_rank!r}")
    return comm


def _bcast_tensor(comm, tensor: torch.Tensor, root_rank: int) -> None:
    """``tensor`` becomes ``root_rank``'s, in place, as bytes (any dtype); CUDA and
    non-contiguous tensors through a contiguous host copy."""
    from mpi4py import MPI
    tensor = tensor.detach()
    in_place = tensor.device.type == "cpu" and tensor.is_contiguous()
    host = tensor if in_place else tensor.contiguous().cpu()
    comm.Bcast([host.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE], root=root_rank)
    if not in_place:
        tensor.copy_(host)
