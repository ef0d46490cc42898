"""Kernels of the 1-bit compressor (algorithm.md §3), shipped as ``hvd_zoadam.native``.

One signature per kernel, dispatched on the tensor's device. The semantics are
defined by :mod:`hvd_zoadam.native.reference` (plain torch); :mod:`.cpu` holds the
Numba CPU kernels. Every function writes into caller-owned, preallocated buffers.

Shapes and dtypes (``N`` = padded numel of the bucket, ``C = N / P`` the chunk,
``nseg`` the number of segments, i.e. tensors, of the bucket):

=================  ======================  ===========================================
argument           dtype, shape            meaning
=================  ======================  ===========================================
``y``              float32, float16 or     input: at least the ``n`` real elements;
                   bfloat16 [>= n]         elements past ``len(y)`` read as 0
``worker_error``   float32[N]              e_w, updated in place
``server_error``   float32[C]              e_s of this rank's chunk, updated in place
``offsets``        int64 ndarray[nseg+1]   segment boundaries, ``offsets[0] == 0``
``packed``         uint8[N/8] or [C/8]     sign bits, MSB first, 1 = +1
``scales``         float32[nseg]           per segment (worker) or per piece (server)
=================  ======================  ===========================================
"""
from __future__ import annotations

import functools
from typing import Iterable

import numpy as np
import torch

from . import cpu, reference
from .host import numpy_view as _np

__all__ = ["use_cuda_kernels_on_cpu", "configure_threads", "threads_per_rank", "warm_up", "Plan", "all_finite",
           "all_finite_many", "on_cpu_path", "finite_flag", "all_true", "read_flags", "clamp_finite_",
           "precondition_clamp_", "clamp_by", "local_step", "local_step_if_finite", "local_step_on_device",
           "local_window_update",
           "local_step_fused",
           "local_step_fuses", "sync_prepare", "sync_rebuild", "worker_scales", "worker_pack", "worker_compress",
           "server_reduce", "decompress", "decompress_momentum", "decompress_sync", "reference"]


