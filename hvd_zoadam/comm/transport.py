"""Collectives for the 1-bit exchange, with byte and round counters (algorithm.md §3).

A transport moves 1-D contiguous tensors among the ranks of one process set.
``HorovodTransport`` uses Horovod's own collectives (``hvd.alltoall``,
``hvd.allgather``, ``hvd.allreduce_``), which work under both the Gloo and the
MPI controller. ``ThreadTransport`` runs P ranks as threads of one process (the
in-process oracle of the tests and of :mod:`hvd_zoadam.oracle.simulate`).

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
import threading
import time
from collections import defaultdict
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


@dataclass
class HorovodHandle:
    """A Horovod async collective in flight."""

    handle: int
    op: str
    name: str
    nbytes: int


@dataclass
class MPIHandle:
    """An mpi4py nonblocking collective in flight, with its receive buffers.

    ``host_recv`` is what MPI writes (pinned host memory when CUDA tensors are staged);
    ``device_recv`` the CUDA tensor to copy it into at ``wait()`` (None without staging);
    ``host_send`` keeps the staged send buffer alive until then."""

    request: object
    op: str
    name: str
    nbytes: int
    recv: torch.Tensor
    host_recv: torch.Tensor
    device_recv: torch.Tensor | None
    host_send: torch.Tensor


@dataclass
class AverageHandle:
    """An :class:`MPICommTransport` average in flight: its first phase (``first``, the alltoall
    of the P chunks of ``tensor``) started; :meth:`MPICommTransport.wait` runs the rest."""

    first: MPIHandle
    tensor: torch.Tensor
    name: str


@dataclass
class ThreadHandle:
    """A :class:`ThreadTransport` collective: the k-th start of ``name`` on every rank (ordered
    groups: the k-th start of any name)."""

    op: str
    key: tuple
    tensor: torch.Tensor
    name: str


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

    def wait(self, handle) -> torch.Tensor:
        """The result of a started collective; raises :class:`CollectiveTimeoutError` past the deadline."""
        raise NotImplementedError

    def progress(self, handle) -> None:
        """Let a started collective move its data now, without waiting for it (the backward
        hooks call it while their rounds are in flight). Nothing here: Horovod, Gloo and
        thread ranks progress on their own threads."""

    def allgather_object(self, obj, name: str) -> list:
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


class HorovodTransport(Transport):
    """Horovod collectives on a process set, each with a deadline.

    Every collective is started asynchronously and polled; past ``timeout_s`` seconds it
    raises :class:`CollectiveTimeoutError` naming the collective, instead of hanging
    when a peer died or stalled. The op names are rank-independent and unique per call site.
    """

    name = "horovod"
    supports_async = True

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
            pause = min(0.001, pause + 0.0001)
        try:
            return hvd.synchronize(handle)
        except HorovodInternalError as exc:
            # Same type, so hvd.elastic.run still catches it; the message names the collective.
            raise HorovodInternalError(f"hvd_zoadam: the {op} '{name}' failed on rank {self.rank} of "
                                       f"{self.world_size} (a peer died or Horovod shut down): {exc}") from exc

    def _nbytes(self, tensor):
        return tensor.numel() * tensor.element_size()

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

    def wait(self, handle):
        if isinstance(handle, Done):
            return handle.result
        return self._wait_horovod(handle)

    def allgather_object(self, obj, name):
        """Over Horovod's allgather under every subclass (set-up only, paired by name)."""
        def gather(tensor, part_name):
            return self._wait_horovod(self._start_horovod("allgather", tensor, part_name))
        return _allgather_object_via_bytes(gather, obj, name)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (None, bools, numbers, strings, bytes, lists, tuples, dicts,
    sets): any class or function a pickle names is refused, so a set-up message runs no code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"hvd_zoadam: a set-up message may hold plain data only, not {module}.{name}")


def loads_plain(data: bytes):
    """``pickle.loads`` of a set-up message (:meth:`Transport.allgather_object`), plain data only."""
    return _PlainUnpickler(io.BytesIO(data)).load()


def _allgather_object_via_bytes(gather, obj, name: str) -> list:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = gather(torch.tensor([data.numel()], dtype=torch.int64), name + ".sizes")
    gathered = gather(data, name + ".data")
    out, pos = [], 0
    for size in sizes.tolist():
        out.append(loads_plain(gathered[pos:pos + size].numpy().tobytes()))
        pos += size
    return out


# -- mpi4py ---------------------------------------------------------------------------------

