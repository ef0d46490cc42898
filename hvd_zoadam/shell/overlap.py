"""Overlap with the backward pass: the exchange the gradient hooks start before ``step()``.

One object per optimizer, in one of three explicit phases:

* ``IDLE``: nothing started for the coming step. The first bucket whose gradients are all
  ready opens a :class:`Window` for the coming step (its number and kind, from the pure
  schedule, so every rank agrees without talking).
* ``OPEN``: buckets start as they become ready, in launch order (last bucket first,
  because backward produces the last layers' gradients first; the same order on every
  rank, as MPI requires). A VARIANCE step starts its allreduces; a COMPRESSED step its
  worker side and round 1; a SYNC step its local update (on copies), the window's update
  and round 1. LOCAL steps start nothing (their window is empty).
* ``CLOSED``: ``synchronize()`` has taken the window; nothing more starts until the step
  ends (:meth:`Overlap.reset`).

The object issues no collective itself: it calls the ``launch(window, index)`` function it
is given, and hands started handles back to whoever drains them.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from hvd_zoadam.core.schedule import StepKind


class Phase(enum.Enum):
    IDLE = "idle"
    OPEN = "open"
    CLOSED = "closed"


@dataclass
class Window:
    """What the hooks started for one coming step.

    ``averages``: bucket index -> a started allreduce (VARIANCE); ``scales``: bucket index ->
    round 1 handle (COMPRESSED, SYNC); ``pre``: bucket index -> the preconditioning the worker side
    used; ``seen``: bucket index -> [(p.grad, its version)] the exchange read, to detect a
    gradient changed afterwards."""

    step: int
    kind: StepKind | None  # None: the coming step starts nothing early
    averages: dict = field(default_factory=dict)
    scales: dict = field(default_factory=dict)
    pre: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)
    lrs: list | None = None  # SYNC: each group's (lr, weight decay) the early inputs used

    def handles(self) -> list:
        """Every started handle (to wait for when the window is dropped)."""
        out = [handle for handle, _, _ in self.averages.values()]
        return out + list(self.scales.values())


EARLY_KINDS = (StepKind.VARIANCE, StepKind.COMPRESSED, StepKind.SYNC)


class Overlap:
    """The overlap state machine of one optimizer (see the module docstring).

    Args:
        nbuckets: the number of buckets.
    """

    def __init__(self, nbuckets: int):
        self.phase = Phase.IDLE
        self.window: Window | None = None
        self.ready = [0] * nbuckets   # per bucket: how many of its params have all their backward passes
        self.position = 0             # how far along launch_order the launches are

    @staticmethod
    def launch_order(nbuckets: int) -> list:
        """Buckets in the order their exchanges start: last bucket first."""
        return list(range(nbuckets - 1, -1, -1))

    def param_ready(self, index: int, bucket_sizes: list, next_step: Callable[[], tuple[int, StepKind]],
                    launch: Callable[[Window, int], None]) -> None:
        """A param of bucket ``index`` got its last backward pass; launch what is ready.

        ``bucket_sizes``: params per bucket. ``next_step()`` -> (step, kind) of the coming step.
        ``launch(window, index)`` starts bucket ``index``'s exchange and records it in the window.
        """
        self.ready[index] += 1
        if self.phase is Phase.CLOSED:
            return
        if self.phase is Phase.IDLE:
            step, kind = next_step()
            self.window = Window(step, kind if kind in EARLY_KINDS else None)
            self.phase = Phase.OPEN
        if self.window.kind is None:
            return
        self._launch_in_order(len(bucket_sizes), launch, lambda bi: self.ready[bi] >= bucket_sizes[bi])

    def complete(self, step: int, kind: StepKind, nbuckets: int, launch: Callable[[Window, int], None]) -> None:
        """Launch, in launch order, every bucket the hooks have not launched for the coming
        step (``step``, ``kind``), through ``launch(window, index)``; ``synchronize()`` calls it
        before the "gradients changed?" flag. A parameter with no gradient on this rank (or no
        hook at all) leaves its bucket and every later one unlaunched here while other ranks
        launched them: afterwards every rank has started this optimizer's collectives in the
        same order, as transports that match collectives by their order (MPI, torch.distributed)
        need. (Several optimizers on one such transport share its order: one whose hooks stop
        early on one rank can still meet another optimizer's exchange there.) Nothing in the
        CLOSED phase: the window was taken, so nothing started since."""
        if self.phase is Phase.CLOSED:
            return
        if self.window is None or self.window.step != step or self.window.kind is not kind:
            self.window, self.position = Window(step, kind), 0  # :meth:`stale` drained any other
        self.phase = Phase.OPEN
        self._launch_in_order(nbuckets, launch)

    def _launch_in_order(self, nbuckets: int, launch, ready=lambda bi: True) -> None:
        """Launch the window's buckets from :attr:`position` on, in launch order, up to the
        first that is not ``ready``."""
        order = self.launch_order(nbuckets)
        while self.position < len(order) and ready(order[self.position]):
            launch(self.window, order[self.position])
            self.position += 1

    def take(self, step: int, kind: StepKind) -> Window | None:
        """Close: hand over the window that matches the coming step (``synchronize()``), or
        None. A window for another step or kind (the schedule moved, e.g. a load between
        backward and step) is returned by :meth:`stale` first; call that before."""
        window, self.window = self.window, None
        self.phase = Phase.CLOSED
        if window is None or window.kind is not kind or window.step != step:
            return None
        return window

    def stale(self, step: int, kind: StepKind, nbuckets: int,
              launch: Callable[[Window, int], None]) -> Window | None:
        """The open window if it was started for another step or kind (the schedule moved, e.g.
        a load between backward and step), to be drained, else None. Its buckets the hooks did
        not launch are launched first, as :meth:`complete` does, so that every rank drains the
        same collectives."""
        w = self.window
        if w is not None and (w.step != step or w.kind not in (kind, None)):
            self._launch_in_order(nbuckets, launch)
            self.window, self.position = None, 0
            return w
        return None

    def reset(self, nbuckets: int) -> Window | None:
        """The step is over (or zero_grad/load dropped it): back to IDLE. Returns the window
        still open, whose started handles the caller must wait for, or None."""
        window, self.window = self.window, None
        self.phase = Phase.IDLE
        self.ready = [0] * nbuckets
        self.position = 0
        return window if window is not None and window.kind is not None else None
