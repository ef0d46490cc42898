"""The math of the four step kinds (algorithm.md §2) over flat float32 tensors of one bucket.

No collectives here: the caller communicates and passes the results in. The op
order of :func:`variance_step` follows ``torch.optim.Adam``'s single-tensor path
(``lerp_``, ``mul_().addcmul_()``, denom, ``addcdiv_``), so the all-VARIANCE
oracle of algorithm.md §2 holds to float rounding.

Shapes: every tensor argument is float32[n] (one bucket). ``lr``, ``weight_decay``
and the betas are Python floats; ``step`` is t and ``exp_avg_sq_steps`` is K, the
exponent of β2 in v's bias correction 1 − β2^K (the number of VARIANCE updates so far, or
under ``"interval"`` weighting the steps they stand for).

Bias correction after the freeze: m̂ = m / (1 - β1^t) keeps its correction in
every step. At a SYNC step the rebuilt momentum is stored as
m = (1 - β1^t)·w/Λ, so that m̂ = w/Λ exactly, the lr-weighted average m̂ of the
window (algorithm.md §2 SYNC step 6).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hvd_zoadam.native import reference


@dataclass(frozen=True)
class Hyper:
    """Per-group hyperparameters of one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool       # AdamW-style decay (True) or L2 folded into the gradient (False)
    bias_correction: bool
    step: int             # t
    exp_avg_sq_steps: int  # K, the exponent of β2 in v's bias correction
    var_update_steps: int = 1  # I: a VARIANCE update of v weighs as I steps (Schedule.variance_update_steps)

    @property
    def bias_correction1(self) -> float:
        return 1 - self.beta1 ** self.step if self.bias_correction else 1.0

    @property
    def bias_correction2(self) -> float:
        return 1 - self.beta2 ** self.exp_avg_sq_steps if self.bias_correction else 1.0


def adam_denom(exp_avg_sq: torch.Tensor, h: Hyper, out: torch.Tensor | None = None) -> torch.Tensor:
    """s = sqrt(v̂) + eps, float32[n] (into ``out`` when given, else a new tensor): the root
    rounded to nearest (:func:`reference.sqrt_rn`), as the VARIANCE kernels compute it."""
    return reference.sqrt_rn(exp_avg_sq, out=out).div_(h.bias_correction2 ** 0.5).add_(h.eps)


def normalized_gradient_bound(h: Hyper, world_size: int = 1) -> float:
    """The bound on one rank's |g|/sqrt(v̂) in the preconditioned exchange and the LOCAL steps:
    sqrt(P) / sqrt(1 − β2).

    The second factor is the largest |ḡ|/sqrt(v̂) Adam itself allows in the long run (from
    v' = β2·v + (1 − β2)·ḡ² >= (1 − β2)·ḡ², with bias correction → 1). But v is built from the
    average ḡ of P gradients, whose noise variance is 1/P of one rank's own g, so a rank's
    |g|/sqrt(v̂) is about sqrt(P) times larger where noise dominates: the factor sqrt(P)
    (docs/algorithm.md §2, "Compression domain"). Without it the bound clipped most
    noise-dominated coordinates at P = 8 and cost 7 % in validation loss. The bound does not
    depend on how many times v was updated: Adam's bound at its (k+1)-th update,
    sqrt(1 − β2^(k+1))/sqrt(1 − β2), is far tighter after few updates (2.6 against 7.1 at
    k = 6, β2 = 0.98) and, applied to every step after the freeze, clipped short runs' steps
    (docs/performance.md, "The bound after a short warm-up").
    """
    return math.sqrt(world_size) / math.sqrt(1 - h.beta2)


def _l2(grad: torch.Tensor, param: torch.Tensor, h: Hyper) -> torch.Tensor:
    if h.weight_decay != 0 and not h.decoupled:
        return grad.add(param, alpha=h.weight_decay)
    return grad


def _decay(param: torch.Tensor, h: Hyper) -> None:
    if h.weight_decay != 0 and h.decoupled:
        param.mul_(1 - h.lr * h.weight_decay)


def variance_step(param: torch.Tensor, grad_avg: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  h: Hyper, mask: torch.Tensor | None = None, denom_out: torch.Tensor | None = None) -> None:
    """VARIANCE (algorithm.md §2): m and v from the full-precision average ḡ; x ← x − γ·m̂/s.

    v ← β·v + (1 − β)·ḡ² with β = β2^I, I = ``h.var_update_steps`` (1: Adam's update; more
    under ``"interval"`` weighting, algorithm.md §4); ``h.exp_avg_sq_steps`` already counts it.

    ``mask`` (bool[n] or None): the momentum mask; coordinates where it is False keep m = 0.
    ``denom_out`` (float32[n] or None): a scratch for s (bitwise the same values), so that a
    step allocates nothing bucket-sized.
    """
    if denom_out is None:
        denom_out = torch.empty_like(exp_avg_sq)
    reference.variance_step(grad_avg, param, exp_avg, exp_avg_sq, denom_out, mask=mask, **variance_step_scalars(h))


