"""numba.cuda kernels of the 1-bit compressor; the same semantics as ``cpu.py`` (``reference.py``).

Torch CUDA tensors go in zero-copy through ``__cuda_array_interface__``
(``numba.cuda.as_cuda_array``) and every kernel is launched on torch's current
stream (``numba.cuda.external_stream``): no host synchronisation and no copy on
the hot path. The plan's small index arrays are copied to the device once.

Under ``NUMBA_ENABLE_CUDASIM=1`` (the CUDA simulator, used by the CI tests) the
same kernels run on the CPU over numpy views of CPU tensors: :func:`_arr` picks the
view. The kernels use only what the simulator has (shared memory, ``syncthreads``;
no warp intrinsics), so every line tested there is the line the GPU runs.

Layout of the work (``TPB`` threads per block):

* ``pack_update``: one thread per element, so loads and stores coalesce; a thread
  writes its sign bit to shared memory and the first ``TPB/8`` threads assemble the
  bytes (MSB first). The block's first segment is found once by binary search
  (thread 0) and each thread walks forward from it.
* sums of squares: one block per task (a piece of a segment of at most
  ``cpu.TASK_NUMEL`` elements), float64, a fixed shared-memory tree, so the result
  is deterministic; then one thread per segment adds its tasks in task order.
  The order differs from the CPU kernels', so scales may differ in the last float64
  bits (the tests bound this); bits and errors are bitwise the CPU's for the same scales.
* No fused multiply-add can change a result. NVVM contracts ``a*b + c`` by default,
  so where the CPU rounds a product before an add, the kernels either avoid the form
  (the error updates are ``z ± s``, the server average ``acc / P + e``) or round the
  product on its own (:func:`_mul_rn`: the momentum lerp, the SYNC rebuild's decay of
  the anchor). The float64 sums of squares may fuse: the square of a float32 is exact
  in float64, so they give the same bits.
"""
from __future__ import annotations

import functools
import math
import threading
import weakref

import numpy as np
import torch
from numba import config as _config
from numba import cuda, float32, float64, int64, uint8

from .cpu import BLOCK, _half_to_f32
from .host import numpy_view

TPB = 256
# The sign bits of one segment of at most BLOCK elements, and 16 more for a byte either side. A
# module constant: numba.cuda sizes a shared array only from a constant, and an expression such
# as ``BLOCK + 16`` inside a kernel types as int64 (the simulator accepts it; a GPU does not).
BITS_SH = BLOCK + 16
SIMULATOR = bool(_config.ENABLE_CUDASIM)


# -- device functions ---------------------------------------------------------------------

@cuda.jit(device=True)
def _identity(v):
    return v


if SIMULATOR:  # the simulator's libdevice functions are stubs (they return NaN); it never fuses
    @cuda.jit(device=True)
    def _mul_rn(a, b):
        return a * b
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _mul_rn(a, b):
        """a·b rounded on its own: NVVM contracts ``a*b + c`` into one FMA by default (numba
        passes no ``-fma=0``), which the CPU kernels round twice; PTX never fuses ``mul.rn``."""
        return libdevice.fmul_rn(a, b)


if SIMULATOR:  # the simulator's cuda.fma is a*b + c rounded twice
    @cuda.jit(device=True)
    def _fma(a, b, c):
        """a·b + c of float32s rounded once: the product is exact in float64, the sum rounded to
        odd (nearest, then its last bit set where inexact), whose rounding to float32 is then
        the correctly rounded one (53 >= 24 + 2 bits)."""
        p, c64 = float(a) * float(b), float(c)
        s = p + c64
        if math.isfinite(s):
            t = s - p
            err = (p - (s - t)) + (c64 - t)   # p + c = s + err exactly (TwoSum)
            if err != 0.0 and not np.float64(s).view(np.int64) & 1:
                s = float(np.nextafter(s, math.inf if err > 0.0 else -math.inf))
        return np.float32(s)
else:
    @cuda.jit(device=True)
    def _fma(a, b, c):
        """a·b + c rounded once (PTX ``fma.rn``): the CPU kernels' ``cpu._fma``."""
        return cuda.fma(a, b, c)


_decode_half = cuda.jit(device=True)(_half_to_f32)


@cuda.jit(device=True)
def _decode_f16_bits(v):
    return _decode_half(int64(v) & 0xFFFF, 10, 15)


@cuda.jit(device=True)
def _decode_bf16_bits(v):
    return _decode_half(int64(v) & 0xFFFF, 7, 127)


@cuda.jit(device=True)
def _segment_of(offsets, j):
    """Index of the segment holding bucket element j (nseg for j >= offsets[-1])."""
    lo = 0
    hi = offsets.shape[0] - 1
    while lo < hi:  # first index with offsets[idx] > j, minus one
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= j:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda.jit(device=True)
def _block_first_segment(offsets, seg_sh, j0):
    """The segment of bucket element ``j0`` (the block's first), found once by thread 0 and shared
    through ``seg_sh`` (int64[1] in shared memory). Every thread of the block must call it."""
    if cuda.threadIdx.x == 0:
        seg_sh[0] = _segment_of(offsets, j0)
    cuda.syncthreads()
    return seg_sh[0]


@cuda.jit(device=True)
def _walk(offsets, seg, j):
    """The segment of element ``j``, walking forward from segment ``seg`` (<= j's)."""
    while offsets[seg + 1] <= j:
        seg += 1
    return seg


