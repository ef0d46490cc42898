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
* No kernel multiplies and adds in one expression where the CPU rounds twice, so
  no fused multiply-add can change a result: the error updates are ``z ± s``, the
  server average ``acc / P + e``, and the SYNC rebuild applies the window's decay
  in a separate torch ``mul_`` first.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import config as _config
from numba import cuda, float64, int64, uint8

from .cpu import _half_to_f32, make_tasks

TPB = 256
SIMULATOR = bool(_config.ENABLE_CUDASIM)


# -- device functions ---------------------------------------------------------------------

@cuda.jit(device=True)
def _identity(v):
    return v


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
        acc_sh[tid] = acc
        cuda.syncthreads()
        step = TPB // 2
        while step > 0:
            if tid < step:
                acc_sh[tid] += acc_sh[tid + step]
            cuda.syncthreads()
            step //= 2
        if tid == 0:
            partial[t] = acc_sh[0]

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

    return sumsq_tasks, pack_update


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
    """server_error[i] <- (sum_p ±wscale[p, seg]) / P + server_error[i], rank order (spec §3)."""
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


@cuda.jit(device=True)
def _unpacked(packed, sscales, offsets, chunk_numel, seg0, j):
    """(value, seg) of bucket element j: its chunk's server scale times its sign."""
    seg = _walk(offsets, seg0, j)
    s = sscales[j // chunk_numel, seg]
    return (s if (packed[j >> 3] >> (7 - (j & 7))) & 1 else -s), seg


@cuda.jit
def _decompress(packed, sscales, offsets, chunk_numel, out, mode, exp_avg, weight, anchor, param, denom, mask,
                factor, has_mask):
    """mode 0: out[j] = ĝ_j; mode 1: exp_avg lerp toward ĝ; mode 2: SYNC rebuild (preconditioned);
    mode 3: SYNC rebuild (spec's momentum units). See cpu.decompress*."""
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
            exp_avg[j] = m + np.float32(weight) * (w - m)
        else:
            if has_mask:
                w = w * np.float32(mask[j])
            if mode == 2:
                x = anchor[j] - w
                exp_avg[j] = (w * denom[j]) * np.float32(factor)
            else:
                x = anchor[j] - w / denom[j]
                exp_avg[j] = w * np.float32(factor)
            param[j] = x
            anchor[j] = x


# -- torch-level entry points ---------------------------------------------------------------

def _arr(t: torch.Tensor):
    """A kernel argument viewing ``t``: zero-copy device array, or a numpy view in the simulator."""
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if SIMULATOR:
        return t.detach().numpy()
    return cuda.as_cuda_array(t.detach())


def _kind(y: torch.Tensor) -> str:
    try:
        return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[y.dtype]
    except KeyError:
        raise TypeError(f"y must be float32, float16 or bfloat16, got {y.dtype}") from None


def _stream(t: torch.Tensor):
    """torch's current stream on ``t``'s device as a numba stream (0 in the simulator)."""
    if SIMULATOR or t.device.type != "cuda":
        return 0
    return cuda.external_stream(torch.cuda.current_stream(t.device).cuda_stream)


def _grid(n: int) -> int:
    return max(1, (n + TPB - 1) // TPB)


def device_plan(plan, device) -> dict:
    """The plan's index arrays as kernel arguments on ``device`` (numpy in the simulator)."""
    def seg_ptr(tasks):
        return np.searchsorted(tasks[:, 0], np.arange(plan.nseg + 1), side="left").astype(np.int64)

    host = {"offsets": plan.offsets,
            "worker_tasks": plan.worker_tasks, "worker_seg_ptr": seg_ptr(plan.worker_tasks),
            "server_tasks": plan.server_tasks, "server_seg_ptr": seg_ptr(plan.server_tasks),
            "worker_partial": np.zeros(max(1, len(plan.worker_tasks))),
            "server_partial": np.zeros(max(1, len(plan.server_tasks)))}
    if SIMULATOR:
        return {k: np.ascontiguousarray(v) for k, v in host.items()}
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in host.items()}
    out = {k: cuda.as_cuda_array(t) for k, t in tensors.items()}
    out["_tensors"] = tensors  # the views do not own the memory: keep the tensors alive with them
    return out


def _plan_arrays(plan, like: torch.Tensor) -> dict:
    return plan.on(like.device) if not SIMULATOR else plan._device.setdefault("sim", device_plan(plan, None))


def worker_scales(y, worker_error, plan, out):
    d = _plan_arrays(plan, worker_error)
    stream = _stream(worker_error)
    sumsq, _ = _kernels(_kind(y))
    ntasks = len(plan.worker_tasks)
    if ntasks:
        sumsq[ntasks, TPB, stream](_arr(y), True, _arr(worker_error), 0, d["worker_tasks"], d["worker_partial"])
    _reduce_scales[_grid(plan.nseg), TPB, stream](d["worker_seg_ptr"], d["worker_partial"], d["offsets"], 0,
                                                  plan.numel, _arr(out))
    return out


def pack_update(y, e, base, plan, scales, packed, has_y=True, e_out=None):
    stream = _stream(e)
    d = _plan_arrays(plan, e)
    _, pack = _kernels(_kind(y))
    eo = _arr(e) if e_out is None else _arr(e_out)
    pack[_grid(e.numel()), TPB, stream](_arr(y), has_y, _arr(e), eo, base, d["offsets"], _arr(scales), _arr(packed))
    return packed


def server_reduce(recv, all_worker_scales, server_error, plan, packed, scales):
    stream = _stream(server_error)
    d = _plan_arrays(plan, server_error)
    se = _arr(server_error)
    _server_average[_grid(server_error.numel()), TPB, stream](_arr(recv), _arr(all_worker_scales), se,
                                                              plan.chunk_start, d["offsets"])
    sumsq, pack = _kernels("f32")
    ntasks = len(plan.server_tasks)
    if ntasks:
        sumsq[ntasks, TPB, stream](se, False, se, plan.chunk_start, d["server_tasks"], d["server_partial"])
    _reduce_scales[_grid(plan.nseg), TPB, stream](d["server_seg_ptr"], d["server_partial"], d["offsets"],
                                                  plan.chunk_start, plan.chunk_start + plan.chunk_numel, _arr(scales))
    pack[_grid(server_error.numel()), TPB, stream](se, False, se, se, plan.chunk_start, d["offsets"], _arr(scales),
                                                   _arr(packed))
    return packed, scales


def _unpack(packed, sscales, plan, mode, like, out=None, exp_avg=None, weight=0.0, anchor=None, param=None,
            denom=None, mask=None, factor=0.0):
    if not plan.numel:
        return
    stream = _stream(like)
    d = _plan_arrays(plan, like)
    dummy = _arr(torch.empty(0, device=like.device))
    arr = lambda t: dummy if t is None else _arr(t)  # noqa: E731
    no_mask = _arr(torch.empty(0, dtype=torch.uint8, device=like.device))
    _decompress[_grid(plan.numel), TPB, stream](
        _arr(packed), _arr(sscales), d["offsets"], plan.chunk_numel, arr(out), mode, arr(exp_avg), float(weight),
        arr(anchor), arr(param), arr(denom), no_mask if mask is None else _arr(mask), float(factor),
        mask is not None)


def decompress(packed, sscales, plan, out):
    _unpack(packed, sscales, plan, 0, out, out=out)
    return out


def decompress_momentum(packed, sscales, plan, exp_avg, beta1):
    _unpack(packed, sscales, plan, 1, exp_avg, exp_avg=exp_avg, weight=1.0 - beta1)
    return exp_avg


def decompress_sync(packed, sscales, plan, anchor, param, exp_avg, denom, factor, decay_product, mask,
                    preconditioned):
    if decay_product != 1.0:  # a separate rounding, as the CPU path (no fused multiply-add)
        anchor.mul_(decay_product)
    _unpack(packed, sscales, plan, 2 if preconditioned else 3, anchor, exp_avg=exp_avg, anchor=anchor,
            param=param, denom=denom, mask=mask, factor=factor)
