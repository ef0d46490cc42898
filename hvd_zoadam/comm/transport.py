"""The base of every transport: collectives on 1-D tensors among the ranks of one group, with
byte and round counters (algorithm.md §3), a deadline, and plain-data set-up messages.

One transport per file beside this one: :mod:`.horovod` (Horovod's collectives),
:mod:`.mpi` (mpi4py, on Horovod's MPI world or on any communicator), :mod:`.gloo` (a Gloo group
beside Horovod's), :mod:`.torch_distributed` (a ``torch.distributed`` process group) and
:mod:`.thread` (P ranks as threads of one process, the in-process oracle of the tests);
:mod:`.select` says which one ``transport="auto"`` gives.

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

import io
import os
import pickle
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

TRANSPORTS = ("auto", "horovod", "mpi", "gloo", "torch.distributed")  # the names the ``transport`` argument accepts
DEFAULT_TIMEOUT_S = 600.0


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete in time: a peer is dead, stalled, or issued other collectives."""


class CollectiveOrderError(RuntimeError):
    """Ranks started different collectives at the same position of an ordered transport (the
    thread ranks' ``ordered`` mode, which checks what MPI and torch.distributed cannot)."""


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
    """Bytes sent and rounds, per step kind (a string key such as ``"variance"``).

    A counter with a ``parent`` (the counter of a transport split from the job's, see
    :meth:`Transport.node_split`) takes its kind from the parent and adds every count to it
    as well, so the parent's totals stay complete."""

    def __init__(self, parent: "CommCounter | None" = None):
        self.bytes_sent = defaultdict(float)  # fractional per call; rounded when reported
        self.rounds = defaultdict(int)
        self.parent = parent
        self._kind = "other"

    @property
    def kind(self) -> str:
        return self.parent.kind if self.parent is not None else self._kind

    @kind.setter
    def kind(self, value: str) -> None:
        self._kind = value

    def add(self, nbytes: float, rounds: int = 1):
        self.bytes_sent[self.kind] += nbytes
        self.rounds[self.kind] += rounds
        if self.parent is not None:
            self.parent.add(nbytes, rounds)

    def total_bytes(self) -> int:
        return int(round(sum(self.bytes_sent.values())))


@dataclass
class Done:
    """The handle of a collective that completed inside ``start()``."""

    result: torch.Tensor