@cuda.jit(device=True)
def _tree_sum(acc_sh, acc):
    """The sum over the block of every thread's float64 ``acc``, by a fixed tree in shared memory
    (``acc_sh``: float64[TPB]), the same order on every launch, so deterministic. Every thread
    of the block must call it, and every thread gets the total."""
    tid = cuda.threadIdx.x
    acc_sh[tid] = acc
    cuda.syncthreads()
    step = TPB // 2
    while step > 0:
        if tid < step:
            acc_sh[tid] += acc_sh[tid + step]
        cuda.syncthreads()
        step //= 2
    total = acc_sh[0]
    cuda.syncthreads()  # every thread has read it before acc_sh is written again
    return total


@cuda.jit(device=True)
def _segment_scale(acc_sh, s_sh, acc, count, scales, seg):
    """``scales[seg]`` = sqrt(block sum of the float64 ``acc`` / ``count``) as float32 (0 when
    ``count`` is 0), also returned to every thread (through ``s_sh``: float32[1])."""
    total = _tree_sum(acc_sh, acc)
    if cuda.threadIdx.x == 0:
        scales[seg] = math.sqrt((0.0 + total) / count) if count > 0 else 0.0
        s_sh[0] = scales[seg]
    cuda.syncthreads()
    return s_sh[0]


@cuda.jit(device=True)
def _sign_range(z_sh, lo, a, b, s, bits_sh, e_out):
    """This thread's share of a <= i < b: the sign flag of z = ``z_sh[i - lo]`` (+0 and -0 give 1)
    into ``bits_sh[i - lo // 8 * 8]`` and the new error z - s*sign into ``e_out[i]``."""
    base8 = (lo >> 3) << 3
    i = a + cuda.threadIdx.x
    while i < b:
        z = z_sh[i - lo]
        bit = 1 if z >= 0 else 0
        bits_sh[i - base8] = bit
        e_out[i] = z - s if bit else z + s
        i += TPB


@cuda.jit(device=True)
def _emit_group_bytes(bits_sh, lo, hi, packed, part_val, g):
    """The bytes of group ``g``'s sign flags (``bits_sh[i - lo // 8 * 8]`` for lo <= i < hi):
    those wholly inside [lo, hi) into ``packed`` (MSB first); the head and the tail byte, which
    the group may share with its neighbours, into ``part_val[g, 0]`` and ``[g, 1]`` (0 where
    none) for ``merge_bytes``. Every thread of the block must call it, after a syncthreads."""
    tid = cuda.threadIdx.x
    base8 = (lo >> 3) << 3
    lo8 = ((lo + 7) >> 3) << 3   # first byte wholly inside the group
    hi8 = (hi >> 3) << 3         # end of the last byte wholly inside
    q = tid
    while lo8 + 8 * q < hi8:
        r = lo8 - base8 + 8 * q
        v = 0
        for k in range(8):
            v = (v << 1) | bits_sh[r + k]
        packed[(lo8 >> 3) + q] = v
        q += TPB
    if tid == 0:
        v = 0
        if lo & 7:
            for i in range(lo, min(hi, lo8)):
                v |= bits_sh[i - base8] << (7 - (i & 7))
        part_val[g, 0] = v
        v = 0
        if hi & 7 and hi8 >= lo8:
            for i in range(hi8, hi):
                v |= bits_sh[i - base8] << (7 - (i & 7))
        part_val[g, 1] = v


# -- kernels, one set per input dtype -------------------------------------------------------

