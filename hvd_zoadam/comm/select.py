"""Which transport a job gets: the ``transport`` argument resolved against what this process
runs (Horovod with the MPI or the Gloo controller, or a ``torch.distributed`` process group)."""
from __future__ import annotations

import torch

from hvd_zoadam.comm.gloo import GlooTransport, gloo_unavailable_reason
from hvd_zoadam.comm.transport import TRANSPORTS, HorovodTransport, MPITransport, Transport, mpi_unavailable_reason


def make_transport(transport, process_set=None, device=None) -> Transport:
    """Resolve the ``transport`` argument into a :class:`Transport` for ``process_set``.

    ``transport``: a :class:`Transport` (returned as it is), or one of :data:`TRANSPORTS`:
    ``"mpi"`` (:class:`MPITransport`), ``"gloo"`` (:class:`~hvd_zoadam.comm.gloo.GlooTransport`),
    ``"horovod"`` (:class:`HorovodTransport`),
    ``"torch.distributed"`` (:class:`~hvd_zoadam.comm.torch_distributed.TorchDistributedTransport`;
    ``process_set`` is then a ``torch.distributed`` process group or None), ``"auto"``:
    ``"torch.distributed"`` when ``torch.distributed`` is initialised and Horovod is not (or is
    not installed), else ``"mpi"`` where :func:`mpi_unavailable_reason` finds nothing against it,
    else ``"gloo"`` for tensors on the CPU (``device``; None counts as the CPU) where
    :func:`~hvd_zoadam.comm.gloo.gloo_unavailable_reason` finds nothing against it, else
    ``"horovod"`` (whose GPU collectives need no trip through host memory).

    Raises:
        ValueError: unknown name, or neither Horovod nor torch.distributed initialised, or this
            rank outside the set, or ``"mpi"`` or ``"gloo"`` where it cannot work (the reason named).
    """
    if isinstance(transport, Transport):
        return transport
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS} or a Transport instance, got {transport!r}")
    if transport == "torch.distributed" or (transport == "auto" and _torch_distributed_only()):
        from hvd_zoadam.comm.torch_distributed import TorchDistributedTransport
        return TorchDistributedTransport(process_set)
    try:
        import horovod.torch as hvd
    except ImportError:
        raise ValueError(f"transport={transport!r} needs Horovod, which is not installed here: install it "
                         "(scripts/setup.sh builds it), or initialise torch.distributed and use "
                         "hvd_zoadam.distributed.DistributedOptimizer") from None

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
