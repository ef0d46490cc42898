"""Numba CPU kernels of the 1-bit compressor; semantics in ``reference.py``.

All arrays are numpy views of torch CPU tensors, created by the caller (numba 0.68
loses writes through views made inside a ``parallel=True`` function). Every output
buffer is preallocated by the caller and reused.

How they reach memory speed on one core:

* Loops index with unsigned integers. With a signed index numba must handle
  negative (wrap-around) indices, and that alone stops LLVM from vectorising
  (measured: a float64 sum of squares ran at 0.25x copy bandwidth, 1.4x unsigned).
* Work is cut into blocks of ``BLOCK`` elements that stay in L1. Per segment piece
  of a block, one branch-free loop computes z once, writes its sign as a byte to a
  block-local scratch and updates the error; the block's bytes of bits are then
  assembled 8 at a time (MSB first, algorithm.md §3) by one multiplication each
  (:func:`_pack8`). The inputs cross memory once per pass.
  (An earlier version packed 64 signs into a uint64 in a segment-agnostic loop and
  recomputed z for the error update: 1.45x slower.)
* The worker side runs in one pass over memory when no segment is longer than
  ``BLOCK`` (hvd_zoadam's per-block scales): :func:`compress_fused` takes runs of whole
  segments, sums each one and then signs it and writes its error while it is still in L1
  (12 bytes moved per element instead of the two passes' 20). Longer segments take the two
  passes, :func:`sumsq_tasks` then :func:`pack_update`; both paths share :func:`_sumsq`, so
  they give the same scales, bits and errors bit for bit.
* Sums of squares are float64, per *task* (a piece of a segment of at most
  ``TASK_NUMEL`` elements), reduced per segment in task order: scales do not depend
  on the thread count. Inside a task, LLVM may reassociate the sum to vectorise it
  (``fastmath={"reassoc"}``); scales then differ from the torch reference in the last
  float64 bits, which the float32 cast almost always hides (the tests bound it).

Input dtypes: ``y`` is float32, or the bits of a float16 tensor as ``uint16`` or of
a bfloat16 tensor as ``int16`` (numba has no half types on the CPU); :func:`load`
decodes them exactly to float32 with two LLVM intrinsics (``fpext half``; a shift and a
bitcast), which vectorise. ``_half_to_f32`` is the same decode in plain
arithmetic, used by the CUDA kernels; the tests check the two agree on all 65 536 patterns.
"""
from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

if sys.byteorder != "little":  # _pack8 reads 8 sign bytes as one little-endian uint64
    raise ImportError("hvd_zoadam.native.cpu assumes a little-endian CPU")

TASK_NUMEL = 1 << 16
BLOCK = 1 << 12          # elements per block of the packing kernel; a multiple of 8
_FM = {"reassoc", "contract"}  # never "nnan"/"ninf": a NaN must reach the scales (algorithm.md §5)