def _make_kernels(decode):
    @cuda.jit
    def sumsq_tasks(y, has_y, e, base, tasks, partial):
        """partial[t] = float64 sum over task t of z**2, z = y + e (or e); element j of
        the bucket is element j - base of the buffers."""
        acc_sh = cuda.shared.array(TPB, dtype=float64)
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        a = tasks[t, 1] - base
        b = tasks[t, 2] - base
        ny = y.shape[0] if has_y else 0
        acc = 0.0
        i = a + tid
        while i < b:
            z = decode(y[i]) + e[i] if i < ny else e[i]
            z64 = float64(z)
            acc += z64 * z64
            i += TPB
        total = _tree_sum(acc_sh, acc)
        if tid == 0:
            partial[t] = total

    @cuda.jit
    def pack_update(y, has_y, e, e_out, base, offsets, scales, packed):
        """Bits of z (MSB first) into packed; e_out <- z - scale*sign on real elements (e_out may be e)."""
        bits_sh = cuda.shared.array(TPB, dtype=uint8)
        seg_sh = cuda.shared.array(1, dtype=int64)
        tid = cuda.threadIdx.x
        i0 = cuda.blockIdx.x * TPB
        i = i0 + tid
        n_el = e.shape[0]
        numel = offsets[offsets.shape[0] - 1]
        ny = y.shape[0] if has_y else 0
        seg0 = _block_first_segment(offsets, seg_sh, base + i0)
        bit = 1
        if i < n_el:
            z = decode(y[i]) + e[i] if i < ny else e[i]
            bit = 1 if z >= 0 else 0
            j = base + i
            if j < numel:
                s = scales[_walk(offsets, seg0, j)]
                e_out[i] = z - s if bit else z + s
        bits_sh[tid] = bit
        cuda.syncthreads()
        if tid < TPB // 8:
            byte = (i0 >> 3) + tid
            if byte * 8 < n_el:
                v = 0
                for k in range(8):
                    v = (v << 1) | bits_sh[tid * 8 + k]
                packed[byte] = v

    @cuda.jit
    def compress_fused(y, e, e_out, offsets, groups, scales, packed, part_val):
        """The whole worker side in one pass over memory: one thread block per group of whole
        segments (``cpu.make_groups``, at most ``BLOCK`` elements). z = y + e is read once into
        shared memory; per segment the block sums z**2 in float64 (the order and tree of
        ``sumsq_tasks`` over a one-task segment, so the scale is bitwise the two-pass kernels'),
        then signs the segment and writes ``e_out <- z - scale*sign``. Bytes wholly inside the
        group are written here; the group's head and tail bytes, which it may share with its
        neighbours, go to ``part_val[g, 0/1]`` for :func:`merge_bytes`."""
        z_sh = cuda.shared.array(BLOCK, dtype=float32)
        bits_sh = cuda.shared.array(BITS_SH, dtype=uint8)
        acc_sh = cuda.shared.array(TPB, dtype=float64)
        s_sh = cuda.shared.array(1, dtype=float32)
        g = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        s0 = groups[g, 0]
        s1 = groups[g, 1]
        lo = offsets[s0]
        hi = offsets[s1]
        ny = y.shape[0]
        i = lo + tid
        while i < hi:
            z_sh[i - lo] = decode(y[i]) + e[i] if i < ny else e[i]
            i += TPB
        cuda.syncthreads()
        for seg in range(s0, s1):
            a = offsets[seg]
            b = offsets[seg + 1]
            acc = 0.0
            i = a + tid
            while i < b:
                z64 = float64(z_sh[i - lo])
                acc += z64 * z64
                i += TPB
            s = _segment_scale(acc_sh, s_sh, acc, b - a, scales, seg)
            _sign_range(z_sh, lo, a, b, s, bits_sh, e_out)
            cuda.syncthreads()  # s_sh is the next segment's
        _emit_group_bytes(bits_sh, lo, hi, packed, part_val, g)

    @cuda.jit(device=True)
    def padding_bits(y, e, i0, i1):
        """The MSB-first bits of z = y + e (y reads 0 past its end) for i0 <= i < i1, one byte."""
        ny = y.shape[0]
        v = 0
        for i in range(i0, i1):
            z = (decode(y[i]) if i < ny else np.float32(0.0)) + e[i]
            if z >= 0:
                v |= 1 << (7 - (i & 7))
        return v

    @cuda.jit
    def merge_bytes(y, e, bounds, numel, part_val, packed):
        """One thread per group: the bytes that groups share, from their ``part_val``, and the
        padding's bits. ``bounds[g]`` is group g's element range [lo, hi) in the buffers'
        coordinates (consecutive, from 0 to ``numel``, the real elements). A shared byte is
        written by the last group that reaches into it, which ORs in the pieces of the groups
        before it; the last group also adds the padding's bits (sign of y + e, y reading 0 past
        its end, as the CPU kernels) and writes the bytes wholly in the padding."""
        g = cuda.grid(1)
        ngroups = bounds.shape[0]
        if g >= ngroups:
            return
        n_el = e.shape[0]
        lo = bounds[g, 0]
        hi = bounds[g, 1]
        last = g == ngroups - 1
        if lo & 7:
            b = lo >> 3
            if hi >= 8 * b + 8 or last:
                v = part_val[g, 0]
                h = g - 1
                while h >= 0:
                    hlo = bounds[h, 0]
                    hhi = bounds[h, 1]
                    if hhi <= 8 * b:
                        break
                    if hlo & 7 and (hlo >> 3) == b:
                        v |= part_val[h, 0]
                    if hhi & 7 and (hhi >> 3) == b:
                        v |= part_val[h, 1]
                    h -= 1
                if last:
                    v |= padding_bits(y, e, numel, min(n_el, 8 * b + 8))
                packed[b] = v
        if last:
            lo8 = ((lo + 7) >> 3) << 3
            if hi & 7 and ((hi >> 3) << 3) >= lo8:  # the group's own tail byte, with the padding's bits
                b = hi >> 3
                packed[b] = part_val[g, 1] | padding_bits(y, e, numel, min(n_el, 8 * b + 8))
            for q in range((numel + 7) >> 3, n_el >> 3):
                packed[q] = padding_bits(y, e, 8 * q, 8 * q + 8)

    return sumsq_tasks, pack_update, compress_fused, merge_bytes


_KERNELS = {}


def _kernels(kind: str):
    if kind not in _KERNELS:
        _KERNELS[kind] = _make_kernels({"f32": _identity, "f16": _decode_f16_bits, "bf16": _decode_bf16_bits}[kind])
    return _KERNELS[kind]


@cuda.jit
def _reduce_scales(seg_ptr, partial, offsets, lo, hi, scales):
    """scales[s] = sqrt(sum of partial over the segment's tasks / count), float32; 0 if empty."""
    s = cuda.grid(1)
    if s < scales.shape[0]:
        acc = 0.0
        for t in range(seg_ptr[s], seg_ptr[s + 1]):
            acc += partial[t]
        a = max(offsets[s], lo)
        b = min(offsets[s + 1], hi)
        scales[s] = math.sqrt(acc / (b - a)) if a < b else 0.0


@cuda.jit
def _server_average(recv, wscales, server_error, chunk_start, offsets):
    """server_error[i] <- (sum_p ±wscale[p, seg]) / P + server_error[i], rank order (algorithm.md §3)."""
    seg_sh = cuda.shared.array(1, dtype=int64)
    tid = cuda.threadIdx.x
    i0 = cuda.blockIdx.x * TPB
    i = i0 + tid
    numel = offsets[offsets.shape[0] - 1]
    seg0 = _block_first_segment(offsets, seg_sh, chunk_start + i0)
    j = chunk_start + i
    if i < server_error.shape[0] and j < numel:
        seg = _walk(offsets, seg0, j)
        world_size = recv.shape[0]
        sh = 7 - (i & 7)
        acc = np.float32(0.0)
        for p in range(world_size):
            s = wscales[p, seg]
            acc = acc + (s if (recv[p, i >> 3] >> sh) & 1 else -s)
        server_error[i] = acc / np.float32(world_size) + server_error[i]


