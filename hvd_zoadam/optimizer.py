"""The Horovod shell: ``hvd_zoadam.DistributedOptimizer`` and the optimizer it returns.

:class:`ZeroOneAdamOptimizer` is the ``torch.optim.Optimizer`` a user holds: Horovod's
contract (``synchronize``, ``skip_synchronize``, ``step``, ``zero_grad``, backward hooks,
``backward_passes_per_step``), torch's (``param_groups``, ``state_dict``), checkpoints and
reports. It holds state and drives a step; it does no math and names no collective:

* :mod:`.engine`: the buckets and flat state;
* :mod:`.algorithms.zeroone`: 0/1 Adam's schedule and step functions;
* :mod:`.protocol`: every exchange and collective name; :mod:`.transport`: the collectives;
* :mod:`.overlap`: what the backward hooks start early.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

from . import native
from .algorithms import StepContext
from .algorithms.onebit import OnebitAdam as _OnebitAdam
from .algorithms.zeroone import ZeroOneAdam
from .elastic import register_state_handler
from .engine import Engine
from .options import (ADOPT_KEY, STATE_KEY, check_arguments, check_group, check_horovod_arguments,
                      check_named_parameters)
from .overlap import Overlap
from .hierarchical import node_levels
from .protocol import (Average, CollectiveNames, check_layout, exchange_buckets, grads_changed_anywhere,
                       pool_error_feedback)
from .schedule import Schedule, StepKind
from .state import StateDictMixin
from .stats import CommStats, StepLog
from .transport import Transport, make_transport

_registered = {}  # id(param) -> (weakref to param, weakref to the optimizer that owns it)


class ZeroOneAdamOptimizer(StateDictMixin, torch.optim.Optimizer):
    """0/1 Adam over Horovod (Lu et al., arXiv 2202.06009). Build it with :func:`DistributedOptimizer`.

    It starts with the ``param_groups`` (lr, betas, eps, weight_decay) of the wrapped
    ``torch.optim.Adam``/``AdamW``; its own ``param_groups`` are read at every step, so LR
    schedulers and manual changes take effect at once. ``load_state_dict`` replaces them with
    new dicts, as torch does: after a load, use the returned optimizer, not the wrapped one
    (as with ``hvd.DistributedOptimizer``).

    **Communication per step kind** (algorithm.md §2): VARIANCE averages g in full precision;
    COMPRESSED sends C(g); LOCAL sends nothing; SYNC sends C(accumulated update).

    **synchronize()** performs the gradient exchange of the coming step and writes its
    result into ``p.grad``: the full-precision average in VARIANCE steps, the 1-bit
    compressed average ĝ = C(g) in COMPRESSED steps. In LOCAL and SYNC steps it
    leaves the local gradient in place (the SYNC exchange is of the update and runs
    inside ``step()``). So ``synchronize(); clip_grad_norm_(...); with
    skip_synchronize(): step()`` clips the quantity the step will use.

    **State.** Per trainable parameter ``state[p]`` holds ``exp_avg``, ``exp_avg_sq``
    and ``anchor`` (float32 views of flat per-bucket buffers), so ``state_dict()``,
    ``torch.save`` and ``hvd.broadcast_optimizer_state`` work as with Adam. All state
    is created at construction: no collective runs there (elastic forbids it), and
    ``broadcast_optimizer_state`` never needs its dummy zero-gradient ``step()``.
    The step counters live in ``param_groups[0]["zoadam"]`` (``step``,
    ``exp_avg_sq_steps``, ``freeze_lr``) and each group holds the window's
    ``lr_sum`` (Λ) and ``decay_product``; they are identical on all ranks and travel
    with ``state_dict()`` and ``broadcast_optimizer_state``. The error buffers are
    per rank and are *not* in ``state_dict()``: a load keeps this rank's buffers.

    **Memory** (bytes, n = trainable elements, P = world size, B = buckets):
    ``4·(3n + padded_numel + padded_numel/P)`` for exp_avg, exp_avg_sq, anchor,
    worker_error, server_error, i.e. about ``(4 + 1/P)·n`` floats with less than
    ``8P`` padding elements per bucket, plus a reusable scratch of four float32
    buffers the size of the largest bucket and, at P > 1, each bucket's exchange input
    (``4·padded_numel``, which the worker side turns into the new ``worker_error`` in the
    same pass; see :meth:`memory_bytes`).
    """

    def __init__(self, optimizer, named_parameters, *, schedule: Schedule, transport: Transport,
                 compression, backward_passes_per_step: int, gradient_predivide_factor: float,
                 sparse_as_dense: bool, bias_correction: bool, bucket_cap_numel: int,
                 scale_block_numel: int | None = None, exp_avg_mask=None, auto_exp_avg_mask: bool = False,
                 precondition_compression: bool = True, step_log: str | None = None, overlap: bool = True,
                 algorithm: str = "zoadam", hierarchical=False):
        self._ready = False
        # Not super(): built by DistributedOptimizer, this class sits before the wrapped
        # torch.optim.Adam/AdamW in the MRO, and their __init__ must not run (as in Horovod).
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, dict(optimizer.defaults))
        self.schedule = schedule
        self.algorithm = ZeroOneAdam(schedule, precondition_compression) if algorithm == "zoadam" \
            else _OnebitAdam(schedule.var_freeze_step)
        self.transport = transport
        self.world_size = transport.world_size
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.bias_correction = bias_correction
        self.bucket_cap_numel = bucket_cap_numel
        self.scale_block_numel = scale_block_numel
        self.auto_exp_avg_mask = auto_exp_avg_mask
        self.precondition_compression = precondition_compression
        self.overlap = overlap
        self._step_log = None
        if step_log is not None and ("{rank}" in step_log or transport.rank == 0):
            self._step_log = StepLog(step_log.format(rank=transport.rank))
        self._names = self._name_parameters(named_parameters)
        self._collectives = CollectiveNames.for_layout(self._layout_description(), transport.world_size)
        self._engine = Engine(self, self._names, self._resolve_masks(exp_avg_mask),
                              transport, self._collectives, bucket_cap_numel=bucket_cap_numel,
                              scale_block_numel=scale_block_numel, sparse_as_dense=sparse_as_dense,
                              bias_correction=bias_correction, auto_exp_avg_mask=auto_exp_avg_mask,
                              levels=node_levels(transport, hierarchical, self._collectives.prefix))
        self._average = self._new_average()
        self._hook_handles = []
        weakref.finalize(self, _remove_hooks, self._hook_handles)  # a dropped optimizer leaves no hook behind
        self._passes = {}
        self._synchronized = False
        self._should_synchronize = True
        self._pending = None          # (step, kind, skip) prepared by synchronize()
        self._exchanged = False       # p.grad holds this step's exchange result
        self._checked_layout = False
        self._amp_seen = False
        self._warned_changed = False
        self._stats = CommStats()
        self.param_groups[0].setdefault(STATE_KEY, {"step": 0, "exp_avg_sq_steps": 0, "freeze_lr": None})
        for index, group in enumerate(self.param_groups):
            check_group(group, index)
            self._build_group(index)
        self._overlap = Overlap(len(self._buckets))
        if not self._buckets and not any(p.numel() == 0 for g in self.param_groups for p in g["params"]
                                         if p.requires_grad):
            raise ValueError("nothing to optimize: no parameter of the optimizer has requires_grad=True")
        native.warm_up(self._engine.device)  # the kernels' JIT here, not as a stall of the first exchanging step
        self._ready = True

    @property
    def _buckets(self) -> list:
        return self._engine.buckets

    def _new_average(self) -> Average:
        return Average(self.transport, self._collectives, gradient_predivide_factor=self.gradient_predivide_factor,
                       fp16_wire=self._fp16_wire(), sparse_grad=self._engine.sparse_grad)

    # -- construction ----------------------------------------------------------------------
    def _name_parameters(self, named_parameters) -> dict:
        return check_named_parameters(self.param_groups, named_parameters)

    def _resolve_masks(self, exp_avg_mask) -> dict:
        """``exp_avg_mask``: {param or name: 0/1 tensor of the param's shape}; also DeepSpeed's
        ``exp_avg_mask`` option in a param group that holds one parameter."""
        by_name = {name: p for p, name in self._names.items()}
        masks = {}
        for key, mask in (exp_avg_mask or {}).items():
            p = by_name.get(key) if isinstance(key, str) else key
            if p is None or p not in self._names:
                raise ValueError(f"exp_avg_mask names {key!r}, which is not a parameter of this optimizer")
            masks[p] = mask
        for i, group in enumerate(self.param_groups):
            if group.get("exp_avg_mask") is not None:
                if len(group["params"]) != 1:
                    raise ValueError(f"param_groups[{i}] has an exp_avg_mask and {len(group['params'])} parameters; "
                                     "a group mask needs a group of one parameter (or pass exp_avg_mask={param: mask})")
                masks[group["params"][0]] = group["exp_avg_mask"]
        for p, mask in masks.items():
            if not isinstance(mask, torch.Tensor) or mask.shape != p.shape:
                raise ValueError(f"exp_avg_mask of {self._names[p]!r} must be a tensor of shape {tuple(p.shape)}, "
                                 f"got {getattr(mask, 'shape', type(mask).__name__)}")
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError(f"exp_avg_mask of {self._names[p]!r} must hold only 0 and 1")
        return masks

    def _layout_description(self) -> list:
        """The trainable parameters' layout (names, shapes, dtypes, groups): the digest in the
        collective names, the same on every rank however many optimizers each built (see
        :class:`~hvd_zoadam.protocol.CollectiveNames`)."""
        return [(i, self._names[p], tuple(p.shape), str(p.dtype)) for i, g in enumerate(self.param_groups)
                for p in g["params"] if p.requires_grad]

    def _build_group(self, index: int) -> None:
        group = self.param_groups[index]
        group.setdefault("lr_sum", 0.0)
        group.setdefault("decay_product", 1.0)
        trainable = [p for p in group["params"] if p.requires_grad]
        for p in trainable:
            param_ref, owner = _registered.get(id(p), (lambda: None, lambda: None))
            if param_ref() is p and owner() is not None and owner() is not self:
                raise ValueError(f"parameter {self._names.get(p, id(p))!r} is already optimized by another "
                                 "hvd_zoadam optimizer; give each parameter to one optimizer only")
        self._engine.build_group(index, trainable)
        for p in trainable:
            _registered[id(p)] = (weakref.ref(p), weakref.ref(self))
            if p not in self._passes:
                self._passes[p] = 0
                if hasattr(p, "register_post_accumulate_grad_hook"):
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (torch semantics). Its params get new, zeroed buffers and unique names."""
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            index = len(self.param_groups) - 1
            check_group(self.param_groups[index], index)
            for j, p in enumerate(self.param_groups[index]["params"]):
                self._names.setdefault(p, f"noname.{index}.{j}")
            self._build_group(index)
            self._overlap.ready.extend([0] * (len(self._buckets) - len(self._overlap.ready)))
            self._checked_layout = False

    # -- backward hooks and overlap ------------------------------------------------------------
    def _make_hook(self, p):
        """The post-accumulate-grad hook of ``p``. It holds the optimizer weakly, so that a model
        does not keep a dropped optimizer alive (its parameters may then get a new one)."""
        owner = weakref.ref(self)

        def hook(param):
            opt = owner()
            if opt is not None:
                opt._grad_ready(param)
        return hook

    def _grad_ready(self, p) -> None:
        """A backward pass accumulated ``p``'s gradient: count it, start what is ready (overlap)."""
        if self._passes[p] >= self.backward_passes_per_step:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally. (hvd_zoadam: parameter "
                f"{self._names.get(p)!r} of the optimizer {self._collectives.prefix}; when several optimizers "
                "share a model, call step() on each one whose parameters got gradients.)")
        self._passes[p] += 1
        bucket_of = self._engine.bucket_of
        if self._passes[p] == self.backward_passes_per_step and p in bucket_of and self._can_overlap():
            self._overlap.param_ready(bucket_of[p], [len(b.params) for b in self._buckets],
                                      self._next_early_kind, self._launch)

    def _reset_passes(self) -> None:
        """Forget this step's backward passes; drain an exchange the hooks started (it was started
        on every rank, so it is completed and its result dropped)."""
        for p in self._passes:
            self._passes[p] = 0
        self._drain(self._overlap.reset(len(self._buckets)))

    def _drain(self, window) -> None:
        for handle in (window.handles() if window is not None and window.kind is not None else ()):
            self.transport.wait(handle)

    def _can_overlap(self) -> bool:
        # Not before the first step's settings check (a mismatch must fail fast, not hang in a
        # collective), and not under a GradScaler (its scale is known only in step()).
        # Nor right after loading an Adam checkpoint: the anchor and error buffers are set in synchronize().
        return (self.overlap and self.transport.supports_async and self.world_size > 1 and self._checked_layout
                and not self._amp_seen and not self._counters.get(ADOPT_KEY)
                and self._pending is None and getattr(self, "_ready", False))

    def _launch(self, window, bi: int) -> None:
        """Start bucket ``bi``'s exchange for the coming step from the hooks (see :mod:`.overlap`)."""
        b = self._buckets[bi]
        self.transport.counter.kind = window.kind.value
        if self.sparse_as_dense:  # densified here, so that what the exchange reads is what p.grad holds
            for p in b.params:
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
        # What the exchange read: checked in synchronize(), so that a gradient changed after
        # backward() (e.g. clipped without synchronize()) is not silently left out.
        window.seen[bi] = [(p.grad, p.grad._version if p.grad is not None else None) for p in b.params]
        if window.kind is StepKind.VARIANCE:
            window.averages[bi] = self._average.start(bi, b, self._engine.inv_grad_scale, copy=True)
        else:
            window.scales[bi] = self._start_compressed(bi, window.step, window.pre)

    def _start_compressed(self, bi: int, step: int, pre: dict):
        """Fill bucket ``bi``'s exchange input for a COMPRESSED step (``pre`` caches the
        preconditioning by bucket index) and start round 1. Returns round 1's handle."""
        b = self._buckets[bi]
        if bi not in pre:
            pre[bi] = self.algorithm.compressed_pre(self._engine, b, step, self._counters)
        self.algorithm.fill_compressed(self._engine, b, b.exchange.input, pre[bi])
        b.exchange.step = step
        return b.exchange.start(b.exchange.input)

    # -- per-step helpers --------------------------------------------------------------------
    @property
    def _counters(self) -> dict:
        return self.param_groups[0][STATE_KEY]

    def _next_kind(self) -> tuple[int, StepKind]:
        c = self._counters
        step = c["step"] + 1
        return step, self.algorithm.kind(step, float(self.param_groups[0]["lr"]), c["freeze_lr"])

    def _next_early_kind(self) -> tuple:
        """(step, kind) of the coming step for the hooks; kind None when the algorithm's step
        exchanges what it needs itself (nothing to start early)."""
        step, kind = self._next_kind()
        return step, kind if self.algorithm.gradient_exchange(kind) is not None else None

    def _check_layout(self) -> None:
        """algorithm.md §5: settings and parameter layout compared across ranks (raises on every rank)."""
        self._checked_layout = True
        items = self.algorithm.settings()
        items.update(bias_correction=self.bias_correction, bucket_cap_numel=self.bucket_cap_numel,
                     scale_block_numel=self.scale_block_numel, auto_exp_avg_mask=self.auto_exp_avg_mask,
                     overlap=self.overlap, backward_passes_per_step=self.backward_passes_per_step,
                     compression=getattr(self.compression, "__name__", repr(self.compression)))
        items.update(self._engine.layout_items())
        check_layout(self.transport, items)

    # -- elastic -------------------------------------------------------------------------------
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
        finds the world size or rank changed (then error feedback restarts at zero).
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

    # -- Horovod's contract --------------------------------------------------------------------
    def synchronize(self) -> None:
        """Run the gradient exchange of the coming step (see the class docstring). Idempotent per step."""
        if self._pending is not None:
            return
        if self.transport.refresh():
            # An elastic reset without hvd.elastic.TorchState: re-lay out here (collective-free).
            passes = dict(self._passes)
            self.on_reset()
            self._passes.update(passes)
        step, kind = self._next_kind()
        for b in self._buckets:
            b.exchange.step = step  # announced in round 1: ranks at different steps fail fast
        how = self.algorithm.gradient_exchange(kind)
        armed = how is not None and self._can_overlap()  # the same on every rank
        self._engine.check_params_unchanged()
        self._adopt_loaded_adam()
        if not self._checked_layout:
            self._check_layout()
        self._drain(self._overlap.stale(step, kind))  # the schedule moved under us (a load between backward and step)
        if armed:
            self.transport.counter.kind = kind.value
            self._redo_if_changed(step, kind)
        window = self._overlap.take(step, kind)  # nothing more starts from the hooks this step
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

    def _fp16_wire(self) -> bool:
        return self.compression is not None and getattr(self.compression, "__name__", "") == "FP16Compressor"

    def _grads_changed_here(self) -> bool:
        """Whether a gradient the hooks' exchange read was replaced or modified since."""
        window = self._overlap.window
        for bi, seen in (window.seen if window is not None else {}).items():
            if any(p.grad is not grad or (grad is not None and grad._version != version)
                   for p, (grad, version) in zip(self._buckets[bi].params, seen)):
                return True
        return False

    def _redo_if_changed(self, step: int, kind: StepKind) -> bool:
        """Whether some rank's gradients changed after the hooks started their exchange (e.g.
        clipped without synchronize()), agreed by one 4-byte allreduce on every step where
        overlap is armed. True: every rank completes the early exchange of every bucket once
        (starting, with its current gradients, the ones its hooks did not start), so the names
        pair up; the results are dropped and the step exchanges the gradients as they are now,
        like overlap=False (a COMPRESSED step's early worker side only staged its error:
        ``worker_error`` is untouched until round 2)."""
        if not grads_changed_anywhere(self.transport, self._collectives, step, self._grads_changed_here()):
            return False
        window = self._overlap.window
        averages = window.averages if window else {}
        scales = window.scales if window else {}
        pre = window.pre if window else {}
        for bi in Overlap.launch_order(len(self._buckets)):
            if kind is StepKind.VARIANCE:
                started = averages.pop(bi, None)
                if started is None:
                    started = self._average.start(bi, self._buckets[bi], self._engine.inv_grad_scale, copy=True)
                for handle, _, _ in started:
                    self.transport.wait(handle)
            else:
                handle = scales.pop(bi, None)
                self.transport.wait(handle if handle is not None else self._start_compressed(bi, step, pre))
        self._overlap.window = None
        if not self._warned_changed:
            self._warned_changed = True
            warnings.warn("hvd_zoadam: gradients changed after backward() had already started their exchange "
                          "(overlap with the backward pass, as in hvd.DistributedOptimizer); the step exchanges "
                          "them again as they are now, which doubles its traffic. To modify gradients (e.g. clip "
                          "them) call opt.synchronize() first and then `with opt.skip_synchronize(): opt.step()`, "
                          "or build the optimizer with overlap=False.")
        return True

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
        return exchange_buckets([self._buckets[bi] for bi in Overlap.launch_order(len(self._buckets))],
                                engine.scratch["g"], engine.scratch["w"],
                                lambda b, buf: algorithm.fill_compressed(engine, b, buf, pre[id(b)]),
                                lambda b, w: algorithm.consume_compressed(engine, b, w, pre[id(b)]),
                                started=started)

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

    @torch.no_grad()
    def step(self, closure=None):
        """One 0/1 Adam step of the kind the schedule gives (algorithm.md §2). Returns the closure's loss.

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
            return self._step(loss)
        finally:
            self._engine.inv_grad_scale = None

    def _step(self, loss):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to "
                              "consider using optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        if self._pending is None:
            raise RuntimeError("step() inside skip_synchronize() needs a prior optimizer.synchronize()")
        step, kind, skip = self._pending
        self._pending = None
        self._synchronized = False
        counters = self._counters
        self.transport.counter.kind = kind.value
        ctx = StepContext(self._engine, step, counters, self._exchanged, self._exchange)
        k = self.algorithm.apply(ctx, kind, skip)
        skip = skip or ctx.skipped
        self._stats.record(kind, skip, self.transport.counter, self.world_size, sum(b.numel for b in self._buckets))
        counters.update(step=step, exp_avg_sq_steps=k)
        if self._step_log:
            self._step_log.write(step, kind, skip, float(self.param_groups[0]["lr"]), self.comm_stats(), loss)
        self._reset_passes()
        return loss

    def _exchange(self, buckets, fill, consume, consume_packed=None) -> bool:
        """The 1-bit exchange of ``buckets`` for a step function (see :func:`.protocol.exchange_buckets`)."""
        return exchange_buckets(buckets, self._engine.scratch["g"], self._engine.scratch["w"], fill, consume,
                                consume_packed)

    def log_loss(self, loss) -> None:
        """Give the coming step's loss (a float or 0-dim tensor) to the per-step log."""
        if self._step_log:
            self._step_log.set_loss(loss)

    # -- reporting -----------------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """What this rank communicated so far.

        Returns a dict: for each kind (``variance``, ``compressed``, ``local``, ``sync``) a dict
        of ``steps``, ``rounds`` (collective calls) and ``bytes_sent``; ``bytes_sent_total``,
        ``rounds_total``, ``skipped_steps``, ``adam_equivalent_bytes`` (what
        ``hvd.DistributedOptimizer(torch.optim.Adam)`` at fp32 would have sent over the same
        steps: an allreduce of every trainable fp32 gradient per step), ``transport`` and
        ``world_size``. Bytes follow the table in :mod:`hvd_zoadam.transport`. With the
        two-level exchange, ``hierarchical`` adds ``nodes``, ``ranks_per_node`` and the 1-bit
        exchanges' bytes split into ``intra_node_bytes`` and ``inter_node_bytes`` (both also in
        the totals; the full-precision averages are Horovod's and not split).
        """
        out = self._stats.report(self.transport.describe(), self.world_size)
        levels = self._engine.levels
        if levels is not None:
            out["hierarchical"] = {"nodes": levels[1].world_size, "ranks_per_node": levels[0].world_size,
                                   "intra_node_bytes": levels[0].counter.total_bytes(),
                                   "inter_node_bytes": levels[1].counter.total_bytes()}
        return out

    def memory_bytes(self) -> dict:
        """Bytes this optimizer holds: ``state`` (exp_avg, exp_avg_sq, anchor, and float32 master
        weights for fp16/bf16 parameters), ``error_buffers``,
        ``scratch`` (reused every step) and ``total``."""
        return self._engine.memory_bytes()

    def schedule_state(self) -> dict:
        """The schedule after the last step: step, frozen, var_interval, var_counter,
        exp_avg_sq_steps, local_step_interval, local_step_counter, freeze_lr."""
        c = self._counters
        out = self.schedule.describe(c["step"], lr=float(self.param_groups[0]["lr"]), freeze_lr=c["freeze_lr"])
        out.update(exp_avg_sq_steps=c["exp_avg_sq_steps"], freeze_lr=c["freeze_lr"],
                   lr_sum=[g["lr_sum"] for g in self.param_groups])
        return out


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


_classes: dict = {}  # the wrapped optimizer's class -> the class DistributedOptimizer builds for it


def _optimizer_class(base: type) -> type:
    """A subclass of :class:`ZeroOneAdamOptimizer` and ``base`` (the wrapped ``torch.optim.Adam``,
    ``AdamW`` or a subclass of them), made once per ``base``: so ``isinstance(opt, base)``
    holds, as for the class ``hvd.DistributedOptimizer`` builds. ZeroOneAdamOptimizer comes
    first in the MRO and overrides what ``base`` defines (``__init__``, ``step``,
    ``__setstate__``), so none of ``base``'s own code runs."""
    cls = _classes.get(base)
    if cls is None:
        cls = _classes[base] = type(ZeroOneAdamOptimizer.__name__, (ZeroOneAdamOptimizer, base),
                                    {"__module__": ZeroOneAdamOptimizer.__module__,
                                     "__qualname__": ZeroOneAdamOptimizer.__qualname__,
                                     "__doc__": ZeroOneAdamOptimizer.__doc__})
    return cls


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=None, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                         process_set=None, *, var_freeze_step=100000, var_update_scaler=16,
                         local_step_scaler=32768, local_step_clipper=16, local_step_policy="steps",
                         bias_correction=True, transport="auto", bucket_cap_mb=25.0, scale_block_numel=2048,
                         exp_avg_mask=None, auto_exp_avg_mask=True, precondition_compression=True,
                         step_log=None, overlap=True, algorithm="zoadam", hierarchical=False):
    """Wrap a ``torch.optim.Adam``/``AdamW`` into a 0/1 Adam (or 1-bit Adam) optimizer that
    communicates through Horovod. A drop-in replacement for ``hvd.DistributedOptimizer``.

    ``algorithm``: ``"zoadam"`` (0/1 Adam, the default) or ``"onebit"`` (1-bit Adam, Tang et
    al. 2021, algorithm.md §9: full-precision Adam up to step ``var_freeze_step``, then the
    1-bit exchange of the momentum at every step with v frozen; :func:`OnebitAdam` says it
    with DeepSpeed's name ``freeze_step``). Under ``"onebit"`` the 0/1 Adam knobs
    ``var_update_scaler``, ``local_step_*`` and ``precondition_compression`` must keep their
    defaults (ValueError otherwise).

    Horovod's arguments keep Horovod's meaning:

    * ``named_parameters``: ``(name, param)`` tuples; names key the layout check across ranks.
    * ``compression``: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16``, which
      casts the full-precision VARIANCE-step averages to fp16 on the wire, as Horovod does.
      The 1-bit phases are already compressed and do not change.
    * ``backward_passes_per_step`` (>= 1): gradients of that many ``backward()`` calls are
      summed locally (torch semantics) before ``step()``; more raise Horovod's error.
    * ``op``: only ``hvd.Average`` (the default); 0/1 Adam is defined on the average.
    * ``gradient_predivide_factor``: as Horovod, splits the VARIANCE average into a
      divide by f before and a multiply by f/P after the sum. The 1-bit exchange is
      scale-free and does not use it.
    * ``groups``: not supported (hvd_zoadam fuses parameters into buckets of
      ``bucket_cap_mb`` itself); pass ``None``.
    * ``sparse_as_dense``: sparse gradients are densified when True and refused otherwise.
    * ``process_set``: the ranks this optimizer trains with (default: all). Unlike Horovod,
      a rank outside it cannot build the optimizer (ValueError): it would hold buffers laid
      out for a world it is not part of, and a ``step()`` there could only be a no-op.

    0/1 Adam's keyword-only knobs (algorithm.md §4): ``var_freeze_step`` (T_f, steps),
    ``var_update_scaler`` (κ), ``local_step_scaler`` (α, steps), ``local_step_clipper``
    (H_max, steps), ``local_step_policy`` (``"steps"``, ``"lr"`` or ``"constant"``),
    ``bias_correction``, ``transport`` (``"horovod"``: Horovod's collectives; ``"mpi"``: the
    1-bit phases over mpi4py on Horovod's MPI world, a ``ValueError`` naming the reason where
    that cannot work; ``"auto"``: ``"mpi"`` when Horovod runs the MPI controller with
    ``MPI_THREAD_MULTIPLE`` and mpi4py works, else ``"horovod"``; ``comm_stats()["transport"]``
    says which), ``bucket_cap_mb``
    (the fused bucket size, MiB of float32), ``scale_block_numel`` (elements per 1-bit scale:
    each tensor is cut into blocks of at most this many elements, each with its own scale;
    ``None`` for one scale per tensor; a multiple of 8 or None), ``exp_avg_mask``
    (``{param or name: 0/1 tensor of its shape}``: coordinates at 0 never move; sign
    compression cannot send an exact 0, so a coordinate whose gradient is always 0 would
    otherwise random-walk; DeepSpeed's group option ``exp_avg_mask`` works too), and
    ``auto_exp_avg_mask`` (default True: hold still the coordinates whose averaged gradient
    was exactly 0 in every VARIANCE step, i.e. whose ``exp_avg_sq`` is 0. With a frozen v
    such a coordinate's Adam step would be m/eps, and compression noise drives it to
    overflow; measured: a small CNN on digits went to NaN within 10 steps without it. It
    costs no memory. A coordinate that gets its first gradient after the freeze stays
    still; pass False to get DeepSpeed's behaviour), and ``precondition_compression``
    (default True: compress g/s and x_a − x instead of the paper's g and (x_a − x)·s, so each
    coordinate's compression error is proportional to its own Adam denominator s; with False
    a coordinate with a small v receives the block's error divided by its small s, which made
    a small CNN diverge here), and ``step_log`` (a path: append one JSON line per step with
    step, kind, lr, loss (from ``step(closure)`` or :meth:`ZeroOneAdamOptimizer.log_loss`),
    skipped, and the cumulative bytes sent and rounds; rank 0 only unless the path holds
    ``{rank}``), and ``overlap`` (default True: with P > 1, from the second step on, the
    gradient hooks start a VARIANCE step's allreduces and a COMPRESSED step's round 1 for
    each bucket as soon as all its gradients are ready, in a fixed bucket order, while the
    backward pass goes on; not under ``torch.amp.GradScaler``, whose scale is only known in
    ``step()``. False: everything starts in ``synchronize()``. Same results either way), and
    ``hierarchical`` (``False``, the default; ``True``; or ``"auto"``: the two-level exchange of
    algorithm.md §3 for nodes of several ranks: a full-precision reduce-scatter inside each
    node, the 1-bit exchange of each shard among the nodes, an allgather inside the node; about
    L times fewer bytes between nodes with L ranks per node. It needs ``transport="mpi"``
    (``True`` under Horovod's collectives is a ValueError that says so) and the same number of
    ranks on every node; nodes are MPI's shared-memory domains, or blocks of
    ``HVD_ZOADAM_RANKS_PER_NODE`` consecutive ranks. ``"auto"`` turns it on where the transport
    can split and there are several nodes of several ranks each).

    Every argument is checked before Horovod is (``hvd.init()`` called, this rank in
    ``process_set``), as ``hvd.DistributedOptimizer`` does.

    Returns:
        A :class:`ZeroOneAdamOptimizer` sharing ``optimizer.param_groups``; it is also an
        instance of ``type(optimizer)`` (``isinstance(opt, torch.optim.Adam)`` holds, as for
        Horovod's wrapper), though none of that class's code runs.

    Raises:
        TypeError: ``optimizer`` is not a plain ``torch.optim.Adam``/``AdamW``, a knob
            has the wrong type, or a parameter is on neither the CPU nor a CUDA device.
        ValueError: an unsupported option (``amsgrad``, ``op=hvd.Adasum``, ``groups``, ...)
            or a knob out of range, the message naming the option and the fix; or two
            trainable parameters on different devices (one device per rank, as Horovod).
        RuntimeError: CUDA parameters where numba's CUDA target sees no device.
    """
    try:
        import horovod.torch as hvd
    except ImportError:
        if not isinstance(transport, Transport) or compression is not None or op is not None:
            raise
        hvd = None  # an explicit transport (e.g. thread-ranks in tests) needs no Horovod

    register_state_handler(ZeroOneAdamOptimizer)
    if isinstance(optimizer, ZeroOneAdamOptimizer):
        raise TypeError("this optimizer is already an hvd_zoadam optimizer; wrap the plain torch.optim.Adam once")
    if type(optimizer).__module__ == "horovod.torch.optimizer":
        raise TypeError("this optimizer was already wrapped by hvd.DistributedOptimizer; pass the plain "
                        "torch.optim.Adam/AdamW to hvd_zoadam.DistributedOptimizer instead")
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError("hvd_zoadam.DistributedOptimizer supports torch.optim.Adam (L2 weight decay) and "
                        f"torch.optim.AdamW (decoupled weight decay); got {type(optimizer).__name__}")
    compression, op = check_horovod_arguments(hvd, compression, op)
    scale_block_numel = check_arguments(
        backward_passes_per_step=backward_passes_per_step, gradient_predivide_factor=gradient_predivide_factor,
        groups=groups, sparse_as_dense=sparse_as_dense, bias_correction=bias_correction,
        local_step_policy=local_step_policy, scale_block_numel=scale_block_numel, bucket_cap_mb=bucket_cap_mb)
    if not (isinstance(hierarchical, bool) or hierarchical == "auto"):
        raise ValueError(f"hierarchical must be False, True or 'auto', got {hierarchical!r}")
    if algorithm not in ("zoadam", "onebit"):
        raise ValueError(f"algorithm must be 'zoadam' (0/1 Adam) or 'onebit' (1-bit Adam), got {algorithm!r}")
    if algorithm == "onebit":
        zoadam_only = dict(var_update_scaler=(var_update_scaler, 16), local_step_scaler=(local_step_scaler, 32768),
                           local_step_clipper=(local_step_clipper, 16), local_step_policy=(local_step_policy, "steps"),
                           precondition_compression=(precondition_compression, True))
        for name, (value, default) in zoadam_only.items():
            if value != default:
                raise ValueError(f"{name}={value!r} is a 0/1 Adam knob; algorithm='onebit' (1-bit Adam) has only "
                                 "var_freeze_step (its freeze_step): drop the argument or use algorithm='zoadam'")
        var_update_scaler = 1  # every warm-up step updates v
    schedule = Schedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper,
                        local_step_policy)
    # Every argument is checked before Horovod is asked anything (initialised? in the process set?).
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    check_named_parameters(optimizer.param_groups, named_parameters)
    for index, group in enumerate(optimizer.param_groups):
        check_group(group, index)
    transport = make_transport(transport, process_set)
    return _optimizer_class(type(optimizer))(
        optimizer, named_parameters, schedule=schedule, transport=transport, compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=float(gradient_predivide_factor), sparse_as_dense=sparse_as_dense,
        bias_correction=bias_correction, bucket_cap_numel=max(1, int(bucket_cap_mb * 2 ** 20 / 4)),
        scale_block_numel=scale_block_numel, exp_avg_mask=exp_avg_mask, auto_exp_avg_mask=bool(auto_exp_avg_mask),
        precondition_compression=bool(precondition_compression), step_log=step_log, overlap=bool(overlap),
        algorithm=algorithm, hierarchical=hierarchical)


def OnebitAdam(optimizer, named_parameters=None, *, freeze_step, **kwargs):
    """1-bit Adam (Tang et al., arXiv 2102.02888) over Horovod: ``DistributedOptimizer(optimizer,
    named_parameters, algorithm="onebit", var_freeze_step=freeze_step, **kwargs)``.

    ``freeze_step`` (DeepSpeed's name): the last full-precision Adam step; from
    ``freeze_step + 1`` on, v is frozen and the momentum goes through the 1-bit exchange at
    every step. The paper advises 15–25 % of training. Everything else (Horovod's
    arguments, ``transport``, ``bucket_cap_mb``, ``scale_block_numel``, masks, checkpoints,
    elastic) is as for :func:`DistributedOptimizer`.
    """
    return DistributedOptimizer(optimizer, named_parameters, algorithm="onebit", var_freeze_step=freeze_step,
                                **kwargs)