def variance_step_scalars(h: Hyper) -> dict:
    """The scalars of :func:`reference.variance_step` for ``h``: :func:`local_step_scalars`'s, and
    ``beta2`` β2^I (I = ``h.var_update_steps``), ``bias_correction2`` 1 − β2^K, ``eps``."""
    return {**local_step_scalars(h), "beta2": h.beta2 ** h.var_update_steps,
            "bias_correction2": h.bias_correction2, "eps": h.eps}


def local_step_scalars(h: Hyper) -> dict:
    """The scalars of :func:`reference.local_step` for ``h``: ``weight`` 1 − β1, ``step_size``
    −γ/(1 − β1^t), ``decay`` 1 − γλ (AdamW; else 1) and ``l2`` λ (Adam's L2; else 0)."""
    decoupled = h.weight_decay != 0 and h.decoupled
    return {"weight": 1 - h.beta1, "step_size": -h.lr / h.bias_correction1,
            "decay": 1 - h.lr * h.weight_decay if decoupled else 1.0,
            "l2": h.weight_decay if not h.decoupled else 0.0}


def momentum_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor, h: Hyper,
                  mask: torch.Tensor | None = None) -> None:
    """COMPRESSED (with ĝ = C(g)) and LOCAL (with the local g): m ← β1·m + (1−β1)·g; x ← x − γ·m̂/s.

    v is not touched. ``denom`` is :func:`adam_denom` of the frozen or current v; ``mask`` as
    in :func:`variance_step`. The ops are :func:`reference.local_step`'s.
    """
    reference.local_step(grad, param, exp_avg, denom, mask=mask, **local_step_scalars(h))


def local_momentum(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, h: Hyper,
                   out: torch.Tensor) -> None:
    """1-bit Adam's exchange input (algorithm.md §9): out <- β1·m + (1−β1)·g, computed as
    ``m.lerp(g, 1 − β1)`` (Adam's own op); g gets Adam's L2 term λ·x first. ``out`` must not
    alias ``grad`` or ``exp_avg``; m is not changed."""
    torch.lerp(exp_avg, _l2(grad, param, h), 1 - h.beta1, out=out)


def frozen_adam_step(param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor, h: Hyper) -> None:
    """1-bit Adam after the freeze, from the exchanged m: x ← x·(1 − γλ) (AdamW only), then
    x ← x − γ·m̂/s with s from the frozen v."""
    _decay(param, h)
    param.addcdiv_(exp_avg, denom, value=-h.lr / h.bias_correction1)


def sync_prepare(param: torch.Tensor, anchor: torch.Tensor, denom: torch.Tensor, decay_product: float,
                 out: torch.Tensor, preconditioned: bool = True) -> None:
    """SYNC steps 2–3: the window's update into ``out``, with the window's decay replayed on the anchor
    (``anchor`` itself is left as it is).

    ``preconditioned`` (hvd_zoadam's default): u = x_a − x, in parameter units. Otherwise the
    paper's u = (x_a − x)·s, in momentum units. The two carry the same information; they differ
    in where the 1-bit compression error lands (docs/algorithm.md §2, "Compression domain").
    """
    if decay_product != 1.0:   # anchor·Π(1 − γλ) − x without touching the anchor (sync_finish decays it)
        torch.mul(anchor, decay_product, out=out).sub_(param)
    else:
        torch.sub(anchor, param, out=out)
    if not preconditioned:
        out.mul_(denom)


def sync_finish(param: torch.Tensor, anchor: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor,
                w: torch.Tensor, lr_sum: float, h: Hyper, mask: torch.Tensor | None = None,
                preconditioned: bool = True) -> None:
    """SYNC steps 5–7: x ← x_a − w/s; m ← (1−β1^t)·w/Λ (so m̂ = w/Λ); x_a ← x.

    With ``preconditioned`` w is in parameter units: x ← x_a − w and m ← (1−β1^t)·w·s/Λ.
    With a ``mask``, w is zeroed where it is False first: sign compression cannot send an
    exact 0, so masked coordinates would otherwise move by ±scale/s at every sync.
    """
    reference.sync_rebuild(w, anchor, param, exp_avg, denom, h.bias_correction1 / lr_sum, 1.0, mask, preconditioned)