MPI_CUDA_AWARE_ENV = "HVD_ZOADAM_MPI_CUDA_AWARE"
_mpi_comms: dict = {}  # tuple(ranks) -> communicator over Horovod's MPI world
_mpi_flag_comms: dict = {}  # communicator key -> its duplicate, which carries only the flag


def mpi_unavailable_reason() -> str | None:
    """Why ``transport="mpi"`` cannot work in this process, or None when it can.

    Needs: Horovod initialised with the MPI controller (``hvd.mpi_enabled()``), MPI
    initialised with ``MPI_THREAD_MULTIPLE`` (``hvd.mpi_threads_supported()``: Horovod's
    background thread calls MPI too), mpi4py importable, and mpi4py's ``COMM_WORLD``
    being Horovod's world (same rank and size).
    """
    import horovod.torch as hvd
    if not hvd.is_initialized():
        return "Horovod has not been initialized; call hvd.init() first"
    if not hvd.mpi_enabled():
        return ("Horovod does not run with the MPI controller (e.g. horovodrun --gloo, or "
                "HOROVOD_CONTROLLER=gloo); launch with mpirun, horovodrun --mpi or srun --mpi=pmi2/pmix")
    if not hvd.mpi_threads_supported():
        return ("MPI is initialised without MPI_THREAD_MULTIPLE (HOROVOD_MPI_THREADS_DISABLE=1 or an MPI "
                "build without thread support), and Horovod's background thread also calls MPI; unset "
                "HOROVOD_MPI_THREADS_DISABLE or use transport='horovod'")
    try:
        from mpi4py import MPI
    except ImportError as exc:
        return f"mpi4py cannot be imported ({exc}); pip install mpi4py, or use transport='horovod'"
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (hvd.rank(), hvd.size()):
        return (f"mpi4py's COMM_WORLD (rank {world.Get_rank()} of {world.Get_size()}) is not Horovod's world "
                f"(rank {hvd.rank()} of {hvd.size()}), e.g. after hvd.init(comm=...); use transport='horovod'")
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return "mpi4py reports a thread level below MPI_THREAD_MULTIPLE; use transport='horovod'"
    return None


def mpi_cuda_aware() -> bool:
    """Whether MPI may be handed CUDA device buffers.

    ``HVD_ZOADAM_MPI_CUDA_AWARE=1``/``0`` decides when set; otherwise Open MPI's
    ``MPIX_Query_cuda_support()`` is asked, and any other MPI counts as not CUDA-aware
    (CUDA tensors are then staged through pinned host buffers).
    """
    value = os.environ.get(MPI_CUDA_AWARE_ENV)
    if value is not None:
        if value not in ("0", "1"):
            raise ValueError(f"{MPI_CUDA_AWARE_ENV} must be 0 or 1, got {value!r}")
        return value == "1"
    return bool(query_mpix_cuda_support())


def query_mpix_cuda_support() -> bool | None:
    """Open MPI's ``MPIX_Query_cuda_support()`` from the MPI library found by ctypes;
    None when there is no such library or function (MPICH, Intel MPI, no MPI)."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("mpi")
    if not name:
        return None
    try:
        query = ctypes.CDLL(name).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    return bool(query())


def _mpi_comm(process_set):
    """The communicator of ``process_set``'s ranks, made once per process set with
    ``MPI_Comm_create_group`` (collective over the set's members only, so process sets
    that train separate models never wait on each other), tagged by the set's id."""
    from mpi4py import MPI
    ranks = tuple(process_set.ranks)
    comm = _mpi_comms.get(ranks)
    if comm is None:
        world = MPI.COMM_WORLD
        group = world.Get_group().Incl(list(ranks))
        comm = world.Create_group(group, tag=1000 + int(process_set.process_set_id))
        group.Free()
        _mpi_comms[ranks] = comm
        _mpi_flag_comms[ranks] = comm.Dup()  # made with it, so every rank makes it at the same point
    return comm


