"""0/1 Adam (Lu, Li, Zhang, De Sa, He, arXiv 2202.06009, ICLR 2023) as step functions.

The four kinds of step of docs/algorithm.md §2 over each bucket's flat float32 tensors:

* VARIANCE: m and v from the full-precision average of g;
* COMPRESSED: m from the 1-bit exchange of g (or of g/s, ``precondition_compression``);
* LOCAL: m from the local g, nothing sent, the window's Λ grows;
* SYNC: a LOCAL step, then the 1-bit exchange of the window's update x_a − x (or
  (x_a − x)·s), from which x and m are rebuilt bitwise alike on every rank.

The math is :mod:`hvd_zoadam.core.step_math` and :mod:`hvd_zoadam.native`; the schedule is
:class:`hvd_zoadam.core.schedule.Schedule` (algorithm.md §4). No collectives here: the gradient
exchange runs in the shell's ``synchronize()``, and a SYNC step calls ``ctx.exchange``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hvd_zoadam import native
from hvd_zoadam.core import step_math
from hvd_zoadam.core.algorithms import StepContext
from hvd_zoadam.core.engine import grads_finite_each, skip_flags
from hvd_zoadam.core.schedule import AutoFreeze, Schedule, StepKind

if TYPE_CHECKING:
    from hvd_zoadam.core.engine import Bucket, Engine


class ZeroOneAdam:
    """0/1 Adam's schedule and step functions.

    Args:
        schedule: the pure :class:`~hvd_zoadam.core.schedule.Schedule` (T_v, T_f, T_u).
        precondition_compression: compress g/s and x_a − x (True, the default) instead of the
            paper's g and (x_a − x)·s (docs/algorithm.md §2, "Compression domain").
        auto_freeze: an :class:`~hvd_zoadam.core.schedule.AutoFreeze` when T_f is decided during
            training (``var_freeze_step="auto"``; ``schedule.var_freeze_step`` is then
            :data:`~hvd_zoadam.core.schedule.NEVER`), else None. The decision lives in the
            counters (``var_freeze_step``), which travel with ``state_dict()``.
    """

    name = "zoadam"
    GRADIENT_EXCHANGE = {StepKind.VARIANCE: "average", StepKind.COMPRESSED: "compressed",
                         StepKind.LOCAL: None, StepKind.SYNC: None}

    def __init__(self, schedule: Schedule, precondition_compression: bool = True,
                 auto_freeze: AutoFreeze | None = None):
        self.base_schedule = schedule
        self.precondition_compression = precondition_compression
        self.auto_freeze = auto_freeze

    def schedule(self, counters: dict) -> Schedule:
        """The schedule in force: the base one, with the T_f the counters hold under ``"auto"``."""
        return self.base_schedule if self.auto_freeze is None else self.auto_freeze.schedule(self.base_schedule,
                                                                                             counters)

    def kind(self, step: int, lr: float, counters: dict) -> StepKind:
        return self.schedule(counters).kind(step, lr=lr, freeze_lr=counters["freeze_lr"])

    def gradient_exchange(self, kind: StepKind):
        return self.GRADIENT_EXCHANGE[kind]

    def starts_early(self, step: int, kind: StepKind, counters: dict) -> bool:
        """Whether the backward hooks may start step ``step``'s exchange before ``step()``: the
        gradient exchanges, and a SYNC step's exchange of the window's update except at the
        first step after the freeze (which sets the anchor in ``step()``)."""
        if kind is StepKind.SYNC:
            return step != self.schedule(counters).var_freeze_step + 1
        return self.gradient_exchange(kind) is not None

    def observe(self, counters: dict, lr: float) -> int | None:
        """After step ``counters["step"]``: with ``var_freeze_step="auto"``, its learning rate
        into the decision (:meth:`AutoFreeze.observe`). Returns T_f once decided, else None."""
        if self.auto_freeze is None:
            return self.base_schedule.var_freeze_step
        return self.auto_freeze.observe(counters, counters["step"], lr)

    def settings(self) -> dict:
        """The settings every rank must share (for the layout check)."""
        items = {f"schedule.{k}": v for k, v in vars(self.base_schedule).items()}
        if self.auto_freeze is not None:
            items["schedule.var_freeze_step"] = "auto"
        items["precondition_compression"] = self.precondition_compression
        return items

    # -- the COMPRESSED step's gradient exchange (run by synchronize() or the hooks) ----------
    def compressed_pre(self, engine: Engine, b: Bucket, step: int, counters: dict):
        """(s, clip) of bucket ``b`` for the preconditioned exchange of a COMPRESSED step, or None.

        With ``precondition_compression`` the exchange runs on y = g/s (s = sqrt(v̂) + eps,
        identical on all ranks), clipped to |y| <= sqrt(P) / sqrt(1 − β2)
        (:func:`hvd_zoadam.core.step_math.normalized_gradient_bound`), and the result is multiplied
        back by s. Each coordinate's compression error then scales with its own s,
        and a coordinate whose gradient appears after v was last updated cannot blow up the
        scale of its block.
        """
        if not self.precondition_compression:
            return None
        k = counters["exp_avg_sq_steps"]
        h = engine.hyper(b, step, k)
        return engine.denom(b, h), step_math.normalized_gradient_bound(h, engine.transport.world_size)

    @staticmethod
    def fill_compressed(engine: Engine, b: Bucket, buf: torch.Tensor, pre: tuple[torch.Tensor, float] | None) -> None:
        """buf <- the exchange input of a COMPRESSED step: g, or g/s clipped (``pre`` = (s, clip))."""
        buf[b.numel:].zero_()
        engine.grads_into(b, buf)
        if pre is not None:
            native.precondition_clamp_(buf[:b.numel], pre[0], pre[1])  # a NaN/Inf must reach the scales

    @staticmethod
    def consume_compressed(engine: Engine, b: Bucket, w: torch.Tensor,
                           pre: tuple[torch.Tensor, float] | None) -> None:
        """p.grad <- the exchanged ĝ (times s when preconditioned; masked coordinates 0)."""
        if pre is not None:
            w.mul_(pre[0])
        mask = engine.mask_of(b)
        if mask is not None:
            w.mul_(mask)
            b.exchange.mask_errors(mask)
        engine.write_grads(b, w)

    # -- the step ------------------------------------------------------------------------------
    def apply(self, ctx: StepContext, kind: StepKind, skip: bool) -> int:
        """Run step ``ctx.step`` of ``kind`` on every bucket (nothing when ``skip``: the agreed
        skip of algorithm.md §5). Returns the new ``exp_avg_sq_steps`` k."""
        schedule = self.schedule(ctx.counters)
        if kind in (StepKind.LOCAL, StepKind.SYNC) and ctx.step == schedule.var_freeze_step + 1:
            self.enter_freeze(ctx)
        if kind is StepKind.VARIANCE:
            i = schedule.variance_update_steps(ctx.step, ctx.counters["exp_avg_sq_steps"])
            k = ctx.counters["exp_avg_sq_steps"] + (0 if skip else i)
            if not skip:
                variance_step(ctx, k, i)
            return k
        k = ctx.counters["exp_avg_sq_steps"]
        if not skip:
            {StepKind.COMPRESSED: compressed_step, StepKind.LOCAL: self.local_step,
             StepKind.SYNC: self.sync_step}[kind](ctx, k)
        return k

    @staticmethod
    def enter_freeze(ctx: StepContext) -> None:
        """algorithm.md §4 'At the freeze': zero both error buffers, anchor <- x, remember lr."""
        engine = ctx.engine
        ctx.counters["freeze_lr"] = float(engine.param_groups[0]["lr"])
        for b in engine.buckets:
            b.exchange.zero_errors()
            b.anchor.copy_(engine.load_x(b))
        for group in engine.param_groups:
            group["lr_sum"], group["decay_product"] = 0.0, 1.0

    def local_scalars(self, engine: Engine, h: step_math.Hyper) -> dict:
        """The keyword scalars of :func:`native.local_step` for a step after the freeze: those of
        ``h``, and with ``precondition_compression`` the bound on |g|/s (v is frozen: bound it
        as Adam would once v had seen g, see :meth:`compressed_pre`)."""
        bound = (step_math.normalized_gradient_bound(h, engine.transport.world_size)
                 if self.precondition_compression else None)
        return {**step_math.local_step_scalars(h), "bound_factor": bound}

    def local_update(self, engine: Engine, b: Bucket, h: step_math.Hyper, denom: torch.Tensor,
                     x: torch.Tensor | None = None, exp_avg: torch.Tensor | None = None,
                     finite: bool | None = None) -> torch.Tensor:
        """LOCAL steps 1–2 on bucket ``b`` with the local g (skipped on this rank alone when g
        is not finite, algorithm.md §5), the check and the pass over the bucket in one call on
        the CPU (:func:`native.local_step_if_finite`). Returns x, float32[n], for :meth:`Engine.store_x`.

        ``x``, ``exp_avg``: where to take the step (float32[n] each), by default the bucket's own
        x (:meth:`Engine.load_x`: the parameters' flat storage itself) and m; :meth:`sync_input`
        passes copies. ``finite``: whether g is finite, where the caller read it already
        (:func:`~hvd_zoadam.core.engine.grads_finite_each`)."""
        g = engine.grads(b)
        x = engine.load_x(b) if x is None else x
        exp_avg = b.exp_avg if exp_avg is None else exp_avg
        native.local_step_if_finite(g, x, exp_avg, denom, mask=engine.mask_of(b), finite=finite,
                                    **self.local_scalars(engine, h))
        return x

    def local_update_on_device(self, engine: Engine, row: int, h: step_math.Hyper) -> bool:
        """LOCAL steps 1–2 on bucket ``engine.buckets[row]`` off the CPU path in one kernel launch
        that checks g and skips on the device (:func:`native.local_step_on_device`, its count in
        row ``row`` of :func:`~hvd_zoadam.core.engine.skip_flags`), x stored into the parameters; nothing read on
        the host. Returns False, taking no step, where that kernel does not take the bucket (the
        CPU path, whose own kernel call checks g; see :func:`native.local_step_on_device`)."""
        b = engine.buckets[row]
        if native.on_cpu_path(b.exp_avg):
            return False
        x = engine.load_x(b)
        if not native.local_step_on_device(engine.grads(b), x, b.exp_avg, engine.denom(b, h), skip_flags(engine),
                                           row, mask=engine.mask_of(b), **self.local_scalars(engine, h)):
            return False
        engine.store_x(b, x)
        return True

    def local_step(self, ctx: StepContext, k: int) -> None:
        """LOCAL on every bucket: off the CPU path one launch per bucket decides its skip on the
        device (:meth:`local_update_on_device`); the buckets that kernel does not take have
        their finiteness read first, in one host synchronisation (not one per bucket)."""
        engine = ctx.engine
        hypers = [engine.hyper(b, ctx.step, k) for b in engine.buckets]
        rest = [i for i in range(len(engine.buckets)) if not self.local_update_on_device(engine, i, hypers[i])]
        finite = grads_finite_each(engine, [engine.buckets[i] for i in rest])
        for j, i in enumerate(rest):
            b, h = engine.buckets[i], hypers[i]
            engine.store_x(b, self.local_update(engine, b, h, engine.denom(b, h),
                                                finite=None if finite is None else finite[j]))
        advance_window(engine.param_groups)

    def sync_step(self, ctx: StepContext, k: int) -> None:
        _SyncStep(self, ctx, k).run()

    def sync_input(self, engine: Engine, b: Bucket, step: int, counters: dict, buf: torch.Tensor) -> bool:
        """A SYNC step's exchange input for bucket ``b``, from the backward hooks before
        ``step()``: the window's update u after this step's local update, into the padded
        float32 ``buf``, with x, m and the window left as they are (the local update runs on
        copies). ``step()`` completes the exchange and rebuilds x and m from it, which
        overwrites both, so it takes the local update on x and m for real only if the exchange
        is skipped (bitwise the same update: nothing it reads has changed). Returns False,
        writing nothing, when the bucket's window did not move (its learning rates sum to 0:
        the step sends nothing for it)."""
        group = engine.param_groups[b.group_index]
        lr_sum, decay_product = window_after(group)
        if not lr_sum > 0:
            return False
        h = engine.hyper(b, step, counters["exp_avg_sq_steps"])
        self.window_input(engine, b, h, engine.denom(b, h), decay_product, buf)
        return True

    def window_input(self, engine: Engine, b: Bucket, h: step_math.Hyper, denom: torch.Tensor,
                     decay_product: float, buf: torch.Tensor) -> None:
        """SYNC steps 1–3 of bucket ``b`` with x and m left as they are: the window's update
        after this step's local update (on copies), u = x_a·``decay_product`` − x' (times s
        without ``precondition_compression``), into the padded float32 ``buf``. One pass over
        the bucket on the CPU (:func:`native.local_window_update`), one kernel launch off it
        (its count in the bucket's row of :func:`~hvd_zoadam.core.engine.skip_flags`); a g that is not finite
        gives the u of x as it is (this rank's local step skips, algorithm.md §5)."""
        buf[b.numel:].zero_()
        if self.precondition_compression:  # the common case in one pass that writes only buf
            g, x = engine.grads(b), engine.load_x(b)
            row = next(i for i, c in enumerate(engine.buckets) if c is b)
            if not native.local_window_update(g, x, b.exp_avg, denom, b.anchor, buf[:b.numel],
                                              decay_product=decay_product, mask=engine.mask_of(b),
                                              flags=skip_flags(engine), row=row, **self.local_scalars(engine, h)):
                fill_sync(b, x, denom, decay_product, buf, True)
            return
        x = self.local_update(engine, b, h, denom, engine.x_copy(b), b.exp_avg.clone())
        fill_sync(b, x, denom, decay_product, buf, False)

    def deliver_owed(self, engine: Engine, b: Bucket, owed: torch.Tensor, step: int, k: int) -> None:
        """Put the error feedback that a job of several ranks still owed, ``owed`` =
        float32[n] (the pooled worker plus server error of bucket ``b``, in the exchange's
        units), into x and the anchor at once: at P = 1 no exchange will ever deliver it
        (algorithm.md §6). Only after the freeze, where the errors are those of the window
        updates: u = x_a − x (or (x_a − x)·s without ``precondition_compression``)."""
        if not self.precondition_compression:
            owed = owed / engine.denom(b, engine.hyper(b, step, k))
        x = engine.load_x(b)
        x.sub_(owed)
        b.anchor.sub_(owed)
        engine.store_x(b, x)

    @staticmethod
    def window_open(engine: Engine) -> bool:
        """Whether a window of local steps has moved since its anchor (some group's Λ > 0)."""
        return any(group.get("lr_sum", 0.0) > 0 for group in engine.param_groups)


def _with_gradients(ctx: StepContext, k: int, var_update_steps: int = 1):
    """Per bucket: (bucket, its Hyper, its gradient float32[n] from p.grad, x float32[n]); x is
    scattered back into the parameters once the caller's step on it is done."""
    engine = ctx.engine
    for b in engine.buckets:
        h = engine.hyper(b, ctx.step, k, var_update_steps)
        g = engine.grads(b, raw=not ctx.exchanged)
        x = engine.load_x(b)
        yield b, h, g, x
        engine.store_x(b, x)


def variance_step(ctx: StepContext, k: int, var_update_steps: int = 1) -> None:
    """VARIANCE on every bucket, from the averaged gradients in p.grad; the update of v weighs
    as ``var_update_steps`` steps (:meth:`Schedule.variance_update_steps`). One pass (one
    kernel launch on a GPU) a bucket, which also leaves the new denominators kept for the
    steps up to the next VARIANCE step (:meth:`DerivedFromExpAvgSq.denom_written`)."""
    derived = ctx.engine.derived
    for b, h, g, x in _with_gradients(ctx, k, var_update_steps):
        # Only the user's mask here: with the exact average, v == 0 after this step means every
        # ḡ so far was exactly 0, so m is already 0 there (the automatic mask is a no-op).
        native.variance_step(g, x, b.exp_avg, b.exp_avg_sq, derived.denom_out(b), mask=b.mask,
                             **step_math.variance_step_scalars(h))
        derived.denom_written(b, h)


def compressed_step(ctx: StepContext, k: int) -> None:
    """COMPRESSED on every bucket, from ĝ in p.grad (the local g at P = 1)."""
    for b, h, g, x in _with_gradients(ctx, k):  # step_math.momentum_step, in one pass on the CPU
        native.local_step(g, x, b.exp_avg, ctx.engine.denom(b, h), mask=ctx.engine.mask_of(b),
                          **step_math.local_step_scalars(h))


def window_after(group: dict) -> tuple[float, float]:
    """(Λ, decay product) of ``group``'s window once this step is in it: Λ + γ, and the
    product times (1 − γλ) under AdamW's decoupled weight decay."""
    lr = float(group["lr"])
    decay_product = group["decay_product"]
    if group["weight_decay"] and group.get("decoupled_weight_decay", False):
        decay_product = decay_product * (1 - lr * group["weight_decay"])
    return group["lr_sum"] + lr, decay_product


def advance_window(param_groups: list[dict]) -> None:
    """Λ += γ and the window's decay product *= (1 − γλ) (AdamW), per param group."""
    for group in param_groups:
        group["lr_sum"], group["decay_product"] = window_after(group)


def fill_sync(b: Bucket, x: torch.Tensor, denom: torch.Tensor, decay_product: float, buf: torch.Tensor,
              preconditioned: bool) -> None:
    """SYNC steps 2–3 of bucket ``b``: the window's update u = x_a·(decay product) − x, times
    s when not ``preconditioned``, into the padded float32 ``buf`` (zeros past n)."""
    buf[b.numel:].zero_()
    if preconditioned:  # the common case in one pass
        native.sync_prepare(x, b.anchor, decay_product, buf[:b.numel])
    else:
        step_math.sync_prepare(x, b.anchor, denom, decay_product, buf[:b.numel], False)


class _SyncStep:
    """One SYNC step (algorithm.md §2): the 1-bit exchange of each live bucket's window update
    after this step's local update, and the rebuild of x, m and the anchor from it.

    The rebuild overwrites x and m without reading them, so a live bucket's local update is
    taken on copies for the exchange input only (:meth:`ZeroOneAdam.window_input`, by
    :meth:`fill` or by the backward hooks, ``ctx.started_early``), and on x and m for real only
    when the exchange is skipped (bitwise the same update: nothing it reads has changed). A
    bucket whose window did not move (its learning rates sum to 0) sends nothing and takes its
    local update at once. On a GPU the engine's scratch holds one bucket's denominator at a
    time (:meth:`~hvd_zoadam.core.engine.Engine.denom`; on the CPU the engine keeps every
    bucket's): ``denom_for`` says whose, and another is recomputed where it is used (bitwise
    the same each time: v is frozen).
    """

    def __init__(self, algorithm: ZeroOneAdam, ctx: StepContext, k: int):
        self.algorithm, self.ctx, self.k = algorithm, ctx, k
        self.engine = ctx.engine
        self.preconditioned = algorithm.precondition_compression
        self.denom_for = None  # the bucket whose denominator denom_value is
        self.denom_value = None
        self.rebuilt = set()   # id() of the buckets rebuilt from the exchange

    def run(self) -> None:
        engine, ctx = self.engine, self.ctx
        live = [b for b in engine.buckets if window_after(engine.param_groups[b.group_index])[0] > 0]
        sending = {id(b) for b in live}
        for b in engine.buckets:
            if id(b) not in sending:
                self.local_update(b)  # nothing to send: m still moves with g
        advance_window(engine.param_groups)
        if ctx.exchange(live, self.fill, self.consume, self.consume_packed):
            for group in engine.param_groups:
                group["lr_sum"], group["decay_product"] = 0.0, 1.0
        elif live:
            ctx.skipped = True
        for b in live:  # not rebuilt: the exchange was skipped
            if id(b) not in self.rebuilt:
                self.local_update(b)

    def local_update(self, b: Bucket) -> None:
        """SYNC step 1 on bucket ``b`` for real (:meth:`ZeroOneAdam.local_update`)."""
        h = self.engine.hyper(b, self.ctx.step, self.k)
        self.engine.store_x(b, self.algorithm.local_update(self.engine, b, h, self.denom(b)))

    def denom(self, b: Bucket):
        if self.denom_for is not b:
            self.denom_value = self.engine.denom(b, self.engine.hyper(b, self.ctx.step, self.k))
            self.denom_for = b
        return self.denom_value

    def fill(self, b: Bucket, buf: torch.Tensor) -> None:
        """SYNC steps 1–3 on copies: the window's update u into the exchange input ``buf``."""
        group = self.engine.param_groups[b.group_index]
        self.algorithm.window_input(self.engine, b, self.engine.hyper(b, self.ctx.step, self.k), self.denom(b),
                                    group["decay_product"], buf)

    def _factor(self, b) -> float:
        group = self.engine.param_groups[b.group_index]
        return self.engine.hyper(b, self.ctx.step, self.k).bias_correction1 / group["lr_sum"]

    def consume(self, b: Bucket, w: torch.Tensor) -> None:
        """SYNC steps 5–7 from the unpacked w."""
        group = self.engine.param_groups[b.group_index]
        x = self.engine.x_buffer(b)
        mask = self.engine.mask_of(b)
        if mask is None and self.preconditioned:  # the common case in one pass
            native.sync_rebuild(w, b.anchor, x, b.exp_avg, self.denom(b), self._factor(b), group["decay_product"])
        else:
            if group["decay_product"] != 1.0:
                b.anchor.mul_(group["decay_product"])
            step_math.sync_finish(x, b.anchor, b.exp_avg, self.denom(b), w, group["lr_sum"],
                              self.engine.hyper(b, self.ctx.step, self.k), mask, self.preconditioned)
        self._finish(b, x, mask)

    def consume_packed(self, b: Bucket, packed: torch.Tensor, server_scales: torch.Tensor) -> None:
        """The same as :meth:`consume`, fused: w is unpacked straight into m, the anchor and x,
        which is the parameters' flat storage itself where they have one (no copy), else the
        master weights or the scratch."""
        group = self.engine.param_groups[b.group_index]
        x = self.engine.x_buffer(b)
        mask = self.engine.mask_of(b)
        native.decompress_sync(packed, server_scales, b.exchange.plan, anchor=b.anchor, param=x, exp_avg=b.exp_avg,
                               denom=self.denom(b), factor=self._factor(b), decay_product=group["decay_product"],
                               mask=mask, preconditioned=self.preconditioned)
        self._finish(b, x, mask)

    def _finish(self, b, x, mask) -> None:
        """After the rebuild: the mask on the error buffers, and x into the parameters."""
        if mask is not None:
            b.exchange.mask_errors(mask)
        self.engine.store_x(b, x)
        self.rebuilt.add(id(b))
