"""The step driver: one optimizer step from the schedule's kind through the exchange to the
algorithm's step function (algorithm.md §2, §5). Every front end shares it.

:class:`StepDriver` is a mixin of :class:`~hvd_zoadam.shell.optimizer.DistributedAdamOptimizer`:
it reads the state the optimizer holds (``param_groups``, the engine, the algorithm, the
transport, the overlap window) and issues every collective through :mod:`hvd_zoadam.comm.protocol`.
What it does per step:

* :meth:`_prepare_step` (from ``synchronize()``): the settings and layout check of the first
  step, the coming step's kind, the gradient exchange that kind needs (a full-precision average,
  the 1-bit exchange of C(g), or nothing), completing what the backward hooks started early;
* :meth:`_apply_step` (from ``step()``): the algorithm's step function, which runs a SYNC
  step's exchange of the update through :meth:`_exchange`;
* :meth:`_launch` (from the backward hooks): start one bucket's exchange early.
"""
from __future__ import annotations

import logging
import warnings

from hvd_zoadam.comm.protocol import Average, CollectiveNames, exchange_buckets
from hvd_zoadam.comm.transport import Transport
from hvd_zoadam.core import bucket as flat_storage
from hvd_zoadam.core.algorithms import Algorithm, StepContext
from hvd_zoadam.core.engine import (
    Engine,
    check_params_unchanged,
    grads_finite,
    hold_frozen,
    refresh_masks,
    restore_frozen,
)
from hvd_zoadam.core.schedule import StepKind, constant_rate_freeze_risk, low_beta2_risk
from hvd_zoadam.shell.options import ADOPT_KEY, STATE_KEY
from hvd_zoadam.shell.overlap import Overlap
from hvd_zoadam.shell.stats import CommStats, StepLog

_log = logging.getLogger("hvd_zoadam")


