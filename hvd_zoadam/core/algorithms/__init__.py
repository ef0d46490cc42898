"""Algorithms: a pure schedule plus step functions over flat bucket tensors.

An algorithm issues no collective. The engine (:mod:`hvd_zoadam.core.engine`) holds the
buckets and flat state, the protocol (:mod:`hvd_zoadam.comm.protocol`) exchanges them, and the
shell (:mod:`hvd_zoadam.shell.horovod`) drives one step as follows:

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
   rate into a freeze decided during training and returns T_f (None while undecided). ``ctx`` (:class:`StepContext`) carries the engine, the step number
   and ``ctx.exchange``, the 1-bit exchange of a list of buckets as a callable.

A new algorithm is a new module here with those methods; the engine does not change.
:mod:`.zeroone` is 0/1 Adam (Lu et al., arXiv 2202.06009).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepContext:
    """What a step function receives.

    engine: the :class:`~hvd_zoadam.core.engine.Engine`. step: t. counters: the shared counters
    dict (``step``, ``exp_avg_sq_steps``, ``freeze_lr``, and under ``var_freeze_step="auto"``
    ``var_freeze_step``, ``lr_rise_step``, ``last_lr``), identical on all ranks.
    exchanged: ``p.grad`` holds this step's exchange result (not the local gradient).
    exchange: ``exchange(buckets, fill, consume, consume_packed=None) -> bool``, the 1-bit
    exchange of :func:`hvd_zoadam.comm.protocol.exchange_buckets` (False: skipped on every rank).
    skipped: set by a step function whose own exchange was skipped on every rank (a
    non-finite input somewhere), so that the step counts as skipped.
    started_early: ``id()`` of the buckets whose exchange the backward hooks already started
    (a SYNC step's: its input was taken from a local update on copies of x and m).
    """

    engine: object
    step: int
    counters: dict
    exchanged: bool
    exchange: object
    skipped: bool = False
    started_early: frozenset = frozenset()
