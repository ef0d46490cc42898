"""Reference semantics of the 1-bit compressor, in plain torch (algorithm.md §3).

This module owns the bit layout and the arithmetic. The Numba kernels in
``cpu.py`` must reproduce it bit for bit, given the same scales; the scales
themselves may differ in the last float64 bit of their sums (summation order),
which after the float32 cast almost never shows.

Conventions shared by every function here:

* ``y`` and ``worker_error`` are float32, 1-D, of ``padded_numel`` elements. The
  real elements are ``y[:offsets[-1]]``; the rest is padding, which is 0 in ``y``
  and stays 0 in the error buffers.
* ``offsets`` is an int64 array of ``nseg + 1`` ascending element offsets: segment
  ``i`` (one tensor of a bucket) is ``[offsets[i], offsets[i+1])``. ``offsets[0] == 0``.
* Sign: ``+1`` where ``z >= 0`` (so both ``+0.0`` and ``-0.0`` give ``+1``), else ``-1``.
* Packing: element ``j`` of a chunk goes to byte ``j // 8``, bit ``7 - j % 8``
  (most significant bit first, numpy ``packbits`` order); bit 1 means ``+1``.
* Scale of a segment (or of a segment's piece inside a server chunk):
  ``sqrt(sum(z**2) / count)`` with the sum in float64 over real elements only,
  then cast to float32. An empty segment has scale 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(z: torch.Tensor) -> torch.Tensor:
    """Pack ``z >= 0`` MSB-first. ``z``: float, length a multiple of 8. Returns uint8[len/8]."""
    bits = (z >= 0).to(torch.uint8).view(-1, 8)
    return (bits * _BIT_WEIGHTS).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: uint8[m] -> float32[8m] of +1/-1."""
    bits = (packed.view(-1, 1) & _BIT_WEIGHTS) != 0
    return torch.where(bits, 1.0, -1.0).to(torch.float32).view(-1)


def _segment_scale(z: torch.Tensor) -> torch.Tensor:
    if z.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    sumsq = (z.double() ** 2).sum()
    return torch.sqrt(sumsq / z.numel()).float()


def _expand(scales: torch.Tensor, offsets, start: int, stop: int) -> torch.Tensor:
    """Per-element scale for elements [start, stop): segment scale, 0 on padding."""
    out = torch.zeros(stop - start, dtype=torch.float32)
    for i in range(len(offsets) - 1):
        lo, hi = max(int(offsets[i]), start), min(int(offsets[i + 1]), stop)
        if lo < hi:
            out[lo - start:hi - start] = scales[i]
    return out


def worker_scales(y: torch.Tensor, worker_error: torch.Tensor, offsets: list[int] | np.ndarray) -> torch.Tensor:
    """Per-segment scale of ``z = y + worker_error``: float32[nseg]."""
    z = y + worker_error
    return torch.stack([_segment_scale(z[int(offsets[i]):int(offsets[i + 1])])
                        for i in range(len(offsets) - 1)]) if len(offsets) > 1 else torch.zeros(0)


def worker_pack(y: torch.Tensor, worker_error: torch.Tensor, offsets: list[int] | np.ndarray,
                scales: torch.Tensor) -> torch.Tensor:
    """Sign-pack ``z = y + worker_error`` and set ``worker_error <- z - scale*sign``.

    Returns uint8[padded_numel / 8]. ``worker_error`` is updated in place.
    """
    z = y + worker_error
    sign = torch.where(z >= 0, 1.0, -1.0).to(torch.float32)
    worker_error.copy_(z - _expand(scales, offsets, 0, z.numel()) * sign)
    return pack_signs(z)


def server_reduce(recv: torch.Tensor, all_worker_scales: torch.Tensor, server_error: torch.Tensor,
                  offsets: list[int] | np.ndarray, chunk_start: int):
    """Server side for one chunk (algorithm.md §3).

    Args:
        recv: uint8[P, chunk_numel/8], the chunk as packed by ranks 0..P-1.
        all_worker_scales: float32[P, nseg].
        server_error: float32[chunk_numel], updated in place.
        offsets: segment offsets of the bucket.
        chunk_start: element offset of this chunk in the bucket.

    Returns:
        (packed uint8[chunk_numel/8], server_scales float32[nseg]), where the scale of
        segment i is over its piece inside this chunk (0 if the piece is empty).
    """
    world_size, chunk_numel = recv.shape[0], server_error.numel()
    acc = torch.zeros(chunk_numel, dtype=torch.float32)
    for p in range(world_size):
        acc = acc + _expand(all_worker_scales[p], offsets, chunk_start, chunk_start + chunk_numel) \
            * unpack_signs(recv[p])
    c = acc / torch.full_like(acc, world_size) + server_error
    nseg = len(offsets) - 1
    scales = torch.zeros(nseg, dtype=torch.float32)
    for i in range(nseg):
        lo = max(int(offsets[i]), chunk_start) - chunk_start
        hi = min(int(offsets[i + 1]), chunk_start + chunk_numel) - chunk_start
        if lo < hi:
            scales[i] = _segment_scale(c[lo:hi])
    sign = torch.where(c >= 0, 1.0, -1.0).to(torch.float32)
    server_error.copy_(c - _expand(scales, offsets, chunk_start, chunk_start + chunk_numel) * sign)
    return pack_signs(c), scales


