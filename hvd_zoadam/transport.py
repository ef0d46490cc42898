"""Collectives for the 1-bit exchange, with byte and round counters (spec §3).

A transport moves 1-D contiguous tensors among the ranks of one process set.
``HorovodTransport`` uses Horovod's own collectives (``hvd.alltoall``,
``hvd.allgather``, ``hvd.allreduce_``), which work under both the Gloo and the
MPI controller. ``ThreadTransport`` runs P ranks as threads of one process (the
in-process oracle of the tests and of :mod:`hvd_zoadam.simulate`).

**Counting bytes.** Each call counts what this rank puts on the wire under the
standard ring/pairwise algorithms, so numbers compare across transports:

==============================================  =========================
collective                                      bytes sent by this rank
==============================================  =========================
allreduce of B bytes                            2·(P−1)/P·B
alltoall of B bytes (B/P to each rank)          (P−1)/P·B
allgather where each rank contributes b bytes   (P−1)·b
==============================================  =========================

A round is one collective call. With P = 1 nothing is sent and no round counted.
"""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

import torch

TRANSPORTS = ("auto", "horovod")
DEFAULT_TIMEOUT_S = 600.0


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete in time: a peer is dead, stalled, or issued other collectives."""


def default_timeout_s() -> float:
    """Seconds a collective may take before :class:`CollectiveTimeoutError`: the environment
    variable ``HVD_ZOADAM_TIMEOUT_S``, else 600."""
    value = os.environ.get("HVD_ZOADAM_TIMEOUT_S")
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        timeout = float(value)
    except ValueError:
        raise ValueError(f"HVD_ZOADAM_TIMEOUT_S must be a number of seconds, got {value!r}") from None
    if not timeout > 0:
        raise ValueError(f"HVD_ZOADAM_TIMEOUT_S must be > 0, got {value!r}")
    return timeout


class CommCounter:
    """Bytes sent and rounds, per step kind (a string key such as ``"variance"``)."""

    def __init__(self):
        self.bytes_sent = defaultdict(float)  # fractional per call; rounded when reported
        self.rounds = defaultdict(int)
        self.kind = "other"

    def add(self, nbytes: float, rounds: int = 1):
        self.bytes_sent[self.kind] += nbytes
        self.rounds[self.kind] += rounds


class Transport:
    """Base class: rank, world size and counted collectives on 1-D tensors."""

    name = "base"

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.counter = CommCounter()

    def refresh(self) -> bool:
        """Re-read rank and world size after an elastic reset; True when they changed."""
        return False

    def _count(self, op: str, tensor: torch.Tensor):
        p = self.world_size
        if p == 1:
            return
        b = tensor.numel() * tensor.element_size()
        nbytes = {"allreduce": 2 * (p - 1) / p * b, "alltoall": (p - 1) / p * b,
                  "allgather": (p - 1) * b}[op]
        self.counter.add(nbytes)

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Concatenation of every rank's ``tensor`` in rank order: [P * len]."""
        self._count("allgather", tensor)
        return self._allgather(tensor, name)

    def alltoall(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Chunk q of ``tensor`` (len/P elements) goes to rank q; returns the P received chunks in rank order."""
        self._count("alltoall", tensor)
        return self._alltoall(tensor, name)

    def allreduce_average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """In-place average over ranks (Horovod's op=Average)."""
        self._count("allreduce", tensor)
        return self._allreduce_average_(tensor, name)

    def allgather_object(self, obj, name: str) -> list:
        """Every rank's picklable ``obj``, in rank order (uncounted: set-up only)."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class HorovodTransport(Transport):
    """Horovod collectives on a process set, each with a deadline.

    Every collective is started asynchronously and polled; past ``timeout_s`` seconds it
    raises :class:`CollectiveTimeoutError` naming the collective, instead of hanging
    when a peer died or stalled. The op names are rank-independent and unique per call site.
    """

    name = "horovod"

    def __init__(self, process_set=None, timeout_s: float | None = None):
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
            pause = min(0.005, pause + 0.0002)
        try:
            return hvd.synchronize(handle)
        except HorovodInternalError as exc:
            # Same type, so hvd.elastic.run still catches it; the message names the collective.
            raise HorovodInternalError(f"hvd_zoadam: the {op} '{name}' failed on rank {self.rank} of "
                                       f"{self.world_size} (a peer died or Horovod shut down): {exc}") from exc

    def _nbytes(self, tensor):
        return tensor.numel() * tensor.element_size()

    def _allgather(self, tensor, name):
        handle = self._hvd.allgather_async(tensor, name=name, process_set=self.process_set)
        return self._wait(handle, "allgather", name, self._nbytes(tensor))

    def _alltoall(self, tensor, name):
        handle = self._hvd.alltoall_async(tensor, name=name, process_set=self.process_set)
        return self._wait(handle, "alltoall", name, self._nbytes(tensor))[0]

    def _allreduce_average_(self, tensor, name):
        handle = self._hvd.allreduce_async_(tensor, op=self._hvd.Average, name=name, process_set=self.process_set)
        return self._wait(handle, "allreduce", name, self._nbytes(tensor))

    def allgather_object(self, obj, name):
        return _allgather_object_via_bytes(self, obj, name)


def _allgather_object_via_bytes(transport: Transport, obj, name: str) -> list:
    import pickle
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = transport._allgather(torch.tensor([data.numel()], dtype=torch.int64), name + ".sizes")
    gathered = transport._allgather(data, name + ".data")
    out, pos = [], 0
    for size in sizes.tolist():
        out.append(pickle.loads(gathered[pos:pos + size].numpy().tobytes()))
        pos += size
    return out


class ThreadGroup:
    """Shared state of P :class:`ThreadTransport` ranks living in one process."""

    def __init__(self, world_size: int, timeout_s: float = 60.0):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout_s)
        self.slots = [None] * world_size

    def transports(self) -> list["ThreadTransport"]:
        return [ThreadTransport(self, r) for r in range(self.world_size)]


class ThreadTransport(Transport):
    """One rank of a :class:`ThreadGroup`: collectives by exchange through shared slots."""

    name = "thread"

    def __init__(self, group: ThreadGroup, rank: int):
        super().__init__(rank, group.world_size)
        self.group = group

    def _exchange(self, value):
        """Every rank's ``value`` in rank order; tensors are copied before anyone moves on."""
        g = self.group
        g.barrier.wait()
        g.slots[self.rank] = value.clone() if isinstance(value, torch.Tensor) else value
        g.barrier.wait()
        out = list(g.slots)
        g.barrier.wait()
        return out

    def _allgather(self, tensor, name):
        return torch.cat(self._exchange(tensor))

    def _alltoall(self, tensor, name):
        parts = self._exchange(tensor)
        n = tensor.numel() // self.world_size
        return torch.cat([p[self.rank * n:(self.rank + 1) * n] for p in parts])

    def _allreduce_average_(self, tensor, name):
        parts = self._exchange(tensor)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return tensor.copy_(total / self.world_size)

    def allgather_object(self, obj, name):
        return self._exchange(obj)
