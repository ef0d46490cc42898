"""Which transport a job gets: the ``transport`` argument resolved against what this process
runs (Horovod with the MPI or the Gloo controller, a ``torch.distributed`` process group, or
MPI through mpi4py alone)."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from hvd_zoadam.comm.gloo import GlooTransport, gloo_unavailable_reason
from hvd_zoadam.comm.horovod import HorovodTransport
from hvd_zoadam.comm.mpi import MPICommTransport, MPITransport, mpi_unavailable_reason
from hvd_zoadam.comm.transport import TRANSPORTS, Transport

if TYPE_CHECKING:
    from mpi4py import MPI
    from torch.distributed import ProcessGroup


def make_transport(transport: str | Transport, process_set: object = None,
                   device: torch.device | str | None = None) -> Transport:
    """Resolve the ``transport`` argument into a :class:`Transport` for ``process_set``.

    ``transport``: a :class:`Transport` (returned as it is), or one of :data:`TRANSPORTS`:
    ``"mpi"`` (:class:`MPITransport`), ``"gloo"`` (:class:`~hvd_zoadam.comm.gloo.GlooTransport`),
    ``"horovod"`` (:class:`HorovodTransport`),
    ``"torch.distributed"`` (:class:`~hvd_zoadam.comm.torch_distributed.TorchDistributedTransport`;
    ``process_set`` is then a ``torch.distributed`` process group or None), ``"auto"``:
    ``"torch.distributed"`` when ``torch.distributed`` is initialised and Horovod is not (or is
    not installed); mpi4py alone (:class:`~hvd_zoadam.comm.mpi.MPICommTransport` on
    ``MPI.COMM_WORLD``) when neither is and ``mpi4py.MPI`` has initialised MPI; else ``"mpi"``
    where :func:`mpi_unavailable_reason` finds nothing against it,
    else ``"gloo"`` for tensors on the CPU (``device``; None counts as the CPU) where
    :func:`~hvd_zoadam.comm.gloo.gloo_unavailable_reason` finds nothing against it, else
    ``"horovod"`` (whose GPU collectives need no trip through host memory). A
    ``process_set`` that is an mpi4py intracommunicator takes mpi4py alone on it, under
    ``"auto"`` or ``"mpi"``.

    Raises:
        ValueError: unknown name, or neither Horovod nor torch.distributed nor MPI initialised,
            or this rank outside the set, or ``"mpi"`` or ``"gloo"`` where it cannot work (the
            reason named).
    """
    if isinstance(transport, Transport):
        return transport
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS} or a Transport instance, got {transport!r}")
    if _is_mpi_comm(process_set):
        if transport not in ("auto", "mpi"):
            raise ValueError(f"process_set is an mpi4py communicator, which only transport='mpi' or 'auto' "
                             f"moves; got transport={transport!r}")
        return mpi_alone_transport(process_set)
    if transport == "torch.distributed" or (transport == "auto" and _torch_distributed_only()):
        return torch_distributed_transport(process_set)
    if transport == "auto" and process_set is None and _mpi_only():
        return mpi_alone_transport(None)
    try:
        import horovod.torch as hvd
    except ImportError:
        raise ValueError(f"transport={transport!r} needs Horovod, which is not installed here: install it "
                         "(scripts/setup.sh builds it), or initialise torch.distributed and use "
                         "hvd_zoadam.distributed.DistributedOptimizer, or launch with mpirun and use "
                         "hvd_zoadam.mpi.DistributedOptimizer") from None

    from hvd_zoadam import native
    if not hvd.is_initialized():
        raise ValueError("Horovod has not been initialized; call hvd.init() before building "
                         "hvd_zoadam.DistributedOptimizer or calling compressed_allreduce")
    process_set = hvd.global_process_set if process_set is None else process_set
    if not process_set.included():
        raise ValueError(f"this rank ({hvd.rank()}) is not in the process_set {process_set}; build the "
                         "optimizer only on the ranks of the process set it trains with")
    native.configure_threads(hvd.local_size())
    if transport == "mpi" or (transport == "auto" and mpi_unavailable_reason() is None):
        return MPITransport(process_set)
    on_cpu = device is None or torch.device(device).type == "cpu"
    if transport == "gloo" or (transport == "auto" and on_cpu and gloo_unavailable_reason() is None):
        return GlooTransport(process_set)
    return HorovodTransport(process_set)


def horovod_initialized() -> bool:
    """Whether Horovod is installed and ``hvd.init()`` has run in this process."""
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return bool(hvd.is_initialized())


def _torch_distributed_only() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and not horovod_initialized()


def _is_mpi_comm(obj) -> bool:
    """Whether ``obj`` is an mpi4py communicator (without importing mpi4py where no one has)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(obj, mpi.Comm)


