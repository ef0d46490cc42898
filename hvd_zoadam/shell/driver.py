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

from hvd_zoadam import native
from collections import Counter

from hvd_zoadam.comm.protocol import (GRADS_CHANGED, NO_GRADIENT, Average, StepMismatchError, check_layout,
                                      exchange_buckets, step_flags)
from hvd_zoadam.core.algorithms import StepContext
from hvd_zoadam.core.schedule import StepKind
from hvd_zoadam.shell.options import ADOPT_KEY, STATE_KEY
from hvd_zoadam.shell.overlap import Overlap

_log = logging.getLogger("hvd_zoadam")


class StepDriver:
    """Drives one step (see the module docstring). Holds no state of its own beyond the
    attributes :class:`~hvd_zoadam.shell.optimizer.DistributedAdamOptimizer` sets up."""

    @property
    def _buckets(self) -> list:
        return self._engine.buckets

    @property
    def _counters(self) -> dict:
        return self.param_groups[0][STATE_KEY]

    def _new_average(self) -> Average:
        return Average(self.transport, self._collectives, gradient_predivide_factor=self.gradient_predivide_factor,
                       fp16_wire=self._fp16_wire(), sparse_grad=self._engine.sparse_grad)

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
        return (self.overlap and self.transport.supports_async and self.world_size > 1 and self._checked_layout
                and not self._amp_seen and not self._counters.get(ADOPT_KEY)
                and self._pending is None and getattr(self, "_ready", False))

    def _check_layout(self, no_gradient: bool = False) -> None:
        """algorithm.md §5: settings and parameter layout compared across ranks, and that every
        rank starts from the same parameters and ran backward() (raises on every rank; the next
        step checks again)."""
        items = self.algorithm.settings()
        items.update(bias_correction=self.bias_correction, bucket_cap_numel=self.bucket_cap_numel,
                     scale_block_numel=self.scale_block_numel, auto_exp_avg_mask=self.auto_exp_avg_mask,
                     overlap=self.overlap, backward_passes_per_step=self.backward_passes_per_step,
                     transport=self.transport.name,
                     compression=getattr(self.compression, "__name__", repr(self.compression)))
        items.update(self._engine.layout_items())
        if self.world_size > 1:
            items.update(parameters=self._engine.params_digest(), backward=not no_gradient)
        advice = {"backward": _no_backward_message("some rank"), "parameters": _PARAMETERS_DIFFER}
        try:
            check_layout(self.transport, items, advice=advice)
        except ValueError:
            self._reset_passes()  # raised on every rank, nothing exchanged: the step may be taken again
            raise
        self._checked_layout = True

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
        ``self._pending = (step, kind, skip)`` for :meth:`_apply_step`."""
        step, kind = self._next_kind()
        announced = self._announced(step)
        for b in self._buckets:
            b.exchange.step = announced  # announced in round 1: ranks at different steps fail fast
        how = self.algorithm.gradient_exchange(kind)
        armed = self.algorithm.starts_early(step, kind, self._counters) and self._can_overlap()  # same on every rank
        self._engine.check_params_unchanged()
        no_gradient = self._no_gradient_here()
        self._adopt_loaded_adam()
        if not self._checked_layout:
            self._check_layout(no_gradient)
        elif no_gradient and not armed:  # no flag to carry it this step: this rank raises alone
            self._reset_passes()
            raise RuntimeError("hvd_zoadam: " + _no_backward_message(f"rank {self.transport.rank}"))
        # the schedule moved under us (a load between backward and step)
        self._drain(self._overlap.stale(step, kind, len(self._buckets), self._launch))
        if armed:
            self.transport.counter.kind = kind.value
            self._overlap.complete(step, kind, len(self._buckets), self._launch)
            self._agree_on_step(step, no_gradient)
        window = self._overlap.take(step, kind)  # nothing more starts from the hooks this step
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
            skip = not native.all_finite_many(g.to_dense() if g.is_sparse else g
                                              for b in self._buckets for p in b.params
                                              for g in (p.grad,) if g is not None)
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

    def _grads_changed_here(self) -> bool:
        """Whether a gradient the hooks' exchange read was replaced or modified since (or, for a
        SYNC step, a learning rate or weight decay)."""
        window = self._overlap.window
        if window is not None and window.lrs is not None and window.lrs != self._lrs():
            return True
        for bi, seen in (window.seen if window is not None else {}).items():
            if any(p.grad is not grad or (grad is not None and grad._version != version)
                   for p, (grad, version) in zip(self._buckets[bi].params, seen)):
                return True
        return False

    def _no_gradient_here(self) -> bool:
        """Whether this rank reached the step with no gradient at all: every laid-out parameter
        that requires one has ``grad`` None (no ``backward()`` since the last ``zero_grad()``)."""
        trainable = [p for b in self._buckets for p in b.params if p.requires_grad]
        return bool(trainable) and all(p.grad is None for p in trainable)

    def _agree_on_step(self, step: int, no_gradient: bool) -> None:
        """The ranks' flags for a step where overlap is armed, in one allgather of 4 bytes a rank
        (:func:`~hvd_zoadam.comm.protocol.step_flags`), after every rank has started every
        bucket's early exchange (:meth:`.Overlap.complete`), so the collectives pair up.

        A rank without any gradient (:meth:`_no_gradient_here`): every rank raises RuntimeError
        naming it, after the early exchanges are completed. Some rank's gradients changed after
        the hooks started their exchange (e.g. clipped without synchronize()): the early
        exchanges are completed and their results dropped, and the step exchanges the
        gradients as they are now, like overlap=False (a COMPRESSED step's early worker side
        only staged its error: ``worker_error`` is untouched until round 2)."""
        mine = (GRADS_CHANGED if self._grads_changed_here() else 0) | (NO_GRADIENT if no_gradient else 0)
        flags = step_flags(self.transport, self._collectives, step, mine)
        if not any(flags):
            return
        self._drain(self._overlap.window)
        self._overlap.window = None
        missing = [rank for rank, flag in enumerate(flags) if flag & NO_GRADIENT]
        if missing:
            self._reset_passes()
            raise RuntimeError("hvd_zoadam: " + _no_backward_message(
                f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))}"))
        if not self._warned_changed:
            self._warned_changed = True
            warnings.warn("hvd_zoadam: gradients changed after backward() had already started their exchange "
                          "(overlap with the backward pass, as in hvd.DistributedOptimizer); the step exchanges "
                          "them again as they are now, which doubles its traffic. To modify gradients (e.g. clip "
                          "them) call opt.synchronize() first and then `with opt.skip_synchronize(): opt.step()`, "
                          "or build the optimizer with overlap=False.")

    def _compress_grads(self, step: int, window) -> bool:
        """C(g) of every bucket into p.grad, shaped by the algorithm (see ZeroOneAdam.compressed_pre),
        in launch order, as the hooks start them (MPI pairs collectives by their order).
        Returns False when the step is skipped on every rank."""
        cached = window.pre if window is not None else {}
        engine, algorithm = self._engine, self.algorithm
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
        counters = self._counters
        self.transport.counter.kind = kind.value
        ctx = StepContext(self._engine, step, counters, self._exchanged, self._exchange,
                          started_early=frozenset(self._sync_started))
        held = self._engine.hold_frozen(kind is StepKind.VARIANCE)
        k = self.algorithm.apply(ctx, kind, skip)
        if held:
            self._engine.restore_frozen(held)
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
        frozen (the freeze then waits: never worse than Adam's quality, more bytes)."""
        auto = self.algorithm.auto_freeze
        if auto is None or counters.get("var_freeze_step") is not None:
            return
        decided = self.algorithm.observe(counters, float(self.param_groups[0]["lr"]))
        if self.transport.rank != 0:
            return
        if decided is not None:
            _log.info("hvd_zoadam: v freezes after step %d (var_freeze_step='auto': the learning rate last rose at "
                      "step %d; at least %d steps)", decided, max(1, counters.get("lr_rise_step") or 0), auto.earliest())
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

    def _announced(self, step: int) -> int:
        """What the coming step's 1-bit exchanges announce in round 1 (int32): the iteration of
        :meth:`set_iteration` when the script gives one, else the optimizer step."""
        self._announcing = (step, self._iteration)
        return step if self._iteration is None else self._iteration

    def _naming_ranks(self, exchange, *args, **kwargs):
        """``exchange(*args, **kwargs)``; a :class:`StepMismatchError` is raised again naming
        the ranks that announced another value than most ranks. In the flat exchange every rank
        reads every server's round-2 flags, so every rank gets here together: one allgather of
        what each announced. In the two-level exchange a shard's check may reach one node only,
        so no collective runs there: the message gives this rank's own step and iteration."""
        try:
            return exchange(*args, **kwargs)
        except StepMismatchError as exc:
            if self._engine.topology() is not None:
                step, iteration = self._announcing
                raise StepMismatchError(f"{exc} (rank {self.transport.rank}: optimizer step {step}, iteration "
                                        f"{iteration})") from None
            seen = self.transport.allgather_object(self._announcing, f"zoadam.{self._collectives.prefix}.mismatch")
            raise StepMismatchError(_mismatch_message(str(exc), seen)) from None


