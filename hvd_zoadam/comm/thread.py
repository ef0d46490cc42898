"""P ranks as threads of one process: the collectives of the in-process tests and of the
two-level exchange's simulated nodes (:class:`ThreadGroup`, :class:`ThreadTransport`)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hvd_zoadam.comm.transport import (
    CollectiveOrderError,
    CollectiveTimeoutError,
    CommCounter,
    Done,
    Transport,
    check_uniform_nodes,
)


@dataclass
class ThreadHandle:
    """A :class:`ThreadTransport` collective: the k-th start of ``name`` on every rank (ordered
    groups: the k-th start of any name)."""

    op: str
    key: tuple
    tensor: torch.Tensor
    name: str


class ThreadGroup:
    """Shared state of P :class:`ThreadTransport` ranks living in one process."""

    def __init__(self, world_size: int, timeout_s: float = 60.0, ranks_per_node: int | None = None,
                 ordered: bool = False):
        """``ranks_per_node``: the simulated topology for :meth:`ThreadTransport.node_split`
        (nodes are blocks of that many consecutive ranks; default: one node). ``ordered``:
        match nonblocking collectives by their order, as MPI and torch.distributed do, and
        raise :class:`CollectiveOrderError` when the k-th collectives of two ranks differ."""
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.ordered = ordered
        self.ranks_per_node = world_size if ranks_per_node is None else ranks_per_node
        self._subgroups = {}  # ("node", i) / ("cross", local rank) -> ThreadGroup
        self._lock = threading.Lock()
        self.barrier = threading.Barrier(world_size, timeout=timeout_s)
        self.slots = [None] * world_size
        # Nonblocking collectives, matched by name like Horovod's: the k-th start of a name on
        # each rank pairs with the k-th start of that name on every other rank (ordered: the
        # k-th start of any name, whose op, name and size must then agree).
        self.cond = threading.Condition()
        self.pending = {}   # (name, k) -> {"values": [per rank], "left": ranks yet to wait}
        self.started = {}   # (name, rank) -> starts so far
        self.aborted = False

    def abort(self) -> None:
        """Release every rank blocked in a collective (one rank failed)."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
        self.barrier.abort()
        for sub in list(self._subgroups.values()):
            sub.abort()

    def subgroup(self, key: tuple, size: int) -> "ThreadGroup":
        """The shared sub-group ``key`` of ``size`` ranks (made by the first rank to ask)."""
        with self._lock:
            if key not in self._subgroups:
                self._subgroups[key] = ThreadGroup(size, self.timeout_s, ordered=self.ordered)
            return self._subgroups[key]

    def transports(self) -> list["ThreadTransport"]:
        return [ThreadTransport(self, r) for r in range(self.world_size)]


class ThreadTransport(Transport):
    """One rank of a :class:`ThreadGroup`: collectives by exchange through shared slots."""

    name = "thread"
    supports_async = True

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

    def _start(self, op, tensor, name):
        g = self.group
        key = None if g.ordered else name
        with g.cond:
            k = g.started.get((key, self.rank), 0)
            g.started[(key, self.rank)] = k + 1
            entry = g.pending.setdefault((key, k), {"values": [None] * self.world_size, "left": self.world_size,
                                                    "what": [None] * self.world_size})
            entry["values"][self.rank] = tensor.clone()
            entry["what"][self.rank] = (op, name, tensor.numel())
            g.cond.notify_all()
        return ThreadHandle(op, (key, k), tensor, name)

    def wait(self, handle: object):
        if isinstance(handle, Done):
            return handle.result
        op, key, tensor = handle.op, handle.key, handle.tensor
        g = self.group
        with g.cond:
            entry = g.pending[key]
            if not g.cond.wait_for(lambda: g.aborted or all(v is not None for v in entry["values"]), g.timeout_s):
                raise CollectiveTimeoutError(f"hvd_zoadam: the {op} '{handle.name}' did not complete within "
                                             f"{g.timeout_s:g} s on thread-rank {self.rank}")
            if g.aborted:
                raise CollectiveTimeoutError(f"hvd_zoadam: the {op} '{handle.name}' was aborted (another rank failed)")
            parts, what = entry["values"], entry["what"]
            entry["left"] -= 1
            if entry["left"] == 0:
                del g.pending[key]
        if any(w != what[self.rank] for w in what):
            q = next(r for r, w in enumerate(what) if w != what[self.rank])
            raise CollectiveOrderError(f"hvd_zoadam: collective number {key[1]} is {what[self.rank]} on thread-rank "
                                       f"{self.rank} but {what[q]} on thread-rank {q} (op, name, elements)")
        if op == "allgather":
            return torch.cat(parts)
        if op == "alltoall":
            n = tensor.numel() // self.world_size
            return torch.cat([p[self.rank * n:(self.rank + 1) * n] for p in parts])
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return tensor.copy_(total / self.world_size)

    def allgather_object(self, obj: object, name: str):
        return self._exchange(obj)

    def node_split(self, name: str) -> tuple["Transport", "Transport"]:
        """See :meth:`Transport.node_split`: nodes are blocks of the group's ``ranks_per_node``."""
        g = self.group
        local = check_uniform_nodes([g.ranks_per_node], self.world_size)  # blocks of one size
        nodes = self.world_size // local
        node, local_rank = divmod(self.rank, local)
        intra = ThreadTransport(g.subgroup((name, "node", node), local), local_rank)
        cross = ThreadTransport(g.subgroup((name, "cross", local_rank), nodes), node)
        intra.counter, cross.counter = CommCounter(self.counter), CommCounter(self.counter)
        return intra, cross


def run_ranks(world_size: int, fn: Callable[[int, ThreadTransport], object], timeout_s: float = 600) -> list:
    """``fn(rank, transport)`` on ``world_size`` thread ranks of one :class:`ThreadGroup`; their
    results in rank order. The first exception a rank raises is raised here, once every rank
    has ended (the others are released from their collectives)."""
    group = ThreadGroup(world_size, timeout_s=timeout_s)
    results, errors = [None] * world_size, []

    def body(rank: int, transport: ThreadTransport):
        try:
            results[rank] = fn(rank, transport)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            group.abort()

    threads = [threading.Thread(target=body, args=(r, t)) for r, t in enumerate(group.transports())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