def decompress(packed: torch.Tensor, all_server_scales: torch.Tensor, offsets: list[int] | np.ndarray,
               numel: int) -> torch.Tensor:
    """Unpack the allgathered server chunks: float32[numel] (padding cut off).

    ``packed``: uint8[padded_numel/8], chunks of ranks 0..P-1 in order;
    ``all_server_scales``: float32[P, nseg].
    """
    world_size = all_server_scales.shape[0]
    signs = unpack_signs(packed)
    chunk_numel = signs.numel() // world_size if world_size else 0
    out = torch.empty(signs.numel(), dtype=torch.float32)
    for q in range(world_size):
        lo, hi = q * chunk_numel, (q + 1) * chunk_numel
        out[lo:hi] = _expand(all_server_scales[q], offsets, lo, hi) * signs[lo:hi]
    return out[:numel]


def decompress_momentum(packed: torch.Tensor, all_server_scales: torch.Tensor, offsets: list[int] | np.ndarray,
                        exp_avg: torch.Tensor, beta1: float) -> torch.Tensor:
    """COMPRESSED step 2 (algorithm.md §2) from the packed result: ``exp_avg <- exp_avg + (1-β1)·(ĝ - exp_avg)``.

    Each operation rounds to float32 once, in this order (the kernels do the same).
    ``exp_avg``: float32[n], updated in place and returned.
    """
    g = decompress(packed, all_server_scales, offsets, exp_avg.numel())
    w = torch.tensor(1.0 - beta1, dtype=torch.float32)
    return exp_avg.add_((g - exp_avg) * w)


def sync_rebuild(w: torch.Tensor, anchor: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor,
                 factor: float, decay_product: float = 1.0, mask: torch.Tensor | None = None,
                 preconditioned: bool = True) -> None:
    """SYNC steps 5-7 (algorithm.md §2) from the exchanged window update ``w``: the one torch
    home of the rebuild formula, which every other path calls or matches bitwise.

    In order, each operation rounding to float32 once: ``w <- w·mask`` (when given, in place);
    ``x_a <- x_a·decay_product`` (when != 1, in place); preconditioned (w in parameter units):
    ``x = x_a − w`` and ``m = (w·s)·factor``; otherwise (the paper's momentum units):
    ``x = x_a − w/s`` and ``m = w·factor``; then ``x_a <- x``. ``factor`` is (1 − β1^t)/Λ.

    ``w``, ``anchor`` (x_a), ``param`` (x), ``exp_avg`` (m), ``denom`` (s): float32[n];
    ``mask``: bool[n] or None. ``param``, ``exp_avg`` and ``anchor`` are written in place.
    """
    if mask is not None:
        w.mul_(mask)
    if decay_product != 1.0:
        anchor.mul_(decay_product)
    if preconditioned:
        torch.sub(anchor, w, out=param)
        torch.mul(w, denom, out=exp_avg).mul_(factor)
    else:
        torch.sub(anchor, w / denom, out=param)
        torch.mul(w, factor, out=exp_avg)
    anchor.copy_(param)


def decompress_sync(packed: torch.Tensor, all_server_scales: torch.Tensor, offsets: list[int] | np.ndarray, *,
                    anchor: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor,
                    factor: float, decay_product: float = 1.0, mask: torch.Tensor | None = None,
                    preconditioned: bool = True) -> None:
    """SYNC steps 5-7 (algorithm.md §2) from the packed result w: :func:`decompress`, then
    :func:`sync_rebuild`. ``factor`` = (1 − β1^t)/Λ."""
    w = decompress(packed, all_server_scales, offsets, anchor.numel())
    sync_rebuild(w, anchor, param, exp_avg, denom, factor, decay_product, mask, preconditioned)