_PARAMETERS_DIFFER = (
    "the ranks start from different parameters (a checksum of their bits differs). Make every rank's model the "
    "same before the first step: hvd.broadcast_parameters(model.state_dict(), root_rank=0) under Horovod, "
    "hvd_zoadam.distributed.broadcast_parameters(model.state_dict(), root_rank=0) under torchrun (what "
    "DistributedDataParallel did at construction), hvd_zoadam.mpi.broadcast_parameters under mpirun; or load "
    "the same checkpoint on every rank.")


def _no_backward_message(who: str) -> str:
    return (f"{who} called step() with no gradient at all (every parameter's grad is None: no backward() since "
            "the last zero_grad()). Every rank must run backward() before each step(), or the others would "
            "average its gradient as 0; to leave out a bad batch, multiply its loss by 0 on that rank.")


def _odd_ones(values: list) -> tuple:
    """``(the value most ranks hold, "rank r at V, ..." for the others)``; on a tie for the most
    common value, ``(None, every rank's value)``."""
    counts = Counter(values).most_common(2)
    usual = counts[0][0] if len(counts) == 1 or counts[0][1] > counts[1][1] else None
    return usual, ", ".join(f"rank {r} at {v}" for r, v in enumerate(values) if v != usual)


def _mismatch_message(base: str, seen: list) -> str:
    """The message of a step mismatch, from every rank's ``(optimizer step, iteration or None)``
    as its step began (``base``: the exchange's own message). Names the ranks that differ from
    most ranks (all of them on a tie): in the iteration when the steps agree (a rank skipped or
    repeated a whole iteration), else in the step."""
    steps = [t for t, _ in seen]
    iterations = [i for _, i in seen]
    restart = "; restart from the last checkpoint"
    if len(set(steps)) == 1 and len(set(iterations)) == 1:  # what was announced changed during the step
        return (f"{base} (every rank began optimizer step {steps[0]} at iteration {iterations[0]}: call "
                "set_iteration() before backward(), on every rank)")
    if len(set(steps)) == 1 and None in iterations:
        given = [r for r, i in enumerate(iterations) if i is not None]
        return (f"hvd_zoadam: set_iteration() was called on rank(s) {given} only, at optimizer step {steps[0]}: "
                "call it on every rank before each backward(), or on none")
    if len(set(steps)) == 1:
        usual, odd = _odd_ones(iterations)
        where = f", where the other ranks are at iteration {usual}" if usual is not None else ""
        return (f"hvd_zoadam: a rank skipped or repeated a whole iteration: {odd.replace(' at ', ' at iteration ')}"
                f"{where}, all at optimizer step {steps[0]}. Every rank must run backward() and step() at every "
                f"iteration (to leave out a bad batch, zero its loss on that rank){restart}")
    usual, odd = _odd_ones(steps)
    odd = odd.replace(" at ", " at step ")
    others = f", the other ranks at step {usual}" if usual is not None else ""
    if None in iterations:
        return f"{base} ({odd}{others})"
    return (f"hvd_zoadam: ranks are at different optimizer steps: {odd}{others}. Every rank must call step() "
            f"(or skip_synchronize()/synchronize() alike) at every iteration{restart}")