def _mpi_only() -> bool:
    """MPI initialised by mpi4py, and neither Horovod nor torch.distributed initialised."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return False
    if "horovod.torch" in sys.modules and horovod_initialized():  # Horovod is not imported for nothing
        return False
    import torch.distributed as dist
    return not (dist.is_available() and dist.is_initialized())


def mpi_alone_transport(comm: MPI.Intracomm | None) -> MPICommTransport:
    """:class:`MPICommTransport` on ``comm`` (None: ``MPI.COMM_WORLD``), with the CPU kernels'
    threads shared among the ranks on this host (:func:`ranks_on_this_host`)."""
    from hvd_zoadam import native
    transport = MPICommTransport(comm)
    native.configure_threads(ranks_on_this_host(transport))
    return transport


def torch_distributed_transport(process_group: ProcessGroup | None = None):
    """:class:`~hvd_zoadam.comm.torch_distributed.TorchDistributedTransport` on ``process_group``
    (None: the default group), with the CPU kernels' threads shared among the ranks on this
    host as the launcher tells them (:func:`launcher_ranks_on_this_host`; torchrun sets
    ``LOCAL_WORLD_SIZE``). No collective."""
    from hvd_zoadam import native
    from hvd_zoadam.comm.torch_distributed import TorchDistributedTransport
    transport = TorchDistributedTransport(process_group)
    local = launcher_ranks_on_this_host()
    native.configure_threads(local if local is not None else 1)
    return transport


# What launchers set on each rank: the job's ranks on this host. torchrun's; Open MPI's; MPICH's
# and Intel MPI's; Horovod's horovodrun (Gloo); Slurm's srun (one task count per node in a list).
LOCAL_SIZE_ENV = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "HOROVOD_LOCAL_SIZE")


def launcher_ranks_on_this_host(environ: Mapping[str, str] | None = None) -> int | None:
    """The job's ranks on this host as the launcher tells them in the environment
    (:data:`LOCAL_SIZE_ENV`, then Slurm's ``SLURM_TASKS_PER_NODE`` on a job of one node), or
    None when no launcher says. No collective; every rank of the job counts, whatever group
    it trains on."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_SIZE_ENV:
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    tasks = environ.get("SLURM_TASKS_PER_NODE", "")  # e.g. "4" or "4(x2)" (4 on each of 2 nodes)
    head = tasks.split("(")[0]
    if head.isdigit() and int(head) > 0 and "," not in tasks:
        return int(head)
    return None


def ranks_on_this_host(transport: MPICommTransport) -> int:
    """The job's ranks on this host, as the launcher tells them (:func:`launcher_ranks_on_this_host`:
    no collective, and every rank of the job counts, whatever communicator it trains on);
    otherwise ``transport``'s ranks on this host, by one ``Split_type`` over its communicator
    the first time (collective over it)."""
    local = launcher_ranks_on_this_host()
    if local is not None:
        return local
    key = transport._comm_key()
    if key not in _ranks_on_host:
        node = transport._comm.Split_type(transport._MPI.COMM_TYPE_SHARED, key=transport.rank)
        _ranks_on_host[key] = node.Get_size()
        node.Free()
    return _ranks_on_host[key]


_ranks_on_host: dict = {}  # communicator key -> its ranks on this host
