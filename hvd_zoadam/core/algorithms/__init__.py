"""Algorithms: a pure schedule plus step functions over flat bucket tensors.

An algorithm issues no collective. The engine (:mod:`hvd_zoadam.core.engine`) holds the
buckets and flat state, the protocol (:mod:`hvd_zoadam.comm.protocol`) exchanges them, and the
shell's step driver (:mod:`hvd_zoadam.shell.driver`) runs one step as follows:

1. ``kind = algorithm.kind(step, lr, counters)``: pure (the counters are the same on every
   rank), so every rank (and a backward hook asking about a step that has not run yet)
   computes it alone.
2. ``algorithm.gradient_exchange(kind)`` says what ``synchronize()`` does with the gradients
   before the step: ``"average"`` (full precision, :class:`~hvd_zoadam.comm.protocol.Average`),
   ``"compressed"`` (the 1-bit exchange of :func:`~hvd_zoadam.comm.protocol.exchange_buckets`,
   with the algorithm's ``compressed_pre``, ``fill_compressed`` and ``consume_compressed``
   shaping its input and output), or None (the step exchanges what it needs itself).
3. ``algorithm.apply(ctx, kind, skip)`` runs the step on every bucket and returns the new
   ``exp_avg_sq_steps``; then ``algorithm.observe(counters, lr)`` takes the step's learning
   rate into a freeze decided during training and returns T_f (None while undecided). ``ctx``
   (:class:`StepContext`) carries the engine, the step number and ``ctx.exchange``, the 1-bit
   exchange of a list of buckets as a callable.

A new algorithm is a new module here whose class satisfies :class:`Algorithm` (and, where its
gradient exchange is ``"compressed"`` or its SYNC steps start from the backward hooks,
:class:`CompressedGradients` and :class:`EarlySync`); the engine does not change.
:mod:`.zeroone` is 0/1 Adam (Lu et al., arXiv 2202.06009), :mod:`.onebit` 1-bit Adam.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from hvd_zoadam.core.schedule import AutoFreeze, Schedule, StepKind

if TYPE_CHECKING:
    import torch

    from hvd_zoadam.core.engine import Bucket, Engine

# exchange(buckets, fill(bucket, buf), consume(bucket, w), consume_packed=None) -> False when skipped everywhere
Exchange = Callable[..., bool]


@dataclass
class StepContext:
    """What a step function receives.

    engine: the :class:`~hvd_zoadam.core.engine.Engine`. step: t. counters: the shared counters
    dict (``step``, ``exp_avg_sq_steps``, ``freeze_lr``, and under ``var_freeze_step="auto"``
    ``var_freeze_step``, ``lr_rise_step``, ``lr_fall_step``, ``last_lr``), identical on all ranks.
    exchanged: ``p.grad`` holds this step's exchange result (not the local gradient).
    exchange: ``exchange(buckets, fill, consume, consume_packed=None) -> bool``, the 1-bit
    exchange of :func:`hvd_zoadam.comm.protocol.exchange_buckets` (False: skipped on every rank).
    skipped: set by a step function whose own exchange was skipped on every rank (a
    non-finite input somewhere), so that the step counts as skipped.
    started_early: ``id()`` of the buckets whose exchange the backward hooks already started
    (a SYNC step's: its input was taken from a local update on copies of x and m).
    """

    engine: Engine
    step: int
    counters: dict
    exchanged: bool
    exchange: Exchange
    skipped: bool = False
    started_early: frozenset = frozenset()


@runtime_checkable
class Algorithm(Protocol):
    """What the shell's step driver calls on every algorithm (steps 1–3 above)."""

    name: str
    auto_freeze: AutoFreeze | None  # the freeze decided during training, or None

    def schedule(self, counters: dict) -> Schedule:
        """The schedule in force, with the T_f the counters hold."""

    def kind(self, step: int, lr: float, counters: dict) -> StepKind:
        """The kind of step ``step``, from the pure schedule."""

    def gradient_exchange(self, kind: StepKind) -> str | None:
        """``"average"``, ``"compressed"`` or None: what ``synchronize()`` does with the gradients."""

    def starts_early(self, step: int, kind: StepKind, counters: dict) -> bool:
        """Whether the backward hooks may start step ``step``'s exchange before ``step()``."""

    def observe(self, counters: dict, lr: float) -> int | None:
        """After a step: its learning rate into a freeze decided during training; T_f or None."""

    def settings(self) -> dict:
        """The settings every rank must share (the first step's check)."""

    def apply(self, ctx: StepContext, kind: StepKind, skip: bool) -> int:
        """Run step ``ctx.step`` on every bucket; returns the new ``exp_avg_sq_steps``."""


@runtime_checkable
class CompressedGradients(Protocol):
    """An algorithm whose ``gradient_exchange`` gives ``"compressed"``: it shapes the 1-bit
    exchange's input and output (the driver's ``_compress_grads`` and the hooks' early start)."""

    def compressed_pre(self, engine: Engine, b: Bucket, step: int, counters: dict) -> object:
        """What filling and consuming bucket ``b`` need (the preconditioning), computed once."""

    def fill_compressed(self, engine: Engine, b: Bucket, buf: torch.Tensor, pre: object) -> None:
        """Bucket ``b``'s exchange input into the padded float32 ``buf``."""

    def consume_compressed(self, engine: Engine, b: Bucket, w: torch.Tensor, pre: object) -> None:
        """The exchange's result ``w`` (float32[n]) of bucket ``b`` into ``p.grad``."""


@runtime_checkable
class EarlySync(Protocol):
    """An algorithm whose SYNC steps the backward hooks may start (:meth:`Algorithm.starts_early`)."""

    def sync_input(self, engine: Engine, b: Bucket, step: int, counters: dict, buf: torch.Tensor) -> bool:
        """A SYNC step's exchange input of bucket ``b`` into ``buf``; False when its window did not move."""