def make_tasks(offsets: np.ndarray, lo: int, hi: int, task_numel: int = TASK_NUMEL,
               chunk_numel: int = 0) -> np.ndarray:
    """int64[ntasks, 3] of (segment, start, stop) covering the real elements of [lo, hi).

    With ``chunk_numel`` > 0 no task crosses a multiple of it (a server chunk boundary),
    so each task has one (chunk, segment) scale.
    """
    rows = []
    offsets = [int(o) for o in offsets]
    for seg in range(len(offsets) - 1):
        a, b = max(offsets[seg], lo), min(offsets[seg + 1], hi)
        while a < b:
            e = min(b, a + task_numel)
            if chunk_numel:
                e = min(e, (a // chunk_numel + 1) * chunk_numel)
            rows.append((seg, a, e))
            a = e
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


# -- decoding of the input dtypes ---------------------------------------------------------

def load(y, i):
    """float32 value of element ``i`` of ``y`` (float32, fp16 bits as uint16, bf16 bits as int16)."""
    raise NotImplementedError  # only inside jitted code


def _half_to_f32(h, mant_bits, bias):
    """Exact float32 of a 16-bit float with 1 sign bit, ``15 - mant_bits`` exponent bits and the
    given exponent ``bias``: IEEE binary16 is (10, 15), bfloat16 is (7, 127). ``h``: the bits, an int."""
    exp_max = (1 << (15 - mant_bits)) - 1
    ex = (h >> mant_bits) & exp_max
    mant = h & ((1 << mant_bits) - 1)
    if ex == exp_max:
        v = np.inf if mant == 0 else np.nan
    elif ex == 0:   # subnormal: mant * 2**(1 - bias - mant_bits), exact in float64
        v = mant * 2.0 ** (1 - bias - mant_bits)
    else:
        v = ((1 << mant_bits) + mant) * 2.0 ** (ex - bias - mant_bits)
    return np.float32(-v if (h >> 15) & 1 else v)


def _f16_to_f32(h):
    """Exact float32 of the IEEE binary16 with bits ``h`` (an int)."""
    return _half_to_f32(h, 10, 15)


def _bf16_to_f32(b):
    """Exact float32 of the bfloat16 with bits ``b`` (an int; the top half of a float32)."""
    return _half_to_f32(b, 7, 127)


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """float32 of IEEE binary16 bits (uint16): LLVM's fpext, exact (vcvtph2ps where the CPU has F16C)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    """float32 of bfloat16 bits (int16): the bits are the top half of the float32's, exact."""
    sig = types.float32(types.int16)

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return sig, codegen


@overload(load)
def _load_impl(y, i):
    if y.dtype == types.float32:
        return lambda y, i: y[i]
    if y.dtype == types.uint16:
        return lambda y, i: _half_bits_to_f32(y[i])
    if y.dtype == types.int16:
        return lambda y, i: _bf16_bits_to_f32(y[i])
    raise TypeError("y must be float32, or float16/bfloat16 bits as uint16/int16")


# -- worker side --------------------------------------------------------------------------

@njit(fastmath=_FM, cache=True)
def _sumsq(y, e, a, cnt):
    """float64 sum of (y + e)**2 over elements [a, a + cnt) (``a``, ``cnt``: uint64); LLVM may
    reassociate it to vectorise. Both worker paths use this one loop, so their scales agree."""
    acc = 0.0
    for i in range(cnt):
        z = np.float64(load(y, a + i) + e[a + i])
        acc += z * z
    return acc


@njit(parallel=True, cache=True)
def sumsq_tasks(y, e, tasks, partial):
    """partial[t] = sum over task t of float64((y + e)**2)."""
    for t in prange(tasks.shape[0]):
        partial[t] = _sumsq(y, e, np.uint64(tasks[t, 1]), np.uint64(tasks[t, 2] - tasks[t, 1]))


@njit(parallel=True, fastmath=_FM, cache=True)
def sumsq_tasks_1(c, tasks, base, partial):
    """partial[t] = sum over task t of float64(c[j - base]**2)."""
    for t in prange(tasks.shape[0]):
        acc = 0.0
        a = np.uint64(tasks[t, 1] - base)
        for i in range(np.uint64(tasks[t, 2] - tasks[t, 1])):
            z = np.float64(c[a + i])
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
def _pack8(x):
    """The byte of 8 sign flags (each byte of the little-endian uint64 ``x`` is 0 or 1, the
    first element in the lowest byte), MSB first: flag k lands on bit 63 - k of the product,
    every other partial product on a distinct lower bit, so nothing carries into the top byte.
    Only read through a view made inside a parallel loop: numba 0.68 can lose writes
    through such a view, not reads (the tests compare the bytes with numpy's packbits)."""
    return np.uint8((x * np.uint64(0x8040201008040201)) >> np.uint64(56))


@njit(parallel=True, cache=True)
def pack_update(y, has_y, e, e_out, base, offsets, scales, packed):
    """Sign-pack z and update the error, one block of ``BLOCK`` elements per task.

    z = y + e (``has_y``) or z = e (server side, ``y`` unused). Element ``i`` of ``e``
    is element ``base + i`` of the bucket; ``offsets`` are the bucket's segments and
    ``scales[seg]`` the scale of segment ``seg`` here. Writes ``packed[i // 8]`` bit
    ``7 - i % 8`` = (z >= 0) for every i < len(e), and ``e_out <- z - scale*sign`` on the
    real elements (bucket index < offsets[-1]; ``e_out`` may be ``e``); padding is not written.
    ``y`` (when used) must hold every element of ``e`` that is real, i.e. at least
    ``offsets[-1] - base`` elements; elements past ``len(y)`` read as 0.

    Per block: one loop per segment piece computes z once, stores its sign as a byte in a
    block-local scratch and updates the error (compare, select, subtract, store: it
    vectorises); then the block's bytes of bits are assembled 8 at a time.
    """
    n_el = e.shape[0]
    ny = y.shape[0] if has_y else 0
    numel = offsets[-1]
    nblocks = (n_el + BLOCK - 1) // BLOCK
    for blk in prange(nblocks):
        bits = np.empty(BLOCK, np.uint8)
        j0 = blk * BLOCK
        j1 = min(n_el, j0 + BLOCK)
        lo = base + j0
        hi = min(base + j1, numel)
        if lo < hi:
            seg = np.searchsorted(offsets, lo, side="right") - 1
            while lo < hi:
                end = min(offsets[seg + 1], hi)
                s = scales[seg]
                ns = -s
                a = np.uint64(lo - base)
                b0 = np.uint64(lo - base - j0)
                cnt = np.uint64(end - lo)
                if not has_y or lo - base + cnt <= ny:
                    for k in range(cnt):
                        i = a + k
                        z = load(y, i) + e[i] if has_y else e[i]
                        pos = z >= np.float32(0.0)
                        bits[b0 + k] = pos
                        e_out[i] = z - (s if pos else ns)
                else:
                    for k in range(cnt):
                        i = a + k
                        z = load(y, i) + e[i] if i < ny else e[i]
                        pos = z >= np.float32(0.0)
                        bits[b0 + k] = pos
                        e_out[i] = z - (s if pos else ns)
                lo = end
                seg += 1
        for i in range(max(j0, numel - base), j1):  # padding: its sign only, the error stays
            z = load(y, i) + e[i] if has_y and i < ny else e[i]
            bits[i - j0] = z >= np.float32(0.0)
        b64 = bits.view(np.uint64)  # read only (see _pack8)
        ob = np.uint64(j0 >> 3)
        for q in range(np.uint64((j1 - j0) >> 3)):
            packed[ob + q] = _pack8(b64[q])


def make_groups(offsets: np.ndarray, block: int = BLOCK) -> np.ndarray | None:
    """int64[ngroups, 2] of (first segment, stop segment): runs of whole consecutive segments of
    at most ``block`` elements in all, for :func:`compress_fused`; None when a segment is
    longer than ``block`` (the two-pass kernels then serve the plan)."""
    sizes = np.diff(np.asarray(offsets, dtype=np.int64))
    if len(sizes) and int(sizes.max()) > block:
        return None
    rows, first, total = [], 0, 0
    for seg, n in enumerate(sizes.tolist()):
        if total + n > block:
            rows.append((first, seg))
            first, total = seg, 0
        total += n
    if len(sizes):
        rows.append((first, len(sizes)))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 2)


@njit(parallel=True, cache=True)
def compress_fused(y, e, e_out, offsets, groups, scales, packed, part_idx, part_val):
    """The whole worker side in one pass over memory, for segments of at most ``BLOCK`` elements.

    Per group of whole segments (:func:`make_groups`), each segment is summed (:func:`_sumsq`,
    bitwise the two-pass path's scale), then its elements, now in L1, are signed and their
    error written: ``e_out <- z - scale*sign`` (``e_out`` may be ``e``). Bytes wholly inside a
    group are written by it; the at most two bytes a group shares with its neighbours are
    kept in ``part_idx``/``part_val`` (int64/uint8[ngroups, 2]) and merged after the parallel
    loop, with the padding's bits (sign of y + e; the padding's error is not written). ``y``
    covers at least the real elements; its elements past ``len(y)`` read as 0.
    """
    numel = offsets[-1]
    for g in prange(groups.shape[0]):
        s0 = groups[g, 0]
        s1 = groups[g, 1]
        lo = offsets[s0]
        hi = offsets[s1]
        base8 = lo & ~np.int64(7)
        bits = np.empty(BLOCK + 16, np.uint8)
        for seg in range(s0, s1):
            a = offsets[seg]
            cnt = offsets[seg + 1] - a
            acc = _sumsq(y, e, np.uint64(a), np.uint64(cnt))
            s = np.float32(np.sqrt(acc / cnt))
            scales[seg] = s
            ns = -s
            ua = np.uint64(a)
            b0 = np.uint64(a - base8)
            for k in range(np.uint64(cnt)):
                i = ua + k
                z = load(y, i) + e[i]
                pos = z >= np.float32(0.0)
                bits[b0 + k] = pos
                e_out[i] = z - (s if pos else ns)
        lo8 = (lo + 7) & ~np.int64(7)     # first byte wholly inside the group
        hi8 = hi & ~np.int64(7)           # end of the last byte wholly inside
        if lo8 < hi8:
            b64 = bits.view(np.uint64)  # read only (see _pack8)
            r0 = np.uint64((lo8 - base8) >> 3)
            ob = np.uint64(lo8 >> 3)
            for q in range(np.uint64((hi8 - lo8) >> 3)):
                packed[ob + q] = _pack8(b64[r0 + q])
        part_idx[g, 0] = -1
        part_idx[g, 1] = -1
        k = 0
        if lo & 7:                        # the byte shared with the previous group (or the padding)
            v = 0
            for i in range(lo, min(hi, lo8)):
                v |= bits[i - base8] << (7 - (i & 7))
            part_idx[g, 0] = lo >> 3
            part_val[g, 0] = v
            k = 1
        if hi & 7 and hi8 >= lo8:         # the byte shared with the next group (or the padding)
            v = 0
            for i in range(hi8, hi):
                v |= bits[i - base8] << (7 - (i & 7))
            part_idx[g, k] = hi >> 3
            part_val[g, k] = v
    _merge_shared_bytes(y, e, numel, part_idx, part_val, packed)


@njit(cache=True)
def _merge_shared_bytes(y, e, numel, part_idx, part_val, packed):
    """After :func:`compress_fused`'s parallel loop, sequentially: the bytes groups share, and
    the padding's bits (sign of y + e past ``numel``; elements past ``len(y)`` read as 0)."""
    n_el = e.shape[0]
    ny = y.shape[0]
    for g in range(part_idx.shape[0]):
        for k in range(2):
            if part_idx[g, k] >= 0:
                packed[part_idx[g, k]] = 0
    for q in range((numel + 7) >> 3, n_el >> 3):
        packed[q] = 0
    for g in range(part_idx.shape[0]):
        for k in range(2):
            if part_idx[g, k] >= 0:
                packed[part_idx[g, k]] |= part_val[g, k]
    for i in range(numel, n_el):
        z = (load(y, i) if i < ny else np.float32(0.0)) + e[i]
        if z >= np.float32(0.0):
            packed[i >> 3] |= np.uint8(1 << (7 - (i & 7)))


# -- server side --------------------------------------------------------------------------

@njit(parallel=True, cache=True)
def server_average(recv, wscales, server_error, out, tasks, chunk_start, partial):
    """out <- c = (sum_p wscale_p*sign_p) / P + server_error on the real elements of the chunk
    (algorithm.md §3; ``out`` may be ``server_error``, else it is only read), and partial[t] =
    float64 sum of c**2 over task t (for the scales).

    No fastmath here: the sum over p must stay in rank order, bitwise as the reference. Per
    task, rank p's bits are added into a task-local float32 accumulator a whole byte at a time
    (unaligned ends bit by bit): 1.5-1.8x faster than a per-element gather of each rank's bit.
    """
    world_size = recv.shape[0]
    div = np.float32(world_size)
    for t in prange(tasks.shape[0]):
        seg = tasks[t, 0]
        a = tasks[t, 1] - chunk_start
        cnt = tasks[t, 2] - tasks[t, 1]
        acc = np.zeros(cnt, np.float32)
        for p in range(world_size):
            s = wscales[p, seg]
            ns = -s
            i = a
            while i < a + cnt and (i & 7):
                acc[i - a] += s if (recv[p, i >> 3] >> (7 - (i & 7))) & 1 else ns
                i += 1
            nb = (a + cnt - i) >> 3
            base = np.uint64(i - a)
            q0 = np.uint64(i >> 3)
            for q in range(np.uint64(nb)):
                bits = recv[p, q0 + q]
                o = base + q * np.uint64(8)
                for k in range(8):
                    acc[o + np.uint64(k)] += s if (bits >> np.uint8(7 - k)) & np.uint8(1) else ns
            i += nb * 8
            while i < a + cnt:
                acc[i - a] += s if (recv[p, i >> 3] >> (7 - (i & 7))) & 1 else ns
                i += 1
        acc2 = 0.0
        ua = np.uint64(a)
        for k in range(np.uint64(cnt)):
            c = acc[k] / div + server_error[ua + k]
            out[ua + k] = c
            c64 = np.float64(c)
            acc2 += c64 * c64
        partial[t] = acc2


@njit(cache=True)
def server_reduce(recv, wscales, server_error, e, tasks, chunk_start, chunk_end, partial, offsets, scales, packed):
    """The server side in one call: :func:`server_average` into ``e``, :func:`reduce_scales`
    of the chunk, then :func:`pack_update` of ``e`` in place (``packed``, and e the new error)."""
    server_average(recv, wscales, server_error, e, tasks, chunk_start, partial)
    reduce_scales(tasks, partial, offsets, chunk_start, chunk_end, scales)
    pack_update(e, False, e, e, chunk_start, offsets, scales, packed)


# -- unpacking ----------------------------------------------------------------------------

@njit(inline="always")
def _sign_scale(packed, j, s):
    bit = (packed[j >> np.uint64(3)] >> (np.uint64(7) - (j & np.uint64(7)))) & np.uint8(1)
    return s if bit else -s


@njit(parallel=True, cache=True)
def decompress(packed, sscales, tasks, chunk_numel, out):
    """out[j] = server_scale[chunk(j), seg(j)] * sign_j over the tasks (real elements)."""
    for t in prange(tasks.shape[0]):
        j0 = tasks[t, 1]
        s = sscales[j0 // chunk_numel, tasks[t, 0]]
        a = np.uint64(j0)
        for k in range(np.uint64(tasks[t, 2] - j0)):
            out[a + k] = _sign_scale(packed, a + k, s)


@njit(parallel=True, cache=True)
def decompress_momentum(packed, sscales, tasks, chunk_numel, exp_avg, weight):
    """exp_avg <- exp_avg + weight * (g - exp_avg), g the decompressed value (lerp, weight = 1 - beta1)."""
    w = np.float32(weight)
    for t in prange(tasks.shape[0]):
        j0 = tasks[t, 1]
        s = sscales[j0 // chunk_numel, tasks[t, 0]]
        a = np.uint64(j0)
        for k in range(np.uint64(tasks[t, 2] - j0)):
            j = a + k
            m = exp_avg[j]
            exp_avg[j] = m + w * (_sign_scale(packed, j, s) - m)


@njit(inline="always")
def _rebuild(a, w, d, f):
    """SYNC steps 5-6 for one element in parameter units: (x, m) = (a − w, (w·d)·f), each
    product rounded to float32 (:func:`hvd_zoadam.native.reference.sync_rebuild`)."""
    return a - w, (w * d) * f


@njit(inline="always")
def _rebuild_momentum_units(a, w, d, f):
    """The same in the paper's momentum units: (x, m) = (a − w/d, w·f)."""
    return a - w / d, w * f


@njit(parallel=True, cache=True)
def _sync_plain(packed, sscales, tasks, chunk_numel, anchor, param, off, exp_avg, denom, dp, f):
    o = np.uint64(off)
    for t in prange(tasks.shape[0]):
        j0 = tasks[t, 1]
        s = sscales[j0 // chunk_numel, tasks[t, 0]]
        a0 = np.uint64(j0)
        for k in range(np.uint64(tasks[t, 2] - j0)):
            j = a0 + k
            x, exp_avg[j] = _rebuild(anchor[j] * dp, _sign_scale(packed, j, s), denom[j], f)
            param[j - o] = x
            anchor[j] = x


@njit(parallel=True, cache=True)
def _sync_masked(packed, sscales, tasks, chunk_numel, anchor, param, off, exp_avg, denom, mask, dp, f):
    o = np.uint64(off)
    for t in prange(tasks.shape[0]):
        j0 = tasks[t, 1]
        s = sscales[j0 // chunk_numel, tasks[t, 0]]
        a0 = np.uint64(j0)
        for k in range(np.uint64(tasks[t, 2] - j0)):
            j = a0 + k
            x, exp_avg[j] = _rebuild(anchor[j] * dp, _sign_scale(packed, j, s) * np.float32(mask[j]), denom[j], f)
            param[j - o] = x
            anchor[j] = x


@njit(parallel=True, cache=True)
def _sync_momentum_units(packed, sscales, tasks, chunk_numel, anchor, param, off, exp_avg, denom, mask, dp, f):
    o = np.uint64(off)
    has_mask = mask.shape[0] > 0
    for t in prange(tasks.shape[0]):
        j0 = tasks[t, 1]
        s = sscales[j0 // chunk_numel, tasks[t, 0]]
        a0 = np.uint64(j0)
        for k in range(np.uint64(tasks[t, 2] - j0)):
            j = a0 + k
            w = _sign_scale(packed, j, s)
            if has_mask:
                w = w * np.float32(mask[j])
            x, exp_avg[j] = _rebuild_momentum_units(anchor[j] * dp, w, denom[j], f)
            param[j - o] = x
            anchor[j] = x


def decompress_sync(packed, sscales, tasks, chunk_numel, anchor, param, exp_avg, denom, mask,
                    decay_product, factor, preconditioned):
    """SYNC steps 5-7 (algorithm.md §2) from the packed result w, bitwise as ``kinds.sync_finish``:

    a <- anchor * decay_product (float32, rounded on its own as the torch path's ``mul_``: the
    kernels are not fastmath, so nothing contracts it into a fused multiply-add; times 1 is
    exact); w <- w * mask (when ``mask`` is non-empty); preconditioned: param = a - w,
    exp_avg = (w * denom) * factor; else: param = a - w / denom, exp_avg = w * factor;
    anchor = param. One pass over memory, the decay included (a pass of its own for it cost
    11-14 % of this kernel alone, about 1 ms of a SYNC step at the main job's size). One kernel
    per case: loop-invariant branches inside one kernel kept LLVM from vectorising it
    (measured 4x slower).

    ``param``: float32[n], or the parameters themselves: a list of ``(float32 array, the bucket
    index of its first element)`` that covers the n elements in order, each array's elements
    in whole tasks (``tasks`` are sorted by start and none crosses a parameter). One kernel
    call per parameter then.
    """
    dp, f = np.float32(decay_product), np.float32(factor)
    if isinstance(param, np.ndarray):
        parts = [(param, 0, tasks)]
    else:
        starts = tasks[:, 1]
        parts = [(a, off, tasks[np.searchsorted(starts, off):np.searchsorted(starts, off + a.size)])
                 for a, off in param]
    for arr, off, t in parts:
        if not preconditioned:
            _sync_momentum_units(packed, sscales, t, chunk_numel, anchor, arr, off, exp_avg, denom, mask, dp, f)
        elif mask.shape[0]:
            _sync_masked(packed, sscales, t, chunk_numel, anchor, arr, off, exp_avg, denom, mask, dp, f)
        else:
            _sync_plain(packed, sscales, t, chunk_numel, anchor, arr, off, exp_avg, denom, dp, f)


# -- checks and small fused helpers of the optimizer -------------------------------------------

@njit(parallel=True, cache=True)
def count_non_finite(a):
    """Number of NaN/Inf elements of float32 ``a``: one read-only pass (``|x| < inf`` is False
    for NaN and ±Inf), an integer reduction that vectorises; torch's ``isfinite(a).all()`` makes
    a bool tensor first and ran 4x slower."""
    n = a.shape[0]
    nblocks = (n + TASK_NUMEL - 1) // TASK_NUMEL
    bad = 0
    for blk in prange(nblocks):
        lo = np.uint64(blk * TASK_NUMEL)
        cnt = np.uint64(min(n, blk * TASK_NUMEL + TASK_NUMEL) - blk * TASK_NUMEL)
        b = 0
        for k in range(cnt):
            b += 0 if abs(a[lo + k]) < np.float32(np.inf) else 1
        bad += b
    return bad


@njit(parallel=True, cache=True, error_model="numpy")  # x/0 is ±inf or NaN, as in torch
def precondition_clamp(y, s, bound):
    """In place, y <- clamp(y/s, -bound, bound), every non-finite y/s made NaN so that it
    reaches the scales (algorithm.md §5); one pass. Bitwise torch's ``y.div_(s)`` then
    :func:`hvd_zoadam.native.clamp_finite_`. ``y``, ``s``: float32[n]; ``bound``: float32."""
    n = y.shape[0]
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    for t in prange((n + TASK_NUMEL - 1) // TASK_NUMEL):
        lo = t * TASK_NUMEL
        for i in range(lo, min(n, lo + TASK_NUMEL)):
            z = y[i] / s[i]
            if not abs(z) < inf:
                z = nan
            elif z < -bound:
                z = -bound
            elif z > bound:
                z = bound
            y[i] = z


@njit(parallel=True, cache=True)
def clamp_by(g, denom, c):
    """g <- min(max(g, -(denom*c)), denom*c) with denom*c rounded to float32 once, in place: the
    preconditioning bound of a LOCAL step in one pass (torch needed four)."""
    cf = np.float32(c)
    for t in prange((g.shape[0] + TASK_NUMEL - 1) // TASK_NUMEL):
        lo = np.uint64(t * TASK_NUMEL)
        for k in range(np.uint64(min(g.shape[0], t * TASK_NUMEL + TASK_NUMEL) - t * TASK_NUMEL)):
            i = lo + k
            b = denom[i] * cf
            x = g[i]
            x = b if x > b else x
            g[i] = -b if x < -b else x


@njit(parallel=True, cache=True)
def sync_rebuild(w, anchor, param, exp_avg, denom, f, decay):
    """SYNC steps 5-7 from an unpacked w (preconditioned, no mask): a = anchor*decay (when
    decay != 1), param = a - w, exp_avg = (w * denom) * f, anchor = param; one pass, bitwise
    ``anchor.mul_(decay)`` then ``kinds.sync_finish``."""
    decayed = decay != np.float32(1.0)
    for t in prange((w.shape[0] + TASK_NUMEL - 1) // TASK_NUMEL):
        lo = np.uint64(t * TASK_NUMEL)
        for k in range(np.uint64(min(w.shape[0], t * TASK_NUMEL + TASK_NUMEL) - t * TASK_NUMEL)):
            i = lo + k
            x, exp_avg[i] = _rebuild(anchor[i] * decay if decayed else anchor[i], w[i], denom[i], f)
            param[i] = x
            anchor[i] = x


@intrinsic
def _fma(typingctx, a, b, c):
    """a·b + c rounded once (LLVM's fma): the fused multiply-add torch's vectorised CPU
    kernels use in ``lerp`` and ``add(alpha=)``. float32 in, float32 out."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)
    return sig, codegen


@njit(inline="always")
def _local_one(gi, xi, mi, si, mk, c, decay, l2, coeff, small, has_l2, step_size):
    """One element of a LOCAL step: (x', m'). Selects, not branches, so that the loops
    vectorise; x·1 and m·1 are x and m bit for bit."""
    xi = xi * decay
    gi = _fma(xi, l2, gi) if has_l2 else gi
    b = si * c
    gi = b if gi > b else gi
    gi = -b if gi < -b else gi
    mi = _fma(coeff, gi - mi, mi if small else gi) * mk
    return xi + (step_size * mi) / si, mi


@njit(inline="always")
def _lerp_coeff(w):
    """torch's two lerp formulas as one fma: (coeff, small), m' = fma(coeff, g − m, m if small else g)."""
    small = abs(w) < np.float32(0.5)
    return (w if small else w - np.float32(1.0)), small


@njit(parallel=True, cache=True, error_model="numpy")  # x/0 is ±inf or NaN, as in torch; and it vectorises
def local_step(g, x, m, s, mask, c, decay, l2, w, step_size):
    """A LOCAL step on one tensor in one pass, in place (bitwise
    :func:`hvd_zoadam.native.reference.local_step`): g clamped to ±s·c (c = +inf: no clamp),
    x·decay, g + l2·x (l2 != 0, fused as torch's ``add(alpha=)``), m = lerp(m, g, w) in torch's
    fused form for both ranges of w, m·mask (when ``mask`` is not empty), then
    x + (step_size·m)/s. All float32[n] but ``mask`` (bool or uint8[n] or [0]); scalars float32."""
    n = g.shape[0]
    coeff, small = _lerp_coeff(w)
    has_l2, masked, one = l2 != np.float32(0.0), mask.shape[0] > 0, np.float32(1.0)
    for t in prange((n + TASK_NUMEL - 1) // TASK_NUMEL):
        lo = np.uint64(t * TASK_NUMEL)
        hi = lo + np.uint64(min(n, t * TASK_NUMEL + TASK_NUMEL) - t * TASK_NUMEL)
        if masked:
            for i in range(lo, hi):
                x[i], m[i] = _local_one(g[i], x[i], m[i], s[i], np.float32(mask[i]), c, decay, l2, coeff, small,
                                        has_l2, step_size)
        else:
            for i in range(lo, hi):
                x[i], m[i] = _local_one(g[i], x[i], m[i], s[i], one, c, decay, l2, coeff, small, has_l2, step_size)


@njit(cache=True)
def local_step_if_finite(g, x, m, s, mask, c, decay, l2, w, step_size):
    """:func:`local_step` where every element of g is finite, else nothing (the rank's own skip
    of algorithm.md §5): both passes, the read-only check and the step, in one call. Returns how
    many elements of g are not finite. Arguments as :func:`local_step`'s."""
    bad = count_non_finite(g)
    if bad == 0:
        local_step(g, x, m, s, mask, c, decay, l2, w, step_size)
    return bad


@njit(parallel=True, cache=True, error_model="numpy")
def local_window_update(g, x, m, s, mask, a, out, c, decay, l2, w, step_size, dp):
    """SYNC steps 1–3 on one tensor in one pass, x and m left as they are: out = a·dp − x'
    (a when dp is 1), x' the LOCAL step's new x (:func:`local_step`). Returns how many
    elements of g are not finite (the caller discards ``out`` then). Bitwise
    :func:`hvd_zoadam.native.reference.local_window_update`. Arrays as in :func:`local_step`,
    ``a`` and ``out`` float32[n]."""
    n = g.shape[0]
    coeff, small = _lerp_coeff(w)
    has_l2, masked, one = l2 != np.float32(0.0), mask.shape[0] > 0, np.float32(1.0)
    decayed = dp != np.float32(1.0)
    bad = 0
    for t in prange((n + TASK_NUMEL - 1) // TASK_NUMEL):
        lo = np.uint64(t * TASK_NUMEL)
        hi = lo + np.uint64(min(n, t * TASK_NUMEL + TASK_NUMEL) - t * TASK_NUMEL)
        if masked:  # two loops: a load of mask[i] under a condition would keep LLVM from vectorising
            for i in range(lo, hi):
                xi, _ = _local_one(g[i], x[i], m[i], s[i], np.float32(mask[i]), c, decay, l2, coeff, small, has_l2,
                                   step_size)
                out[i] = (a[i] * dp if decayed else a[i]) - xi
                bad += not np.isfinite(g[i])
        else:
            for i in range(lo, hi):
                xi, _ = _local_one(g[i], x[i], m[i], s[i], one, c, decay, l2, coeff, small, has_l2, step_size)
                out[i] = (a[i] * dp if decayed else a[i]) - xi
                bad += not np.isfinite(g[i])
    return bad


@njit(parallel=True, cache=True)
def sync_prepare(param, anchor, decay, out):
    """SYNC steps 2-3, preconditioned: out = anchor*decay - param (anchor - param when decay is
    1), bitwise ``kinds.sync_prepare``; one pass instead of two."""
    decayed = decay != np.float32(1.0)
    for t in prange((out.shape[0] + TASK_NUMEL - 1) // TASK_NUMEL):
        lo = np.uint64(t * TASK_NUMEL)
        for k in range(np.uint64(min(out.shape[0], t * TASK_NUMEL + TASK_NUMEL) - t * TASK_NUMEL)):
            i = lo + k
            out[i] = (anchor[i] * decay if decayed else anchor[i]) - param[i]


@njit(inline="always")
def _variance_one(gi, xi, mi, vi, mk, decay, l2, coeff, small, has_l2, step_size, beta2, one_minus_beta2, c2, eps):
    """One element of a VARIANCE step: (x', m', v', s'), :func:`_local_one`'s x·decay, L2 term
    and lerp, then v·β + ((1 − β)·g)·g with the last product fused into the sum (torch's ``mul_``,
    then ``addcmul_``, whose vectorised kernel fuses), s = sqrt(v)/c2 + eps
    and x + (step_size·m)/s, each rounded as torch's CPU ops round it."""
    xi = xi * decay
    gi = _fma(xi, l2, gi) if has_l2 else gi
    mi = _fma(coeff, gi - mi, mi if small else gi) * mk
    vi = _fma(one_minus_beta2 * gi, gi, vi * beta2)
    si = np.sqrt(vi) / c2 + eps
    return xi + (step_size * mi) / si, mi, vi, si


@njit(parallel=True, cache=True, error_model="numpy")
def variance_step(g, x, m, v, s, mask, decay, l2, w, step_size, beta2, one_minus_beta2, c2, eps):
    """A VARIANCE step on one tensor in one pass, in place (bitwise
    :func:`hvd_zoadam.native.reference.variance_step`): x, m and v updated, s written. g, x,
    m, v, s: float32[n]; ``mask``: bool or uint8[n], or [0] for none; scalars float32: decay,
    l2, w (1 − β1), step_size, beta2 (β2^I), one_minus_beta2 (1 − β2^I rounded once),
    c2 (sqrt of v's bias correction), eps."""
    n = g.shape[0]
    coeff, small = _lerp_coeff(w)
    has_l2, masked, one = l2 != np.float32(0.0), mask.shape[0] > 0, np.float32(1.0)
    for t in prange((n + TASK_NUMEL - 1) // TASK_NUMEL):
        lo = np.uint64(t * TASK_NUMEL)
        hi = lo + np.uint64(min(n, t * TASK_NUMEL + TASK_NUMEL) - t * TASK_NUMEL)
        if masked:
            for i in range(lo, hi):
                x[i], m[i], v[i], s[i] = _variance_one(g[i], x[i], m[i], v[i], np.float32(mask[i]), decay, l2, coeff,
                                                       small, has_l2, step_size, beta2, one_minus_beta2, c2, eps)
        else:
            for i in range(lo, hi):
                x[i], m[i], v[i], s[i] = _variance_one(g[i], x[i], m[i], v[i], one, decay, l2, coeff, small, has_l2,
                                                       step_size, beta2, one_minus_beta2, c2, eps)
