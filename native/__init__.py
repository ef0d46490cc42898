"""Kernels of the 1-bit compressor (spec §3), shipped as ``hvd_zoadam.native``.

One signature per kernel, dispatched on the tensor's device. The semantics are
defined by :mod:`hvd_zoadam.native.reference` (plain torch); :mod:`.cpu` holds the
Numba CPU kernels. Every function writes into caller-owned, preallocated buffers.

Shapes and dtypes (``N`` = padded numel of the bucket, ``C = N / P`` the chunk,
``nseg`` the number of segments, i.e. tensors, of the bucket):

=================  ======================  ===========================================
argument           dtype, shape            meaning
=================  ======================  ===========================================
``y``              float32[N]              input; padding elements are 0
``worker_error``   float32[N]              e_w, updated in place
``server_error``   float32[C]              e_s of this rank's chunk, updated in place
``offsets``        int64 ndarray[nseg+1]   segment boundaries, ``offsets[0] == 0``
``packed``         uint8[N/8] or [C/8]     sign bits, MSB first, 1 = +1
``scales``         float32[nseg]           per segment (worker) or per piece (server)
=================  ======================  ===========================================
"""
from __future__ import annotations

import numpy as np
import torch

from . import cpu, reference

__all__ = ["configure_threads", "Plan", "worker_scales", "worker_pack", "server_reduce", "decompress", "reference"]


def configure_threads(ranks_per_host: int) -> int:
    """Give each of ``ranks_per_host`` ranks an equal share of the cores for the CPU kernels.

    Numba's OpenMP pool busy-waits between parallel regions; with several ranks per host
    and every rank using all cores, the ranks starve each other (measured here: 2 ranks
    on 2 cores ran 2.6x slower). A ``NUMBA_NUM_THREADS`` set by the user wins. Returns
    the thread count now in force.
    """
    import os

    import numba
    if "NUMBA_NUM_THREADS" not in os.environ:
        share = max(1, (os.cpu_count() or 1) // max(1, ranks_per_host))
        numba.set_num_threads(min(share, numba.config.NUMBA_NUM_THREADS))
    return numba.get_num_threads()


class Plan:
    """Precomputed integer layout of one bucket for the CPU kernels (no tensors).

    Args:
        offsets: segment boundaries, ints, ``offsets[-1]`` = real numel n.
        padded_numel: N, a multiple of ``8 * world_size``.
        world_size: P.
        rank: this rank's index in the process set (which chunk it serves).
    """

    def __init__(self, offsets, padded_numel: int, world_size: int, rank: int):
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
        self._worker_partial = np.zeros(len(self.worker_tasks), dtype=np.float64)
        self._server_partial = np.zeros(len(self.server_tasks), dtype=np.float64)


def _check_cpu(*tensors):
    for t in tensors:
        if t.device.type != "cpu":
            raise NotImplementedError(
                "hvd_zoadam's compressor kernels run on CPU tensors only in this release; "
                f"got a tensor on {t.device}. Move the model to the CPU or wait for the CUDA kernels.")


def worker_scales(y: torch.Tensor, worker_error: torch.Tensor, plan: Plan, out: torch.Tensor) -> torch.Tensor:
    """out[i] = ||(y + worker_error)[segment i]||_2 / sqrt(len_i), float64 sums. Returns ``out``."""
    _check_cpu(y, worker_error, out)
    cpu.sumsq_tasks(y.numpy(), worker_error.numpy(), plan.worker_tasks, plan._worker_partial)
    cpu.reduce_scales(plan.worker_tasks, plan._worker_partial, plan.offsets, 0, plan.numel, out.numpy())
    return out


def worker_pack(y, worker_error, plan: Plan, scales, packed) -> torch.Tensor:
    """packed <- bits of z = y + worker_error; worker_error <- z - scale*sign. Returns ``packed``."""
    _check_cpu(y, worker_error, scales, packed)
    cpu.worker_pack(y.numpy(), worker_error.numpy(), plan.offsets, scales.numpy(), packed.numpy())
    return packed


def server_reduce(recv, all_worker_scales, server_error, plan: Plan, packed, scales):
    """Average the P received chunks with their scales, add ``server_error``, recompress.

    ``recv``: uint8[P, C/8]; ``all_worker_scales``: float32[P, nseg]; writes
    ``packed`` uint8[C/8] and ``scales`` float32[nseg] (per piece of this chunk),
    and sets ``server_error <- c - scale*sign``.
    """
    _check_cpu(recv, all_worker_scales, server_error, packed, scales)
    se = server_error.numpy()
    cpu.server_average(recv.numpy(), all_worker_scales.numpy(), se, plan.offsets, plan.chunk_start)
    cpu.sumsq_tasks_1(se, plan.server_tasks, plan.chunk_start, plan._server_partial)
    cpu.reduce_scales(plan.server_tasks, plan._server_partial, plan.offsets, plan.chunk_start,
                      plan.chunk_start + plan.chunk_numel, scales.numpy())
    cpu.server_pack(se, plan.offsets, scales.numpy(), plan.chunk_start, packed.numpy())
    return packed, scales


def decompress(packed, all_server_scales, plan: Plan, out) -> torch.Tensor:
    """out[j] = server_scale[chunk(j), segment(j)] * sign_j for j < out.numel(). Returns ``out``."""
    _check_cpu(packed, all_server_scales, out)
    if out.numel():
        cpu.decompress(packed.numpy(), all_server_scales.numpy(), plan.offsets, plan.chunk_numel, out.numpy())
    return out
