"""Horovod's contract, as ``hvd.DistributedOptimizer`` defines it: backward hooks that count
``backward_passes_per_step`` and start the exchange early, ``synchronize()`` and
``skip_synchronize()`` (the clipping pattern), ``zero_grad()``'s refusals between
``backward()`` and ``step()``, ``step()`` under ``torch.amp.GradScaler``, and the elastic
reset (``hvd.elastic``), with Horovod's error texts.

:class:`HorovodContract` is a mixin of :class:`~hvd_zoadam.shell.optimizer.DistributedAdamOptimizer`;
the step itself is :class:`~hvd_zoadam.shell.driver.StepDriver`'s.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch

from hvd_zoadam.comm.protocol import CollectiveNames, pool_error_feedback
from hvd_zoadam.shell.overlap import Overlap


class HorovodContract:
    """Horovod's optimizer contract (see the module docstring)."""

    def _make_hook(self, p):
        """The post-accumulate-grad hook of ``p``. It holds the optimizer weakly, so that a model
        does not keep a dropped optimizer alive (its parameters may then get a new one)."""
        owner = weakref.ref(self)

        def hook(param: torch.Tensor):
            opt = owner()
            if opt is not None and not opt._no_sync_depth:
                opt._grad_ready(param)
        return hook

    def _grad_ready(self, p) -> None:
        """A backward pass accumulated ``p``'s gradient: count it, start what is ready (overlap),
        and let the rounds 1 already in flight move their data (:meth:`Transport.progress`)."""
        if self._passes[p] >= self.backward_passes_per_step:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally. (hvd_zoadam: parameter "
                f"{self._names.get(p)!r} of the optimizer {self._collectives.prefix}; when several optimizers "
                "share a model, call step() on each one whose parameters got gradients. For a number of passes "
                "that varies, run all but the last backward() inside `with opt.no_sync():`, as with DDP.)")
        self._passes[p] += 1
        bucket_of = self._engine.bucket_of
        if self._passes[p] == self.backward_passes_per_step and p in bucket_of and self._can_overlap():
            self._overlap.param_ready(bucket_of[p], [len(b.params) for b in self._buckets],
                                      self._next_early_kind, self._launch)
        window = self._overlap.window
        # The rounds in flight only: progressing a VARIANCE step's averages here too (measured with
        # hvd_zoadam.mpi at 100 Mbit/s) made the step slower, its flag queued behind their bytes.
        for handle in window.scales.values() if window is not None else ():
            self.transport.progress(handle)

    def _reset_passes(self) -> None:
        """Forget this step's backward passes; drain an exchange the hooks started (it was started
        on every rank, so it is completed and its result dropped)."""
        for p in self._passes:
            self._passes[p] = 0
        self._drain(self._overlap.reset(len(self._buckets)))

    def synchronize(self) -> None:
        """Run the gradient exchange of the coming step (see the class docstring). Idempotent per step."""
        if self._pending is not None:
            return
        if self.transport.refresh():
            # An elastic reset that sync() did not see: re-lay out here. Under TorchState it was
            # a removal of hosts only (Horovod skips sync() then): every rank of the new world
            # is a survivor and gets here, so the error feedback is pooled. Without TorchState a
            # new rank would not get here: nothing collective, error feedback at zero.
            passes = dict(self._passes)
            self.on_reset()
            if getattr(self, "_elastic_state_handler", False):
                self.pool_errors_after_reset()
            self._passes.update(passes)
        self._prepare_step()

    @contextlib.contextmanager
    def no_sync(self):
        """Context in which backward passes only accumulate into ``p.grad``, as in
        ``DistributedDataParallel.no_sync()``: they are not counted toward
        ``backward_passes_per_step`` and start no exchange. The passes after the context count
        as usual, so DDP's accumulation loop works unchanged with the optimizer in the model's
        place, whatever the number of passes per step (it may differ from step to step and
        from rank to rank)::

            for i, batch in enumerate(loader):
                if (i + 1) % accumulate:
                    with opt.no_sync():
                        loss_fn(model, batch).backward()
                else:
                    loss_fn(model, batch).backward()
                    opt.step()
                    opt.zero_grad()

        ``step()`` inside the context still exchanges (every rank must call it alike).
        """
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Context in which ``step()`` does not call ``synchronize()`` (Horovod's clipping pattern)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; also resets the backward-pass count of ``backward_passes_per_step``.

        With more than one rank, as ``hvd.DistributedOptimizer``, it raises ``AssertionError``
        between ``backward()`` and ``step()``: when backward passes were counted since the last
        step (the hooks may have started the step's exchange on every rank) or when an
        exchange started by the hooks is in flight. It also raises between ``synchronize()``
        and ``step()``, where Horovod allows it: the step's exchange has run on every rank and
        a 1-bit exchange cannot be taken back. With one rank it never raises (nothing is
        exchanged), as with Horovod.
        """
        if self.world_size > 1:
            window = self._overlap.window
            if self._pending is not None:
                raise AssertionError(
                    "optimizer.zero_grad() was called after optimizer.synchronize() but before optimizer.step(). "
                    "hvd_zoadam has already exchanged this step's gradients on every rank (a 1-bit exchange "
                    "cannot be taken back); call optimizer.step() first.")
            if any(self._passes.values()) or (window is not None and window.handles()):
                raise AssertionError(
                    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                    "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        self._reset_passes()
        super().zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's: from now on ``passes`` backward passes are accumulated per ``step()``; the
        passes counted so far are forgotten (an exchange the hooks already started is kept).
        Every rank must set the same value (the first step's settings check compares it)."""
        if isinstance(passes, bool) or not isinstance(passes, int):
            raise TypeError(f"backward_passes_per_step must be an int, got {passes!r}")
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        for p in self._passes:
            self._passes[p] = 0

    # torch.amp.GradScaler calls step() on every rank, with grad_scale and found_inf set, instead of
    # deciding per rank whether to call it: every rank stays in lockstep, and a NaN/Inf on one rank
    # skips a communicating step on all ranks together (algorithm.md §5).
    _step_supports_amp_scaling = True

    # torch.compiler.disable: under torch.compile (of opt.step, or of a training step that calls
    # it) the step runs as written, a graph break: its collectives and numba kernels cannot be
    # traced, and Dynamo failed inside them instead of breaking the graph.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor | float] | None = None):
        """One 0/1 Adam step of the kind the schedule gives (algorithm.md §2). Returns the closure's loss.
        Under ``torch.compile`` it runs uncompiled (a graph break), as the rest of the model's code compiles.

        Under ``torch.amp.GradScaler`` (``scaler.step(optimizer)``) the gradients are unscaled
        before any exchange, so the error buffers stay in unscaled units whatever the scale does.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self, "found_inf", None) is not None:  # set by torch.amp.GradScaler.step(), even after unscale_()
            self._amp_seen = True  # from now on nothing starts from the hooks: the grads may be rescaled
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step()
        if grad_scale is not None:
            if self._pending is not None:
                raise RuntimeError(
                    "with torch.amp.GradScaler, let scaler.step(optimizer) run hvd_zoadam's exchange: do not "
                    "call optimizer.synchronize() before it (the gradients would be exchanged at the loss "
                    "scale). To clip, call scaler.unscale_(optimizer) and clip the local gradients instead.")
            self._engine.inv_grad_scale = 1.0 / float(grad_scale)
            self._amp_seen = True
        try:
            return self._apply_step(loss)
        finally:
            self._engine.inv_grad_scale = None

    def on_reset(self) -> None:
        """Re-lay out this rank's world-size-dependent state for the current Horovod world.

        For ``hvd.elastic.run``: after a reset (``hvd.shutdown(); hvd.init()``) the world size
        and this process's rank may differ. Every bucket gets a new exchange plan and new,
        zeroed ``worker_error`` float32[padded_numel(n, P)] and ``server_error``
        float32[padded_numel(n, P) // P]; m, v, the anchor, the window and the schedule
        counters are untouched (``state.sync()`` broadcasts them from rank 0 right after). The
        old world's error buffers are kept until :meth:`pool_errors_after_reset` (which
        ``hvd.elastic.TorchState`` calls next) carries what they owe over. The settings and
        layout check of the first step runs again, on every rank. A half-done step (counted
        backward passes, a prepared exchange) is dropped.

        ``hvd.elastic.TorchState`` calls this from its ``sync()`` on every rank (hvd_zoadam
        registers a state handler for its optimizer); :meth:`step` also calls it when it
        finds the world size or rank changed: after a removal of hosts, for which Horovod
        skips ``sync()``, followed by :meth:`pool_errors_after_reset` under ``TorchState``;
        without ``TorchState`` error feedback restarts at zero.
        Collectives: none.
        """
        before = (self.world_size, self.transport.rank, [b.exchange for b in self._buckets])
        self.transport.refresh()
        self._before_reset = before if self._counters["step"] > 0 else None  # a joined rank owes nothing
        self.world_size = self.transport.world_size
        self._collectives.prefix = CollectiveNames.for_layout(self._layout_description(), self.world_size).prefix
        self._engine.relayout()
        self._average = self._new_average()
        self._checked_layout = False
        self._pending = None
        self._synchronized = False
        self._exchanged = False
        self._overlap = Overlap(len(self._buckets))  # handles of the old world: dropped, not waited for
        self._sync_started = {}
        self._reset_passes()

    def pool_errors_after_reset(self) -> int:
        """Carry the error feedback of the ranks that were in the old world over to the new one
        (algorithm.md §6), after :meth:`on_reset`. **Collective** over the new world: every rank
        calls it (``hvd.elastic.TorchState``'s ``sync()`` does).

        Every new rank's ``worker_error`` becomes the mean of the surviving ranks' worker
        errors, and the new server chunks are cut from the surviving ranks' server chunks in
        the bucket's global layout. What a rank that left owed is lost: its worker error,
        and its server chunk (those elements restart at zero). Returns the number of
        surviving ranks (0: nothing carried over, the buffers stay zero).
        """
        before, self._before_reset = getattr(self, "_before_reset", None), None
        survivors = sum(self.transport.allgather_object(before is not None, f"{self._collectives.pool(0)}.count"))
        if survivors == 0:
            return 0
        for index, b in enumerate(self._buckets):
            ex = b.exchange
            worker = torch.zeros(ex.padded_numel, device=ex.worker_error.device)
            server = torch.zeros_like(worker)
            if before is not None:
                old_p, old_rank, exchanges = before
                old = exchanges[index]
                worker[:ex.numel] = old.worker_error[:ex.numel]
                lo = old_rank * old.chunk_numel
                hi = min(ex.numel, lo + old.chunk_numel)
                if hi > lo:
                    server[lo:hi] = old.server_error[:hi - lo]
            worker, server = pool_error_feedback(worker, server, survivors, self.transport,
                                                 self._collectives.pool(index))
            ex.set_errors(worker, server)
        return survivors
