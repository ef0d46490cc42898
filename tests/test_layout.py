"""padded_numel (the complement, not the remainder: equal whole-byte chunks per rank) and bucketing."""
from __future__ import annotations

import pytest

from hvd_zoadam import padded_numel
from hvd_zoadam.core.layout import make_buckets


def test_padded_numel_is_the_complement_not_the_remainder():
    for w in range(1, 9):
        unit = 8 * w
        for n in range(0, 301):
            big = padded_numel(n, w)
            assert big >= n and big % unit == 0 and big - n < unit
            assert (big == n) == (n % unit == 0)
            assert (big // w) % 8 == 0  # every chunk is whole bytes of sign bits
    assert padded_numel(19, 8) == 64 and padded_numel(72, 7) == 112 and padded_numel(0, 3) == 0


@pytest.mark.parametrize("args, exc", [((-1, 2), ValueError), ((5, 0), ValueError), ((5.0, 2), TypeError)])
def test_padded_numel_rejects_bad_input(args, exc):
    with pytest.raises(exc):
        padded_numel(*args)


def test_buckets_respect_the_cap_and_skip_empty_tensors():
    assert make_buckets([4, 0, 4, 4, 10, 1], cap_numel=8) == [[0, 2], [3], [4], [5]]
    assert make_buckets([0, 0], cap_numel=8) == []
