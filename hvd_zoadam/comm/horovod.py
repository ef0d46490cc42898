"""Horovod's own collectives (``hvd.alltoall``, ``hvd.allgather``, ``hvd.allreduce_``), which
work under both the Gloo and the MPI controller: the ``"horovod"`` transport, and the base of
the mpi4py transport on Horovod's MPI world (:class:`~hvd_zoadam.comm.mpi.MPITransport`) and of
the Gloo one beside Horovod's (:class:`~hvd_zoadam.comm.gloo.GlooTransport`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hvd_zoadam.comm.transport import (
    CollectiveTimeoutError,
    Done,
    Transport,
    allgather_object_via_bytes,
    default_timeout_s,
)

if TYPE_CHECKING:
    import torch
    from horovod.common.process_sets import ProcessSet


@dataclass
class HorovodHandle:
    """A Horovod async collective in flight."""

    handle: int
    op: str
    name: str
    nbytes: int


class HorovodTransport(Transport):
    """Horovod collectives on a process set, each with a deadline.

    Every collective is started asynchronously and polled; past ``timeout_s`` seconds it
    raises :class:`CollectiveTimeoutError` naming the collective, instead of hanging
    when a peer died or stalled. The op names are rank-independent and unique per call site.
    """

    name = "horovod"
    supports_async = True

    def __init__(self, process_set: ProcessSet | None = None, timeout_s: float | None = None):
        import horovod.torch as hvd
        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        super().__init__(self.process_set.rank(), self.process_set.size())

    def refresh(self) -> bool:
        """Re-read rank and world size from Horovod (they change when an elastic job resets).
        Returns True when either changed."""
        rank, size = self.process_set.rank(), self.process_set.size()
        changed = (rank, size) != (self.rank, self.world_size)
        self.rank, self.world_size = rank, size
        return changed

    def _wait(self, handle, op: str, name: str, nbytes: int):
        from horovod.common.exceptions import HorovodInternalError
        hvd, deadline, pause = self._hvd, time.monotonic() + self.timeout_s, 0.0
        while not hvd.poll(handle):
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"hvd_zoadam: the {op} '{name}' ({nbytes} bytes) did not complete within {self.timeout_s:g} s "
                    f"on rank {self.rank} of {self.world_size}: a peer is dead or stalled, or the ranks issue "
                    "different collectives. Set HVD_ZOADAM_TIMEOUT_S to change the limit.")
            time.sleep(pause)
            pause = min(0.001, pause + 0.0001)
        try:
            return hvd.synchronize(handle)
        except HorovodInternalError as exc:
            # Same type, so hvd.elastic.run still catches it; the message names the collective.
            raise HorovodInternalError(f"hvd_zoadam: the {op} '{name}' failed on rank {self.rank} of "
                                       f"{self.world_size} (a peer died or Horovod shut down): {exc}") from exc

    def _start_horovod(self, op, tensor, name) -> HorovodHandle:
        """Start ``op`` on Horovod's collectives (whatever a subclass does with :meth:`_start`)."""
        hvd, ps = self._hvd, self.process_set
        if op == "allgather":
            handle = hvd.allgather_async(tensor, name=name, process_set=ps)
        elif op == "alltoall":
            handle = hvd.alltoall_async(tensor, name=name, process_set=ps)
        else:
            handle = hvd.allreduce_async_(tensor, op=hvd.Average, name=name, process_set=ps)
        return HorovodHandle(handle, op, name, self._nbytes(tensor))

    def _start(self, op, tensor, name):
        return self._start_horovod(op, tensor, name)

    def _wait_horovod(self, handle: HorovodHandle):
        out = self._wait(handle.handle, handle.op, handle.name, handle.nbytes)
        return out[0] if handle.op == "alltoall" else out

    def wait(self, handle: object):
        if isinstance(handle, Done):
            return handle.result
        return self._wait_horovod(handle)

    def allgather_object(self, obj: object, name: str):
        """Over Horovod's allgather under every subclass (set-up only, paired by name)."""
        def gather(tensor: torch.Tensor, part_name: str):
            return self._wait_horovod(self._start_horovod("allgather", tensor, part_name))
        return allgather_object_via_bytes(gather, obj, name)
