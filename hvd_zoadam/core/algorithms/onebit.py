"""1-bit Adam (Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, arXiv 2102.02888, ICML 2021)
as step functions over each bucket's flat float32 tensors (docs/algorithm.md §9).

Two kinds of step, by the step number t alone:

* t <= ``freeze_step`` (the warm-up): VARIANCE, full-precision Adam on the average of the
  gradients (0/1 Adam's VARIANCE step, :func:`.zeroone.variance_step`);
* t > ``freeze_step``: COMPRESSED, v frozen; every rank forms its local momentum
  m_r = β1·m + (1 − β1)·g_r, the 1-bit exchange (algorithm.md §3, with error feedback) makes
  m = C(m_1..m_P), bitwise alike on every rank, and x ← x − γ·m̂/s with the frozen s.
  Both error buffers are zeroed when the compression starts (the paper's Algorithm 1).

No collectives here: the step calls ``ctx.exchange``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hvd_zoadam.core import step_math
from hvd_zoadam.core.algorithms import StepContext
from hvd_zoadam.core.algorithms.zeroone import variance_step
from hvd_zoadam.core.schedule import Schedule, StepKind

if TYPE_CHECKING:
    import torch

    from hvd_zoadam.core.engine import Bucket


class OnebitAdam:
    """1-bit Adam's schedule and step functions.

    Args:
        schedule: a :class:`~hvd_zoadam.core.schedule.Schedule` whose ``var_freeze_step`` is
            ``freeze_step``, the last warm-up step (full-precision Adam); compression starts at
            ``freeze_step + 1``. The paper advises 15–25 % of training.
    """

    name = "onebit"
    auto_freeze = None  # freeze_step is always given
    GRADIENT_EXCHANGE = {StepKind.VARIANCE: "average", StepKind.COMPRESSED: None}

    def __init__(self, schedule: Schedule):
        self.base_schedule = schedule
        self.freeze_step = schedule.var_freeze_step

    def schedule(self, counters: dict) -> Schedule:
        """The schedule: ``freeze_step`` is always given, never decided during training."""
        return self.base_schedule

    def kind(self, step: int, lr: float, counters: dict) -> StepKind:
        return StepKind.VARIANCE if step <= self.freeze_step else StepKind.COMPRESSED

    def gradient_exchange(self, kind: StepKind):
        return self.GRADIENT_EXCHANGE[kind]

    def observe(self, counters: dict, lr: float) -> int:
        """T_f: ``freeze_step``, always decided."""
        return self.freeze_step

    def starts_early(self, step: int, kind: StepKind, counters: dict) -> bool:
        """Whether the backward hooks may start step ``step``'s exchange: the gradient average
        of the warm-up only (the momentum exchange runs in ``step()``)."""
        return self.gradient_exchange(kind) is not None

    def settings(self) -> dict:
        """The settings every rank must share (for the layout check)."""
        return {"algorithm": self.name, "freeze_step": self.freeze_step}

    def apply(self, ctx: StepContext, kind: StepKind, skip: bool) -> int:
        """Run step ``ctx.step`` of ``kind`` on every bucket (nothing when ``skip``). Returns
        the new ``exp_avg_sq_steps`` k."""
        if kind is StepKind.COMPRESSED and ctx.step == self.freeze_step + 1:
            ctx.counters["freeze_lr"] = float(ctx.engine.param_groups[0]["lr"])
            for b in ctx.engine.buckets:
                b.exchange.zero_errors()
        k = ctx.counters["exp_avg_sq_steps"] + (1 if kind is StepKind.VARIANCE and not skip else 0)
        if not skip:
            if kind is StepKind.VARIANCE:
                variance_step(ctx, k)
            else:
                _MomentumStep(ctx, k).run()
        return k


class _MomentumStep:
    """One compressed step: fill each bucket's exchange input with its local momentum, exchange
    all buckets (skipped on every rank together when some rank's input is not finite: m and x
    stay), then m ← the result and the Adam step with the frozen v."""

    def __init__(self, ctx: StepContext, k: int):
        self.ctx, self.k, self.engine = ctx, k, ctx.engine

    def run(self) -> None:
        self.ctx.skipped = not self.ctx.exchange(self.engine.buckets, self.fill, self.consume)

    def fill(self, b: Bucket, buf: torch.Tensor) -> None:
        """buf <- m_r = β1·m + (1 − β1)·g_r (with Adam's L2 term in g_r), zero padding."""
        engine = self.engine
        h = engine.hyper(b, self.ctx.step, self.k)
        g = engine.scratch_d(b.numel)
        engine.grads_into(b, g)
        buf[b.numel:].zero_()
        step_math.local_momentum(engine.load_x(b), g, b.exp_avg, h, out=buf[:b.numel])

    def consume(self, b: Bucket, w: torch.Tensor) -> None:
        """m <- w (masked), then x <- x − γ·m̂/s with the frozen v (and AdamW's decay)."""
        engine = self.engine
        h = engine.hyper(b, self.ctx.step, self.k)
        mask = engine.mask_of(b)
        b.exp_avg.copy_(w)
        if mask is not None:
            b.exp_avg.mul_(mask)
            b.exchange.mask_errors(mask)
        x = engine.load_x(b)
        step_math.frozen_adam_step(x, b.exp_avg, engine.denom(b, h), h)
        engine.store_x(b, x)