@cuda.jit
def _server_fused(recv, wscales, server_error, chunk_start, tasks, groups, scales, packed, part_val):
    """The server side in one pass over the chunk: one thread block per group of tasks (pieces
    of segments inside the chunk, each its own scale). Per task, the block forms
    c = (sum_p ±wscale[p, seg]) / P + server_error in rank order (:func:`_server_average`'s
    arithmetic), sums c**2 in float64 (``sumsq_tasks``' order and tree), and writes the signs
    and ``server_error <- c - scale*sign``: bitwise the three two-pass kernels. Bytes wholly
    inside the group are written here, its head and tail bytes go to ``part_val``."""
    z_sh = cuda.shared.array(BLOCK, dtype=float32)
    bits_sh = cuda.shared.array(BITS_SH, dtype=uint8)
    acc_sh = cuda.shared.array(TPB, dtype=float64)
    s_sh = cuda.shared.array(1, dtype=float32)
    g = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    t0 = groups[g, 0]
    t1 = groups[g, 1]
    lo = tasks[t0, 1] - chunk_start
    hi = tasks[t1 - 1, 2] - chunk_start
    world_size = recv.shape[0]
    for t in range(t0, t1):
        seg = tasks[t, 0]
        a = tasks[t, 1] - chunk_start
        b = tasks[t, 2] - chunk_start
        acc = 0.0
        i = a + tid
        while i < b:
            sh = 7 - (i & 7)
            c = np.float32(0.0)
            for p in range(world_size):
                w = wscales[p, seg]
                c = c + (w if (recv[p, i >> 3] >> sh) & 1 else -w)
            c = c / np.float32(world_size) + server_error[i]
            z_sh[i - lo] = c
            c64 = float64(c)
            acc += c64 * c64
            i += TPB
        s = _segment_scale(acc_sh, s_sh, acc, b - a, scales, seg)
        _sign_range(z_sh, lo, a, b, s, bits_sh, server_error)
        cuda.syncthreads()  # s_sh is the next task's
    _emit_group_bytes(bits_sh, lo, hi, packed, part_val, g)


@cuda.jit
def _zero_scales_outside(offsets, lo, hi, scales):
    """scales[s] = 0 for every segment with no element in [lo, hi) (as :func:`_reduce_scales`)."""
    s = cuda.grid(1)
    if s < scales.shape[0] and max(offsets[s], lo) >= min(offsets[s + 1], hi):
        scales[s] = 0.0


