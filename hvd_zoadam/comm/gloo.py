"""The 1-bit rounds over a Gloo group of hvd_zoadam's own, under Horovod's Gloo controller
(``horovodrun --gloo``), as :class:`~hvd_zoadam.comm.mpi.MPITransport` sends them through
mpi4py under Horovod's MPI controller.

Through Horovod, every collective is a request that Horovod's background thread negotiates
with the other ranks in its next cycle before Gloo moves a byte, and a SYNC step of the main
job issues about 26 of them (two rounds per bucket and a flag). Here the alltoall and the
allgather go straight to a ``torch.distributed`` ``ProcessGroupGloo`` over the process set's
ranks, made beside Horovod's Gloo context without touching ``torch.distributed``'s default
group; the fp32 averages of VARIANCE steps stay on Horovod's fused allreduce. The bytes are
the same and so is every result, to the last bit: only who moves them changes.

The group is made at the first collective, once per process set: the set's first rank serves
a ``TCPStore`` on the address of ``HOROVOD_GLOO_IFACE`` (the interface horovodrun chose for
Horovod's own Gloo traffic) and the others learn it over Horovod's allgather.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hvd_zoadam.comm.horovod import HorovodTransport
from hvd_zoadam.comm.transport import CollectiveTimeoutError

if TYPE_CHECKING:
    from horovod.common.process_sets import ProcessSet


def gloo_unavailable_reason() -> str | None:
    """Why ``transport="gloo"`` cannot work in this process, or None when it can.

    Needs: Horovod initialised with the Gloo controller (``hvd.gloo_enabled()``), a job that is
    not elastic (its ranks change at a reset; the group is made for fixed ones),
    ``HOROVOD_GLOO_IFACE`` naming an interface with an IPv4 address here, and torch's Gloo backend.
    """
    import horovod.torch as hvd
    if not hvd.is_initialized():
        return "Horovod has not been initialized; call hvd.init() first"
    if not hvd.gloo_enabled():
        return ("Horovod does not run with the Gloo controller (e.g. mpirun or horovodrun --mpi, where "
                "transport='mpi' does the same through mpi4py); launch with horovodrun --gloo")
    if os.environ.get("HOROVOD_ELASTIC", "0") not in ("", "0"):
        return ("an elastic job (HOROVOD_ELASTIC=1) changes its ranks at a reset and this group is made for "
                "fixed ranks; use transport='horovod'")
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    if not iface:
        return ("HOROVOD_GLOO_IFACE is not set (horovodrun --gloo sets it to the interface of Horovod's Gloo "
                "traffic); set it to that interface, or use transport='horovod'")
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_gloo_available()):
        return "this torch build has no Gloo backend (torch.distributed.is_gloo_available() is False)"
    if interface_address(iface) is None:
        return f"the interface HOROVOD_GLOO_IFACE={iface!r} has no IPv4 address here; use transport='horovod'"
    return None


def interface_address(iface: str) -> str | None:
    """The first IPv4 address of network interface ``iface`` (e.g. ``"eth0"``), or None."""
    import psutil  # a dependency of Horovod
    for addr in psutil.net_if_addrs().get(iface, []):
        if addr.family == socket.AF_INET:
            return addr.address
    return None


@dataclass
class GlooHandle:
    """A round in flight on the Gloo group: its work, the byte buffers it reads and writes,
    and the device its result goes back to."""

    work: object
    op: str
    name: str
    nbytes: int
    send: torch.Tensor
    out: torch.Tensor
    dtype: torch.dtype
    device: torch.device


class GlooTransport(HorovodTransport):
    """Horovod's process set, its alltoall and allgather over a Gloo group of its own
    (module docstring); rank, world size, allreduce and set-up messages as
    :class:`HorovodTransport`. Tensors on a GPU are staged through host memory.

    Raises:
        ValueError: at construction, naming the reason (:func:`gloo_unavailable_reason`).
    """

    name = "gloo"

    def __init__(self, process_set: ProcessSet | None = None, timeout_s: float | None = None):
        reason = gloo_unavailable_reason()
        if reason is not None:
            raise ValueError(f"transport='gloo' cannot work here: {reason}")
        super().__init__(process_set, timeout_s)
        self.iface = os.environ["HOROVOD_GLOO_IFACE"]
        self._group = None  # made at the first round: construction runs no collective

    def refresh(self) -> bool:
        return False  # not elastic (gloo_unavailable_reason)

    def describe(self) -> str:
        return f"gloo (a Gloo group of hvd_zoadam's beside Horovod's, on {self.iface})"

    def _start(self, op, tensor, name):
        if op == "allreduce":  # the fp32 averages stay on Horovod's fused allreduce
            return self._start_horovod(op, tensor, name)
        if self._group is None:
            try:
                self._group = _process_set_group(self)
            except (RuntimeError, OSError, ValueError) as exc:
                raise RuntimeError(f"hvd_zoadam: transport='gloo' could not make its Gloo group on "
                                   f"HOROVOD_GLOO_IFACE={self.iface!r} (rank {self.rank} of {self.world_size}): "
                                   f"{type(exc).__name__}: {exc}; use transport='horovod'") from exc
        send = tensor.contiguous()
        nbytes = send.numel() * send.element_size()
        send_bytes = send.cpu().view(torch.uint8)  # the alltoall's chunks split by bytes as by elements
        if op == "alltoall":
            out = torch.empty_like(send_bytes)
            work = self._group.alltoall_base(out, send_bytes, [], [])
        else:
            out = torch.empty(self.world_size * send_bytes.numel(), dtype=torch.uint8)
            work = self._group._allgather_base(out, send_bytes)
        return GlooHandle(work, op, name, nbytes, send_bytes, out, send.dtype, send.device)

    def wait(self, handle: object):
        if not isinstance(handle, GlooHandle):  # Horovod's allreduce, or done inside start()
            return super().wait(handle)
        deadline, pause = time.monotonic() + self.timeout_s, 0.0
        while not handle.work.is_completed():
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"hvd_zoadam: the {handle.op} '{handle.name}' ({handle.nbytes} bytes, gloo) did not complete "
                    f"within {self.timeout_s:g} s on rank {self.rank} of {self.world_size}: a peer is dead or "
                    "stalled, or the ranks issue different collectives. Set HVD_ZOADAM_TIMEOUT_S to change the limit.")
            time.sleep(pause)
            pause = min(0.001, pause + 0.0001)
        try:
            handle.work.wait()
        except Exception as exc:  # noqa: BLE001 - Gloo raises RuntimeError subclasses of its own
            raise CollectiveTimeoutError(
                f"hvd_zoadam: the {handle.op} '{handle.name}' failed on rank {self.rank} of {self.world_size} (a "
                f"peer died or closed its connection): {type(exc).__name__}: {exc}") from exc
        return handle.out.view(handle.dtype).to(handle.device)


_groups: dict = {}  # the process set's ranks -> (TCPStore, ProcessGroupGloo)


def _process_set_group(transport: GlooTransport):
    """The Gloo group of ``transport``'s process set, made on first use (collective over the
    set: every rank's first round reaches here in the same order)."""
    import torch.distributed as dist
    key = tuple(transport.process_set.ranks)
    made = _groups.get(key)
    if made is None:
        timeout = datetime.timedelta(seconds=transport.timeout_s + 60)  # the polled deadline comes first
        store, where = None, None
        if transport.rank == 0:
            host = interface_address(transport.iface)
            store = dist.TCPStore(host, 0, transport.world_size, True, timeout, wait_for_workers=False)
            where = [host, store.port]
        host, port = transport.allgather_object(where, f"hvd_zoadam.gloo.{'.'.join(map(str, key))}")[0]
        if store is None:
            store = dist.TCPStore(host, port, transport.world_size, False, timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(interface=transport.iface)]
        made = _groups[key] = (store, dist.ProcessGroupGloo(store, transport.rank, transport.world_size, options))
    return made[1]