class MPITransport(HorovodTransport):
    """The 1-bit phases over mpi4py on Horovod's own MPI world (algorithm.md §3 rounds 1–3).

    ``Iallgather``/``Ialltoall`` on a communicator per process set, each polled against
    the same deadline as :class:`HorovodTransport`. The full-precision averages of the
    VARIANCE steps, and set-up messages, stay on Horovod's fused allreduce/allgather
    (NCCL or MPI, whichever Horovod uses). Buffers: CPU tensors go to MPI zero-copy; CUDA
    tensors go straight to a CUDA-aware MPI (:func:`mpi_cuda_aware`), otherwise through
    reusable pinned host buffers. Byte counts follow the table above.

    Raises:
        ValueError: at construction, naming the reason (:func:`mpi_unavailable_reason`).
    """

    name = "mpi"

    def __init__(self, process_set=None, timeout_s: float | None = None):
        reason = mpi_unavailable_reason()
        if reason is not None:
            raise ValueError(f"transport='mpi' cannot work here: {reason}")
        super().__init__(process_set, timeout_s)
        from mpi4py import MPI
        self._MPI = MPI
        self._comm = None  # made at the first collective: construction runs none
        self.cuda_aware = None
        self._pinned = {}

    def refresh(self) -> bool:
        return False  # MPI jobs are not elastic

    def describe(self) -> str:
        cuda = "" if self.cuda_aware is None else (", CUDA-aware" if self.cuda_aware else ", staged via host")
        return f"mpi (mpi4py on Horovod's MPI world{cuda})"

    def node_split(self, name: str) -> tuple["Transport", "Transport"]:
        """See :meth:`Transport.node_split`. Nodes are the shared-memory domains MPI reports
        (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``), or blocks of
        ``HVD_ZOADAM_RANKS_PER_NODE`` consecutive ranks (:func:`ranks_per_node_override`); the
        cross-node communicator orders the nodes by their lowest rank. Collective over the
        process set's ranks (MPI ``Split``s, made once per process set)."""
        comm, forced = self._world_comm(), ranks_per_node_override()
        key = (self._comm_key(), forced)
        comms = _mpi_split_comms.get(key)
        if comms is None:
            if forced is not None:
                node = comm.Split(color=comm.Get_rank() // forced, key=comm.Get_rank())
            else:
                node = comm.Split_type(self._MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
            check_uniform_nodes(comm.allgather(node.Get_size()), comm.Get_size())
            lowest = node.allreduce(comm.Get_rank(), op=self._MPI.MIN)
            comms = _mpi_split_comms[key] = (node, comm.Split(color=node.Get_rank(), key=lowest))
        return (MPICommTransport(comms[0], self.timeout_s, self.counter),
                MPICommTransport(comms[1], self.timeout_s, self.counter))

    def _host(self, tensor, key, send: bool):
        """(tensor to hand MPI, device tensor to copy the result back into, or None).

        ``send``: MPI reads the tensor (a receive buffer is only written: nothing to stage
        or wait for; the send's synchronisation came first)."""
        if tensor.device.type == "cpu":
            return tensor, None
        if self.cuda_aware is None:
            self.cuda_aware = mpi_cuda_aware()
        if self.cuda_aware:
            if send:  # MPI reads device memory outside torch's streams: what the kernels queued must be done
                torch.cuda.current_stream(tensor.device).synchronize()
            return tensor, None
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < tensor.numel() or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
            self._pinned[key] = buf
        buf = buf[:tensor.numel()]
        if send:
            buf.copy_(tensor)  # device to pinned host: waits for the stream's work on the tensor
        return buf, (None if send else tensor)

    @staticmethod
    def _buf(tensor):
        if tensor.device.type == "cpu":
            return tensor.view(torch.uint8).numpy()
        return tensor.view(torch.uint8)  # __cuda_array_interface__, for a CUDA-aware MPI

    def _world_comm(self):
        """The process set's communicator, made at the first collective (construction runs none)."""
        if self._comm is None:
            self._comm = _mpi_comm(self.process_set)
        return self._comm

    def _comm_key(self):
        """What keys the communicators made from this transport's (the process set's ranks)."""
        return tuple(self.process_set.ranks)

    def _flag_comm(self):
        self._world_comm()
        return _mpi_flag_comms[self._comm_key()]

    def allgather_flag(self, tensor, name):
        """See :meth:`Transport.allgather_flag`: on a duplicate of the rounds' communicator
        (one per communicator), which only the flags use, in the same order on every rank."""
        comm = self._flag_comm()
        self._count("allgather", tensor)
        return self.wait(self._start_on(comm, "allgather", tensor, name))

    def _start(self, op, tensor, name):
        if op == "allreduce":  # the fp32 averages stay on Horovod's fused allreduce
            return self._start_horovod(op, tensor, name)
        return self._start_on(self._world_comm(), op, tensor, name)

    def _start_on(self, comm, op, tensor, name, stage=None):
        """Start ``op`` on ``comm``. ``stage``: the key of the pinned host buffers that stage
        CUDA tensors for an MPI that takes none (default ``name``: several collectives can be in
        flight at once); one key for collectives that are never in flight together."""
        MPI = self._MPI
        send = tensor.contiguous()
        numel = self.world_size * send.numel() if op == "allgather" else send.numel()
        recv = torch.empty(numel, dtype=send.dtype, device=send.device)
        key = name if stage is None else stage
        host_send, _ = self._host(send, (key, "send"), send=True)
        host_recv, device_recv = self._host(recv, (key, "recv"), send=False)
        sbuf, rbuf = [self._buf(host_send), MPI.BYTE], [self._buf(host_recv), MPI.BYTE]
        request = (comm.Iallgather if op == "allgather" else comm.Ialltoall)(sbuf, rbuf)
        return MPIHandle(request, op, name, self._nbytes(send), recv, host_recv, device_recv, host_send)

    def progress(self, handle) -> None:
        """MPI moves a nonblocking collective's data only inside MPI calls (no progress thread
        with the TCP transport): one ``Test`` moves what the sockets take now. Other handles
        (Horovod's) progress on their own."""
        if isinstance(handle, MPIHandle):
            handle.request.Test()

    def wait(self, handle):
        if not isinstance(handle, MPIHandle):
            return super().wait(handle)
        request, op, name, nbytes = handle.request, handle.op, handle.name, handle.nbytes
        # MPI moves a nonblocking collective's data only inside MPI calls (no progress thread
        # with the TCP transport), so poll without sleeping: a sleeping poll left the link idle
        # between calls (measured on a 100 Mbit/s link: 0.69 steps/s instead of ...). sleep(0)
        # still yields the core; the clock is read every 64 polls.
        deadline, polls = time.monotonic() + self.timeout_s, 0
        while not request.Test():
            polls += 1
            if polls % 64 == 0 and time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"hvd_zoadam: the {op} '{name}' ({nbytes} bytes, mpi4py) did not complete within "
                    f"{self.timeout_s:g} s on rank {self.rank} of {self.world_size}: a peer is dead or stalled, or "
                    "the ranks issue different collectives. Set HVD_ZOADAM_TIMEOUT_S to change the limit.")
            time.sleep(0)
        if handle.device_recv is not None:
            handle.device_recv.copy_(handle.host_recv)
        return handle.recv


class MPICommTransport(MPITransport):
    """The whole exchange over mpi4py on one intracommunicator, with no Horovod: the
    transport of :mod:`hvd_zoadam.mpi` (``comm``: default ``MPI.COMM_WORLD``), and of the
    node and cross-node communicators :meth:`MPITransport.node_split` makes.

    The 1-bit rounds are :class:`MPITransport`'s (``Ialltoall``/``Iallgather``, polled against
    the deadline). The full-precision average is a reduce-scatter and an allgather, each rank
    summing its chunk of every rank's tensor in rank order and dividing by the world size
    (:meth:`_start_allreduce`): every rank sends 2(P−1)/P of the bytes, over both directions of
    each link at once (Open MPI's nonblocking ``Iallreduce`` reduced to a root and broadcast,
    twice the time at P = 2), and at P = 2 the result equals Horovod's to the last bit. The
    flag and each phase of the averages travel on duplicates of ``comm`` of their own, made
    together at the first collective (construction runs none). Counts go to
    ``parent_counter`` too when given.

    Raises:
        TypeError: ``comm`` is not an mpi4py intracommunicator.
        ValueError: MPI cannot serve this transport here (:func:`mpi_comm_unavailable_reason`).
    """

    name = "mpi"

    def __init__(self, comm=None, timeout_s: float | None = None, parent_counter: CommCounter | None = None):
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        reason = mpi_comm_unavailable_reason(comm)
        if reason is not None:
            raise ValueError(f"hvd_zoadam: MPI cannot carry the exchange here: {reason}")
        Transport.__init__(self, comm.Get_rank(), comm.Get_size())
        self._MPI, self._comm, self.cuda_aware, self._pinned = MPI, comm, None, {}
        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        self.process_set = None
        if parent_counter is not None:
            self.counter = CommCounter(parent_counter)

    def describe(self) -> str:
        cuda = "" if self.cuda_aware is None else (", CUDA-aware" if self.cuda_aware else ", staged via host")
        return f"mpi (mpi4py{cuda})"

    def _comm_key(self):
        """The communicator object's identity, kept alive here so that the key stays its own
        (a handle could be reused by MPI once the user frees the communicator)."""
        _mpi_keyed_comms.setdefault(id(self._comm), self._comm)
        return ("comm", id(self._comm))

    def _side_comms(self) -> tuple:
        """(the flag's, the averages' first phase's, their second phase's) duplicates of
        ``comm``, made together the first time (collective: at every rank's first collective
        or flag, so in the same place). Each phase on a communicator of its own: the ranks
        need only start their averages in one order and wait for them in one order."""
        key = self._comm_key()
        if key not in _mpi_flag_comms:
            _mpi_flag_comms[key] = self._comm.Dup()
            _mpi_average_comms[key] = (self._comm.Dup(), self._comm.Dup())
        return (_mpi_flag_comms[key], *_mpi_average_comms[key])

    def _flag_comm(self):
        return self._side_comms()[0]

    def _start(self, op, tensor, name):
        if op == "allreduce":
            return self._start_allreduce(tensor, name)
        self._side_comms()  # made before any collective of this communicator is in flight
        return self._start_on(self._comm, op, tensor, name)

    def _start_allreduce(self, tensor, name):
        """The average's first phase: ``tensor`` (floating point, contiguous, left untouched
        until :meth:`wait`) zero-padded to a multiple of P elements, its P chunks to their
        ranks (``Ialltoall`` on the first phase's communicator). The second phase is issued at
        :meth:`wait`, on a communicator of its own: every rank must start its averages in one
        order and wait for them in one order, as every collective of an ordered transport."""
        if not tensor.is_floating_point():
            raise TypeError(f"hvd_zoadam: the average '{name}' takes a floating-point tensor, got {tensor.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"hvd_zoadam: the average '{name}' needs a contiguous tensor")
        n, p = tensor.numel(), self.world_size
        send = torch.zeros(-(-n // p) * p, dtype=tensor.dtype, device=tensor.device)
        send[:n] = tensor.view(-1)
        first = self._start_on(self._side_comms()[1], "alltoall", send, f"{name}.scatter")
        return AverageHandle(first, tensor, name)

    def _finish_average(self, handle: AverageHandle) -> torch.Tensor:
        """The average's second phase: this rank's chunk summed over the ranks in rank order,
        the sums allgathered, the average written into the tensor."""
        received = MPITransport.wait(self, handle.first)
        chunks = received.view(self.world_size, received.numel() // self.world_size)
        total = chunks[0].clone()
        for row in chunks[1:]:
            total += row
        gathered = MPITransport.wait(self, self._start_on(self._side_comms()[2], "allgather", total,
                                                          f"{handle.name}.gather", stage="average.gather"))
        tensor = handle.tensor
        tensor.view(-1).copy_(gathered[:tensor.numel()]).div_(self.world_size)
        return tensor

    def wait(self, handle):
        if isinstance(handle, AverageHandle):
            return self._finish_average(handle)
        return super().wait(handle)

    def progress(self, handle) -> None:
        super().progress(handle.first if isinstance(handle, AverageHandle) else handle)

    def allgather_object(self, obj, name):
        return [loads_plain(data) for data in self._comm.allgather(pickle.dumps(obj))]  # bytes travel


def mpi_comm_unavailable_reason(comm) -> str | None:
    """Why :class:`MPICommTransport` cannot run on ``comm``, or None when it can.

    Needs: MPI initialised (importing ``mpi4py.MPI`` does that) and not finalised, at a thread
    level of ``MPI_THREAD_SERIALIZED`` or above (the backward hooks of CUDA models run on
    autograd's threads), and ``comm`` an intracommunicator (not ``COMM_NULL``).

    Raises:
        TypeError: ``comm`` is not an mpi4py intracommunicator.
    """
    from mpi4py import MPI
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:  # what Split gives the ranks it leaves out
        return "comm is MPI.COMM_NULL: build the optimizer only on the ranks of the communicator it trains with"
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD or comm.Split(...)), "
                        f"got {type(comm).__name__}")
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return "MPI is not initialised (or already finalised); import mpi4py.MPI before building the optimizer"
    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        return ("MPI was initialised below MPI_THREAD_SERIALIZED (mpi4py.rc.thread_level); leave "
                "mpi4py.rc.thread_level at its default, 'multiple'")
    return None


_mpi_keyed_comms: dict = {}  # id(communicator) -> the communicator, for MPICommTransport._comm_key
_mpi_average_comms: dict = {}  # communicator key -> its two duplicates for MPICommTransport's averages' phases
_mpi_split_comms = {}  # (communicator key, HVD_ZOADAM_RANKS_PER_NODE) -> (node comm, cross-node comm)


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

    def subgroup(self, key, size: int) -> "ThreadGroup":
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

    def wait(self, handle):
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

    def allgather_object(self, obj, name):
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
