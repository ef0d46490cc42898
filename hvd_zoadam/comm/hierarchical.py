"""The two-level 1-bit exchange of a bucket, for nodes of several ranks (algorithm.md §3, "Two levels").

N nodes of L ranks each (P = N·L). The bucket of n elements is cut into L shards
(:func:`hvd_zoadam.core.layout.node_shards`); local rank l owns shard l:

1. intra-node alltoall: shard q of every local rank's ``y`` goes to local rank q, with the step
   the rank is at. Local rank l averages the L pieces of its shard in float32, in local-rank
   order (sum, then divide by L): the node's average ȳ_l. Full precision, on the fast links.
2. the two-round 1-bit exchange :class:`~hvd_zoadam.comm.protocol.Exchange` of ȳ_l among the N
   ranks with local rank l (one per node), with its own ``worker_error`` and ``server_error``
   sized for shard l and a world of N. Only this level crosses the slow network.
3. intra-node allgather of ``[flag, lowest step, highest step (int32) | C(ȳ_l) (float32)]``:
   every rank gets the whole result and every shard's flag.

The flags make the skip and the step check agree across the whole job: a shard's cross-node
exchange is agreed among its N ranks, and step 3 spreads every shard's verdict to every rank of
each node. Both error buffers stay staged until then. Every rank of a node gathers the same
floats, and the N ranks of one local rank decompress the same bytes, so the result is bitwise
identical on every rank. The oracle is :func:`hvd_zoadam.oracle.simulate.simulate_hierarchical_allreduce`.

Bytes sent per rank and exchange, m = ceil(n/L): (L−1)·(4 + 4m) in step 1 and (L−1)·(12 + 4m)
in step 3, inside the node; the flat formula at world size N for shard l in step 2, between nodes
(algorithm.md §3, "Counting bytes").
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from hvd_zoadam import native
from hvd_zoadam.comm.protocol import Exchange, _align4, check_layout, exchange_bytes, step_mismatch
from hvd_zoadam.comm.transport import Transport
from hvd_zoadam.core.layout import node_shards, padded_numel, segment_offsets, shard_segments


def intra_node_bytes(width: int) -> tuple[int, int]:
    """Sizes in bytes of step 1's message to each local rank, ``4 + 4m``, and of step 3's
    allgather message, ``12 + 4m`` word-aligned, for shards of m = ``width`` elements."""
    return 4 + 4 * width, _align4(12 + 4 * width)


def hierarchical_exchange_bytes(numels: Iterable[int], world_size: int, ranks_per_node: int) -> list[tuple[int, int]]:
    """Per local rank l, the bytes one rank sends in one two-level exchange of a bucket of
    segments ``numels``: ``(inside the node, between nodes)``, (L − 1) times both messages of
    :func:`intra_node_bytes` and the flat :func:`~hvd_zoadam.comm.protocol.exchange_bytes` of
    shard l at world size N = P/L. What the transport's counters add. Pure integer arithmetic."""
    offsets = segment_offsets(numels)
    local, nodes = ranks_per_node, world_size // ranks_per_node
    shards = node_shards(offsets[-1], local)
    inside = (local - 1) * sum(intra_node_bytes(shards[0][1] - shards[0][0]))
    return [(inside, exchange_bytes(shard_segments(offsets, lo, hi), nodes) if hi > lo else 0) for lo, hi in shards]