def threads_per_rank(ranks_per_host: int) -> int:
    """The CPU kernels' threads each of ``ranks_per_host`` ranks runs: ``NUMBA_NUM_THREADS`` when
    the user set it, else an equal share of the host's cores (at least 1). Pure: reads the
    environment and numba's config, changes nothing."""
    import os

    import numba
    if "NUMBA_NUM_THREADS" in os.environ:
        return numba.config.NUMBA_NUM_THREADS
    share = max(1, (os.cpu_count() or 1) // max(1, ranks_per_host))
    return min(share, numba.config.NUMBA_NUM_THREADS)


def configure_threads(ranks_per_host: int) -> int:
    """Give each of ``ranks_per_host`` ranks an equal share of the cores for the CPU kernels
    (:func:`threads_per_rank`).

    Numba's OpenMP pool busy-waits between parallel regions; with several ranks per host
    and every rank using all cores, the ranks starve each other (measured here: 2 ranks
    on 2 cores ran 2.6x slower; a torchrun job 8-10x slower than DDP). A
    ``NUMBA_NUM_THREADS`` set by the user wins. Returns the thread count now in force.

    Numba launches its pool of ``NUMBA_NUM_THREADS`` threads at the first parallel call and
    ``set_num_threads`` only masks threads out: with the OpenMP layer the masked threads still
    join every parallel region and spin at its barrier (measured: a torchrun job of 2 ranks on
    2 cores ran 11x slower than with ``NUMBA_NUM_THREADS=1``, as slow as with no share at
    all). So while the pool is not launched yet, it is launched at the share's size.
    """
    import numba
    from numba.np.ufunc import parallel
    threads = threads_per_rank(ranks_per_host)
    if not getattr(parallel, "_is_initialized", True) and hasattr(parallel, "NUM_THREADS"):
        numba.config.NUMBA_NUM_THREADS = parallel.NUM_THREADS = threads
    numba.set_num_threads(threads)
    return numba.get_num_threads()


class Plan:
    """Precomputed integer layout of one bucket for the kernels (no tensors).

    Args:
        offsets: segment boundaries, ints, ``offsets[-1]`` = real numel n.
        padded_numel: N, a multiple of ``8 * world_size``.
        world_size: P.
        rank: this rank's index in the process set (which chunk it serves).
    """

    def __init__(self, offsets: list[int] | np.ndarray, padded_numel: int, world_size: int, rank: int):
        self.offsets = np.ascontiguousarray(np.asarray(offsets, dtype=np.int64))
        self.nseg = len(self.offsets) - 1
        self.numel = int(self.offsets[-1])
        self.padded_numel = padded_numel
        self.world_size = world_size
        self.rank = rank
        self.chunk_numel = padded_numel // world_size if world_size else 0
        self.chunk_start = rank * self.chunk_numel
        self.worker_tasks = cpu.make_tasks(self.offsets, 0, self.numel)
        self.server_tasks = cpu.make_tasks(self.offsets, self.chunk_start,
                                           self.chunk_start + self.chunk_numel)
        self.unpack_tasks = cpu.make_tasks(self.offsets, 0, self.numel, chunk_numel=self.chunk_numel)
        # Runs of whole segments for the one-pass worker kernel (None: a segment is too long)
        self.groups = cpu.make_groups(self.offsets)
        ng = 0 if self.groups is None else len(self.groups)
        # Runs of whole server tasks for the one-pass CUDA server kernel. Each task is then a
        # whole piece of a segment (a piece longer than cpu.BLOCK makes this None, and tasks
        # split only pieces longer than cpu.TASK_NUMEL), so it has one scale.
        self.server_groups = (cpu.make_groups(np.concatenate([self.server_tasks[:1, 1], self.server_tasks[:, 2]]))
                              if len(self.server_tasks) else None)
        # Scratch of the CPU kernels (the CUDA kernels keep their own copies: cuda.plan_arrays)
        self.part_idx = np.zeros((ng, 2), dtype=np.int64)
        self.part_val = np.zeros((ng, 2), dtype=np.uint8)
        self.worker_partial = np.zeros(len(self.worker_tasks), dtype=np.float64)
        self.server_partial = np.zeros(len(self.server_tasks), dtype=np.float64)


_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _host_input(y: torch.Tensor) -> np.ndarray:
    """numpy view of ``y`` for the CPU kernels: float32, or the bits of fp16/bf16 (cpu.load)."""
    if y.dtype == torch.float32:
        return _np(y)
    if y.dtype == torch.float16:
        return y.view(torch.uint16).numpy()
    if y.dtype == torch.bfloat16:
        return y.view(torch.int16).numpy()
    raise TypeError(f"y must be float32, float16 or bfloat16, got {y.dtype}")


_CUDA_ON_CPU = False  # use_cuda_kernels_on_cpu(): the CUDA simulator's kernels take CPU tensors


def use_cuda_kernels_on_cpu(enabled: bool = True) -> None:
    """Testing seam for machines without a GPU: send CPU tensors to the numba.cuda kernels.

    Only under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` before numba is imported), which
    runs the CUDA kernels, thread by simulated thread, over numpy views of CPU tensors. Every
    function of this module then takes the path a CUDA tensor takes (the CUDA kernels, and
    the torch ops instead of the CPU-only Numba helpers), so that an optimizer on CPU
    parameters exercises the GPU code. Raises RuntimeError without the simulator.
    """
    global _CUDA_ON_CPU
    from numba import config
    if enabled and not config.ENABLE_CUDASIM:
        raise RuntimeError("use_cuda_kernels_on_cpu() needs the CUDA simulator: set NUMBA_ENABLE_CUDASIM=1 "
                           "before numba is imported")
    _CUDA_ON_CPU = bool(enabled)


def _cpu_kernels(*tensors) -> bool:
    """True when the CPU-only Numba helpers may take these tensors: all on the CPU, contiguous."""
    return not _CUDA_ON_CPU and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _on_cuda(*tensors) -> bool:
    """True when every tensor is on one CUDA device, False when all are on the CPU (True there
    too under :func:`use_cuda_kernels_on_cpu`)."""
    types = {t.device.type for t in tensors}
    if types == {"cpu"}:
        return _CUDA_ON_CPU
    if types == {"cuda"} and len({t.device for t in tensors}) == 1:
        return True
    raise ValueError("hvd_zoadam's kernels need all their tensors on the CPU or all on one CUDA device, got "
                     + ", ".join(sorted({str(t.device) for t in tensors})))


def worker_scales(y: torch.Tensor, worker_error: torch.Tensor, plan: Plan, out: torch.Tensor) -> torch.Tensor:
    """Pass 1 of the worker side: ``out[i] = ||(y + worker_error)[segment i]||_2 / sqrt(len_i)``.

    Sums in float64 (algorithm.md §3). ``out``: float32[nseg]. Returns ``out``. A NaN/Inf in the
    input makes that segment's scale non-finite (the agreed-skip signal of algorithm.md §5).
    """
    if _on_cuda(y, worker_error, out):
        from . import cuda as _cuda
        return _cuda.worker_scales(y, worker_error, plan, out)
    cpu.sumsq_tasks(_host_input(y), _np(worker_error), plan.worker_tasks, plan.worker_partial)
    cpu.reduce_scales(plan.worker_tasks, plan.worker_partial, plan.offsets, 0, plan.numel, _np(out))
    return out


def worker_pack(y: torch.Tensor, worker_error: torch.Tensor, plan: Plan, scales: torch.Tensor, packed: torch.Tensor,
                error_out: torch.Tensor | None = None) -> torch.Tensor:
    """Pass 2 of the worker side: ``packed`` (uint8[N/8]) <- MSB-first bits of z = y + worker_error,
    and the new error z - scale*sign on the real elements into ``error_out`` (float32[N],
    default ``worker_error`` itself; its padding is not written). Returns ``packed``."""
    eo = worker_error if error_out is None else error_out
    if _on_cuda(y, worker_error, eo, scales, packed):
        from . import cuda as _cuda
        return _cuda.pack_update(y, worker_error, 0, plan, scales, packed, e_out=eo)
    cpu.pack_update(_host_input(y), True, _np(worker_error), _np(eo), 0, plan.offsets, _np(scales),
                    _np(packed))
    return packed


def worker_compress(y: torch.Tensor, worker_error: torch.Tensor, plan: Plan, scales: torch.Tensor,
                    packed: torch.Tensor, error_out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole worker side of algorithm.md §3: ``scales`` (float32[nseg]) as :func:`worker_scales`,
    ``packed`` and the new error into ``error_out`` as :func:`worker_pack`. Returns ``packed``.

    When no segment is longer than ``cpu.BLOCK`` (4096) elements (hvd_zoadam's per-block
    scales, 2048 by default), both steps run in one pass over memory: on the CPU
    (:func:`cpu.compress_fused`) each segment is summed and then signed while it is in L1; on
    CUDA (:func:`cuda.compress_fused`) one thread block per group of segments holds them in
    shared memory. Both give the same scales, bits and errors as their two passes. Otherwise,
    two passes. With ``error_out`` distinct from ``worker_error`` the input error stays as it
    was, so that a step all ranks agree to skip can leave it untouched (algorithm.md §5).
    """
    eo = worker_error if error_out is None else error_out
    if plan.groups is not None and len(plan.groups) and _on_cuda(y, worker_error, eo, scales, packed):
        from . import cuda as _cuda
        return _cuda.compress_fused(y, worker_error, plan, scales, packed, e_out=eo)
    if plan.groups is not None and not _on_cuda(y, worker_error, eo, scales, packed):
        cpu.compress_fused(_host_input(y), _np(worker_error), _np(eo), plan.offsets, plan.groups,
                           _np(scales), _np(packed), plan.part_idx, plan.part_val)
        return packed
    worker_scales(y, worker_error, plan, scales)
    return worker_pack(y, worker_error, plan, scales, packed, error_out=eo)


def server_reduce(recv: torch.Tensor, all_worker_scales: torch.Tensor, server_error: torch.Tensor, plan: Plan,
                  packed: torch.Tensor, scales: torch.Tensor, error_out: torch.Tensor | None = None):
    """Average the P received chunks with their scales, add ``server_error``, recompress.

    ``recv``: uint8[P, C/8]; ``all_worker_scales``: float32[P, nseg]; writes
    ``packed`` uint8[C/8] and ``scales`` float32[nseg] (per piece of this chunk),
    and sets the new server error ``c - scale*sign`` (algorithm.md §3, server side) into
    ``error_out`` (float32[C], a buffer other than ``server_error``, which is then only read)
    or, when it is None, into ``server_error`` itself. Returns ``(packed, scales)``.
    """
    eo = server_error if error_out is None else error_out
    if _on_cuda(recv, all_worker_scales, server_error, eo, packed, scales):
        from . import cuda as _cuda
        if eo is not server_error:  # the CUDA kernels work in place
            eo.copy_(server_error)
        return _cuda.server_reduce(recv, all_worker_scales, eo, plan, packed, scales)
    real = max(0, min(plan.chunk_numel, plan.numel - plan.chunk_start))
    if eo is not server_error and real < plan.chunk_numel:  # the chunk's padding is not written: keep it
        eo[real:].copy_(server_error[real:])
    cpu.server_reduce(_np(recv), _np(all_worker_scales), _np(server_error), _np(eo), plan.server_tasks,
                      plan.chunk_start, plan.chunk_start + plan.chunk_numel, plan.server_partial, plan.offsets,
                      _np(scales), _np(packed))
    return packed, scales


def decompress(packed: torch.Tensor, all_server_scales: torch.Tensor, plan: Plan, out: torch.Tensor) -> torch.Tensor:
    """``out[j] = server_scale[chunk(j), segment(j)] * sign_j`` for the n real elements.

    ``packed``: uint8[N/8], the allgathered server chunks; ``all_server_scales``:
    float32[P, nseg]; ``out``: float32[>= n]. Returns ``out``.
    """
    if _on_cuda(packed, all_server_scales, out):
        from . import cuda as _cuda
        return _cuda.decompress(packed, all_server_scales, plan, out)
    if plan.numel:
        cpu.decompress(_np(packed), _np(all_server_scales), plan.unpack_tasks, plan.chunk_numel, _np(out))
    return out


def decompress_momentum(packed: torch.Tensor, all_server_scales: torch.Tensor, plan: Plan, exp_avg: torch.Tensor,
                        beta1: float) -> torch.Tensor:
    """COMPRESSED step 2 (algorithm.md §2) straight from the packed result, without materialising ĝ:
    ``exp_avg <- exp_avg + (1 - beta1) * (ĝ - exp_avg)`` (``torch.lerp`` form, float32).

    ``exp_avg``: float32[n]. Returns ``exp_avg``.
    """
    if _on_cuda(packed, all_server_scales, exp_avg):
        from . import cuda as _cuda
        return _cuda.decompress_momentum(packed, all_server_scales, plan, exp_avg, beta1)
    if plan.numel:
        cpu.decompress_momentum(_np(packed), _np(all_server_scales), plan.unpack_tasks, plan.chunk_numel,
                                _np(exp_avg), 1.0 - beta1)
    return exp_avg


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite (no NaN, no ±Inf). float32 CPU tensors take one
    read-only Numba pass; anything else goes to ``torch.isfinite``."""
    if t.dtype == torch.float32 and _cpu_kernels(t):
        return cpu.count_non_finite(_flat(t)[0]) == 0 if t.numel() else True
    return bool(torch.isfinite(t).all())


def on_cpu_path(*tensors: torch.Tensor) -> bool:
    """Whether the CPU kernels take these tensors (all on the CPU and contiguous, and not sent to
    the CUDA kernels under :func:`use_cuda_kernels_on_cpu`): where a value is read on the host
    at no cost, and :func:`local_step_if_finite` checks the gradient inside its kernel call."""
    return _cpu_kernels(*tensors)


def finite_flag(t: torch.Tensor) -> bool | torch.Tensor:
    """Whether every element of ``t`` is finite: a bool where the CPU kernels take ``t`` (one
    read-only pass, :func:`all_finite`), else a 0-dim bool tensor on ``t``'s device, not read,
    for :func:`all_true` to read with others in one host synchronisation."""
    if not t.numel():
        return True
    return all_finite(t) if _cpu_kernels(t) else torch.isfinite(t).all()


def all_true(flags: Iterable[bool | torch.Tensor]) -> bool:
    """Whether every flag of :func:`finite_flag` is True: the bools first, then every tensor
    flag read at once (one host synchronisation, none when the bools decide)."""
    flags = list(flags)
    return all(f for f in flags if isinstance(f, bool)) and all(read_flags(flags))


def read_flags(flags: list[bool | torch.Tensor]) -> list[bool]:
    """:func:`finite_flag`'s flags as bools, every tensor flag read at once."""
    rest = [f for f in flags if not isinstance(f, bool)]
    values = iter(torch.stack([f.to(rest[0].device) for f in rest]).tolist() if rest else [])
    return [f if isinstance(f, bool) else next(values) for f in flags]


def all_finite_many(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite: :func:`finite_flag` of each in turn
    (a read-only pass per CPU tensor, stopping at the first that is not), one host
    synchronisation in all for the rest. Each tensor is flagged before the next is drawn, so
    an iterator may hand out one buffer refilled."""
    flags = []
    for t in tensors:
        flags.append(finite_flag(t))
        if flags[-1] is False:
            return False
    return all_true(flags)


def clamp_finite_(y: torch.Tensor, bound: float) -> torch.Tensor:
    """In place, ``y <- clamp(y, -bound, bound)``, except that a NaN/Inf in ``y`` must still
    reach the scales (algorithm.md §5: the agreed skip): ±Inf become NaN, which the clamp keeps.
    The same result on every device. On the CPU a read-only check first lets a finite ``y``
    take the clamp alone; on CUDA there is no host synchronisation (it runs inside the
    backward hooks). Bitwise ``clamp_`` for finite ``y``. ``y``: float32[n]. Returns ``y``."""
    if _cpu_kernels(y) and all_finite(y):  # one read-only pass, then the clamp alone
        return y.clamp_(-bound, bound)
    return y.masked_fill_(torch.isinf(y), float("nan")).clamp_(-bound, bound)


def precondition_clamp_(y: torch.Tensor, denom: torch.Tensor, bound: float) -> torch.Tensor:
    """In place, ``y <- clamp_finite_(y / denom, bound)`` (:func:`clamp_finite_`): a COMPRESSED
    step's preconditioned exchange input, a NaN/Inf still reaching the scales. One pass on the
    CPU (:func:`cpu.precondition_clamp`), bitwise the torch ops. ``y``, ``denom``: float32[n].
    Returns ``y``."""
    if _cpu_kernels(y, denom) and y.dtype == denom.dtype == torch.float32:
        cpu.precondition_clamp(*_flat(y, denom), np.float32(bound))
        return y
    return clamp_finite_(y.div_(denom), bound)


def clamp_by(g: torch.Tensor, denom: torch.Tensor, c: float) -> torch.Tensor:
    """In place, ``g <- clamp(g, -b, b)`` with ``b = denom * c`` (float32): bitwise
    ``torch.minimum(g, b)`` then ``torch.maximum(g, -b)`` for finite g, in one pass on the CPU.
    ``g``, ``denom``: float32[n]. Returns ``g``."""
    if _cpu_kernels(g, denom):
        cpu.clamp_by(_np(g), _np(denom), float(c))
        return g
    bound = torch.mul(denom, c)
    torch.minimum(g, bound, out=g)
    return torch.maximum(g, bound.neg_(), out=g)


_NO_ARRAY = np.empty(0, dtype=np.float32)


@functools.lru_cache(maxsize=None)
def _kernel_matches_torch() -> bool:
    """Whether :func:`cpu.local_step` gives torch's bits on this machine, tried once on a probe
    that takes both lerp formulas, the L2 term and a scalar tail. torch's vectorised CPU
    kernels fuse the multiply-add of ``lerp`` and ``add(alpha=)`` (its AVX2, AVX-512 and
    NEON builds do); a torch that does not, say on a CPU without FMA, gets the torch ops."""
    gen = torch.Generator().manual_seed(0)
    n = 1000 + 37
    g, x, m = (torch.randn(n, generator=gen) for _ in range(3))
    s = torch.rand(n, generator=gen) + 1e-3
    for weight, l2 in ((0.1, 0.0), (0.7, 0.01)):
        want_x, want_m, got_x, got_m = x.clone(), m.clone(), x.clone(), m.clone()
        reference.local_step(g, want_x, want_m, s, weight=weight, step_size=-0.3, l2=l2, bound_factor=1.5)
        cpu.local_step(g.numpy(), got_x.numpy(), got_m.numpy(), s.numpy(), _NO_ARRAY, *_scalars(
            weight=weight, step_size=-0.3, l2=l2, bound_factor=1.5))
        if not (torch.equal(got_x, want_x) and torch.equal(got_m, want_m)):
            return False
    return True


def local_step_fused(*tensors: torch.Tensor) -> bool:
    """Whether :func:`local_step` and :func:`local_window_update` take these tensors in one Numba
    pass: float32, contiguous, on the CPU, and the kernel matches torch's rounding here (else
    the torch ops run)."""
    return (all(t.dtype == torch.float32 for t in tensors) and _cpu_kernels(*tensors)
            and _kernel_matches_torch())


def local_step_fuses(*, weight: float, step_size: float = 0.0, decay: float = 1.0, l2: float = 0.0,
                     bound_factor: float | None = None) -> bool:
    """Whether the kernels reproduce torch's ops for these scalars (:func:`reference.local_step`'s
    arguments). Left to the torch ops: a ``weight`` that is 1 in float32 (β1 = 0 or nearly),
    where torch's own vector loop and scalar tail give zeros of different signs, which no one
    pass can match; an ``l2`` that float32 rounds to 0 (torch still adds 0·x); a bound that is not
    positive."""
    f32 = np.float32
    return (f32(weight) != f32(1.0) and (l2 == 0.0 or f32(l2) != f32(0.0))
            and (bound_factor is None or bound_factor > 0))


def _fusable(tensors, mask, step: dict) -> bool:
    """:func:`local_step_fused` for the tensors and :func:`local_step_fuses` for the scalars."""
    return local_step_fused(*tensors) and (mask is None or _cpu_kernels(mask)) and local_step_fuses(**step)


def _scalars(*, weight: float, step_size: float, decay: float = 1.0, l2: float = 0.0, bound_factor=None) -> tuple:
    """The float32 scalars of the kernels, in their order: c (+inf: no clamp), decay, l2, w, step_size."""
    f32 = np.float32
    return (f32(np.inf if bound_factor is None else bound_factor), f32(decay), f32(l2), f32(weight),
            f32(step_size))


def _flat(*tensors) -> list:
    """The tensors as 1-D numpy arrays over their memory (no torch op for a 1-D tensor that
    needs no gradient: the buckets' flat buffers)."""
    return [_np(t) if t.dim() == 1 and not t.requires_grad else t.detach().reshape(-1).numpy()
            for t in tensors]


def local_step(grad: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor, *,
               mask: torch.Tensor | None = None, **step: float | None) -> None:
    """A LOCAL step on one tensor, in place, bitwise :func:`reference.local_step` (same
    arguments): on the CPU one pass (:func:`local_step_fused`) instead of a clamp and five torch
    ops, which reads g where it is (``p.grad``) and writes x where it lives (the parameter); on
    the CUDA path one launch (``cuda._momentum_step``, the CPU kernel's bits) where
    :func:`local_step_on_device` would take the tensors. ``grad`` is not checked: a COMPRESSED
    step's, whose skip was agreed before."""
    if not _fusable((grad, param, exp_avg, denom), mask, step):
        if _device_kernel_takes((grad, param, exp_avg, denom), mask, grad, step):
            from . import cuda as _cuda
            _cuda.momentum_step(grad, param, exp_avg, denom, mask, _scalars(**step))
            return
        reference.local_step(grad, param, exp_avg, denom, mask=mask, **step)
        return
    cpu.local_step(*_flat(grad, param, exp_avg, denom), _NO_ARRAY if mask is None else _flat(mask)[0],
                   *_scalars(**step))


def local_step_if_finite(grad: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor, *,
                         mask: torch.Tensor | None = None, finite: bool | None = None, **step: float | None) -> bool:
    """:func:`local_step` where every element of ``grad`` is finite (:func:`all_finite`), else
    nothing. Returns whether it took the step. On the CPU one call of the kernels for the check
    and the step (:func:`cpu.local_step_if_finite`); elsewhere the check, then the step, or
    ``finite`` where the caller read it already (off the CPU path every bucket's at once,
    :func:`read_flags`)."""
    if not _fusable((grad, param, exp_avg, denom), mask, step):
        if not (all_finite(grad) if finite is None else finite):
            return False
        reference.local_step(grad, param, exp_avg, denom, mask=mask, **step)
        return True
    bad = cpu.local_step_if_finite(*_flat(grad, param, exp_avg, denom), _NO_ARRAY if mask is None else _flat(mask)[0],
                                   *_scalars(**step))
    return bad == 0


def local_step_on_device(grad: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor,
                         flags: torch.Tensor, row: int, *, mask: torch.Tensor | None = None,
                         **step: float | None) -> bool:
    """:func:`local_step_if_finite` decided on the device, for CUDA tensors (and CPU tensors
    under :func:`use_cuda_kernels_on_cpu`): one launch of a CUDA kernel checks ``grad`` and,
    where every element is finite, takes the step; nothing is read on the host. The count of
    the non-finite elements lands in ``flags[row, 1]`` (``flags``: int32[rows, 2] on the
    tensors' device, zeroed before its first use; each call leaves 0 in ``flags[row, 0]``).

    The kernel rounds as :func:`cpu.local_step` does: bitwise :func:`reference.local_step` on
    CPU tensors (the simulator's case), and on a GPU the CPU kernels' bits for the same
    inputs, which torch's CUDA ops need not give (they fuse other multiply-adds). ``grad``,
    ``param``, ``exp_avg``, ``denom``: float32[n], contiguous; ``mask``: bool or uint8[n] or
    None; ``step``: the scalars of :func:`reference.local_step`.

    Returns False, doing nothing, where the kernel does not take these (not on the CUDA path,
    a dtype other than float32, a tensor that is not contiguous, scalars that
    :func:`local_step_fuses` leaves to torch's ops); True once launched.

    Raises:
        ValueError: tensors on more than one device.
    """
    if not _device_kernel_takes((grad, param, exp_avg, denom), mask, flags, step):
        return False
    from . import cuda as _cuda
    _cuda.local_step_if_finite(grad, param, exp_avg, denom, mask, flags, row, _scalars(**step))
    return True


def _device_kernel_takes(tensors: tuple, mask, flags: torch.Tensor, step: dict) -> bool:
    """Whether the CUDA kernels of the local step take these: float32 ``tensors``, contiguous
    as ``mask`` is, all on the CUDA path with ``flags``, scalars that :func:`local_step_fuses`
    and, on CPU tensors (the simulator), a torch whose CPU ops the kernels match."""
    every = tensors + (() if mask is None else (mask,))
    return (all(t.is_contiguous() for t in every) and _on_cuda(*every, flags)
            and all(t.dtype == torch.float32 for t in tensors) and local_step_fuses(**step)
            and (tensors[0].device.type != "cpu" or _kernel_matches_torch()))


def local_window_update(grad: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor,
                        anchor: torch.Tensor, out: torch.Tensor, *, decay_product: float = 1.0,
                        mask: torch.Tensor | None = None, flags: torch.Tensor | None = None, row: int = 0,
                        **step: float | None) -> bool:
    """SYNC steps 1–3 on one tensor, bitwise :func:`reference.local_window_update` (same
    arguments and result): on the CPU one pass that writes only ``out``, and counts the
    non-finite gradients on the way. Returns whether ``grad`` is all finite. Off the CPU (CUDA,
    the simulator) nothing is read on the host: where ``grad`` is not finite ``out`` is
    already the skipped step's, and it returns True. There, given ``flags`` (as
    :func:`local_step_on_device`'s, the count landing in ``flags[row, 1]``), one launch of a
    CUDA kernel checks ``grad`` and writes ``out`` where the kernels take the tensors
    (:func:`local_step_on_device`'s conditions); else torch's ops choose (``select``)."""
    tensors = (grad, param, exp_avg, denom, anchor, out)
    if flags is not None and _device_kernel_takes(tensors, mask, flags, step):
        from . import cuda as _cuda
        _cuda.local_window_update(grad, param, exp_avg, denom, mask, anchor, out, flags, row, _scalars(**step),
                                  np.float32(decay_product))
        return True
    if not _fusable((grad, param, exp_avg, denom, anchor, out), mask, step):
        return reference.local_window_update(grad, param, exp_avg, denom, anchor, out, decay_product=decay_product,
                                             mask=mask, select=not _cpu_kernels(grad), **step)
    bad = cpu.local_window_update(*_flat(grad, param, exp_avg, denom), _NO_ARRAY if mask is None else _flat(mask)[0],
                                  *_flat(anchor, out), *_scalars(**step), np.float32(decay_product))
    return bad == 0


def _variance_scalars(*, weight: float, step_size: float, beta2: float, bias_correction2: float, eps: float,
                      decay: float = 1.0, l2: float = 0.0) -> tuple:
    """The float32 scalars of the VARIANCE kernels, in their order: decay, l2, w, step_size,
    beta2, 1 − beta2 (rounded once, as torch's ``value=``), sqrt(bias_correction2), eps."""
    f32 = np.float32
    return (f32(decay), f32(l2), f32(weight), f32(step_size), f32(beta2), f32(1 - beta2),
            f32(bias_correction2 ** 0.5), f32(eps))


@functools.lru_cache(maxsize=None)
def _variance_kernel_matches_torch() -> bool:
    """Whether :func:`cpu.variance_step` gives :func:`reference.variance_step`'s bits here, tried
    once on a probe with both lerp formulas, the L2 term, a mask and a scalar tail (as
    :func:`_kernel_matches_torch` for the local step)."""
    gen = torch.Generator().manual_seed(1)
    n = 1000 + 37
    g, x, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.1
    for step in ({"weight": 0.1, "decay": 0.999}, {"weight": 0.7, "l2": 0.01}):
        step = {"step_size": -0.3, "beta2": 0.98, "bias_correction2": 0.3, "eps": 1e-8, **step}
        want = [x.clone(), m.clone(), v.clone(), torch.empty(n)]
        got = [x.clone(), m.clone(), v.clone(), torch.empty(n)]
        reference.variance_step(g, *want, mask=mask, **step)
        cpu.variance_step(g.numpy(), *(t.numpy() for t in got), mask.numpy(), *_variance_scalars(**step))
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            return False
    return True


def variance_step(grad: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  denom: torch.Tensor, *, mask: torch.Tensor | None = None, **step: float) -> None:
    """A VARIANCE step on one tensor, in place, bitwise :func:`reference.variance_step` (same
    arguments): one pass on the CPU instead of up to nine torch ops, one kernel launch on the
    CUDA path (the CPU kernel's bits, as :func:`local_step_on_device`'s); torch's ops where the
    kernels do not take the tensors (not float32 or not contiguous, scalars that
    :func:`local_step_fuses` leaves to torch, a torch whose rounding the kernels miss).
    ``grad``, ``param``, ``exp_avg``, ``exp_avg_sq``, ``denom``: float32[n] (``denom``
    written); ``mask``: bool or uint8[n] or None. The caller has checked ``grad`` is finite
    (the agreed skip of algorithm.md §5 reads the average once for every bucket).

    Raises:
        ValueError: tensors on more than one device.
    """
    tensors = (grad, param, exp_avg, exp_avg_sq, denom)
    every = tensors + (() if mask is None else (mask,))
    local = {k: step[k] for k in ("weight", "step_size", "decay", "l2") if k in step}
    takes = (all(t.dtype == torch.float32 for t in tensors) and all(t.is_contiguous() for t in every)
             and local_step_fuses(**local))
    if takes and _cpu_kernels(*every):
        if _kernel_matches_torch() and _variance_kernel_matches_torch():
            cpu.variance_step(*_flat(*tensors), _NO_ARRAY if mask is None else _flat(mask)[0],
                              *_variance_scalars(**step))
            return
    elif takes and _on_cuda(*every) and (grad.device.type != "cpu" or _variance_kernel_matches_torch()):
        from . import cuda as _cuda
        _cuda.variance_step(grad, param, exp_avg, exp_avg_sq, denom, mask, _variance_scalars(**step))
        return
    reference.variance_step(grad, param, exp_avg, exp_avg_sq, denom, mask=mask, **step)


def sync_rebuild(w: torch.Tensor, anchor: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor,
                 factor: float, decay_product: float = 1.0) -> None:
    """SYNC steps 5-7 (algorithm.md §2) from an unpacked ``w`` in parameter units (preconditioned, no
    mask): the window's decay on the anchor (``anchor ← anchor·decay_product``), then
    ``param = anchor − w``, ``exp_avg = (w·denom)·factor``, ``anchor = param``. Bitwise
    ``anchor.mul_(decay_product)`` and :func:`hvd_zoadam.core.step_math.sync_finish` with
    ``preconditioned=True, mask=None`` (:func:`reference.sync_rebuild`); one pass on the CPU
    instead of five, one kernel launch on the CUDA path (float32 contiguous tensors; else
    torch's ops). All float32[n]."""
    tensors = (w, anchor, param, exp_avg, denom)
    if _cpu_kernels(*tensors):
        cpu.sync_rebuild(*(_np(t) for t in tensors), np.float32(factor), np.float32(decay_product))
        return
    if all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors) and _on_cuda(*tensors):
        from . import cuda as _cuda
        _cuda.sync_rebuild(w, anchor, param, exp_avg, denom, np.float32(factor), np.float32(decay_product))
        return
    reference.sync_rebuild(w, anchor, param, exp_avg, denom, factor, decay_product)


def sync_prepare(param: torch.Tensor, anchor: torch.Tensor, decay_product: float, out: torch.Tensor) -> torch.Tensor:
    """SYNC steps 2-3 (algorithm.md §2) in parameter units: ``out = anchor·decay_product − param``
    (the anchor itself unchanged), bitwise :func:`hvd_zoadam.core.step_math.sync_prepare` with
    ``preconditioned=True``; one pass on the CPU instead of two. All float32[n]. Returns ``out``."""
    if _cpu_kernels(param, anchor, out):
        cpu.sync_prepare(_np(param), _np(anchor), np.float32(decay_product), _np(out))
        return out
    if decay_product != 1.0:
        return torch.mul(anchor, decay_product, out=out).sub_(param)
    return torch.sub(anchor, param, out=out)


_NO_MASK = np.zeros(0, dtype=np.bool_)


def decompress_sync(packed: torch.Tensor, all_server_scales: torch.Tensor, plan: Plan, *, anchor: torch.Tensor,
                    param: torch.Tensor | list[torch.Tensor], exp_avg: torch.Tensor, denom: torch.Tensor,
                    factor: float, decay_product: float = 1.0, mask: torch.Tensor | None = None,
                    preconditioned: bool = True) -> None:
    """SYNC steps 5-7 (algorithm.md §2) straight from the packed result w, bitwise as
    :func:`hvd_zoadam.core.step_math.sync_finish` after ``anchor.mul_(decay_product)``:

    w <- w·mask; x_a <- x_a·decay_product; preconditioned: x = x_a − w, m = (w·s)·factor;
    otherwise x = x_a − w/s, m = w·factor; then x_a <- x. ``factor`` is (1 − β1^t)/Λ.

    ``anchor``, ``exp_avg``, ``denom`` (s): float32[n]; ``mask``: bool[n] or None. ``param`` (x):
    float32[n], or the bucket's parameters themselves, a list of tensors in bucket order whose
    numels sum to n, each starting at a segment boundary of ``plan``: float32, contiguous and on
    the CPU, they are written in place by the kernel (no flat x and no scatter); otherwise
    through a flat float32[n] copied into them.

    Raises:
        ValueError: a list whose numels do not sum to n, or a parameter that starts inside a
            segment.
    """
    if isinstance(param, (list, tuple)):
        return _decompress_sync_into(packed, all_server_scales, plan, param, anchor=anchor, exp_avg=exp_avg,
                                     denom=denom, factor=factor, decay_product=decay_product, mask=mask,
                                     preconditioned=preconditioned)
    tensors = [packed, all_server_scales, anchor, param, exp_avg, denom] + ([mask] if mask is not None else [])
    if _on_cuda(*tensors):
        from . import cuda as _cuda
        return _cuda.decompress_sync(packed, all_server_scales, plan, anchor, param, exp_avg, denom, factor,
                                     decay_product, mask, preconditioned)
    if plan.numel:
        cpu.decompress_sync(_np(packed), _np(all_server_scales), plan.unpack_tasks, plan.chunk_numel,
                            _np(anchor), _np(param), _np(exp_avg), _np(denom),
                            _NO_MASK if mask is None else _np(mask), float(decay_product), float(factor),
                            bool(preconditioned))


def _decompress_sync_into(packed, all_server_scales, plan: Plan, params, **kw) -> None:
    """:func:`decompress_sync` with ``param`` a list of tensors (see there)."""
    sizes = [p.numel() for p in params]
    if sum(sizes) != plan.numel:
        raise ValueError(f"decompress_sync: the parameters hold {sum(sizes)} elements, the plan {plan.numel}")
    starts = np.cumsum([0] + sizes[:-1], dtype=np.int64)
    at = plan.offsets[np.minimum(np.searchsorted(plan.offsets, starts), plan.nseg)]  # offsets are sorted
    if not np.array_equal(at, starts):
        raise ValueError("decompress_sync: every parameter must start at a segment boundary of the plan")
    tensors = [packed, all_server_scales, kw["anchor"], kw["exp_avg"], kw["denom"], *params] \
        + ([kw["mask"]] if kw["mask"] is not None else [])
    if _on_cuda(*tensors) or not (all(p.dtype == torch.float32 for p in params) and _cpu_kernels(*params)):
        flat = torch.empty(plan.numel, dtype=torch.float32, device=kw["anchor"].device)
        decompress_sync(packed, all_server_scales, plan, param=flat, **kw)
        torch._foreach_copy_([p.detach() for p in params], [v.view_as(p) for v, p in zip(flat.split(sizes), params)])
        return
    if plan.numel:
        mask = kw["mask"]
        cpu.decompress_sync(_np(packed), _np(all_server_scales), plan.unpack_tasks, plan.chunk_numel,
                            _np(kw["anchor"]),
                            [(p.detach().view(-1).numpy(), int(o)) for p, o in zip(params, starts)],
                            _np(kw["exp_avg"]), _np(kw["denom"]),
                            _NO_MASK if mask is None else _np(mask), float(kw["decay_product"]),
                            float(kw["factor"]), bool(kw["preconditioned"]))


_warm = set()


def warm_up(device: torch.device | str | None = None) -> None:
    """Compile (or load from numba's cache) the kernels for float32 inputs, on tiny arrays.

    ``device``: the tensors' device (default the CPU). The CPU kernels are always warmed; a
    CUDA device warms the numba.cuda kernels too, in that device's context. The optimizer
    calls it at construction, so that the first exchanging step does not stall for the JIT
    (tens of seconds with a cold cache, every rank at once); later calls for a device
    return at once. float16/bfloat16 inputs compile on first use.

    Raises:
        RuntimeError: ``device`` is a CUDA device and numba's CUDA target sees none (the
            message says what to install).
    """
    if _CUDA_ON_CPU:  # the simulator compiles nothing
        return
    keys = ["cpu"]
    if device is not None and torch.device(device).type == "cuda":
        from numba import cuda as numba_cuda
        if not numba_cuda.is_available():
            raise RuntimeError(f"hvd_zoadam's kernels for tensors on {device} need numba's CUDA target, which sees "
                               "no CUDA device here: install numba-cuda and the CUDA toolkit's NVVM (check with "
                               "python -m hvd_zoadam.info), or keep the model on the CPU")
        keys.append(str(torch.device(device)))
    for key in keys:
        if key not in _warm:
            _warm_calls(torch.device(key))
            _warm.add(key)


def _warm_calls(device: torch.device) -> None:
    ones = lambda *shape: torch.ones(*shape, device=device)  # noqa: E731
    zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    n, p = 24, 2
    for offsets in ([0, 10, n], [0, 5000]):  # one pass (short segments) and two passes
        m = offsets[-1]
        big = m + (-m) % (8 * p)
        plan = Plan(offsets, big, p, 0)
        y, e = ones(big), zeros(big)
        packed, scales = zeros(big // 8, dtype=torch.uint8), zeros(plan.nseg)
        worker_compress(y, e, plan, scales, packed, error_out=zeros(big))
    plan = Plan([0, 10, n], n + (-n) % (8 * p), p, 0)
    chunk = plan.chunk_numel
    recv, wscales = zeros(p, chunk // 8, dtype=torch.uint8), ones(p, plan.nseg)
    server_reduce(recv, wscales, zeros(chunk), plan, zeros(chunk // 8, dtype=torch.uint8), zeros(plan.nseg))
    packed = zeros(plan.padded_numel // 8, dtype=torch.uint8)
    v = [ones(n) for _ in range(5)]
    decompress(packed, wscales, plan, v[0])
    decompress_momentum(packed, wscales, plan, v[0], 0.9)
    masks = (None, torch.ones(n, dtype=torch.bool, device=device), torch.ones(n, dtype=torch.uint8, device=device))
    for mask in masks:  # auto_exp_avg_mask's are bool, a user's exp_avg_mask uint8
        for preconditioned in (True, False):
            decompress_sync(packed, wscales, plan, anchor=v[0], param=v[1], exp_avg=v[2], denom=v[3], factor=0.5,
                            decay_product=0.5, mask=mask, preconditioned=preconditioned)
    for mask in masks:  # LOCAL and SYNC steps' local update, VARIANCE's
        local_step(v[0], v[1], v[2], v[3], mask=mask, weight=0.1, step_size=-0.1)
        local_step_if_finite(v[0], v[1], v[2], v[3], mask=mask, weight=0.1, step_size=-0.1)
        local_window_update(v[0], v[1], v[2], v[3], v[4], ones(n), mask=mask, weight=0.1, step_size=-0.1)
        variance_step(v[0], v[1], v[2], v[3], v[4], mask=mask, weight=0.1, step_size=-0.1, beta2=0.999,
                      bias_correction2=0.5, eps=1e-8)
    all_finite(v[0])
    precondition_clamp_(v[4], v[3], 1.0)
    clamp_by(v[0], v[1], 1.0)
    sync_prepare(v[0], v[1], 0.5, v[4])
    sync_rebuild(v[4], v[0], v[1], v[2], v[3], 0.5, 0.5)