class Transport:
    """Base class: rank, world size and counted collectives on 1-D tensors.

    Subclasses implement :meth:`_start` (returning a handle), :meth:`wait` and
    :meth:`allgather_object`."""

    name = "base"
    supports_async = False  # True: start() returns before the peers arrive (overlap is possible)
    control_device = torch.device("cpu")  # where the small set-up and flag tensors travel from

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.counter = CommCounter()

    def refresh(self) -> bool:
        """Re-read rank and world size after an elastic reset; True when they changed."""
        return False

    @staticmethod
    def _nbytes(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

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
        return self.wait(self.start("allgather", tensor, name))

    def alltoall(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Chunk q of ``tensor`` (len/P elements) goes to rank q; returns the P received chunks in rank order."""
        return self.wait(self.start("alltoall", tensor, name))

    def allreduce_average_(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """In-place average over ranks (Horovod's op=Average)."""
        return self.wait(self.start("allreduce", tensor, name))

    def allgather_flag(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """:meth:`allgather` of the "gradients changed?" flag. Here the same; a transport whose
        collectives queue in order behind the rounds in flight (mpi4py) sends it on a channel
        of its own, so that reading it does not wait for every round 1 to finish."""
        return self.allgather(tensor, name)

    # Nonblocking form: start() returns a handle, wait() its result (what the blocking calls
    # above return). ``tensor`` must stay untouched until wait(). Every rank must start the
    # collectives of one transport in the same order (MPI matches nonblocking collectives on a
    # communicator by their order). This base class runs the collective inside start().
    def start(self, op: str, tensor: torch.Tensor, name: str, count: bool = True):
        """Start ``op`` (``"allgather"``, ``"alltoall"`` or ``"allreduce"``, the in-place average).
        ``count=False``: the caller counts the bytes and rounds itself."""
        if count:
            self._count(op, tensor)
        return self._start(op, tensor, name)

    def _start(self, op, tensor, name):
        raise NotImplementedError

    def wait(self, handle: object) -> torch.Tensor:
        """The result of a started collective; raises :class:`CollectiveTimeoutError` past the deadline."""
        raise NotImplementedError

    def progress(self, handle: object) -> None:
        """Let a started collective move its data now, without waiting for it (the backward
        hooks call it while their rounds are in flight). Nothing here: Horovod, Gloo and
        thread ranks progress on their own threads."""

    def allgather_object(self, obj: object, name: str) -> list:
        """Every rank's ``obj`` (plain data: None, numbers, strings, lists, tuples, dicts), in rank
        order (uncounted: set-up only)."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def can_split(self) -> bool:
        """Whether :meth:`node_split` knows the nodes here (``hierarchical="auto"`` stays flat
        where it does not)."""
        return type(self).node_split is not Transport.node_split

    def node_split(self, name: str) -> tuple["Transport", "Transport"]:
        """``(intra, cross)``: the collectives among this node's ranks (rank = local rank) and
        among the ranks with this rank's local rank on every node (rank = node index), for the
        two-level exchange (algorithm.md §3, "Two levels"). Every rank must call it, in the same
        order. Counts go to this transport's counter too.

        Raises:
            ValueError: this transport cannot be split, or the nodes hold different numbers of
                ranks (both counts named).
        """
        raise ValueError(f"hierarchical=True needs transport='mpi' or thread ranks; the {self.name!r} "
                         "transport cannot be split by node. Launch under MPI (mpirun, or horovodrun "
                         "--mpi) with mpi4py installed, or pass hierarchical=False")


def ranks_per_node_override() -> int | None:
    """``HVD_ZOADAM_RANKS_PER_NODE`` as an int (None when unset): nodes are then blocks of that
    many consecutive ranks, whatever the launcher says (tests on one host; clusters whose
    "node" for the two-level exchange is a socket or a switch).

    Raises:
        ValueError: not a positive integer.
    """
    value = os.environ.get("HVD_ZOADAM_RANKS_PER_NODE")
    if value is None or value == "":
        return None
    try:
        out = int(value)
    except ValueError:
        out = 0
    if out <= 0:
        raise ValueError(f"HVD_ZOADAM_RANKS_PER_NODE must be a positive integer, got {value!r}")
    return out


def check_uniform_nodes(local_sizes: list, world_size: int) -> int:
    """The common number of ranks per node, from every rank's count (in rank order).

    Raises:
        ValueError: the counts differ (two of them named) or do not divide the world size.
    """
    first = local_sizes[0]
    for rank, size in enumerate(local_sizes):
        if size != first:
            raise ValueError(f"hierarchical=True needs the same number of ranks on every node: rank 0's node has "
                             f"{first}, rank {rank}'s has {size}. Launch the same number of ranks per node "
                             "(mpirun --map-by ppr:L:node), or pass hierarchical=False")
    if world_size % first:
        raise ValueError(f"hierarchical=True: {first} ranks per node do not divide the world size {world_size}")
    return first


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (None, bools, numbers, strings, bytes, lists, tuples, dicts,
    sets): any class or function a pickle names is refused, so a set-up message runs no code."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"hvd_zoadam: a set-up message may hold plain data only, not {module}.{name}")


def loads_plain(data: bytes):
    """``pickle.loads`` of a set-up message (:meth:`Transport.allgather_object`), plain data only."""
    return _PlainUnpickler(io.BytesIO(data)).load()


def allgather_object_via_bytes(gather: Callable[[torch.Tensor, str], torch.Tensor], obj: object, name: str) -> list:
    """Every rank's ``obj`` from two ``gather(tensor, name)`` calls (the sizes, then the pickles
    concatenated), each message read as plain data (:func:`loads_plain`)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = gather(torch.tensor([data.numel()], dtype=torch.int64), name + ".sizes")
    gathered = gather(data, name + ".data")
    out, pos = [], 0
    for size in sizes.tolist():
        out.append(loads_plain(gathered[pos:pos + size].numpy().tobytes()))
        pos += size
    return out