class HierarchicalExchange:
    """One bucket's two-level exchange on one rank; the interface of
    :class:`~hvd_zoadam.comm.protocol.Exchange` (``start -> serve -> gather -> commit/rollback``),
    except that :meth:`gather` returns C(y) unpacked, float32[numel].

    Args:
        numels: the bucket's scale segments, in order (all > 0).
        transport: the job's collectives (world size P, rank).
        levels: ``(intra, cross)`` of ``transport.node_split``.
        name: a rank-independent, job-unique prefix for the collective names.
        device: where the buffers live.

    Attributes:
        worker_error, server_error: float32, the error buffers of this rank's shard exchange
            (padded for a world of N); empty when the shard is empty.
        input: float32[L·m], the buffer a caller fills with ``y`` (padding at 0).
        padded_numel: L·m. step: the step the next exchange announces.
        lo, hi: this rank's shard of the bucket.
    """

    def __init__(self, numels: Iterable[int], transport: Transport, levels: tuple[Transport, Transport], name: str,
                 device: torch.device | str | None = None):
        self.device = device = torch.device("cpu" if device is None else device)
        self.transport, (self.intra, self.cross) = transport, levels
        self.name = name
        offsets = segment_offsets(numels)
        self.numel = offsets[-1]
        self.local_size, self.nodes = self.intra.world_size, self.cross.world_size
        shards = node_shards(self.numel, self.local_size)
        self.width = shards[0][1] - shards[0][0]          # m: elements per shard message
        self.lo, self.hi = shards[self.intra.rank]
        self.padded_numel = self.local_size * self.width
        self.input = torch.zeros(self.padded_numel, device=device)
        self.step = 0
        self.inner = None
        if self.hi > self.lo:
            self.inner = Exchange(shard_segments(offsets, self.lo, self.hi), self.cross, f"{name}.x", device=device)
        self._alone = None  # N = 1: the node average itself (no 1-bit exchange, no error feedback)
        if self.inner is not None and self.nodes == 1:
            self._alone = torch.zeros(padded_numel(self.hi - self.lo, 1), device=device)
        self._m1, self._m3 = intra_node_bytes(self.width)
        self._send = torch.zeros(self.local_size, self._m1, dtype=torch.uint8, device=device)
        self._msg = torch.zeros(self._m3, dtype=torch.uint8, device=device)
        self._result = torch.zeros(self.padded_numel, device=device)
        self._steps = (0, 0)

    # -- the error buffers -----------------------------------------------------------------
    @property
    def worker_error(self) -> torch.Tensor:
        return self.inner.worker_error if self.inner is not None else torch.zeros(0, device=self.device)

    @property
    def server_error(self) -> torch.Tensor:
        return self.inner.server_error if self.inner is not None else torch.zeros(0, device=self.device)

    def memory_bytes(self) -> dict:
        inner = self.inner.memory_bytes() if self.inner is not None else {"error_buffers": 0, "scratch": 0}
        own = (self.input.numel() + self._result.numel()) * 4 + self._send.numel() + self._msg.numel()
        return {"error_buffers": inner["error_buffers"], "scratch": inner["scratch"] + own}

    def mask_errors(self, mask: torch.Tensor) -> None:
        """Zero both error buffers where ``mask`` (bool[numel], bucket order) is False."""
        if self.inner is not None:
            self.inner.mask_errors(mask[self.lo:self.hi])

    def zero_errors(self) -> None:
        if self.inner is not None:
            self.inner.zero_errors()

    def set_errors(self, worker: torch.Tensor, server: torch.Tensor) -> None:
        """Load the bucket's error feedback from the global layout (float32, >= numel each, bucket
        order): this shard's worker error from ``worker``, its server chunk from ``server``."""
        if self.inner is None:
            return
        n = self.hi - self.lo
        w = torch.zeros(self.inner.padded_numel, device=self.device)
        s = torch.zeros_like(w)
        w[:n], s[:n] = worker[self.lo:self.hi], server[self.lo:self.hi]
        self.inner.set_errors(w, s)

    def error_contribution(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """As :meth:`Exchange.error_contribution`, in the bucket's global layout (float32 of
        ``padded_numel(numel, P)``): this shard's worker error, and its server chunk; the worker
        errors in the job are one per node (N)."""
        size = padded_numel(self.numel, self.transport.world_size)
        worker = torch.zeros(size, device=self.device)
        server = torch.zeros(size, device=self.device)
        if self.inner is not None:
            n = self.hi - self.lo
            worker[self.lo:self.hi] = self.inner.worker_error[:n]
            a = self.cross.rank * self.inner.chunk_numel
            b = min(n, a + self.inner.chunk_numel)
            if b > a:
                server[self.lo + a:self.lo + b] = self.inner.server_error[:b - a]
        return worker, server, self.nodes

    # -- the phases ------------------------------------------------------------------------
    def start(self, y: torch.Tensor):
        """Step 1 out: each local rank's shard of ``y`` (float32[padded_numel]), with the step."""
        send = self._send
        send[:, :4].view(torch.int32).fill_(self.step)
        send[:, 4:].view(torch.float32).copy_(y[:self.padded_numel].view(self.local_size, self.width))
        return self.intra.start("alltoall", send.view(-1), f"{self.name}.shards")

    def serve(self, shards_handle: object):
        """Step 1 in (the node average of this shard), then step 2 up to its round 2 in flight."""
        recv = self.intra.wait(shards_handle).view(self.local_size, self._m1)
        steps = recv[:, :4].contiguous().view(torch.int32).view(-1)
        self._steps = (int(steps.min()), int(steps.max()))
        if self.inner is None:
            return None
        n = self.hi - self.lo
        pieces = recv[:, 4:4 + 4 * n].contiguous().view(torch.float32)
        total = pieces[0].clone()
        for j in range(1, self.local_size):  # local-rank order: the oracle's order
            total += pieces[j]
        target = self._alone if self._alone is not None else self.inner.input
        torch.div(total, self.local_size, out=target[:n])
        if self._alone is not None:
            return None
        self.inner.step = self.step
        return self.inner.serve(self.inner.start(target))

    def gather(self, server_handle: object):
        """Step 2's round 2 in, then step 3. Returns C(y), float32[numel] (this object's buffer,
        valid until the next exchange), or None when the exchange is skipped on every rank.

        Raises:
            StepMismatchError: on every rank, when some ranks announced different steps.
        """
        flag, (low, high), n = 0, self._steps, self.hi - self.lo
        if low != high:
            flag = 2
        values = self._msg[12:12 + 4 * n].view(torch.float32)
        if self._alone is not None:
            if not native.all_finite(self._alone[:n]):
                flag = max(flag, 1)
            values.copy_(self._alone[:n])
        elif self.inner is not None:
            inner_flag, a, b, result = self.inner.gather_status(server_handle)
            if inner_flag == 2 or (inner_flag == 1 and flag == 0):
                flag, low, high = inner_flag, min(low, a), max(high, b)
            if result is not None:
                native.decompress(*result, self.inner.plan, values)
        head = self._msg[:12].view(torch.int32)
        head[0], head[1], head[2] = flag, low, high
        gathered = self.intra.wait(self.intra.start("allgather", self._msg, f"{self.name}.result"))
        gathered = gathered.view(self.local_size, self._m3)
        heads = gathered[:, :12].contiguous().view(torch.int32)
        flags = heads[:, 0].tolist()
        if 2 in flags:
            self.rollback()
            q = flags.index(2)
            raise step_mismatch(self.name, int(heads[q, 1]), int(heads[q, 2]))
        if any(flags):
            return None
        self._result.view(self.local_size, self.width).copy_(
            gathered[:, 12:12 + 4 * self.width].contiguous().view(torch.float32))
        return self._result[:self.numel]

    def commit(self) -> None:
        if self.inner is not None and self._alone is None:
            self.inner.commit()

    def rollback(self) -> None:
        if self.inner is not None and self._alone is None:
            self.inner.rollback()

    def finish_gather(self, server_handle: object, out: torch.Tensor):
        result = self.gather(server_handle)
        return None if result is None else out.copy_(result)


def node_levels(transport: Transport, hierarchical: bool | str, name: str):
    """The ``(intra, cross)`` transports of the ``hierarchical`` option, or None (flat).

    A world of one rank: None. Before a split, where the transport can make one (MPI,
    torch.distributed with the nodes known), the ranks agree on ``hierarchical``: one uncounted
    object allgather, so ranks that passed ``True`` and ``"auto"`` raise the settings-mismatch
    ``ValueError`` on every rank, naming both values, instead of hanging in the split. A rank
    that passed ``False`` runs no collective here (building an optimizer on some ranks only,
    e.g. over an EMA copy, stays possible); the others' allgather then meets its first step's
    settings check (it has that check's name, for Horovod's collectives, which pair up by name;
    MPI's pair up by order), and both sides raise the mismatch there. Then ``False``: None.
    ``True``: ``transport.node_split(name)`` (a ``ValueError`` naming the fix where the
    transport cannot be split). ``"auto"``: the split where the transport supports one and there
    are several nodes of several ranks each; else None. Collective (MPI splits) where a split is
    made.
    """
    if transport.world_size == 1:
        return None
    if hierarchical is not False and transport.can_split():
        check_layout(transport, {"hierarchical": hierarchical})  # named as the first step's check
    if hierarchical is False:
        return None
    if hierarchical == "auto" and not transport.can_split():
        return None  # Horovod's collectives, or no ranks per node known: no split
    intra, cross = transport.node_split(name)
    if hierarchical == "auto" and (intra.world_size == 1 or cross.world_size == 1):
        return None
    return intra, cross
