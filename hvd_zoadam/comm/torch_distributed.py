"""Collectives over a ``torch.distributed`` process group (Gloo on CPU tensors, NCCL on CUDA
tensors): the transport of :mod:`hvd_zoadam.distributed`, for jobs launched by ``torchrun``.

The 1-bit exchange's two rounds are ``all_to_all_single`` and ``all_gather_single``; the
full-precision average is ``all_reduce`` (SUM, then a division by the world size, as Gloo has
no AVG). Every collective is started with ``async_op=True`` and polled against a deadline,
so a dead or stalled peer raises :class:`~hvd_zoadam.comm.transport.CollectiveTimeoutError`
naming the collective instead of hanging. Collectives are matched by their order on the
group, as MPI's are: every rank starts them in the same order (the protocol does). Bytes and
rounds are counted with the table of :mod:`hvd_zoadam.comm.transport`.
"""
from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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
    from torch.distributed import ProcessGroup

BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda"}  # the device type each backend moves


def torch_distributed_unavailable_reason() -> str | None:
    """Why the torch.distributed transport cannot work in this process, or None when it can."""
    import torch.distributed as dist
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if not dist.is_initialized():
        return ("torch.distributed is not initialised: call torch.distributed.init_process_group('gloo') "
                "(CPU tensors) or ('nccl') (CUDA tensors) first, e.g. in a script launched by torchrun")
    return None


@dataclass
class WorkHandle:
    """A ``torch.distributed`` collective in flight and the tensor it writes."""

    work: object
    op: str
    name: str
    nbytes: int
    out: torch.Tensor
    divide_by: int  # the allreduce's world size (its SUM becomes the average at wait()), else 1