class StepDriver:
    """Drives one step (see the module docstring). Holds no state of its own: it reads and
    updates the attributes below, which :class:`~hvd_zoadam.shell.optimizer.DistributedAdamOptimizer`
    sets up (``__init__`` and ``_init_step_state``)."""

    algorithm: Algorithm
    transport: Transport
    world_size: int
    overlap: bool
    compression: object
    gradient_predivide_factor: float
    sparse_as_dense: bool
    _engine: Engine
    _collectives: CollectiveNames
    _average: Average
    _overlap: Overlap
    _ready: bool                 # construction is complete
    _amp_seen: bool              # a torch.amp.GradScaler drove a step: nothing starts from the hooks
    _modified_after_backward: bool  # gradients changed after the hooks started: nothing starts from them
    _checked_layout: bool        # the first step's settings check passed
    _pending: tuple | None       # (step, kind, skip) prepared by synchronize()
    _synchronized: bool
    _should_synchronize: bool
    _exchanged: bool
    _warned_unsynchronized: bool
    _sync_started: dict
    _stats: CommStats
    _step_log: StepLog | None

    @property
    def _buckets(self) -> list:
        return self._engine.buckets

    @property
    def _counters(self) -> dict:
        return self.param_groups[0][STATE_KEY]

    def _new_average(self) -> Average:
        return Average(self.transport, self._collectives, gradient_predivide_factor=self.gradient_predivide_factor,
                       fp16_wire=self._fp16_wire(), sparse_grad=self._engine.sparse_grad,
                       grad_storage=flat_storage.grad_storage)

    def _fp16_wire(self) -> bool:
        return self.compression is not None and getattr(self.compression, "__name__", "") == "FP16Compressor"

    def _next_kind(self) -> tuple[int, StepKind]:
        c = self._counters
        step = c["step"] + 1
        return step, self.algorithm.kind(step, float(self.param_groups[0]["lr"]), c)

    def _next_early_kind(self) -> tuple:
        """(step, kind) of the coming step for the hooks; kind None when the algorithm's step
        exchanges what it needs itself (nothing to start early)."""
        step, kind = self._next_kind()
        return step, kind if self.algorithm.starts_early(step, kind, self._counters) else None

    def _can_overlap(self) -> bool:
        # Not before the first step's settings check (a mismatch must fail fast, not hang in a
        # collective), and not under a GradScaler (its scale is known only in step()).
        # Nor right after loading an Adam checkpoint: the anchor and error buffers are set in synchronize().
        # Nor once the script was seen modifying its gradients after backward() (e.g. clipping them).
        return (self.overlap and self.transport.supports_async and self.world_size > 1 and self._checked_layout
                and not self._amp_seen and not self._modified_after_backward and not self._counters.get(ADOPT_KEY)
                and self._pending is None and self._ready)

    def _launch(self, window, bi: int) -> None:
        """Start bucket ``bi``'s exchange for the coming step: from the hooks, or from ``synchronize()``
        for the buckets the hooks did not start (see :mod:`.overlap`)."""
        b = self._buckets[bi]
        self.transport.counter.kind = window.kind.value
        if self.sparse_as_dense:  # densified here, so that what the exchange reads is what p.grad holds
            for p in b.params:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
        if window.kind is StepKind.VARIANCE:
            window.averages[bi] = self._average.start(bi, b, self._engine.inv_grad_scale, copy=True)
        elif window.kind is StepKind.COMPRESSED:
            window.scales[bi] = self._start_compressed(bi, window.step, window.pre)
        else:
            if window.lrs is None:
                window.lrs = self._lrs()
            handle = self._start_sync(bi, window.step)
            if handle is not None:
                window.scales[bi] = handle
        # What the exchange read (after the start, which gives a missing gradient its zeros):
        # checked in synchronize(), so that a gradient changed after backward() (e.g. clipped
        # without synchronize()) is not silently left out.
        window.seen[bi] = [(p.grad, p.grad._version if p.grad is not None else None) for p in b.params]

    def _start_compressed(self, bi: int, step: int, pre: dict):
        """Fill bucket ``bi``'s exchange input for a COMPRESSED step (``pre`` caches the
        preconditioning by bucket index) and start round 1. Returns round 1's handle."""
        b = self._buckets[bi]
        if bi not in pre:
            pre[bi] = self.algorithm.compressed_pre(self._engine, b, step, self._counters)
        self.algorithm.fill_compressed(self._engine, b, b.exchange.input, pre[bi])
        b.exchange.step = self._announced(step)
        return b.exchange.start(b.exchange.input)

    def _start_sync(self, bi: int, step: int):
        """Fill bucket ``bi``'s exchange input for a SYNC step (the window's update after this
        step's local update, taken on copies) and start round 1. Returns round 1's
        handle, or None for a bucket whose window did not move (it sends nothing)."""
        b = self._buckets[bi]
        if not self.algorithm.sync_input(self._engine, b, step, self._counters, b.exchange.input):
            return None
        b.exchange.step = self._announced(step)
        return b.exchange.start(b.exchange.input)

    def _lrs(self) -> list:
        """What a SYNC step's early input read besides the gradients: each group's lr and weight decay."""
        return [(float(g["lr"]), g["weight_decay"]) for g in self.param_groups]

    def _drain(self, window) -> None:
        for handle in (window.handles() if window is not None and window.kind is not None else ()):
            self.transport.wait(handle)

    def _prepare_step(self) -> None:
        """Everything ``synchronize()`` does once the world is current: the settings check of
        the first step, the exchange of the coming step's gradients (or its agreed skip), and
        ``self._pending = (step, kind, skip)`` for :meth:`_apply_step`: kind None where no rank
        has a gradient (:meth:`_no_gradient_anywhere`), a step that changes nothing."""
        step, kind = self._next_kind()
        announced = self._announced(step)
        for b in self._buckets:
            b.exchange.step = announced  # announced in round 1: ranks at different steps fail fast
        how = self.algorithm.gradient_exchange(kind)
        armed = self.algorithm.starts_early(step, kind, self._counters) and self._can_overlap()  # same on every rank
        check_params_unchanged(self._engine)
        no_gradient = self._no_gradient_here()
        self._adopt_loaded_adam()
        # the schedule moved under us (a load between backward and step)
        self._drain(self._overlap.stale(step, kind, len(self._buckets), self._launch))
        self.transport.counter.kind = kind.value  # the step's flag counts with its kind
        nothing_to_step = self._no_gradient_anywhere(step, no_gradient, armed, kind is not StepKind.LOCAL)
        if armed:
            self._overlap.complete(step, kind, len(self._buckets), self._launch)
            nothing_to_step = self._agree_on_step(step, no_gradient)
        window = self._overlap.take(step, kind)  # nothing more starts from the hooks this step
        if nothing_to_step:  # no rank has a gradient: step() changes nothing (kind None)
            self._pending, self._synchronized, self._exchanged = (step, None, False), True, False
            return
        if kind is StepKind.SYNC and window is not None:  # completed by the step function's exchange
            self._sync_started = {id(self._buckets[bi]): handle for bi, handle in window.scales.items()}
        skip = False
        self._exchanged = how is not None and self.world_size > 1
        if self._exchanged:
            self.transport.counter.kind = kind.value
            if how == "average":
                skip = not self._average.all(self._buckets, Overlap.launch_order(len(self._buckets)),
                                             window.averages if window else {}, self._engine.inv_grad_scale)
            else:
                skip = not self._compress_grads(step, window)
        elif how is not None:  # P = 1: nothing to exchange, but a NaN/Inf skips the step as at P > 1
            if how == "compressed":
                refresh_masks(self._engine)  # the masks' one host read, as at P > 1
            skip = not grads_finite(self._engine)
        self._pending = (step, kind, skip)
        self._synchronized = True

    def _adopt_loaded_adam(self) -> None:
        """The first step after loading an Adam checkpoint (see :meth:`load_state_dict`), on every
        rank alike (the mark travels in the counters): anchor <- the parameters as they are now
        (loaded or broadcast after the optimizer, in any order), error buffers and window zeroed."""
        if not self._counters.pop(ADOPT_KEY, False):
            return
        for b in self._buckets:
            b.anchor.copy_(self._engine.load_x(b))
            b.exchange.zero_errors()
        for group in self.param_groups:
            group["lr_sum"], group["decay_product"] = 0.0, 1.0

    def _compress_grads(self, step: int, window) -> bool:
        """C(g) of every bucket into p.grad, shaped by the algorithm (see ZeroOneAdam.compressed_pre),
        in launch order, as the hooks start them (MPI pairs collectives by their order).
        Returns False when the step is skipped on every rank."""
        cached = window.pre if window is not None else {}
        engine, algorithm = self._engine, self.algorithm
        refresh_masks(engine)   # the masks' one host read, before any bucket's result is consumed
        pre = {id(b): cached[bi] if bi in cached else algorithm.compressed_pre(engine, b, step, self._counters)
               for bi, b in enumerate(self._buckets)}
        started = {id(self._buckets[bi]): h for bi, h in window.scales.items()} if window is not None else {}
        if window is not None:
            window.scales = {}
        return self._naming_ranks(exchange_buckets,
                                  [self._buckets[bi] for bi in Overlap.launch_order(len(self._buckets))],
                                  engine.scratch["g"], engine.scratch["w"],
                                  lambda b, buf: algorithm.fill_compressed(engine, b, buf, pre[id(b)]),
                                  lambda b, w: algorithm.consume_compressed(engine, b, w, pre[id(b)]),
                                  started=started)

    def _apply_step(self, loss):
        """The step that ``step()`` runs: ``synchronize()`` unless inside ``skip_synchronize()``,
        then the algorithm's step function of the pending kind, the counts and the per-step log."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        if self._pending is None:  # inside skip_synchronize() without a prior synchronize()
            if not self._warned_unsynchronized:
                self._warned_unsynchronized = True
                warnings.warn("hvd_zoadam: optimizer.step() inside skip_synchronize() without a prior "
                              "optimizer.synchronize(): hvd_zoadam runs synchronize() now, since 0/1 Adam cannot take "
                              "a step without its exchange (the ranks would drift apart). To clip gradients, call "
                              "opt.synchronize() first, then `with opt.skip_synchronize(): opt.step()`.")
            self.synchronize()
        step, kind, skip = self._pending
        self._pending = None
        self._synchronized = False
        if kind is None:  # no rank has a gradient: as torch.optim.Adam's step() without one, nothing moves
            self._mark_wrapped_stepped()
            self._reset_passes()
            return loss
        counters = self._counters
        self.transport.counter.kind = kind.value
        ctx = StepContext(self._engine, step, counters, self._exchanged, self._exchange,
                          started_early=frozenset(self._sync_started))
        held = hold_frozen(self._buckets, kind is StepKind.VARIANCE)
        k = self.algorithm.apply(ctx, kind, skip)
        if held:
            restore_frozen(held)
        skip = skip or ctx.skipped
        self._stats.record(kind, skip, self.transport.counter, self.world_size, sum(b.numel for b in self._buckets))
        counters.update(step=step, exp_avg_sq_steps=k)
        self._observe_freeze(counters)
        self._mark_wrapped_stepped()
        if self._step_log:
            self._step_log.write(step, kind, skip, float(self.param_groups[0]["lr"]), self.comm_stats(), loss)
        self._reset_passes()
        return loss

    def _observe_freeze(self, counters: dict) -> None:
        """The step's learning rate into a freeze decided during training
        (``var_freeze_step="auto"``, :class:`~hvd_zoadam.core.schedule.AutoFreeze`); rank 0 logs the
        decision once, and once a warning when the rate still rises long after v could have
        frozen (the freeze then waits: never worse than Adam's quality, more bytes), once, at twice
        the freeze, :func:`~hvd_zoadam.core.schedule.constant_rate_freeze_risk`'s, and once, after
        the first step, :func:`~hvd_zoadam.core.schedule.low_beta2_risk`'s."""
        auto = self.algorithm.auto_freeze
        if auto is None:
            return
        risk = low_beta2_risk(auto) if counters["step"] == 1 and self.transport.rank == 0 else None
        if risk:
            _log.warning("hvd_zoadam: %s", risk)
        if counters.get("var_freeze_step") is not None:
            if self.transport.rank == 0 and counters["step"] == 2 * counters["var_freeze_step"]:
                risk = constant_rate_freeze_risk(auto, counters["step"], counters["var_freeze_step"],
                                                 float(self.param_groups[0]["lr"]), counters.get("freeze_lr"))
                if risk:
                    _log.warning("hvd_zoadam: %s", risk)
            return
        decided = self.algorithm.observe(counters, float(self.param_groups[0]["lr"]))
        if self.transport.rank != 0:
            return
        if decided is not None:
            _log.info("hvd_zoadam: v freezes after step %d (var_freeze_step='auto': twice the warm-up, the learning "
                      "rate's last rise at step %d, and at least %d steps, or %d while the rate has not fallen)",
                      decided, counters.get("lr_rise_step") or 0, auto.earliest(), 2 * auto.earliest())
        elif counters["step"] == 4 * auto.earliest():
            _log.warning("hvd_zoadam: var_freeze_step='auto' has not frozen v by step %d: the learning rate is still "
                         "rising (last at step %d). v freezes at twice the warm-up once the rate has stopped rising "
                         "for as long as it rose; until then the steps exchange 1-bit gradients and full-precision "
                         "averages (Adam's quality, more bytes). Set var_freeze_step to choose the step yourself.",
                         counters["step"], counters.get("lr_rise_step") or 0)

    def _exchange(self, buckets, fill, consume, consume_packed=None) -> bool:
        """The 1-bit exchange of ``buckets`` for a step function (see :func:`.protocol.exchange_buckets`),
        in launch order, completing the rounds 1 the hooks started (a SYNC step's)."""
        index = {id(b): i for i, b in enumerate(self._buckets)}
        buckets = sorted(buckets, key=lambda b: -index[id(b)])  # Overlap.launch_order
        started, self._sync_started = self._sync_started, {}
        return self._naming_ranks(exchange_buckets, buckets, self._engine.scratch["g"], self._engine.scratch["w"],
                                  fill, consume, consume_packed, started=started)

    def _drain_sync_started(self) -> None:
        """Wait for the rounds 1 of a SYNC step that will not run (a load or a reset before step())."""
        started, self._sync_started = self._sync_started, {}
        for handle in started.values():
            self.transport.wait(handle)
