"""Hypothesis cases shared by the CPU kernel tests (test_native.py) and the CUDA ones (cuda/)."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from hvd_zoadam.layout import padded_numel

# zeros of both signs, subnormals, values near float32's overflow, ordinary ones
SPECIALS = (0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1e-30, 1.0)


@st.composite
def bucket_cases(draw, max_seg_numel=700, max_segs=5, dtypes=(torch.float32,), specials=SPECIALS):
    """(numels, P, y, worker_error, generator): a bucket of 1..max_segs segments, y padded to
    padded_numel(n, P) with zeros, some special values planted, cast to a drawn dtype; the
    error random on the real elements, 0 on the padding."""
    numels = draw(st.lists(st.integers(1, max_seg_numel), min_size=1, max_size=max_segs))
    p = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    n = sum(numels)
    big = padded_numel(n, p)
    y = torch.zeros(big)
    y[:n] = torch.randn(n, generator=gen) * draw(st.sampled_from([1e-6, 1.0, 1e4]))
    for idx, val in draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(specials)), max_size=6)):
        y[idx] = val
    e = torch.zeros(big)
    e[:n] = torch.randn(n, generator=gen) * 0.1
    return numels, p, y.to(dtype), e, gen


def server_inputs(gen, numels, padded: int, p: int, rank: int):
    """(recv uint8[P, C/8], worker scales float32[P, nseg], server_error float32[C], real count) for
    rank ``rank``'s chunk C = padded / P: random bits and scales, the error random on the chunk's
    real elements and 0 on its padding."""
    chunk = padded // p
    recv = torch.randint(0, 256, (p, chunk // 8), generator=gen, dtype=torch.uint8)
    wscales = torch.rand(p, len(numels), generator=gen)
    se = torch.zeros(chunk)
    real = max(0, min(chunk, sum(numels) - rank * chunk))
    se[:real] = torch.randn(real, generator=gen) * 0.1
    return recv, wscales, se, real