class TorchDistributedTransport(Transport):
    """The collectives of one ``torch.distributed`` process group (default: the default group).

    Construction issues no collective. Raises ``ValueError`` (naming the fix) when
    ``torch.distributed`` is not initialised."""

    name = "torch.distributed"
    supports_async = True

    def __init__(self, process_group: ProcessGroup | None = None, timeout_s: float | None = None,
                 parent_counter: CommCounter | None = None):
        reason = torch_distributed_unavailable_reason()
        if reason is not None:
            raise ValueError(reason)
        import torch.distributed as dist
        self._dist = dist
        self.group = process_group
        self.backend = str(dist.get_backend(process_group)).lower()
        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        super().__init__(dist.get_rank(process_group), dist.get_world_size(process_group))
        if parent_counter is not None:
            self.counter = CommCounter(parent_counter)

    def describe(self) -> str:
        return f"torch.distributed ({self.backend})"

    @property
    def control_device(self) -> torch.device:
        """Where set-up messages and the flag travel from: this rank's current GPU under NCCL,
        which moves CUDA tensors only (read at each use: a script may call
        ``torch.cuda.set_device`` after building the optimizer), else the CPU."""
        if BACKEND_DEVICES.get(self.backend) == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def check_device(self, device: torch.device | str) -> None:
        """ValueError when tensors on ``device`` cannot travel over this group's backend."""
        device = torch.device(device)
        want = BACKEND_DEVICES.get(self.backend)
        if want is not None and device.type != want:
            fix = "init_process_group('nccl') for CUDA tensors" if device.type == "cuda" else \
                "init_process_group('gloo') for CPU tensors (or move the model to this rank's GPU)"
            raise ValueError(f"hvd_zoadam: a tensor on {device} cannot travel over the {self.backend!r} backend of "
                             f"this process group, which moves {want} tensors; use {fix}")

    def _start(self, op, tensor, name):
        self.check_device(tensor.device)
        dist, send = self._dist, tensor.contiguous()
        nbytes = send.numel() * send.element_size()
        if op == "allreduce":
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            return WorkHandle(work, op, name, nbytes, tensor, self.world_size)
        if op == "alltoall":
            out = torch.empty_like(send)
            work = dist.all_to_all_single(out, send, group=self.group, async_op=True)
        else:
            out = torch.empty(self.world_size * send.numel(), dtype=send.dtype, device=send.device)
            work = dist.all_gather_single(out, send, group=self.group, async_op=True)
        return WorkHandle(work, op, name, nbytes, out, 1)

    def wait(self, handle: object):
        if isinstance(handle, Done):
            return handle.result
        deadline, pause = time.monotonic() + self.timeout_s, 0.0
        while not handle.work.is_completed():
            if time.monotonic() > deadline:
                raise self._timeout(handle)
            time.sleep(pause)
            pause = min(0.001, pause + 0.0001)
        try:
            handle.work.wait()
        except Exception as exc:  # noqa: BLE001 - Gloo and NCCL raise RuntimeError subclasses of their own
            raise self._timeout(handle, exc) from exc
        if handle.divide_by > 1:
            handle.out.div_(handle.divide_by)
        return handle.out

    def _timeout(self, handle, cause=None) -> CollectiveTimeoutError:
        what = f"failed ({type(cause).__name__}: {cause})" if cause is not None else \
            f"did not complete within {self.timeout_s:g} s"
        return CollectiveTimeoutError(
            f"hvd_zoadam: the {handle.op} '{handle.name}' ({handle.nbytes} bytes, torch.distributed "
            f"{self.backend}) {what} on rank {self.rank} of {self.world_size}: a peer is dead or stalled, or the "
            "ranks issue different collectives. Set HVD_ZOADAM_TIMEOUT_S to change the limit.")

    def allgather_object(self, obj: object, name: str):
        """Every rank's picklable ``obj`` in rank order (these bytes come from this job's own
        ranks): two uncounted allgathers under the same deadline as every collective (the
        sizes, then the pickles padded to the longest), so a peer that never arrives at set-up
        raises :class:`CollectiveTimeoutError` too."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        gather = lambda t, part: self.wait(self.start("allgather", t, f"{name}.{part}", count=False)).cpu()  # noqa: E731
        on = self.control_device  # the CPU, or this rank's GPU under NCCL
        sizes = gather(torch.tensor([data.numel()], dtype=torch.int64, device=on), "sizes").tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        rows = gather(padded.to(on), "data").view(self.world_size, max(sizes))
        return [loads_plain(rows[r, :size].numpy().tobytes()) for r, size in enumerate(sizes)]

    def can_split(self) -> bool:
        """True where the ranks per node are known: ``HVD_ZOADAM_RANKS_PER_NODE`` or torchrun's
        ``LOCAL_WORLD_SIZE``."""
        return ranks_per_node_override() is not None or bool(os.environ.get("LOCAL_WORLD_SIZE"))

    def node_split(self, name: str) -> tuple["Transport", "Transport"]:
        """See :meth:`Transport.node_split`. Nodes are blocks of ``HVD_ZOADAM_RANKS_PER_NODE``
        consecutive ranks when set, else of ``LOCAL_WORLD_SIZE`` (what torchrun sets). The
        subgroups come from ``torch.distributed.new_group``, made once per (group, block size)
        and called by every rank for every subgroup, in the same order."""
        local = ranks_per_node_override() or _local_world_size()
        local = check_uniform_nodes(self.allgather_object(local, name + ".nodes"), self.world_size)
        key = (self._global_ranks(), local)
        groups = _split_groups.get(key)
        if groups is None:
            ranks, nodes = key[0], self.world_size // local
            intra = [self._dist.new_group([ranks[n * local + i] for i in range(local)]) for n in range(nodes)]
            cross = [self._dist.new_group([ranks[n * local + i] for n in range(nodes)]) for i in range(local)]
            groups = _split_groups[key] = (intra, cross)
        node, local_rank = divmod(self.rank, local)
        return (TorchDistributedTransport(groups[0][node], self.timeout_s, self.counter),
                TorchDistributedTransport(groups[1][local_rank], self.timeout_s, self.counter))

    def _global_ranks(self) -> tuple:
        if self.group is None:
            return tuple(range(self.world_size))
        return tuple(self._dist.get_global_rank(self.group, r) for r in range(self.world_size))


_split_groups: dict = {}  # (global ranks, ranks per node) -> ([node groups], [cross-node groups])


def _local_world_size() -> int:
    """``LOCAL_WORLD_SIZE`` (torchrun's ranks on this node); ValueError naming the fix when unset."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if not value:
        raise ValueError("hierarchical=True needs the ranks per node: launch with torchrun (it sets "
                         "LOCAL_WORLD_SIZE) or set HVD_ZOADAM_RANKS_PER_NODE, or pass hierarchical=False")
    return int(value)
