"""Numba CPU kernels of the 1-bit compressor; semantics in ``reference.py``.

All arrays are numpy views of torch CPU tensors, created by the caller (a numba
0.68 bug loses writes through views made inside a ``parallel=True`` function).
Every output buffer is preallocated by the caller and reused.

Work is split into *tasks*: ``(segment, start, stop)`` element ranges of at most
``TASK_NUMEL`` elements that never cross a segment boundary. Sums are reduced per
task in a fixed order, then per segment in task order, so results do not depend
on the thread count.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

TASK_NUMEL = 1 << 16
_BYTES_PER_BLOCK = 1 << 13


def make_tasks(offsets: np.ndarray, lo: int, hi: int, task_numel: int = TASK_NUMEL) -> np.ndarray:
    """int64[ntasks, 3] of (segment, start, stop) covering the real elements of [lo, hi)."""
    rows = []
    for seg in range(len(offsets) - 1):
        a, b = max(int(offsets[seg]), lo), min(int(offsets[seg + 1]), hi)
        while a < b:
            e = min(b, a + task_numel)
            rows.append((seg, a, e))
            a = e
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


@njit(parallel=True, cache=True)
def sumsq_tasks(y, e, tasks, partial):
    """partial[t] = sum over task t of float64((y + e)**2); y, e float32."""
    for t in prange(tasks.shape[0]):
        acc = 0.0
        for j in range(tasks[t, 1], tasks[t, 2]):
            z = np.float64(y[j] + e[j])
            acc += z * z
        partial[t] = acc


@njit(parallel=True, cache=True)
def sumsq_tasks_1(c, tasks, base, partial):
    """partial[t] = sum over task t of float64(c[j - base]**2)."""
    for t in prange(tasks.shape[0]):
        acc = 0.0
        for j in range(tasks[t, 1], tasks[t, 2]):
            z = np.float64(c[j - base])
            acc += z * z
        partial[t] = acc


@njit(cache=True)
def reduce_scales(tasks, partial, offsets, lo, hi, scales):
    """scales[seg] = sqrt(sum / count) over the segment's piece in [lo, hi), as float32."""
    nseg = offsets.shape[0] - 1
    sums = np.zeros(nseg, dtype=np.float64)
    for t in range(tasks.shape[0]):
        sums[tasks[t, 0]] += partial[t]
    for s in range(nseg):
        a = max(offsets[s], lo)
        b = min(offsets[s + 1], hi)
        if a < b:
            scales[s] = np.float32(np.sqrt(sums[s] / (b - a)))
        else:
            scales[s] = np.float32(0.0)


@njit(cache=True)
def _segment_of(offsets, j):
    """Segment index holding element j; nseg for padding."""
    return np.searchsorted(offsets, j, side="right") - 1


@njit(parallel=True, cache=True)
def worker_pack(y, e, offsets, scales, packed):
    """z = y + e; packed <- MSB-first bits of z >= 0; e <- z - scale*sign (0 scale on padding)."""
    nbytes = packed.shape[0]
    nseg = offsets.shape[0] - 1
    nblocks = (nbytes + _BYTES_PER_BLOCK - 1) // _BYTES_PER_BLOCK
    for blk in prange(nblocks):
        b0 = blk * _BYTES_PER_BLOCK
        b1 = min(nbytes, b0 + _BYTES_PER_BLOCK)
        seg = _segment_of(offsets, b0 * 8)
        for byte in range(b0, b1):
            v = 0
            for k in range(8):
                j = byte * 8 + k
                while seg < nseg and j >= offsets[seg + 1]:
                    seg += 1
                s = scales[seg] if seg < nseg else np.float32(0.0)
                z = y[j] + e[j]
                if z >= 0:
                    v |= 1 << (7 - k)
                    e[j] = z - s
                else:
                    e[j] = z + s
            packed[byte] = v


@njit(parallel=True, cache=True)
def server_average(recv, wscales, server_error, offsets, chunk_start):
    """server_error <- (sum_p wscale_p*sign_p) / P + server_error, i.e. c (spec §3)."""
    world_size = recv.shape[0]
    nbytes = recv.shape[1]
    nseg = offsets.shape[0] - 1
    inv = np.float32(world_size)
    nblocks = (nbytes + _BYTES_PER_BLOCK - 1) // _BYTES_PER_BLOCK
    for blk in prange(nblocks):
        b0 = blk * _BYTES_PER_BLOCK
        b1 = min(nbytes, b0 + _BYTES_PER_BLOCK)
        seg = _segment_of(offsets, chunk_start + b0 * 8)
        for byte in range(b0, b1):
            for k in range(8):
                i = byte * 8 + k
                j = chunk_start + i
                while seg < nseg and j >= offsets[seg + 1]:
                    seg += 1
                acc = np.float32(0.0)
                if seg < nseg:
                    for p in range(world_size):
                        s = wscales[p, seg]
                        if (recv[p, byte] >> (7 - k)) & 1:
                            acc = acc + s
                        else:
                            acc = acc - s
                server_error[i] = acc / inv + server_error[i]


@njit(parallel=True, cache=True)
def server_pack(c, offsets, scales, chunk_start, packed):
    """packed <- bits of c >= 0; c (the server_error buffer) <- c - scale*sign."""
    nbytes = packed.shape[0]
    nseg = offsets.shape[0] - 1
    nblocks = (nbytes + _BYTES_PER_BLOCK - 1) // _BYTES_PER_BLOCK
    for blk in prange(nblocks):
        b0 = blk * _BYTES_PER_BLOCK
        b1 = min(nbytes, b0 + _BYTES_PER_BLOCK)
        seg = _segment_of(offsets, chunk_start + b0 * 8)
        for byte in range(b0, b1):
            v = 0
            for k in range(8):
                i = byte * 8 + k
                j = chunk_start + i
                while seg < nseg and j >= offsets[seg + 1]:
                    seg += 1
                s = scales[seg] if seg < nseg else np.float32(0.0)
                z = c[i]
                if z >= 0:
                    v |= 1 << (7 - k)
                    c[i] = z - s
                else:
                    c[i] = z + s
            packed[byte] = v


@njit(parallel=True, cache=True)
def decompress(packed, sscales, offsets, chunk_numel, out):
    """out[j] = server_scale[chunk(j), seg(j)] * sign_j for the real elements j < out.size."""
    n = out.shape[0]
    nseg = offsets.shape[0] - 1
    nbytes = (n + 7) // 8
    nblocks = (nbytes + _BYTES_PER_BLOCK - 1) // _BYTES_PER_BLOCK
    for blk in prange(nblocks):
        b0 = blk * _BYTES_PER_BLOCK
        b1 = min(nbytes, b0 + _BYTES_PER_BLOCK)
        seg = _segment_of(offsets, b0 * 8)
        for byte in range(b0, b1):
            bits = packed[byte]
            for k in range(8):
                j = byte * 8 + k
                if j >= n:
                    break
                while seg < nseg and j >= offsets[seg + 1]:
                    seg += 1
                s = sscales[j // chunk_numel, seg] if seg < nseg else np.float32(0.0)
                out[j] = s if (bits >> (7 - k)) & 1 else -s
