"""The exchange of buckets: every collective hvd_zoadam issues, and every collective name.

* :class:`Exchange`: one bucket's two-phase 1-bit compressed allreduce C(y) (algorithm.md §3),
  in nonblocking phases; :func:`exchange_buckets` pipelines it over several buckets.
* :class:`Average`: the full-precision (fp32 or fp16-on-the-wire) average of a bucket's
  gradients, with its byte accounting.
* :func:`step_flags` (the 4-byte flag: "gradients changed after backward()?", "no gradient here?")
  and :func:`check_layout` (the settings and layout check of algorithm.md §5).
* :class:`CollectiveNames`: the one owner of collective names. Horovod pairs collectives
  by name and MPI by order, so both the names and the start order are part of the protocol.

C(y) per bucket (one or more tensors laid out as segments of one flat buffer):

1. worker side: ``z = y + worker_error``; one scale per segment,
   ``||z_seg|| / sqrt(len_seg)`` in float64; the signs packed MSB first; the new error
   ``z - scale*sign`` staged over ``y`` when ``y`` is the exchange's own input buffer
   (else into a second buffer), not yet over ``worker_error`` (one pass over memory with
   per-block scales: :func:`hvd_zoadam.native.worker_compress`);
2. round 1, alltoall: chunk q's signs (N/(8P) bytes) go to rank q together with the worker
   scales of the segments that overlap chunk q and the step number the rank is at;
3. server side on rank r for chunk r: if the steps differ or a received scale is not finite,
   flag it; otherwise ``c = (1/P)·Σ_i scale_i·sign_i + server_error``, one scale per segment
   piece of the chunk, pack, ``server_error <- c - scale*sign`` (the old one kept);
4. round 2, allgather of ``[flag, steps | the chunk's server scales | packed chunk]``;
5. every rank reads every flag: ranks at different steps raise :class:`StepMismatchError`
   together; a non-finite scale anywhere skips the exchange on every rank, both error buffers
   restored (algorithm.md §5); otherwise the staged worker error becomes ``worker_error``;
6. every rank unpacks the same bytes, so the result is bitwise identical on all ranks.

Two rounds per bucket. Each scale travels only to where it is used, so the scale bytes per
rank do not grow with P (algorithm.md §3, "Counting bytes").
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hvd_zoadam import native
from hvd_zoadam.comm.select import make_transport
from hvd_zoadam.comm.transport import Transport
from hvd_zoadam.core.layout import padded_numel, segment_offsets

if TYPE_CHECKING:
    from horovod.common.process_sets import ProcessSet

LAYOUT_CHECK = "zoadam.layout_check"  # fixed: the layout digest in a prefix may itself differ across ranks


class CollectiveNames:
    """The rank-independent names of one optimizer's collectives.

    ``prefix`` is a digest of the parameter layout (names, shapes, dtypes, groups) and the
    world size, and nothing else: like Horovod, which names its allreduces after the
    parameters, the names do not depend on how many optimizers a process built. So a rank
    may build optimizers the others do not (e.g. over an EMA copy of the model that it never
    steps). Optimizers over different parameters get different names; two optimizers over
    models with the same parameter names and shapes share them, which works when one's
    exchange has finished before the other's starts (as with Horovod; to step such
    optimizers from one backward pass, name one model's parameters apart, e.g.
    ``named_parameters=ema.named_parameters(prefix="ema")``).
    """

    def __init__(self, prefix: str):
        self.prefix = prefix

    @property
    def layout_digest(self) -> str:
        return self.prefix.split(".")[0]

    def bucket(self, index: int) -> str:
        """Prefix of bucket ``index``'s exchange: ``.scales``, ``.signs``, ``.server`` follow."""
        return f"zoadam.{self.prefix}.b{index}"

    def average(self, index: int) -> str:
        """The full-precision allreduce of bucket ``index``'s gradients."""
        return f"{self.bucket(index)}.avg"

    def pool(self, index: int) -> str:
        """Prefix of bucket ``index``'s error-feedback pooling (``.a`` alltoall, ``.b`` allgather)."""
        return f"{self.bucket(index)}.pool"

    def step_flags(self, step: int) -> str:
        return f"zoadam.{self.prefix}.step_flags.{step}"

    @staticmethod
    def for_layout(layout: object, world_size: int) -> "CollectiveNames":
        """Names for an optimizer over ``layout`` (a repr-able description of its parameters)."""
        import hashlib
        return CollectiveNames(hashlib.sha1(repr((layout, world_size)).encode()).hexdigest()[:10])


class StepMismatchError(RuntimeError):
    """The ranks reached one exchange at different optimizer steps; all ranks raise it together."""


class NonFiniteError(FloatingPointError):
    """A compressed allreduce met a NaN or Inf input on some rank; all ranks raise it together."""


def first_flag(heads: list[list[int]]) -> tuple[int, int, int]:
    """``(flag, lowest step, highest step)`` of one bucket's round 2, from every server's
    ``[flag, low, high]`` (``heads``, in rank order): those of the first server that flagged a
    step mismatch (2), else of the first that flagged a non-finite scale (1), else the first
    server's (flag 0)."""
    flags = [h[0] for h in heads]
    q = flags.index(2) if 2 in flags else next((i for i, f in enumerate(flags) if f), 0)
    return heads[q][0], heads[q][1], heads[q][2]


def step_mismatch(name: str, low: int, high: int) -> StepMismatchError:
    """The error every rank raises when the exchange ``name`` met ranks at different steps."""
    return StepMismatchError(
        f"hvd_zoadam: the exchange '{name}' met ranks at different optimizer steps: steps {low} and {high}. "
        "Every rank must call step() (or skip_synchronize()/synchronize() alike) at every iteration; restart "
        "from the last checkpoint")


