"""Padding and bucket layout: pure integer arithmetic (algorithm.md §3, §7 #7)."""
from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence


def _as_int(value, name: str, minimum: int) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def padded_numel(numel: int, world_size: int) -> int:
    """Length of a buffer of ``numel`` elements padded for a ``world_size``-way 1-bit exchange.

    The result N is the smallest multiple of ``8 * world_size`` that is >= ``numel``,
    so the P chunks are equal and each is a whole number of bytes of sign bits.
    ``worker_error`` has N elements and ``server_error`` has N // world_size.
    ``padded_numel(0, P) == 0``.

    Raises:
        TypeError: if an argument is not an int.
        ValueError: if ``numel < 0`` or ``world_size < 1``.
    """
    numel = _as_int(numel, "numel", 0)
    world_size = _as_int(world_size, "world_size", 1)
    unit = 8 * world_size
    return -(-numel // unit) * unit


def segment_offsets(numels: Iterable[int]) -> list[int]:
    """Offsets ``[0, n0, n0+n1, ...]`` of consecutive segments (tensors) in a bucket."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + int(n))
    return offsets


def make_buckets(numels: Iterable[int], cap_numel: int) -> list[list[int]]:
    """Split indices of ``numels`` (in order) into runs of at most ``cap_numel`` elements.

    A tensor larger than the cap gets a bucket of its own. Zero-element tensors are
    left out: they take part in no collective (algorithm.md §5).
    """
    buckets, current, size = [], [], 0
    for i, n in enumerate(numels):
        if n == 0:
            continue
        if current and size + n > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def scale_segments(numels: Iterable[int], block_numel: int | None) -> list[int]:
    """Sizes of the scale segments of a bucket: each tensor split into blocks of at most
    ``block_numel`` elements (one scale each), or whole tensors when ``block_numel`` is None.

    Per-block scales follow the magnitude of each part of a tensor, which cuts the 1-bit
    compression error where magnitudes vary inside a tensor (algorithm.md §3, "Scales").
    """
    out = []
    for n in numels:
        n = int(n)
        if block_numel is None:
            out.append(n)
            continue
        while n > 0:
            out.append(min(n, block_numel))
            n -= block_numel
    return [n for n in out if n > 0]


def node_shards(numel: int, local_size: int) -> list[tuple[int, int]]:
    """``(lo, hi)`` of each local rank's shard of a bucket in the two-level exchange: L
    consecutive ranges of ``ceil(numel / L)`` elements (the last ones shorter, or empty when
    ``numel < L``). Local rank l reduces, compresses and gathers shard l (algorithm.md §3,
    "Two levels")."""
    numel = _as_int(numel, "numel", 0)
    local_size = _as_int(local_size, "local_size", 1)
    width = -(-numel // local_size)
    return [(min(numel, l * width), min(numel, (l + 1) * width)) for l in range(local_size)]


def shard_segments(offsets: Sequence[int], lo: int, hi: int) -> list[int]:
    """The scale segments of the range ``[lo, hi)`` of a bucket whose segments start at
    ``offsets`` (:func:`segment_offsets`): each segment cut at the range's ends, empty ones
    left out. A block that a shard boundary cuts gets one scale on each side."""
    out = []
    for a, b in zip(offsets, offsets[1:]):
        n = min(b, hi) - max(a, lo)
        if n > 0:
            out.append(n)
    return out
