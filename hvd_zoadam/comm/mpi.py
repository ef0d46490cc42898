"""mpi4py transports: the 1-bit rounds over MPI's nonblocking collectives (:class:`MPIRounds`),
on Horovod's MPI world beside Horovod's averages (:class:`MPITransport`, ``transport="mpi"``)
or on any intracommunicator with no Horovod at all (:class:`MPICommTransport`, the transport of
:mod:`hvd_zoadam.mpi`). mpi4py is imported only when one of them is built or asked about."""
from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hvd_zoadam.comm.horovod import HorovodTransport
from hvd_zoadam.comm.transport import (
    CollectiveTimeoutError,
    CommCounter,
    Done,
    Transport,
    check_uniform_nodes,
    default_timeout_s,
    loads_plain,
    ranks_per_node_override,
)

if TYPE_CHECKING:
    from horovod.common.process_sets import ProcessSet
    from mpi4py import MPI

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


class MPIRounds(Transport):
    """The 1-bit rounds over mpi4py, shared by :class:`MPITransport` (on Horovod's MPI world) and
    :class:`MPICommTransport` (on any communicator, no Horovod): ``Iallgather``/``Ialltoall`` on
    the transport's communicator, polled against the deadline; the flag on a duplicate of it;
    CUDA tensors straight to a CUDA-aware MPI (:func:`mpi_cuda_aware`), else through reusable
    pinned host buffers; the split into nodes for the two-level exchange. A subclass gives
    :meth:`_world_comm`, :meth:`_comm_key` and :meth:`_flag_comm`, and calls :meth:`_init_mpi`."""

    name = "mpi"
    supports_async = True

    def _init_mpi(self, comm, timeout_s: float | None) -> None:
        """The mpi4py state: ``comm`` (None: made at the first collective by :meth:`_world_comm`)."""
        from mpi4py import MPI
        self._MPI, self._comm, self.cuda_aware, self._pinned = MPI, comm, None, {}
        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)

    def _world_comm(self):
        """The communicator the rounds travel on."""
        return self._comm

    def _comm_key(self):
        raise NotImplementedError

    def _flag_comm(self):
        raise NotImplementedError

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

    def allgather_flag(self, tensor: torch.Tensor, name: str):
        """See :meth:`Transport.allgather_flag`: on a duplicate of the rounds' communicator
        (one per communicator), which only the flags use, in the same order on every rank."""
        comm = self._flag_comm()
        self._count("allgather", tensor)
        return self.wait(self._start_on(comm, "allgather", tensor, name))

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

    def progress(self, handle: object) -> None:
        """MPI moves a nonblocking collective's data only inside MPI calls (no progress thread
        with the TCP transport): one ``Test`` moves what the sockets take now. Other handles
        (Horovod's) progress on their own."""
        if isinstance(handle, MPIHandle):
            handle.request.Test()

    def wait(self, handle: object):
        if isinstance(handle, Done):
            return handle.result
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


class MPITransport(MPIRounds, HorovodTransport):
    """The 1-bit phases over mpi4py on Horovod's own MPI world (algorithm.md §3 rounds 1–3).

    :class:`MPIRounds` on a communicator per process set, made at the first collective. The
    full-precision averages of the VARIANCE steps, and set-up messages, stay on Horovod's fused
    allreduce/allgather (:class:`~hvd_zoadam.comm.horovod.HorovodTransport`'s; NCCL or MPI,
    whichever Horovod uses). Byte counts follow the table of :mod:`hvd_zoadam.comm.transport`.

    Raises:
        ValueError: at construction, naming the reason (:func:`mpi_unavailable_reason`).
    """

    name = "mpi"

    def __init__(self, process_set: ProcessSet | None = None, timeout_s: float | None = None):
        reason = mpi_unavailable_reason()
        if reason is not None:
            raise ValueError(f"transport='mpi' cannot work here: {reason}")
        HorovodTransport.__init__(self, process_set, timeout_s)
        self._init_mpi(None, timeout_s)  # the communicator is made at the first collective: construction runs none

    def refresh(self) -> bool:
        return False  # MPI jobs are not elastic

    def describe(self) -> str:
        cuda = "" if self.cuda_aware is None else (", CUDA-aware" if self.cuda_aware else ", staged via host")
        return f"mpi (mpi4py on Horovod's MPI world{cuda})"

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

    def _start(self, op, tensor, name):
        if op == "allreduce":  # the fp32 averages stay on Horovod's fused allreduce
            return self._start_horovod(op, tensor, name)
        return self._start_on(self._world_comm(), op, tensor, name)


class MPICommTransport(MPIRounds):
    """The whole exchange over mpi4py on one intracommunicator, with no Horovod: the
    transport of :mod:`hvd_zoadam.mpi` (``comm``: default ``MPI.COMM_WORLD``), and of the
    node and cross-node communicators :meth:`MPITransport.node_split` makes.

    The 1-bit rounds are :class:`MPIRounds`'s (``Ialltoall``/``Iallgather``, polled against
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

    def __init__(self, comm: MPI.Intracomm | None = None, timeout_s: float | None = None,
                 parent_counter: CommCounter | None = None):
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        reason = mpi_comm_unavailable_reason(comm)
        if reason is not None:
            raise ValueError(f"hvd_zoadam: MPI cannot carry the exchange here: {reason}")
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._init_mpi(comm, timeout_s)
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
        received = MPIRounds.wait(self, handle.first)
        chunks = received.view(self.world_size, received.numel() // self.world_size)
        total = chunks[0].clone()
        for row in chunks[1:]:
            total += row
        gathered = MPIRounds.wait(self, self._start_on(self._side_comms()[2], "allgather", total,
                                                          f"{handle.name}.gather", stage="average.gather"))
        tensor = handle.tensor
        tensor.view(-1).copy_(gathered[:tensor.numel()]).div_(self.world_size)
        return tensor

    def wait(self, handle: object):
        if isinstance(handle, AverageHandle):
            return self._finish_average(handle)
        return super().wait(handle)

    def progress(self, handle: object) -> None:
        super().progress(handle.first if isinstance(handle, AverageHandle) else handle)

    def allgather_object(self, obj: object, name: str):
        return [loads_plain(data) for data in self._comm.allgather(pickle.dumps(obj))]  # bytes travel


def mpi_comm_unavailable_reason(comm: MPI.Comm) -> str | None:
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