def local_step(grad: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor, *, weight: float,
               step_size: float, decay: float = 1.0, l2: float = 0.0, bound_factor: float | None = None,
               mask: torch.Tensor | None = None) -> None:
    """A LOCAL (or COMPRESSED) step, algorithm.md §2, in place: the one torch home of its
    formula, which :func:`hvd_zoadam.core.step_math.momentum_step` calls and the CPU kernel matches
    bitwise.

    In order, each operation torch's own: x ← x·``decay`` (AdamW's 1 − γλ, when != 1);
    g ← g + ``l2``·x (Adam's L2 term, when != 0; ``add(alpha=)``); g ← clamp(g, −s·c, s·c)
    with c = ``bound_factor`` (when given; s·c rounded once), after the L2 term: with v frozen
    an unbounded λ·x/s would make x ← x·(1 − γλ/s) grow where s is small (the step of a
    coordinate is then at most γ·c/(1 − β1^t), as Adam's own); m ← ``m.lerp(g, weight)``
    (weight = 1 − β1); m ← m·mask (when given); x ← ``x.addcdiv(m, s, value=step_size)``
    (step_size = −γ/(1 − β1^t)).

    ``grad`` (g), ``param`` (x), ``exp_avg`` (m), ``denom`` (s): float32[n]; ``mask``: bool or
    uint8[n] or None. ``grad`` is not changed.
    """
    if decay != 1.0:
        param.mul_(decay)
    if l2 != 0.0:
        grad = grad.add(param, alpha=l2)
    if bound_factor is not None:
        bound = torch.mul(denom, bound_factor)
        grad = torch.minimum(grad, bound)
        torch.maximum(grad, bound.neg_(), out=grad)
    exp_avg.lerp_(grad, weight)
    if mask is not None:
        exp_avg.mul_(mask)
    param.addcdiv_(exp_avg, denom, value=step_size)


def sqrt_rn(v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The square root of float32 ``v`` rounded to the nearest float32 (IEEE 754's sqrt, the
    kernels' ``sqrt``), into ``out`` when given. torch's CPU ``sqrt`` is within 1 ulp but not
    always the nearest (its vectorised kernel: about 17 % of the float32s in [1, 4) one ulp
    off); through float64 it is (the float64 root rounds to the nearest float32: checked for
    every float32 in [1, 4), which covers every mantissa of both exponent parities). On a GPU
    torch's float32 ``sqrt`` already rounds to nearest."""
    if v.device.type != "cpu":
        return torch.sqrt(v, out=out)
    root = v.double().sqrt_()
    return root.float() if out is None else out.copy_(root)


def variance_step(grad: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  denom: torch.Tensor, *, weight: float, step_size: float, beta2: float, bias_correction2: float,
                  eps: float, decay: float = 1.0, l2: float = 0.0, mask: torch.Tensor | None = None) -> None:
    """A VARIANCE step (algorithm.md §2), in place: the one torch home of its formula, whose op
    order is ``torch.optim.Adam``'s single-tensor path and which the kernels match bitwise
    (torch's CPU Adam differs in the last bit of some roots: see :func:`sqrt_rn`).

    In order, each operation torch's own: x ← x·``decay`` (AdamW's 1 − γλ, when != 1);
    g ← g + ``l2``·x (Adam's L2 term, when != 0); m ← ``m.lerp(g, weight)`` (weight = 1 − β1);
    m ← m·mask (when given); v ← ``v.mul(beta2).addcmul(g, g, value=1 − beta2)`` (``beta2``:
    β2^I, the weight of one update of v); s ← sqrt(v) / sqrt(``bias_correction2``) + ``eps``
    into ``denom``, the root rounded to nearest (:func:`sqrt_rn`, not torch's CPU ``sqrt``);
    x ← ``x.addcdiv(m, s, value=step_size)`` (step_size = −γ/(1 − β1^t)).

    ``grad`` (ḡ, the average), ``param`` (x), ``exp_avg`` (m), ``exp_avg_sq`` (v), ``denom``
    (s, written): float32[n]; ``mask``: bool or uint8[n] or None. ``grad`` is not changed.
    """
    if decay != 1.0:
        param.mul_(decay)
    if l2 != 0.0:
        grad = grad.add(param, alpha=l2)
    exp_avg.lerp_(grad, weight)
    if mask is not None:
        exp_avg.mul_(mask)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    sqrt_rn(exp_avg_sq, out=denom).div_(bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=step_size)


def local_window_update(grad: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor,
                        anchor: torch.Tensor, out: torch.Tensor, decay_product: float = 1.0,
                        select: bool = False, **step: float | None) -> bool:
    """SYNC steps 1–3 (algorithm.md §2) with x and m left as they are: x' from
    :func:`local_step` (its keyword arguments ``step``) on copies, then the window's update in
    parameter units, ``out = anchor·decay_product − x'`` (``anchor − x'`` when decay_product is
    1). ``anchor``, ``out``: float32[n]. Returns whether every element of ``grad`` is finite
    (``out`` is then of no use: the caller takes the step that skips). With ``select`` nothing
    is read on the host: where ``grad`` is not finite, x' is ``param`` itself, chosen on the
    device (the skipped step's ``out``, bitwise :func:`hvd_zoadam.core.step_math.sync_prepare`'s),
    and True is returned."""
    x, m = param.clone(), exp_avg.clone()
    local_step(grad, x, m, denom, **step)
    finite = torch.isfinite(grad).all()
    if select:
        torch.where(finite, x, param, out=x)
    torch.sub(anchor * decay_product if decay_product != 1.0 else anchor, x, out=out)
    return True if select else bool(finite)
