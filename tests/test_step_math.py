"""The step math of hvd_zoadam.core.step_math against hand-computed values."""
import math

import pytest

from hvd_zoadam.core import step_math


def _hyper(beta2=0.98, bias_correction=True):
    return step_math.Hyper(lr=1e-3, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0, decoupled=False,
                       bias_correction=bias_correction, step=10, exp_avg_sq_steps=4)


@pytest.mark.parametrize("world_size", [1, 2, 8, 16])
def test_gradient_bound_grows_with_the_square_root_of_the_world_size(world_size):
    """|g|/sqrt(v̂) of one rank is bounded by sqrt(P)/sqrt(1 − β2): v is built from the average of
    P gradients, whose noise variance is 1/P of one rank's; the bound is the same after any
    number of variance updates and with or without bias correction."""
    want = math.sqrt(world_size) / math.sqrt(1 - 0.98)
    assert step_math.normalized_gradient_bound(_hyper(), world_size) == pytest.approx(want, rel=1e-15)
    assert step_math.normalized_gradient_bound(_hyper(bias_correction=False), world_size) == \
        pytest.approx(want, rel=1e-15)
    assert step_math.normalized_gradient_bound(_hyper(beta2=0.0), world_size) == math.sqrt(world_size)
