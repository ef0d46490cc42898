"""The oracle's 1-bit exchange with the P workers' tensors stacked: one float32[P, n] input,
one float32[P, N] of worker errors, the scales of every segment and rank from one reduction.

The formulas are those of :mod:`hvd_zoadam.native.reference` (algorithm.md §3), element for
element and in the same order of operations; what differs is only how the float64 sums of
squares under each scale are taken (one segmented reduction instead of one ``sum()`` per
segment), so a scale can differ from the per-rank oracle's
(:func:`hvd_zoadam.oracle.simulate.simulate_compressed_allreduce`) in the last bit of its
float64 sum, as the Numba kernels' may. The cost is a few passes over P·n elements, with no
Python loop over segments or over pairs of ranks: what lets the oracle run at P = 128.
"""
from __future__ import annotations

import torch

from hvd_zoadam.core.layout import node_shards, segment_offsets, shard_segments


def _scales(z: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-segment scale sqrt(mean(z²)) of float32[R, m] over consecutive segments of
    ``lengths`` (int64[nseg], summing to m): float32[R, nseg], 0 for an empty segment."""
    rows = z.shape[0]
    sumsq = torch.segment_reduce(z.double().square(), "sum", lengths=lengths.expand(rows, -1).contiguous(), axis=1)
    return torch.where(lengths > 0, torch.sqrt(sumsq / lengths), 0.0).float()


def _per_element(scales: torch.Tensor, lengths: torch.Tensor, padded: int) -> torch.Tensor:
    """float32[..., nseg] scales spread over their segments' elements, 0 on the padding up to
    ``padded`` elements: float32[..., padded]."""
    index = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    out = torch.zeros(*scales.shape[:-1], padded)
    out[..., :index.numel()] = scales[..., index]
    return out


def _lengths(offsets) -> torch.Tensor:
    return torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], dtype=torch.long)


def compressed_allreduce_stacked(inputs: torch.Tensor, worker_errors: torch.Tensor, server_errors: torch.Tensor,
                                 numels: list[int] | None = None, server_exact: bool = False):
    """C(y) over R simulated workers (algorithm.md §3), stacked.

    Args:
        inputs: float32[R, n], worker r's y in row r.
        worker_errors: float32[R, padded_numel(n, R)], updated in place.
        server_errors: float32[R, padded_numel(n, R) // R], updated in place.
        numels: segment sizes (default: one segment of n).
        server_exact: the ablation of :func:`~hvd_zoadam.oracle.simulate.simulate_compressed_allreduce`:
            the exact average of the R compressed messages, ``server_errors`` untouched.

    Returns:
        float32[n], the common result; or None when a worker or server scale is non-finite
        (then no buffer changes).
    """
    rows, n = inputs.shape
    offsets = segment_offsets(numels if numels is not None else [n])
    if rows == 1:
        return inputs[0].float().clone() if torch.isfinite(inputs).all() else None
    big_n = worker_errors.shape[1]
    lengths = _lengths(offsets)
    z = worker_errors.clone()
    z[:, :n] = inputs.float() + worker_errors[:, :n]
    scales = _scales(z[:, :n], lengths)
    if not torch.isfinite(scales).all():
        return None
    messages = _per_element(scales, lengths, big_n) * torch.where(z >= 0, 1.0, -1.0)
    if server_exact:
        worker_errors.copy_(z - messages)
        return row_sum(messages[:, :n]) / rows
    c = row_sum(messages, start=torch.zeros(big_n)) / torch.full((big_n,), rows, dtype=torch.float32) \
        + server_errors.reshape(-1)
    chunk = big_n // rows
    cuts = sorted(set(offsets) | {q * chunk for q in range(rows) if q * chunk < n})
    pieces = _lengths(cuts)  # each segment cut at the chunks' ends: one server scale per piece
    server_scales = _scales(c[None, :n], pieces)[0]
    if not torch.isfinite(server_scales).all():  # finite worker scales summed past float32
        return None
    worker_errors.copy_(z - messages)
    server_out = _per_element(server_scales, pieces, big_n) * torch.where(c >= 0, 1.0, -1.0)
    server_errors.reshape(-1).copy_(c - server_out)
    return server_out[:n].clone()


def row_sum(stack: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
    """``start`` (default: nothing) + Σ_r stack[r], added in rank order, as the per-rank oracle
    adds its lists: float32[...] from float32[R, ...]."""
    total = stack[0].clone() if start is None else start + stack[0]
    for row in stack[1:]:
        total = total + row
    return total


def hierarchical_allreduce_stacked(inputs: torch.Tensor, worker_errors: list[torch.Tensor],
                                   server_errors: list[torch.Tensor], ranks_per_node: int,
                                   numels: list[int] | None = None):
    """The two-level C_2(y) over P = N·L simulated workers (algorithm.md §3, "Two levels"),
    stacked: :func:`~hvd_zoadam.oracle.simulate.simulate_hierarchical_allreduce`'s formulas.

    Args:
        inputs: float32[P, n]; rank r is local rank r mod L of node r // L.
        worker_errors, server_errors: per local rank l, float32[N, padded_numel(len_l, N)] and
            float32[N, padded_numel(len_l, N) // N], the buffers of shard l's exchange on the N
            ranks that serve it (row a: node a's); updated in place.
        ranks_per_node: L (dividing P).
        numels: segment sizes of the bucket (default: one segment of n).

    Returns:
        float32[n], the common result; or None when some node average is non-finite (then no
        buffer changes).
    """
    world_size, n = inputs.shape
    local = ranks_per_node
    nodes = world_size // local
    offsets = segment_offsets(numels if numels is not None else [n])
    by_node = inputs.float().reshape(nodes, local, n)
    out = torch.zeros(n)
    staged = []
    for l, (lo, hi) in enumerate(node_shards(n, local)):
        if hi == lo:
            continue
        total = by_node[:, 0, lo:hi].clone()
        for j in range(1, local):
            total += by_node[:, j, lo:hi]
        we, se = worker_errors[l].clone(), server_errors[l].clone()
        result = compressed_allreduce_stacked(total / local, we, se, shard_segments(offsets, lo, hi))
        if result is None:
            return None
        out[lo:hi] = result
        staged.append((l, we, se))
    for l, we, se in staged:
        worker_errors[l].copy_(we)
        server_errors[l].copy_(se)
    return out