def chunk_pieces(offsets: Sequence[int], chunk_numel: int, world_size: int):
    """Which segments overlap each chunk: ``(lo, count)``, int lists of length P, so that chunk q
    (elements [q·C, (q+1)·C)) holds pieces of segments lo[q] .. lo[q] + count[q] − 1 (count 0
    for a chunk of padding only). Pure integer arithmetic."""
    los, counts = [], []
    nseg = len(offsets) - 1
    for q in range(world_size):
        a, z = q * chunk_numel, (q + 1) * chunk_numel
        lo = next((s for s in range(nseg) if offsets[s + 1] > a), nseg)
        hi = next((s for s in range(lo, nseg) if offsets[s] >= z), nseg)
        los.append(lo)
        counts.append(max(0, hi - lo))
    return los, counts


def _align4(nbytes: int) -> int:
    return -(-nbytes // 4) * 4


def message_bytes(max_pieces: int, chunk_numel: int) -> tuple[int, int]:
    """Sizes in bytes of the two messages of :class:`Exchange` (word-aligned): one alltoall
    message to each rank, ``4S + 4 + C/8``, and one allgather message, ``12 + 4S + C/8``,
    with S = ``max_pieces`` scale slots and C = ``chunk_numel``."""
    nbytes = chunk_numel // 8
    return _align4(4 * max_pieces + 4 + nbytes), _align4(12 + 4 * max_pieces + nbytes)


def exchange_bytes(numels: Iterable[int], world_size: int) -> int:
    """Bytes one rank sends in one compressed exchange of a bucket of segments ``numels`` at
    world size P: (P − 1) times both messages of :func:`message_bytes`, what the transport's
    counter adds (0 at P = 1). Pure integer arithmetic."""
    if world_size == 1:
        return 0
    offsets = segment_offsets(numels)
    chunk = padded_numel(offsets[-1], world_size) // world_size
    alltoall, allgather = message_bytes(max(chunk_pieces(offsets, chunk, world_size)[1]), chunk)
    return (world_size - 1) * (alltoall + allgather)


class _Landing:
    """Where an :class:`Exchange` reads its two rounds' messages (P ranks, ``s`` scale slots per
    chunk, ``count`` of them this rank's, ``nbytes`` bytes of signs per chunk, messages of
    ``m1`` and ``m3`` bytes), so that a step allocates nothing for them: each round's
    messages copied whole into a buffer kept here, read through views made once, and the skip
    flag's own scratch."""

    def __init__(self, p: int, s: int, count: int, nseg: int, nbytes: int, m1: int, m3: int, device: torch.device):
        def u8(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.uint8, device=device)
        self.recv, self.gathered = u8(p, m1), u8(p, m3)
        self.recv_flat, self.gathered_flat = self.recv.view(-1), self.gathered.view(-1)
        # round 1, per rank: [its worker scales (s float32) | its step (int32) | this chunk's signs]
        self.steps = self.recv[:, 4 * s:4 * s + 4].view(torch.int32).view(-1)
        self.scales = self.recv[:, :4 * s].view(torch.float32)[:, :count]
        self.packed_in, self.packed = self.recv[:, 4 * s + 4:4 * s + 4 + nbytes], u8(p, nbytes)
        # round 2, per server: [flag, lowest step, highest step (int32) | scales (s float32) | signs]
        self.heads = self.gathered[:, :12].view(torch.int32)[:, :3]
        self.result_scales_in = self.gathered[:, 12:12 + 4 * s].view(torch.float32)
        self.result_packed_in = self.gathered[:, 12 + 4 * s:12 + 4 * s + nbytes]
        self.result_packed = u8(p * nbytes)
        self.result_packed_rows = self.result_packed.view(p, nbytes)
        self.result_scales_padded = torch.zeros(p, nseg + 1, dtype=torch.float32, device=device)
        self.result_scales = torch.zeros(p, nseg, dtype=torch.float32, device=device)
        self.result_scales_real = self.result_scales_padded[:, :nseg]
        self.finite = torch.zeros(p * count + count, dtype=torch.float32, device=device)
        self.finite_workers, self.finite_server = self.finite[:p * count].view(p, count), self.finite[p * count:]
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        self.bad = torch.zeros(1, dtype=torch.bool, device=device)
        self.bad0 = self.bad[0]

    def decide_flag(self, worker_scales: torch.Tensor, server_scales: torch.Tensor, head: "_Head") -> None:
        """head.flag <- 2 when head.low != head.high (ranks at different steps), else 1 when some
        worker scale (float32[P, count]) or server scale (float32[count]) is not finite, else 0.
        On the device, into buffers of its own: x·0 is 0 for finite x and NaN otherwise, so the
        sum of those is NaN exactly when some scale is not finite."""
        self.finite_workers.copy_(worker_scales)
        self.finite_server.copy_(server_scales)
        torch.sum(self.finite.mul_(0.0), dim=0, out=self.total)
        torch.ne(self.total, self.total, out=self.bad0)
        head.flag.copy_(self.bad)
        torch.ne(head.low1, head.high1, out=self.bad)
        head.flag.masked_fill_(self.bad, 2)


class _Head:
    """Views of the head of a server's round-2 message (uint8[12]: flag, lowest step, highest
    step as int32), made once: ``flag``, ``low1``, ``high1`` int32[1], ``low``, ``high`` 0-dim."""

    def __init__(self, msg: torch.Tensor):
        words = msg[:12].view(torch.int32)
        self.flag, self.low1, self.high1 = words[0:1], words[1:2], words[2:3]
        self.low, self.high = words[1], words[2]


class Exchange:
    """Plan, error buffers and scratch of one bucket's compressed exchange on one rank.

    Args:
        numels: element counts of the bucket's segments, in order (all > 0).
        transport: the collectives; fixes the world size P and the rank.
        name: a rank-independent, job-unique prefix for the collective names.
        worker_error, server_error: float32 buffers to use (default: new zeros).
        device: where the buffers live (default: ``worker_error``'s device, else the CPU);
            ``y`` and the exchange's messages are on it too. CUDA tensors go to the CUDA
            kernels and to the transport as they are.

    Attributes:
        worker_error: float32[padded_numel], e_w.
        server_error: float32[padded_numel // P], e_s; at P > 1, like :attr:`input`, a different
            tensor after each exchange that is not skipped (two buffers swap roles).
        step: the optimizer step the next exchange announces (the owner sets it; the ranks must
            agree on it).
        pieces: ``(lo, count)`` of :func:`chunk_pieces`; S = ``max(count)`` scales per chunk travel.

    Two rounds (algorithm.md §3): an alltoall whose message to rank q is ``[the worker scales of
    the segments overlapping chunk q (S float32) | the step (int32) | chunk q's signs (C/8 bytes)]``,
    and an allgather of every server's ``[flag, lowest step, highest step (int32) | its chunk's
    server scales (S float32) | its packed chunk]``. The flag is 0 (all inputs finite, one step),
    1 (a non-finite worker scale reached this server) or 2 (the ranks announced different steps).
    Both error buffers are staged until every flag is known, so a skip leaves them untouched on
    every rank.

    The input ``y`` of :meth:`prepare` is float32[padded_numel] with the padding at 0.
    When it is :attr:`input` (P > 1), the worker side writes the new error over it and, once
    the exchange is known not to be skipped, :attr:`input` and :attr:`worker_error` swap
    roles; any other ``y`` is left alone and the new error goes to a second buffer.

    Attributes (P > 1):
        input: float32[padded_numel], the buffer a caller fills with ``y``; it is a different
            tensor after each exchange that is not skipped.
    """

    def __init__(self, numels: Iterable[int], transport: Transport, name: str,
                 worker_error: torch.Tensor | None = None, server_error: torch.Tensor | None = None,
                 device: torch.device | str | None = None):
        if device is None:
            device = worker_error.device if worker_error is not None else torch.device("cpu")
        self.device = device = torch.device(device)
        self.transport = transport
        self.name = name
        p, r = transport.world_size, transport.rank
        self.offsets = segment_offsets(numels)
        self.numel = self.offsets[-1]
        self.padded_numel = padded_numel(self.numel, p)
        self.chunk_numel = self.padded_numel // p
        self.nseg = len(self.offsets) - 1
        self.plan = native.Plan(self.offsets, self.padded_numel, p, r)
        self.worker_error = torch.zeros(self.padded_numel, device=device) if worker_error is None else worker_error
        self.server_error = torch.zeros(self.chunk_numel, device=device) if server_error is None else server_error
        # P > 1: the input buffer doubles as the new worker error (see the class docstring)
        self.input = torch.zeros(self.padded_numel, device=device) if p > 1 else None
        self._next = None       # the new worker error when y is not self.input (made on first use)
        self._staged = None     # where the current exchange put the new worker error
        self.step = 0
        self._scales = torch.zeros(self.nseg + 1, dtype=torch.float32, device=device)  # [nseg] + a 0 for padding
        self._packed = torch.zeros(self.padded_numel // 8, dtype=torch.uint8, device=device)
        self.pieces = chunk_pieces(self.offsets, self.chunk_numel, p)
        los, counts = self.pieces
        s = self.max_pieces = max(counts) if counts else 0
        # idx[q, j]: the segment of chunk q's j-th scale slot (nseg, the padding 0, past count[q])
        self._idx = torch.tensor([[lo + j if j < c else self.nseg for j in range(s)] for lo, c in zip(los, counts)],
                                 dtype=torch.long, device=device).reshape(p, s)
        self._idx_flat = self._idx.reshape(-1)
        self._scale_slots = torch.zeros(p * s, dtype=torch.float32, device=device)  # the scales in send order
        nbytes = self.chunk_numel // 8
        self._m1, self._m3 = message_bytes(s, self.chunk_numel)  # alltoall bytes per destination, allgather's
        self._send = torch.zeros(p, self._m1, dtype=torch.uint8, device=device)
        self._server_msg = torch.zeros(self._m3, dtype=torch.uint8, device=device)
        self._worker_scales = torch.zeros(p, self.nseg, dtype=torch.float32, device=device)   # this chunk's columns
        self._server_scales = torch.zeros(self.nseg, dtype=torch.float32, device=device)
        self._server_packed = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._server_next = None    # where the server side puts the new e_s, read from server_error
        self._reduced = False       # this exchange's server side wrote _server_next
        self._landing = None        # what rounds 1 and 2 read out of the messages (made on first use)
        # views of the outgoing messages and of the scales, made once (a step makes none)
        lo, count = los[transport.rank] if los else 0, counts[transport.rank] if counts else 0
        send = self._send
        self._send_flat = send.view(-1)
        self._send_scales = send[:, :4 * s].view(torch.float32) if s else None
        self._slots = self._scale_slots.view(p, s)
        self._send_step = send[:, 4 * s:4 * s + 4].view(torch.int32)
        self._send_packed, self._packed_rows = send[:, 4 * s + 4:4 * s + 4 + nbytes], self._packed.view(p, -1)
        self._scales_real = self._scales[:self.nseg]
        self._head = _Head(self._server_msg)
        self._msg_scales = self._server_msg[12:12 + 4 * s].view(torch.float32)[:count] if s else None
        self._msg_packed = self._server_msg[12 + 4 * s:12 + 4 * s + nbytes]
        self._own_worker_scales = self._worker_scales[:, lo:lo + count]
        self._own_server_scales = self._server_scales[lo:lo + count]

    def memory_bytes(self) -> dict:
        """Bytes held: the two error buffers, and the reusable scratch (the input buffer at
        P > 1, packed bytes, the messages, the staged server error, what the messages are read
        into)."""
        errors = (self.worker_error.numel() + self.server_error.numel()) * 4
        scratch = self._packed.numel() + self._send.numel() + self._server_msg.numel() + self._server_packed.numel() \
            + 4 * self._scale_slots.numel()
        for buf in (self.input, self._next, self._server_next):
            scratch += 0 if buf is None else buf.numel() * 4
        if self._landing is not None:  # its buffers, not the views of them it keeps
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in vars(self._landing).values() if isinstance(t, torch.Tensor)}
            scratch += sum(storages.values())
        return {"error_buffers": errors, "scratch": scratch}

    def mask_errors(self, mask: torch.Tensor) -> None:
        """Zero both error buffers where ``mask`` (bool[numel], bucket order) is False."""
        self.worker_error[:self.numel].mul_(mask)
        lo = self.transport.rank * self.chunk_numel
        hi = min(self.numel, lo + self.chunk_numel)
        if hi > lo:
            self.server_error[:hi - lo].mul_(mask[lo:hi])

    def zero_errors(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    def set_errors(self, worker: torch.Tensor, server: torch.Tensor) -> None:
        """``worker_error`` <- ``worker`` and ``server_error`` <- this rank's chunk of ``server``
        (both float32[padded_numel], in the bucket's global layout)."""
        lo = self.transport.rank * self.chunk_numel
        self.worker_error.copy_(worker)
        self.server_error.copy_(server[lo:lo + self.chunk_numel])

    def error_contribution(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's share of what the bucket's error feedback owes, for
        :func:`pool_error_feedback`: ``(worker_error, server_error at its chunk's place in the
        global layout, zeros elsewhere, the number of worker errors in the job: P)``, float32[N]."""
        server = torch.zeros(self.padded_numel, device=self.server_error.device)
        lo = self.transport.rank * self.chunk_numel
        server[lo:lo + self.chunk_numel] = self.server_error
        return self.worker_error, server, self.transport.world_size

    def prepare(self, y: torch.Tensor):
        """The whole exchange of ``y`` up to its packed result: a token for :meth:`finish`, or
        None when some rank's input is non-finite (every rank returns None together, and
        both error buffers are unchanged)."""
        if self.transport.world_size == 1:
            return self._scales[:self.nseg] if native.all_finite(y[:self.numel]) else None
        result = self.gather(self.serve(self.start(y)))
        if result is None:
            self.rollback()
            return None
        self.commit()
        return result

    def finish(self, y: torch.Tensor, token: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
               out: torch.Tensor) -> torch.Tensor:
        """C(y) into ``out`` (float32[numel]) from :meth:`prepare`'s token. ``y`` is read only at
        P = 1 (C(y) = y, the token unused); at P > 1 :meth:`prepare` consumed it."""
        if self.transport.world_size == 1:
            return out.copy_(y[:self.numel])
        return native.decompress(*token, self.plan, out)

    # The same exchange in nonblocking phases (P > 1), so that the optimizer can run one
    # bucket's collectives while it computes the next bucket's: start -> serve -> gather ->
    # commit (or rollback when any bucket is skipped). ``y`` is read only by start; the
    # messages in flight live in this object's own buffers.
    def start(self, y: torch.Tensor):
        """The whole worker side of ``y + worker_error`` (scales with float64 sums, signs, the new
        error staged over ``y`` if it is :attr:`input`, else in a second buffer), then start
        round 1: the alltoall of each chunk's signs with the scales it needs and the step."""
        if y is self.input:
            staged = y
        else:
            if self._next is None:
                self._next = torch.zeros(self.padded_numel, device=self.device)
            staged = self._next
        native.worker_compress(y, self.worker_error, self.plan, self._scales_real, self._packed, error_out=staged)
        self._staged = staged
        if self.max_pieces:
            torch.index_select(self._scales, 0, self._idx_flat, out=self._scale_slots)
            self._send_scales.copy_(self._slots)
        self._send_step.fill_(self.step)
        self._send_packed.copy_(self._packed_rows)
        return self.transport.start("alltoall", self._send_flat, f"{self.name}.signs")

    def serve(self, signs_handle: object):
        """Round 1 in: average the P chunks with ``server_error`` and recompress (the new e_s
        staged until :meth:`commit`), flag on the device whether the ranks announced one step and
        every worker and server scale is finite (no host read), start round 2."""
        land = self._landing = self._landing or self._new_landing()
        land.recv_flat.copy_(self.transport.wait(signs_handle))
        head = self._head
        torch.aminmax(land.steps, out=(head.low, head.high))
        # The flag, decided on the device and read by the host with round 2 (gather_status, or
        # every bucket's at once in exchange_buckets): 2 when the ranks announced different
        # steps, 1 when a worker scale or (finite ones summed past float32's range) a server
        # scale is not finite, else 0. The chunk is reduced in every case; a flagged exchange
        # rolls back, dropping the staged server error.
        self._own_worker_scales.copy_(land.scales)
        if self._server_next is None:
            self._server_next = torch.zeros_like(self.server_error)
        land.packed.copy_(land.packed_in)
        native.server_reduce(land.packed, self._worker_scales, self.server_error, self.plan,
                             self._server_packed, self._server_scales, error_out=self._server_next)
        self._reduced = True
        land.decide_flag(land.scales, self._own_server_scales, head)
        if self.max_pieces:
            self._msg_scales.copy_(self._own_server_scales)
        self._msg_packed.copy_(self._server_packed)
        return self.transport.start("allgather", self._server_msg, f"{self.name}.server")

    def _new_landing(self) -> _Landing:
        r = self.transport.rank
        return _Landing(self.transport.world_size, self.max_pieces, self.pieces[1][r], self.nseg,
                        self.chunk_numel // 8, self._m1, self._m3, self.device)

    def gather(self, server_handle: object):
        """Wait for round 2. Returns C(y) still packed: (uint8[N/8] signs of every chunk in rank
        order, float32[P, nseg] server scales), for the fused consumers of :mod:`.native`; or None
        when some server met a non-finite scale (skip; call :meth:`rollback`).

        Raises:
            StepMismatchError: on every rank, when the ranks announced different steps.
        """
        flag, low, high, result = self.gather_status(server_handle)
        if flag == 2:
            self.rollback()
            raise step_mismatch(self.name, low, high)
        return result

    def gather_status(self, server_handle: object):
        """:meth:`gather` without raising: ``(flag, lowest step, highest step, result)``, with
        the flag of the first server that raised one (0: none; 1: a non-finite scale; 2: ranks at
        different steps) and ``result`` None unless the flag is 0. One host read."""
        gathered = self.wait_gathered(server_handle)
        flag, low, high = first_flag(self.heads(gathered).tolist())
        return flag, low, high, None if flag else self.result_of(gathered)

    def wait_gathered(self, server_handle: object) -> torch.Tensor:
        """Wait for round 2: every server's message, uint8[P, m3], copied into this exchange's
        buffer on the device; nothing read on the host. Its result is what :meth:`heads` and
        :meth:`result_of` read."""
        land = self._landing
        land.gathered_flat.copy_(self.transport.wait(server_handle))
        return land.gathered

    def heads(self, gathered: torch.Tensor) -> torch.Tensor:
        """Each server's (flag, lowest step, highest step) in ``gathered`` (:meth:`wait_gathered`'s
        result): int32[P, 3], a view of this exchange's buffer."""
        return self._landing.heads

    def result_of(self, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """C(y) still packed from round 2's messages (``gathered``, :meth:`wait_gathered`'s
        result; :meth:`gather`'s result), on the device, in buffers of this exchange's (valid
        until its next exchange)."""
        land = self._landing
        land.result_packed_rows.copy_(land.result_packed_in)
        server_scales = land.result_scales_padded.zero_()
        if self.max_pieces:
            server_scales.scatter_(1, self._idx, land.result_scales_in)
        return land.result_packed, land.result_scales.copy_(land.result_scales_real)

    def commit(self) -> None:
        """The exchange is not skipped: the staged errors become ``worker_error`` and
        ``server_error`` (each pair of buffers swaps roles)."""
        staged, old = self._staged, self.worker_error
        self.worker_error, self._staged = staged, None
        if staged is self.input:
            self.input = old
        else:
            self._next = old
        if self._reduced:
            self.server_error, self._server_next = self._server_next, self.server_error
        self._reduced = False

    def rollback(self) -> None:
        """The exchange is skipped: ``worker_error`` and ``server_error`` as before it (the
        staged errors are dropped)."""
        self._staged, self._reduced = None, False

    def finish_gather(self, server_handle: object, out: torch.Tensor):
        """Wait for round 2 and decompress C(y) into ``out`` (float32[numel]); None when skipped."""
        result = self.gather(server_handle)
        return None if result is None else native.decompress(*result, self.plan, out)


class Average:
    """The full-precision average of buckets' gradients (VARIANCE steps), one collective per bucket.

    A bucket's gradients are averaged by one in-place ``allreduce`` with op=Average, named after
    the bucket: in the bucket's flat gradient storage, of which every ``p.grad`` is a view
    (``grad_storage``), or else gathered into one float32 buffer (one ``cat``) and written back
    into each ``p.grad`` (one ``_foreach_copy_``): under ``torch.distributed`` and MPI, where nothing fuses
    collectives, a step makes as many collectives as there are buckets, not tensors (Horovod
    fuses either). With ``fp16_wire`` the buffer travels as float16 (``hvd.Compression.fp16``);
    ``gradient_predivide_factor`` f splits the average into a divide by f before and a multiply
    by f after the collective's average, as Horovod does. The average of each element is the
    same as a per-tensor allreduce's wherever the transport reduces element by element in a
    fixed rank order (the thread and MPI transports; Horovod's fusion already groups tensors).

    Args:
        transport: the collectives. names: the :class:`CollectiveNames`.
        sparse_grad: ``sparse_grad(name, g)`` densifies a sparse gradient or raises.
        grad_storage: ``grad_storage(bucket)``, the bucket's float32 flat gradient storage with
            every ``p.grad`` its view, or None where it has none (``core.bucket.grad_storage``).
    """

    def __init__(self, transport: Transport, names: CollectiveNames, *, gradient_predivide_factor: float,
                 fp16_wire: bool, sparse_grad: Callable[[str, torch.Tensor], torch.Tensor],
                 grad_storage: Callable[[Any], torch.Tensor | None] | None = None):
        self.transport = transport
        self.names = names
        self.gradient_predivide_factor = gradient_predivide_factor
        self.fp16_wire = fp16_wire
        self.sparse_grad = sparse_grad
        self.grad_storage = grad_storage

    def _flat_grads(self, b: Any) -> torch.Tensor:
        """Bucket ``b``'s gradients as one new float32[b.numel] tensor (a missing gradient is
        zeros and becomes ``p.grad``; a sparse one is densified)."""
        grads = []
        for p, name in zip(b.params, b.names):
            g = p.grad
            if g is None:
                g = p.grad = torch.zeros_like(p)
            elif g.is_sparse:
                g = p.grad = self.sparse_grad(name, g)
            grads.append(g.reshape(-1))
        flat = torch.cat(grads)
        return flat if flat.dtype == torch.float32 else flat.float()

    def start(self, index: int, b: Any, inv_grad_scale: float | None = None, copy: bool = False) -> tuple:
        """Start the average of bucket ``b``'s gradients (number ``index``): in place in the
        bucket's flat gradient storage, of which every ``p.grad`` is a view (``grad_storage``,
        as DDP's ``gradient_as_bucket_view``), or else from a copy, which ``copy`` asks for (the
        hooks' early start, whose gradients may still change before ``step()``; in place, a loss
        scale or ``gradient_predivide_factor`` is taken out of ``p.grad`` at once, so a step
        that fails after it leaves them so). Returns
        ``(handle, wire, flat)`` for :meth:`finish`: the collective's handle (None at P = 1 in
        float32), the tensor on the wire and the float32 buffer."""
        f = self.gradient_predivide_factor
        width = 2 if self.fp16_wire else 4
        p_ = self.transport.world_size
        self.transport.counter.add(2 * (p_ - 1) / p_ * width * b.numel)
        flat = None if copy or self.grad_storage is None else self.grad_storage(b)
        if flat is None:
            flat = self._flat_grads(b)
        if inv_grad_scale is not None:
            flat.mul_(inv_grad_scale)
        if f != 1.0:
            flat.div_(f)
        wire = flat.to(torch.float16) if width == 2 else flat
        if p_ == 1 and width == 4:  # the average of one float32 tensor is itself: no collective
            return None, wire, flat
        return self.transport.start("allreduce", wire, self.names.average(index), count=False), wire, flat

    def finish(self, b: Any, started: tuple) -> torch.Tensor:
        """Wait for :meth:`start`'s allreduce; write the float32 average into each ``p.grad``.
        Returns the float32[b.numel] average, for one finiteness check of the whole step."""
        handle, wire, flat = started
        if handle is not None:
            self.transport.wait(handle)
        if wire is not flat:
            flat.copy_(wire)
        if self.gradient_predivide_factor != 1.0:
            flat.mul_(self.gradient_predivide_factor)
        if flat is getattr(b, "grad", None):
            return flat  # averaged in place: every p.grad is a view of it
        grads = []
        for p in b.params:
            if p.grad is None:  # dropped after the hooks started its allreduce
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])
        return flat

    def all(self, buckets: list, order: list, started: dict, inv_grad_scale: float | None = None) -> bool:
        """The average of every bucket, started in ``order`` (bucket indices) unless
        ``started`` (index -> :meth:`start`'s result, taken from it) holds it already.
        Returns whether every average is finite."""
        handles = {}
        for bi in order:
            handles[bi] = started.pop(bi) if bi in started else self.start(bi, buckets[bi], inv_grad_scale)
        averages = [self.finish(buckets[bi], handles[bi]) for bi in order]
        return native.all_finite_many(averages)  # on a GPU, one host synchronisation per step


def _exchange_alone(buckets: list, g: torch.Tensor, w: torch.Tensor, fill, consume) -> bool:
    """:func:`exchange_buckets` at P = 1: C(y) = y, skipped when some input is not finite; every
    bucket's finiteness read at once (:func:`native.finite_flag`: one host synchronisation on a
    GPU, a read-only pass per bucket on the CPU that stops at the first bucket that is not)."""
    if len(buckets) == 1:  # fill once, hand y itself over
        b = buckets[0]
        buf = g[:b.exchange.padded_numel]
        fill(b, buf)
        if not native.all_true([native.finite_flag(buf[:b.numel])]):
            return False
        consume(b, buf[:b.numel])
        return True
    flags = []
    for b in buckets:
        buf = g[:b.exchange.padded_numel]
        fill(b, buf)
        flags.append(native.finite_flag(buf[:b.numel]))
        if flags[-1] is False:
            return False
    if not native.all_true(flags):
        return False
    for b in buckets:
        buf = g[:b.exchange.padded_numel]
        fill(b, buf)
        consume(b, b.exchange.finish(buf, None, w[:b.numel]))
    return True


def exchange_buckets(buckets: list, scratch_g: torch.Tensor, scratch_w: torch.Tensor, fill: Callable[..., None],
                     consume: Callable[..., None], consume_packed: Callable[..., None] | None = None,
                     started: dict | None = None) -> bool:
    """C(.) of every bucket in ``buckets``, in order (the same on every rank, as MPI requires).
    Returns False when the exchange is skipped on every rank (a non-finite input somewhere).

    ``fill(bucket, buf)`` writes the input into the padded float32 ``buf``; ``consume(bucket, w)``
    receives the float32[n] result, or, when P > 1 and ``consume_packed`` is given,
    ``consume_packed(bucket, packed, server_scales)`` receives it still packed (a fused kernel
    then unpacks it; a two-level exchange's result always goes to ``consume``). No error buffer
    changes and nothing is consumed until every bucket's round 2 is in, so a non-finite input
    anywhere skips every bucket (algorithm.md §5). At P > 1 each bucket is filled once, into its
    exchange's own input buffer, which the worker side turns into the new error; at P = 1 with
    several buckets the scratch ``scratch_g`` is filled again for the second phase (bitwise
    alike). ``started`` (P > 1) maps ``id(bucket)`` to a round 1 the backward hooks already
    started from the bucket's exchange input; those buckets are not filled again. ``scratch_w``:
    float32, at least the largest bucket's numel.
    """
    w = scratch_w
    world_size = buckets[0].exchange.transport.world_size if buckets else 1
    if world_size == 1:
        return _exchange_alone(buckets, scratch_g, w, fill, consume)
    # Pipelined: each bucket's collective is in flight while the next bucket's worker side or
    # server side is computed. No error buffer changes until every bucket's round 2 is in.
    handles = {}
    for b in buckets:
        if started and id(b) in started:
            handles[id(b)] = started[id(b)]
            continue
        fill(b, b.exchange.input)
        handles[id(b)] = b.exchange.start(b.exchange.input)
    served = [b.exchange.serve(handles[id(b)]) for b in buckets]
    try:
        results = _gather_all(buckets, served)
    except StepMismatchError:
        for b in buckets:
            b.exchange.rollback()
        raise
    if results is None:
        for b in buckets:
            b.exchange.rollback()
        return False
    for b, result in zip(buckets, results):
        b.exchange.commit()
        if isinstance(result, torch.Tensor):  # the two-level exchange hands over C(y) unpacked
            consume(b, result)
        elif consume_packed is not None:
            consume_packed(b, *result)
        else:
            consume(b, native.decompress(*result, b.exchange.plan, w[:b.numel]))
    return True


def _gather_all(buckets: list, served: list) -> list | None:
    """Round 2 of every bucket: their results in order, or None when some server flagged a
    non-finite scale. Flat exchanges' flags are read together, one host read per step; a
    two-level exchange reads its own.

    Raises:
        StepMismatchError: when some bucket met ranks at different steps (the first such bucket)."""
    if not all(type(b.exchange) is Exchange for b in buckets):
        results = [b.exchange.gather(h) for b, h in zip(buckets, served)]
        return None if any(r is None for r in results) else results
    gathered = [b.exchange.wait_gathered(h) for b, h in zip(buckets, served)]
    heads = torch.stack([b.exchange.heads(g) for b, g in zip(buckets, gathered)]).tolist()  # [B][P][3]: one read
    status = [first_flag(h) for h in heads]
    for b, (flag, low, high) in zip(buckets, status):
        if flag == 2:
            raise step_mismatch(b.exchange.name, low, high)
    if any(flag for flag, _, _ in status):
        return None
    return [b.exchange.result_of(g) for b, g in zip(buckets, gathered)]


def pool_error_feedback(worker: torch.Tensor, server: torch.Tensor, contributors: int, transport: Transport,
                        name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What a bucket's error feedback still owes, pooled over ranks (algorithm.md §6).

    Args:
        worker: float32[N], N = padded_numel(n, P) of the current world: this rank's
            ``worker_error`` in the bucket's layout, or zeros on a rank with none.
        server: float32[N]: this rank's ``server_error`` at its chunk's place in the bucket's
            global layout (zeros elsewhere). Chunks may come from another world size (an
            elastic reset); each global element must be non-zero on at most one rank.
        contributors: how many ranks contributed a worker error (>= 1).
        transport: the collectives of the current world (P ranks).
        name: a rank-independent collective prefix (``CollectiveNames.pool``).

    Returns:
        ``(worker_mean, server_sum)``, float32[N] each, bitwise the same on every rank: the sum
        of the ``worker`` inputs over ranks divided by ``contributors``, and the sum of the
        ``server`` inputs. Rank q sums chunk q (N/P elements) in float64 in rank order.

    Collectives: one alltoall of 2N floats and one allgather of 2N/P floats per rank, both
    uncounted in ``comm_stats()`` (checkpoint traffic, not training traffic).
    """
    p = transport.world_size
    chunk = worker.numel() // p
    sent = torch.stack([worker.view(p, chunk), server.view(p, chunk)], 1).reshape(-1)
    if p > 1:
        sent = transport.wait(transport.start("alltoall", sent, name + ".a", count=False))
    parts = sent.view(p, 2, chunk).to(torch.float64)
    worker_sum, server_sum = parts[0, 0].clone(), parts[0, 1].clone()
    for q in range(1, p):  # a fixed order, so the file does not depend on the reduction kernel
        worker_sum += parts[q, 0]
        server_sum += parts[q, 1]
    mine = torch.cat([(worker_sum / contributors).float(), server_sum.float()])
    if p > 1:
        mine = transport.wait(transport.start("allgather", mine, name + ".b", count=False))
    both = mine.view(p, 2, chunk)
    return both[:, 0].reshape(-1), both[:, 1].reshape(-1)


GRADS_CHANGED = 1  # step_flags: this rank's gradients changed after the hooks started their exchange
NO_GRADIENT = 2    # step_flags: this rank reached step() with no gradient at all (no backward())


def step_flags(transport: Transport, names: CollectiveNames, step: int, flags: int) -> list[int]:
    """Every rank's ``flags`` for step ``step`` (:data:`GRADS_CHANGED`, :data:`NO_GRADIENT`), in
    rank order: one allgather of a 4-byte flag per rank, on every VARIANCE, COMPRESSED and SYNC
    step after the first at P > 1 (after the early exchange where overlap is armed, before the
    exchange where not: a rank-independent condition), so that all ranks agree. An
    allgather, not an average: it travels over the rounds' transport (:meth:`Transport.allgather_flag`;
    under MPI on a communicator of its own) instead of waking Horovod's background thread, which
    on a machine whose cores training fills costs more than the flag (docs/performance.md,
    "Horovod's background thread and the flag")."""
    flag = torch.tensor([flags], dtype=torch.int32, device=transport.control_device)
    return transport.allgather_flag(flag, names.step_flags(step)).tolist()


def check_layout(transport: Transport, mine: dict, name: str = LAYOUT_CHECK, advice: dict | None = None) -> None:
    """algorithm.md §5: compare settings and parameter layout (``mine``, a dict of picklable
    items) across ranks. Raises ValueError on every rank on a mismatch, naming each difference
    with both values, and for a differing key of ``advice`` (key -> a sentence) that sentence
    first. Collectives: one object allgather (uncounted) named ``name``, at P > 1."""
    if transport.world_size == 1:
        return
    everyone = transport.allgather_object(mine, name)
    for rank, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        # keys both sides have first: where the other side's message is another check's
        # (the topology agreement met by a first-step check), the common key is the news
        keys = sorted(set(mine) | set(theirs), key=lambda k: (not (k in mine and k in theirs), k))
        diffs = [f"{k}: this rank ({transport.rank}) has {mine.get(k, '<missing>')!r}, "
                 f"rank {rank} has {theirs.get(k, '<missing>')!r}" for k in keys if mine.get(k) != theirs.get(k)]
        hint = (" The transports differ: transport='auto' resolved differently on these ranks (mpi4py, "
                "MPI_THREAD_MULTIPLE, the address of HOROVOD_GLOO_IFACE, the parameters' device); pass the same "
                "explicit transport on every rank." if mine.get("transport") != theirs.get("transport") else "")
        first = [text for key, text in (advice or {}).items()
                 if key in mine and key in theirs and mine[key] != theirs[key]]
        if first:
            raise ValueError(f"hvd_zoadam: {first[0]} Differences: " + "; ".join(diffs[:10]))
        raise ValueError("hvd_zoadam settings or parameter layout differ across ranks; every rank must build "
                         "the optimizer alike. Differences: " + "; ".join(diffs[:10]) + hint)


def compressed_allreduce(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         *, process_set: ProcessSet | None = None, transport: str | Transport = "auto",
                         name: str | None = None) -> torch.Tensor:
    """The two-phase 1-bit compressed allreduce C(y) of algorithm.md §3, for one tensor.

    Every rank of the process set must call it with a tensor of the same shape.

    Args:
        tensor: y, any shape; float32, float16 or bfloat16; on the CPU or a CUDA device.
        worker_error: float32[padded_numel(n, P)], e_w, updated in place, on ``tensor``'s device.
        server_error: float32[padded_numel(n, P) // P], e_s, updated in place.
        process_set: a Horovod process set (default: the global one).
        transport: ``"auto"``/``"horovod"`` (Horovod's collectives), or a
            :class:`~hvd_zoadam.comm.transport.Transport` instance.
        name: prefix of the collective names (default: derived from a call counter).

    Returns:
        A new tensor of ``tensor``'s shape and dtype, bitwise identical on every rank,
        approximating the average of ``tensor`` over the ranks. With P = 1 it equals
        ``tensor`` and the error buffers are untouched.

    Raises:
        ValueError/TypeError: wrong buffer sizes, dtypes or devices.
        NonFiniteError: a NaN/Inf reached the exchange on some rank; raised on every
            rank together, with both error buffers untouched.
    """
    t = make_transport(transport, process_set, getattr(tensor, "device", None))
    n, p = tensor.numel(), t.world_size
    want_w, want_s = padded_numel(n, p), padded_numel(n, p) // p
    for buf, want, label in ((worker_error, want_w, "worker_error"), (server_error, want_s, "server_error")):
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.float32:
            raise TypeError(f"{label} must be a float32 torch.Tensor, got "
                            f"{getattr(buf, 'dtype', type(buf).__name__)}")
        if buf.numel() != want or not buf.is_contiguous():
            raise ValueError(f"{label} must be contiguous with {want} elements (padded_numel({n}, {p})"
                             f"{' // ' + str(p) if label == 'server_error' else ''}), got {buf.numel()}")
    for buf, label in ((worker_error, "worker_error"), (server_error, "server_error")):
        if buf.device != tensor.device:
            raise ValueError(f"{label} is on {buf.device} but the tensor is on {tensor.device}; "
                             "allocate the error buffers on the tensor's device")
    if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"compressed_allreduce supports float32, float16 and bfloat16 tensors, got {tensor.dtype}")
    if n == 0:
        return tensor.clone()
    if name is None:  # numbered per rank, so thread-ranks sharing this process pair up too
        count = compressed_allreduce.calls[t.rank] = compressed_allreduce.calls.get(t.rank, 0) + 1
        name = f"zoadam.car.{count}"
    ex = Exchange([n], t, name, worker_error.view(-1), server_error.view(-1), device=tensor.device)
    y = ex.input if ex.input is not None else torch.zeros(ex.padded_numel, dtype=torch.float32, device=tensor.device)
    y[:n].copy_(tensor.reshape(-1))
    scales = ex.prepare(y)
    if scales is None:
        raise NonFiniteError(f"compressed_allreduce({name}): a non-finite value reached the exchange on "
                             "some rank; no error buffer was changed")
    out = ex.finish(y, scales, torch.empty(n, dtype=torch.float32, device=tensor.device))
    if ex.worker_error.data_ptr() != worker_error.data_ptr():
        worker_error.view(-1).copy_(ex.worker_error)  # the caller's buffers are updated in place
    if ex.server_error.data_ptr() != server_error.data_ptr():
        server_error.view(-1).copy_(ex.server_error)
    return out.view(tensor.shape).to(tensor.dtype)


compressed_allreduce.calls = {}