@cuda.jit(device=True)
def _unpacked(packed, sscales, offsets, chunk_numel, seg0, j):
    """(value, seg) of bucket element j: its chunk's server scale times its sign."""
    seg = _walk(offsets, seg0, j)
    s = sscales[j // chunk_numel, seg]
    return (s if (packed[j >> 3] >> (7 - (j & 7))) & 1 else -s), seg


@cuda.jit
def _decompress(packed, sscales, offsets, chunk_numel, out, mode, exp_avg, weight, anchor, param, denom, mask,
                factor, has_mask, decay_product):
    """mode 0: out[j] = ĝ_j; mode 1: exp_avg lerp toward ĝ; mode 2: SYNC rebuild (preconditioned);
    mode 3: SYNC rebuild (the paper's momentum units). Modes 2 and 3 first scale the anchor by
    ``decay_product`` (the product rounded on its own) where it is not 1. See cpu.decompress*."""
    seg_sh = cuda.shared.array(1, dtype=int64)
    tid = cuda.threadIdx.x
    j0 = cuda.blockIdx.x * TPB
    j = j0 + tid
    numel = offsets[offsets.shape[0] - 1]
    seg0 = _block_first_segment(offsets, seg_sh, j0)
    if j < numel:
        w, _ = _unpacked(packed, sscales, offsets, chunk_numel, seg0, j)
        if mode == 0:
            out[j] = w
        elif mode == 1:
            m = exp_avg[j]
            exp_avg[j] = m + _mul_rn(np.float32(weight), w - m)
        else:
            if has_mask:
                w = w * np.float32(mask[j])
            a = anchor[j]
            if decay_product != np.float32(1.0):
                a = _mul_rn(a, decay_product)
            if mode == 2:
                x = a - w
                exp_avg[j] = (w * denom[j]) * np.float32(factor)
            else:
                x = a - w / denom[j]
                exp_avg[j] = w * np.float32(factor)
            param[j] = x
            anchor[j] = x


@cuda.jit(device=True)
def _local_one(gi, xi, mi, si, mk, c, decay, l2, coeff, small, has_l2, step_size):
    """One element of a LOCAL step, (x', m'): ``cpu._local_one``'s operations in its order and
    roundings (x·decay rounded on its own, so that NVVM cannot fuse it into x·decay + q)."""
    xi = _mul_rn(xi, decay)
    if has_l2:
        gi = _fma(xi, l2, gi)
    b = si * c
    gi = b if gi > b else gi
    gi = -b if gi < -b else gi
    mi = _fma(coeff, gi - mi, mi if small else gi) * mk
    return xi + (step_size * mi) / si, mi


@cuda.jit(device=True)
def _grid_non_finite(g, flags, row):
    """The count of non-finite elements of g, for every thread of a cooperative grid: each adds
    its grid-stride share's into ``flags[row, 0]`` (zero before), then a grid-wide barrier."""
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    bad = 0
    while i < g.shape[0]:
        if not abs(g[i]) < np.float32(math.inf):
            bad += 1
        i += stride
    if bad:
        cuda.atomic.add(flags, (row, 0), bad)
    cuda.cg.this_grid().sync()
    return flags[row, 0]


@cuda.jit(device=True)
def _grid_keep_count(flags, row, total):
    """After a grid-wide barrier, thread 0 keeps ``total`` in ``flags[row, 1]`` and zeroes
    ``flags[row, 0]`` for the next launch. Every thread of the grid must call it."""
    cuda.cg.this_grid().sync()
    if cuda.grid(1) == 0:
        flags[row, 1] = total
        flags[row, 0] = 0


@cuda.jit(device=True)
def _local_flags(w, l2, mask):
    """What :func:`_local_one` reads of a launch's scalars: (w below 0.5, the lerp coefficient,
    whether there is an L2 term, whether there is a mask)."""
    small = abs(w) < np.float32(0.5)
    return small, (w if small else w - np.float32(1.0)), l2 != np.float32(0.0), mask.shape[0] > 0


@cuda.jit
def _local_step(g, x, m, s, mask, flags, row, c, decay, l2, w, step_size):
    """A LOCAL step on one bucket where every element of g is finite, else nothing, decided on
    the device in one cooperative launch (``cpu.local_step_if_finite``): the count of the
    non-finite g (:func:`_grid_non_finite`), then where it is 0 each thread updates its
    grid-stride share of x and m in place (:func:`_local_one`; g, x, m, s: float32[n];
    ``mask``: uint8[n], or [0] for none); the count is kept in ``flags[row, 1]``
    (:func:`_grid_keep_count`). ``flags``: int32[rows, 2], zero in column 0 before the launch.
    Scalars float32: c (+inf: no clamp), decay, l2, w, step_size."""
    total = _grid_non_finite(g, flags, row)
    if total == 0:
        small, coeff, has_l2, masked = _local_flags(w, l2, mask)
        i = cuda.grid(1)
        while i < g.shape[0]:
            mk = np.float32(mask[i]) if masked else np.float32(1.0)
            x[i], m[i] = _local_one(g[i], x[i], m[i], s[i], mk, c, decay, l2, coeff, small, has_l2, step_size)
            i += cuda.gridsize(1)
    _grid_keep_count(flags, row, total)


@cuda.jit
def _momentum_step(g, x, m, s, mask, c, decay, l2, w, step_size):
    """A COMPRESSED step's update on one bucket, one thread per element, g known finite (the
    step's skip agreed before): :func:`_local_one` on each element (``cpu.local_step``, whose
    arguments these are)."""
    i = cuda.grid(1)
    if i < g.shape[0]:
        small, coeff, has_l2, masked = _local_flags(w, l2, mask)
        mk = np.float32(mask[i]) if masked else np.float32(1.0)
        x[i], m[i] = _local_one(g[i], x[i], m[i], s[i], mk, c, decay, l2, coeff, small, has_l2, step_size)


@cuda.jit
def _local_window(g, x, m, s, mask, a, out, flags, row, c, decay, l2, w, step_size, dp):
    """SYNC steps 1–3 on one bucket in one cooperative launch, x and m left as they are
    (``cpu.local_window_update``): out = a·dp − x', x' the LOCAL step's new x
    (:func:`_local_one`) where every element of g is finite, else x itself (the skipped
    step's), decided on the device as in :func:`_local_step`, whose arguments these are, with
    ``a`` and ``out`` float32[n] and ``dp`` float32 (a·dp rounded on its own; a·1 is a)."""
    total = _grid_non_finite(g, flags, row)
    small, coeff, has_l2, masked = _local_flags(w, l2, mask)
    i = cuda.grid(1)
    while i < g.shape[0]:
        xi = x[i]
        if total == 0:
            mk = np.float32(mask[i]) if masked else np.float32(1.0)
            xi, _ = _local_one(g[i], xi, m[i], s[i], mk, c, decay, l2, coeff, small, has_l2, step_size)
        out[i] = _mul_rn(a[i], dp) - xi
        i += cuda.gridsize(1)
    _grid_keep_count(flags, row, total)


@cuda.jit
def _sync_rebuild(w, anchor, param, exp_avg, denom, f, decay):
    """SYNC steps 5–7 from an unpacked w, one thread per element (``cpu.sync_rebuild``): a =
    anchor·decay (rounded on its own; a·1 is a), param = a − w, exp_avg = (w·denom)·f, anchor =
    param. All float32[n]; ``f``, ``decay`` float32."""
    i = cuda.grid(1)
    if i < w.shape[0]:
        wi = w[i]
        x = _mul_rn(anchor[i], decay) - wi
        exp_avg[i] = (wi * denom[i]) * f
        param[i] = x
        anchor[i] = x


@cuda.jit
def _variance_step(g, x, m, v, s, mask, decay, l2, w, step_size, beta2, one_minus_beta2, c2, eps):
    """A VARIANCE step on one bucket, one thread per element (``cpu.variance_step``, whose
    arguments these are): ``cpu._variance_one``'s operations in its order and roundings, each
    product that NVVM could fuse into an add rounded on its own (:func:`_mul_rn`), sqrt rounded
    to float32 before the division (the simulator's ``math.sqrt`` returns a float64)."""
    i = cuda.grid(1)
    if i < g.shape[0]:
        small, coeff, has_l2, masked = _local_flags(w, l2, mask)
        mk = np.float32(mask[i]) if masked else np.float32(1.0)
        xi = _mul_rn(x[i], decay)
        gi = _fma(xi, l2, g[i]) if has_l2 else g[i]
        mi = m[i]
        mi = _fma(coeff, gi - mi, mi if small else gi) * mk
        vi = _fma(_mul_rn(one_minus_beta2, gi), gi, _mul_rn(v[i], beta2))
        si = np.float32(math.sqrt(vi)) / c2 + eps
        x[i] = xi + (step_size * mi) / si
        m[i], v[i], s[i] = mi, vi, si


# -- torch-level entry points ---------------------------------------------------------------

_SIM_LOCK = threading.RLock()


def _entry(fn):
    """An entry point; its first tensor argument says which device it runs on.

    On a GPU the kernels launch in the context of that tensor's device: numba otherwise
    uses device 0's, wrong for a Horovod rank on ``cuda:<local_rank>`` that sees every GPU
    of its node. The simulator runs one kernel at a time per process ("concurrent simulated
    kernel not supported"), so there the entry points take a lock instead: thread-ranks of
    one process (the tests' ``ThreadGroup``) then launch in turn."""
    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if SIMULATOR:
            with _SIM_LOCK:
                return fn(*args, **kwargs)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with cuda.gpus[device.index if device.index is not None else torch.cuda.current_device()]:
            return fn(*args, **kwargs)
    return entry


def _arr(t: torch.Tensor):
    """A kernel argument viewing ``t``: zero-copy device array, or a numpy view in the simulator.

    Made once per tensor object and kept on it while its memory, shape and strides stay (the
    buckets' buffers, the exchanges' scratch: numba's own conversion costs tens of microseconds
    an argument, :func:`_device_array`); a view made for one call is converted at each call."""
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.requires_grad:
        t = t.detach()
    if SIMULATOR:
        return numpy_view(t)
    key = (t.data_ptr(), tuple(t.shape), t.stride(), t.device.index)
    cached = t.__dict__.get("_hvd_zoadam_cuda")
    if cached is not None and cached[0] == key:
        return cached[1]
    arr = _device_array(t)
    t.__dict__["_hvd_zoadam_cuda"] = (key, arr)
    return arr


def _device_array(t: torch.Tensor):
    """A numba device array over ``t``'s memory that holds no reference to ``t`` (kept on ``t``,
    it lives and dies with it, no cycle to keep GPU memory alive until a garbage collection;
    every caller holds ``t`` while its kernel runs). sync=False: should torch's array interface
    name a stream (version 3; torch 2.13 gives version 2, without one), numba would synchronize
    it with the host on every argument. The kernels run on torch's current stream, whose order
    suffices."""
    return cuda.from_cuda_array_interface(t.__cuda_array_interface__, owner=None, sync=False)


_EMPTY = {}  # (device index, dtype) -> an empty tensor, for a kernel's unused array arguments


def _empty(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    key = (device.type, device.index, dtype)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return _EMPTY[key]


def _kind(y: torch.Tensor) -> str:
    try:
        return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[y.dtype]
    except KeyError:
        raise TypeError(f"y must be float32, float16 or bfloat16, got {y.dtype}") from None


_STREAMS = {}  # (device index, torch's stream handle) -> numba's stream object


def _stream(t: torch.Tensor):
    """torch's current stream on ``t``'s device as a numba stream (0 in the simulator), made once
    per device and stream (numba's launch configuration is cached per stream object)."""
    if SIMULATOR or t.device.type != "cuda":
        return 0
    handle = torch.cuda.current_stream(t.device).cuda_stream
    key = (t.device.index, handle)
    stream = _STREAMS.get(key)
    if stream is None:
        # torch's default stream is the legacy one, even where numba's 0 is per-thread
        stream = _STREAMS[key] = cuda.legacy_default_stream() if handle == 0 else cuda.external_stream(handle)
    return stream


def _grid(n: int) -> int:
    return max(1, (n + TPB - 1) // TPB)


def _check_group_sizes(bounds: np.ndarray, name: str) -> None:
    """The one-pass kernels hold a group in shared memory (``BLOCK`` float32 and ``BITS_SH``
    bytes per thread block): a larger group would write past them, which a GPU does not catch.
    Raises ValueError naming ``plan.<name>`` and its largest group (``bounds``: int64[ngroups, 2])."""
    largest = int((bounds[:, 1] - bounds[:, 0]).max()) if len(bounds) else 0
    if largest > BLOCK:
        raise ValueError(f"plan.{name} has a group of {largest} elements; the one-pass CUDA kernels take at "
                         f"most BLOCK = {BLOCK}: build it with cpu.make_groups(offsets) (block <= {BLOCK})")


def device_plan(plan, device) -> dict:
    """The plan's index arrays as kernel arguments on ``device`` (numpy in the simulator)."""
    def seg_ptr(tasks):
        return np.searchsorted(tasks[:, 0], np.arange(plan.nseg + 1), side="left").astype(np.int64)

    host = {"offsets": plan.offsets,
            "worker_tasks": plan.worker_tasks, "worker_seg_ptr": seg_ptr(plan.worker_tasks),
            "server_tasks": plan.server_tasks, "server_seg_ptr": seg_ptr(plan.server_tasks),
            "worker_partial": np.zeros(max(1, len(plan.worker_tasks))),
            "server_partial": np.zeros(max(1, len(plan.server_tasks)))}
    if plan.groups is not None:  # the one-pass worker kernel's groups and their shared bytes
        host["groups"] = plan.groups
        host["group_bounds"] = plan.offsets[plan.groups].reshape(-1, 2)
        _check_group_sizes(host["group_bounds"], "groups")
        host["part_val"] = np.zeros((max(1, len(plan.groups)), 2), dtype=np.uint8)
    server_groups = plan.server_groups
    if server_groups is not None:  # the one-pass server kernel's groups of tasks
        host["server_groups"] = server_groups
        host["server_bounds"] = np.stack([plan.server_tasks[server_groups[:, 0], 1],
                                          plan.server_tasks[server_groups[:, 1] - 1, 2]], axis=1) - plan.chunk_start
        host["server_part_val"] = np.zeros((len(server_groups), 2), dtype=np.uint8)
        _check_group_sizes(host["server_bounds"], "server_groups")
    if SIMULATOR:
        return {k: np.ascontiguousarray(v) for k, v in host.items()}
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in host.items()}
    out = {k: cuda.as_cuda_array(t) for k, t in tensors.items()}
    out["_tensors"] = tensors  # the views do not own the memory: keep the tensors alive with them
    return out


_PLAN_ARRAYS = weakref.WeakKeyDictionary()  # Plan -> {device key: device_plan(...)}


def _plan_arrays(plan, like: torch.Tensor) -> dict:
    """``plan``'s index arrays on ``like``'s device, copied once per plan and device."""
    key = "sim" if SIMULATOR else str(like.device)
    per_plan = _PLAN_ARRAYS.setdefault(plan, {})
    if key not in per_plan:
        per_plan[key] = device_plan(plan, None if SIMULATOR else like.device)
    return per_plan[key]


def forget_plan_arrays(plan) -> None:
    """Drop the cached device arrays of ``plan`` (the next kernel call copies them again)."""
    _PLAN_ARRAYS.pop(plan, None)


@_entry
def worker_scales(y, worker_error, plan, out):
    d = _plan_arrays(plan, worker_error)
    stream = _stream(worker_error)
    sumsq = _kernels(_kind(y))[0]
    ntasks = len(plan.worker_tasks)
    if ntasks:
        sumsq[ntasks, TPB, stream](_arr(y), True, _arr(worker_error), 0, d["worker_tasks"], d["worker_partial"])
    _reduce_scales[_grid(plan.nseg), TPB, stream](d["worker_seg_ptr"], d["worker_partial"], d["offsets"], 0,
                                                  plan.numel, _arr(out))
    return out


@_entry
def pack_update(y, e, base, plan, scales, packed, has_y=True, e_out=None):
    stream = _stream(e)
    d = _plan_arrays(plan, e)
    pack = _kernels(_kind(y))[1]
    eo = _arr(e) if e_out is None else _arr(e_out)
    pack[_grid(e.numel()), TPB, stream](_arr(y), has_y, _arr(e), eo, base, d["offsets"], _arr(scales), _arr(packed))
    return packed


@_entry
def compress_fused(y, e, plan, scales, packed, e_out=None):
    """The worker side in one pass (``plan.groups`` must not be None): scales, bits and the new
    error into ``e_out`` (default ``e``), bitwise those of :func:`worker_scales` + :func:`pack_update`."""
    stream = _stream(e)
    d = _plan_arrays(plan, e)
    fused, merge = _kernels(_kind(y))[2:]
    ya, ea = _arr(y), _arr(e)
    eo = ea if e_out is None else _arr(e_out)
    ngroups = len(plan.groups)
    fused[ngroups, TPB, stream](ya, ea, eo, d["offsets"], d["groups"], _arr(scales), _arr(packed), d["part_val"])
    merge[_grid(ngroups), TPB, stream](ya, ea, d["group_bounds"], plan.numel, d["part_val"], _arr(packed))
    return packed


@_entry
def server_reduce(recv, all_worker_scales, server_error, plan, packed, scales):
    stream = _stream(server_error)
    d = _plan_arrays(plan, server_error)
    se = _arr(server_error)
    if "server_groups" in d:  # one pass over the chunk
        ngroups = len(d["server_groups"])
        pk, sc = _arr(packed), _arr(scales)
        _server_fused[ngroups, TPB, stream](_arr(recv), _arr(all_worker_scales), se, plan.chunk_start,
                                            d["server_tasks"], d["server_groups"], sc, pk, d["server_part_val"])
        real = min(plan.numel, plan.chunk_start + plan.chunk_numel) - plan.chunk_start
        merge = _kernels("f32")[3]
        merge[_grid(ngroups), TPB, stream](_arr(_empty(server_error.device)), se, d["server_bounds"],
                                           real, d["server_part_val"], pk)
        _zero_scales_outside[_grid(plan.nseg), TPB, stream](d["offsets"], plan.chunk_start,
                                                            plan.chunk_start + plan.chunk_numel, sc)
        return packed, scales
    return server_reduce_two_pass(recv, all_worker_scales, server_error, plan, packed, scales)


@_entry
def server_reduce_two_pass(recv, all_worker_scales, server_error, plan, packed, scales):
    """:func:`server_reduce` as three kernels (average, sums of squares and scales, pack):
    what serves chunks with a task longer than ``BLOCK``, and the one-pass kernel's oracle."""
    stream = _stream(server_error)
    d = _plan_arrays(plan, server_error)
    se = _arr(server_error)
    _server_average[_grid(server_error.numel()), TPB, stream](_arr(recv), _arr(all_worker_scales), se,
                                                              plan.chunk_start, d["offsets"])
    sumsq, pack = _kernels("f32")[:2]
    ntasks = len(plan.server_tasks)
    if ntasks:
        sumsq[ntasks, TPB, stream](se, False, se, plan.chunk_start, d["server_tasks"], d["server_partial"])
    _reduce_scales[_grid(plan.nseg), TPB, stream](d["server_seg_ptr"], d["server_partial"], d["offsets"],
                                                  plan.chunk_start, plan.chunk_start + plan.chunk_numel, _arr(scales))
    pack[_grid(server_error.numel()), TPB, stream](se, False, se, se, plan.chunk_start, d["offsets"], _arr(scales),
                                                   _arr(packed))
    return packed, scales


@_entry
def _unpack(packed, sscales, plan, mode, like, out=None, exp_avg=None, weight=0.0, anchor=None, param=None,
            denom=None, mask=None, factor=0.0, decay_product=1.0):
    if not plan.numel:
        return
    stream = _stream(like)
    d = _plan_arrays(plan, like)
    dummy = _arr(_empty(like.device))
    arr = lambda t: dummy if t is None else _arr(t)  # noqa: E731
    no_mask = _arr(_empty(like.device, torch.uint8))
    _decompress[_grid(plan.numel), TPB, stream](
        _arr(packed), _arr(sscales), d["offsets"], plan.chunk_numel, arr(out), mode, arr(exp_avg), float(weight),
        arr(anchor), arr(param), arr(denom), no_mask if mask is None else _arr(mask), float(factor),
        mask is not None, np.float32(decay_product))


def decompress(packed, sscales, plan, out):
    _unpack(packed, sscales, plan, 0, out, out=out)
    return out


def decompress_momentum(packed, sscales, plan, exp_avg, beta1):
    _unpack(packed, sscales, plan, 1, exp_avg, exp_avg=exp_avg, weight=1.0 - beta1)
    return exp_avg


_COOPERATIVE = {}  # (kernel, device id) -> the most blocks of TPB threads one cooperative launch runs


def _cooperative_grid(kernel, args: tuple, n: int) -> int:
    """Blocks for a cooperative launch of ``kernel`` over ``n`` elements: one per ``TPB``
    elements, at most as many as the device holds at once (a grid-wide barrier needs every
    block resident), at least one; one in the simulator, whose grid barrier is a block's."""
    if SIMULATOR:
        return 1
    key = (kernel, cuda.get_current_device().id)
    if key not in _COOPERATIVE:
        argtypes = tuple(kernel.typeof_pyval(a) for a in args)
        _COOPERATIVE[key] = kernel.compile(argtypes).max_cooperative_grid_blocks(TPB)
    return max(1, min(_grid(n), _COOPERATIVE[key]))


@_entry
def local_step_if_finite(g, x, m, s, mask, flags, row, scalars):
    """:func:`_local_step` on torch tensors (``mask`` None or bool/uint8[n]; ``scalars``: its
    five float32 scalars in order), one launch on the current stream."""
    mk = _arr(_empty(g.device, torch.uint8) if mask is None else mask)
    args = (_arr(g), _arr(x), _arr(m), _arr(s), mk, _arr(flags), row, *scalars)
    _local_step[_cooperative_grid(_local_step, args, g.numel()), TPB, _stream(g)](*args)


@_entry
def local_window_update(g, x, m, s, mask, a, out, flags, row, scalars, dp):
    """:func:`_local_window` on torch tensors (as :func:`local_step_if_finite`, with ``a`` and
    ``out`` float32[n] and the float32 ``dp``), one launch on the current stream."""
    mk = _arr(_empty(g.device, torch.uint8) if mask is None else mask)
    args = (_arr(g), _arr(x), _arr(m), _arr(s), mk, _arr(a), _arr(out), _arr(flags), row, *scalars, dp)
    _local_window[_cooperative_grid(_local_window, args, g.numel()), TPB, _stream(g)](*args)


@_entry
def sync_rebuild(w, anchor, param, exp_avg, denom, f, decay):
    """:func:`_sync_rebuild` on torch tensors (``f``, ``decay``: float32), one launch."""
    _sync_rebuild[_grid(w.numel()), TPB, _stream(w)](_arr(w), _arr(anchor), _arr(param), _arr(exp_avg), _arr(denom),
                                                      f, decay)


@_entry
def decompress_sync(packed, sscales, plan, anchor, param, exp_avg, denom, factor, decay_product, mask,
                    preconditioned):
    _unpack(packed, sscales, plan, 2 if preconditioned else 3, anchor, exp_avg=exp_avg, anchor=anchor,
            param=param, denom=denom, mask=mask, factor=factor, decay_product=decay_product)


@_entry
def variance_step(g, x, m, v, s, mask, scalars):
    """:func:`_variance_step` on torch tensors (``mask`` None or bool/uint8[n]; ``scalars``: its
    eight float32 scalars in order), one launch on the current stream."""
    mk = _arr(_empty(g.device, torch.uint8) if mask is None else mask)
    _variance_step[_grid(g.numel()), TPB, _stream(g)](_arr(g), _arr(x), _arr(m), _arr(v), _arr(s), mk, *scalars)


@_entry
def momentum_step(g, x, m, s, mask, scalars):
    """:func:`_momentum_step` on torch tensors (``mask`` None or bool/uint8[n]; ``scalars``: its
    five float32 scalars in order), one launch on the current stream."""
    mk = _arr(_empty(g.device, torch.uint8) if mask is None else mask)
    _momentum_step[_grid(g.numel()), TPB, _stream(g)](_arr(g), _arr(x), _arr(m), _arr(s), mk, *scalars)
