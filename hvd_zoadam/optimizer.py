"""The imperative shell: a Horovod-style DistributedOptimizer running 0/1 Adam.

The class holds state; the math lives in :mod:`.kinds`, the schedule in
:mod:`.schedule`, the exchange in :mod:`.protocol`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from . import kinds, native
from .layout import make_buckets, scale_segments
from .protocol import Exchange
from .schedule import LOCAL_STEP_POLICIES, Schedule, StepKind, check_positive_int
from .elastic import register_state_handler
from .transport import Transport, make_transport

STATE_KEY = "zoadam"            # param_groups[0][STATE_KEY]: the step counters shared by all ranks
_KIND_NAMES = [k.value for k in StepKind]
_prefix_counts: dict = {}  # layout digest -> optimizers built over it in this process
_registered = {}  # id(param) -> (weakref to param, weakref to the optimizer that owns it)


@dataclass
class _Bucket:
    """One fused exchange unit: consecutive trainable params of one param group and device."""

    group_index: int
    params: list
    names: list
    exchange: Exchange
    exp_avg: torch.Tensor       # float32[n]
    exp_avg_sq: torch.Tensor    # float32[n]
    anchor: torch.Tensor        # float32[n], x_a; meaningful after the freeze
    master: torch.Tensor | None = None  # float32[n] master weights when the params are fp16/bf16
    mask: torch.Tensor | None = None    # uint8[n] momentum mask (exp_avg_mask), 0 = never moves
    views: dict = field(default_factory=dict)  # key -> list of per-param views of the flat buffers

    @property
    def numel(self) -> int:
        return self.exchange.numel


def _check_group(group: dict, index: int) -> None:
    """Validate one param group's Adam options (ValueError/TypeError naming the option)."""
    where = f"param_groups[{index}]"
    for opt, bad, fix in (("amsgrad", True, "set amsgrad=False"),
                          ("maximize", True, "negate the loss instead"),
                          ("capturable", True, "set capturable=False"),
                          ("differentiable", True, "set differentiable=False"),
                          ("fused", True, "leave fused=None; hvd_zoadam runs its own fused math")):
        if group.get(opt, False) == bad:
            raise ValueError(f"{where}: {opt}={bad} is not supported by 0/1 Adam; {fix}")
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        raise TypeError(f"{where}: lr must be a Python float, not a Tensor")
    if not lr >= 0:
        raise ValueError(f"{where}: lr must be >= 0, got {lr}")
    beta1, beta2 = group["betas"]
    for name, b in (("betas[0]", beta1), ("betas[1]", beta2)):
        if isinstance(b, torch.Tensor) or not 0.0 <= b < 1.0:
            raise ValueError(f"{where}: {name} must be a float in [0, 1), got {b}")
    if not group["eps"] >= 0:
        raise ValueError(f"{where}: eps must be >= 0, got {group['eps']}")
    if not group["weight_decay"] >= 0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {group['weight_decay']}")


class ZeroOneAdamOptimizer(torch.optim.Optimizer):
    """0/1 Adam over Horovod (Lu et al., arXiv 2202.06009). Build it with :func:`DistributedOptimizer`.

    It shares ``param_groups`` (lr, betas, eps, weight_decay) with the wrapped
    ``torch.optim.Adam``/``AdamW``; they are read at every step, so LR schedulers and
    manual changes take effect at once.

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
                 precondition_compression: bool = True, step_log: str | None = None, overlap: bool = True):
        self._ready = False
        super().__init__(optimizer.param_groups, dict(optimizer.defaults))
        self.schedule = schedule
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
            self._step_log = step_log.format(rank=transport.rank)
        self._loss = None
        self._user_masks = {}  # param -> mask tensor, resolved from exp_avg_mask after naming
        self._names = self._name_parameters(named_parameters)
        self._uid = self._collective_prefix()
        self._user_masks = self._resolve_masks(exp_avg_mask)
        self._buckets: list[_Bucket] = []
        self._device = None  # the one device of every trainable parameter (CPU or one CUDA device)
        self._scratch = {}
        self._hook_handles = []
        self._passes = {}
        self._synchronized = False
        self._should_synchronize = True
        self._pending = None          # (step, kind, skip) prepared by synchronize()
        self._exchanged = False       # p.grad holds this step's exchange result
        self._inv_grad_scale = None   # 1 / GradScaler's scale while scaler.step() drives us
        self._checked_layout = False
        self._mask_cache = {}
        # Overlap with the backward pass (see _launch_ready): which bucket each param is in, how
        # many of a bucket's params are ready, how far along the launch order we are, and the
        # exchange started from the hooks for the coming step.
        self._bucket_of = {}
        self._ready_count = []
        self._launch_pos = 0
        self._early = None
        self._amp_seen = False
        self._warned_changed = False
        self._stats = {k: {"steps": 0, "rounds": 0, "bytes_sent": 0} for k in _KIND_NAMES}
        self._stats_extra = {"skipped_steps": 0, "adam_equivalent_bytes": 0}
        self._adam_equivalent_bytes = 0.0
        self.param_groups[0].setdefault(STATE_KEY, {"step": 0, "exp_avg_sq_steps": 0, "freeze_lr": None})
        for index, group in enumerate(self.param_groups):
            _check_group(group, index)
            self._build_group(index)
        if not self._buckets and not any(p.numel() == 0 for g in self.param_groups for p in g["params"]
                                         if p.requires_grad):
            raise ValueError("nothing to optimize: no parameter of the optimizer has requires_grad=True")
        native.warm_up(self._device)  # the kernels' JIT here, not as a stall of the first exchanging step
        self._ready = True

    # -- construction ----------------------------------------------------------------------
    def _name_parameters(self, named_parameters) -> dict:
        params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            return {p: f"noname.{i}.{j}" for i, g in enumerate(self.param_groups)
                    for j, p in enumerate(g["params"])}
        named_parameters = list(named_parameters)
        if any(not isinstance(item, tuple) for item in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        seen, dups = set(), set()
        for name, _ in named_parameters:
            (dups if name in seen else seen).add(name)
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                             + ", ".join(sorted(dups)))
        names = {p: name for name, p in named_parameters}
        missing = [id(p) for p in params if p not in names]
        if missing:
            raise ValueError("named_parameters was specified, but one or more model parameters were "
                             "not named. Python object ids: " + ", ".join(map(str, missing)))
        return names

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

    def _collective_prefix(self) -> str:
        """A rank-independent name for this optimizer's collectives: a digest of its parameter
        layout (names, shapes, dtypes, groups) plus how many optimizers over the same layout this
        process built before. A per-process instance counter would pair different optimizers
        across ranks that built, say, an extra optimizer for evaluation."""
        layout = [(i, self._names[p], tuple(p.shape), str(p.dtype)) for i, g in enumerate(self.param_groups)
                  for p in g["params"] if p.requires_grad]
        digest = hashlib.sha1(repr((layout, self.transport.world_size)).encode()).hexdigest()[:10]
        if not hasattr(self, "_uid_count"):
            # counted per rank too, so that P thread-ranks in one process (the tests' in-process
            # transport) name their collectives alike, as separate processes do
            key = (digest, self.transport.rank)
            self._uid_count = _prefix_counts.get(key, 0)
            _prefix_counts[key] = self._uid_count + 1
        return f"{digest}.{self._uid_count}"

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
            if p.is_sparse:
                raise TypeError(f"parameter {self._names.get(p)!r} is sparse; 0/1 Adam needs dense parameters")
            if not p.is_floating_point():
                raise TypeError(f"parameter {self._names.get(p)!r} has dtype {p.dtype}; 0/1 Adam needs "
                                "floating-point parameters")
            if p.device.type not in ("cpu", "cuda"):
                raise TypeError(f"parameter {self._names.get(p)!r} is on {p.device}: hvd_zoadam runs on CPU and "
                                "CUDA tensors; move the model to a CUDA device or to the CPU")
            if self._device is None:
                self._device, self._device_param = p.device, self._names.get(p)
            elif p.device != self._device:
                raise ValueError(f"parameter {self._names.get(p)!r} is on {p.device} but parameter "
                                 f"{self._device_param!r} is on {self._device}: hvd_zoadam needs every trainable "
                                 "parameter of a rank on one device, as Horovod does (torch.cuda.set_device("
                                 "hvd.local_rank()), then model.cuda())")
        by_dtype = {}
        for p in trainable:
            by_dtype.setdefault(p.dtype, []).append(p)
        for params in by_dtype.values():
            for idx in make_buckets([p.numel() for p in params], self.bucket_cap_numel):
                self._add_bucket(index, [params[i] for i in idx])
        for p in trainable:
            _registered[id(p)] = (weakref.ref(p), weakref.ref(self))
            if p not in self._passes:
                self._passes[p] = 0
                if hasattr(p, "register_post_accumulate_grad_hook"):
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _add_bucket(self, group_index: int, params: list) -> None:
        for p in params:
            self._bucket_of[p] = len(self._buckets)
        self._ready_count.append(0)
        numels = [p.numel() for p in params]
        name = f"zoadam.{self._uid}.b{len(self._buckets)}"
        dev = self._device
        exchange = Exchange(scale_segments(numels, self.scale_block_numel), self.transport, name, device=dev)
        n = exchange.numel
        bucket = _Bucket(group_index, params, [self._names[p] for p in params], exchange,
                         torch.zeros(n, device=dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev))
        if params[0].dtype != torch.float32:
            bucket.master = torch.cat([p.detach().reshape(-1).float() for p in params])
        keys = ["exp_avg", "exp_avg_sq", "anchor"]
        if any(p in self._user_masks for p in params):
            bucket.mask = torch.cat([self._user_masks[p].reshape(-1).to(dev, torch.uint8) if p in self._user_masks
                                     else torch.ones(p.numel(), dtype=torch.uint8, device=dev) for p in params])
            keys.append("mask")
        for key in keys:
            flat = getattr(bucket, key)
            bucket.views[key] = [v.view_as(p) for v, p in zip(flat.split(numels), params)]
            for p, v in zip(params, bucket.views[key]):
                self.state[p]["exp_avg_mask" if key == "mask" else key] = v
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1).float() for p in params], out=bucket.anchor)
        self._buckets.append(bucket)
        for key, size in (("x", n), ("g", exchange.padded_numel), ("w", n)):
            if self._scratch.get(key, torch.empty(0)).numel() < size:
                self._scratch[key] = torch.zeros(size, device=dev)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (torch semantics). Its params get new, zeroed buffers and unique names."""
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            index = len(self.param_groups) - 1
            _check_group(self.param_groups[index], index)
            for j, p in enumerate(self.param_groups[index]["params"]):
                self._names.setdefault(p, f"noname.{index}.{j}")
            self._build_group(index)
            self._checked_layout = False

    def _make_hook(self, p):
        def hook(*_):
            if self._passes[p] >= self.backward_passes_per_step:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally. (hvd_zoadam: parameter "
                    f"{self._names.get(p)!r} of the optimizer {self._uid}; when several optimizers share a "
                    "model, call step() or zero_grad() on each one whose parameters got gradients.)")
            self._passes[p] += 1
            if self._passes[p] == self.backward_passes_per_step and p in self._bucket_of and self._can_overlap():
                self._ready_count[self._bucket_of[p]] += 1
                self._launch_ready()
        return hook

    def _reset_passes(self) -> None:
        """Forget this step's backward passes; drain an exchange the hooks started (it was started
        on every rank, so it is completed and its result dropped)."""
        for p in self._passes:
            self._passes[p] = 0
        self._ready_count = [0] * len(self._buckets)
        self._launch_pos = 0
        self._drain_early()

    def _drain_early(self) -> None:
        early, self._early = self._early, None
        if early is None or early["kind"] is None:
            return
        for started in early["handles"].values():
            for handle, _, _ in started:
                self.transport.wait(handle)
        for handle in early["scales"].values():
            self.transport.wait(handle)

    # -- overlap with the backward pass --------------------------------------------------------
    @property
    def _launch_order(self) -> list:
        """Buckets in the order their exchanges start: last bucket first, because backward
        produces the last layers' gradients first. The same on every rank (MPI needs it)."""
        return list(range(len(self._buckets) - 1, -1, -1))

    def _can_overlap(self) -> bool:
        # Not before the first step's settings check (a mismatch must fail fast, not hang in a
        # collective), and not under a GradScaler (its scale is known only in step()).
        return (self.overlap and self.transport.supports_async and self.world_size > 1 and self._checked_layout
                and not self._amp_seen
                and self._pending is None and getattr(self, "_ready", False))

    def _launch_ready(self) -> None:
        """Start the coming step's exchange for every bucket whose gradients are all ready, in
        launch order: a VARIANCE step's allreduces; a COMPRESSED step's worker side (scales,
        signs, the staged error) and round 1 (the scales' allgather), whose rounds 2–3 then
        run in synchronize(), once every rank's round 1 is in. Local steps send nothing; a
        SYNC step sends the update made in step(), so it starts nothing early."""
        if self._early is None:
            step, kind = self._next_kind()
            early_kind = kind if kind in (StepKind.VARIANCE, StepKind.COMPRESSED) else None
            self._early = {"step": step, "kind": early_kind, "handles": {}, "scales": {}, "pre": {}}
        early = self._early
        if early["kind"] is None:
            return
        order = self._launch_order
        while self._launch_pos < len(order):
            bi = order[self._launch_pos]
            if self._ready_count[bi] < len(self._buckets[bi].params):
                return
            self._launch(bi)
            self._launch_pos += 1

    def _launch(self, bi: int) -> None:
        early, b = self._early, self._buckets[bi]
        self.transport.counter.kind = early["kind"].value
        # What the allreduce read: checked in synchronize(), so that a gradient changed after
        # backward() (e.g. clipped without synchronize()) is not silently left out.
        early.setdefault("seen", {})[bi] = [(p.grad, p.grad._version if p.grad is not None else None)
                                            for p in b.params]
        if early["kind"] is StepKind.VARIANCE:
            early["handles"][bi] = self._start_average(b, copy=True)
        else:
            early["scales"][bi] = self._start_compressed(bi, early["step"], early["pre"])

    def _start_compressed(self, bi: int, step: int, pre: dict):
        """Fill bucket ``bi``'s exchange input for a COMPRESSED step (``pre`` caches the
        preconditioning by bucket index) and start round 1. Returns round 1's handle."""
        b = self._buckets[bi]
        if bi not in pre:
            pre[bi] = self._compress_denom(b, step)
        self._fill_compressed(b, b.exchange.input, step, pre[bi] or False)
        return b.exchange.start_scales(b.exchange.input)

    # -- per-step helpers --------------------------------------------------------------------
    @property
    def _counters(self) -> dict:
        return self.param_groups[0][STATE_KEY]

    def _hyper(self, group: dict, step: int, exp_avg_sq_steps: int) -> kinds.Hyper:
        beta1, beta2 = group["betas"]
        return kinds.Hyper(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=group["weight_decay"],
                           decoupled=bool(group.get("decoupled_weight_decay", False)),
                           bias_correction=self.bias_correction, step=step,
                           exp_avg_sq_steps=max(exp_avg_sq_steps, 1))

    def _next_kind(self) -> tuple[int, StepKind]:
        c = self._counters
        step = c["step"] + 1
        lr = float(self.param_groups[0]["lr"])
        return step, self.schedule.kind(step, lr=lr, freeze_lr=c["freeze_lr"])

    def _grads_into(self, bucket: _Bucket, out: torch.Tensor, raw: bool = True) -> None:
        """out[:n] <- the bucket's gradients as float32 (None counts as 0).

        ``raw``: ``p.grad`` holds this rank's own gradient (not an exchange result), which is
        still multiplied by a ``torch.amp.GradScaler`` loss scale when one drives the step.
        """
        grads = []
        for p, name in zip(bucket.params, bucket.names):
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
            elif g.is_sparse:
                if not self.sparse_as_dense:
                    raise ValueError(f"parameter {name!r} got a sparse gradient; pass sparse_as_dense=True "
                                     "to hvd_zoadam.DistributedOptimizer (0/1 Adam exchanges dense tensors)")
                g = g.to_dense()
            grads.append(g.reshape(-1).float())
        torch.cat(grads, out=out[:bucket.numel])
        if raw and self._inv_grad_scale is not None:
            out[:bucket.numel].mul_(self._inv_grad_scale)

    @staticmethod
    def _scatter(flat: torch.Tensor, targets: list) -> None:
        torch._foreach_copy_([t.detach() for t in targets],
                             [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in targets]), targets)])

    def _write_grads(self, bucket: _Bucket, flat: torch.Tensor) -> None:
        for p in bucket.params:
            if p.grad is None or p.grad.is_sparse:
                p.grad = torch.zeros_like(p)
        self._scatter(flat[:bucket.numel], [p.grad for p in bucket.params])

    def _check_params_unchanged(self) -> None:
        """The buffers were laid out for the parameters at construction (BH-23): refuse to go on
        when a parameter was replaced in param_groups or resized in place."""
        current = [p for g in self.param_groups for p in g["params"] if p.requires_grad and p.numel()]
        laid_out = [p for b in self._buckets for p in b.params]
        if len(current) == len(laid_out) and all(a is b for a, b in zip(current, laid_out)) \
                and all(p.numel() == v.numel() for b in self._buckets for p, v in zip(b.params, b.views["exp_avg"])):
            return
        for b in self._buckets:
            for p, v, name in zip(b.params, b.views["exp_avg"], b.names):
                if p.numel() != v.numel():
                    raise ValueError(f"parameter {name!r} changed shape from {tuple(v.shape)} to {tuple(p.shape)} "
                                     "after the optimizer was built; its error buffers and chunks no longer fit. "
                                     "Build a new hvd_zoadam.DistributedOptimizer after changing the model.")
        raise ValueError("the trainable parameters in param_groups are not the ones hvd_zoadam laid out at "
                         "construction (a parameter was replaced, or requires_grad changed); build a new "
                         "hvd_zoadam.DistributedOptimizer after changing the model, or use add_param_group "
                         "for new parameters")

    def _check_layout(self) -> None:
        """algorithm.md §5: compare settings and parameter layout across ranks; raise on every rank on a mismatch."""
        self._checked_layout = True
        if self.world_size == 1:
            return
        mine = self._digest_items()
        # A fixed name: the layout digest in self._uid may itself differ across ranks, and Horovod
        # pairs collectives by name (sequential calls may reuse one).
        everyone = self.transport.allgather_object(mine, "zoadam.layout_check")
        for rank, theirs in enumerate(everyone):
            if theirs == mine:
                continue
            keys = sorted(set(mine) | set(theirs))
            diffs = [f"{k}: this rank ({self.transport.rank}) has {mine.get(k, '<missing>')!r}, "
                     f"rank {rank} has {theirs.get(k, '<missing>')!r}" for k in keys if mine.get(k) != theirs.get(k)]
            raise ValueError("hvd_zoadam settings or parameter layout differ across ranks; every rank must build "
                             "the optimizer alike. Differences: " + "; ".join(diffs[:10]))

    def _digest_items(self) -> dict:
        items = {f"schedule.{k}": v for k, v in vars(self.schedule).items()}
        items.update(bias_correction=self.bias_correction, bucket_cap_numel=self.bucket_cap_numel,
                     scale_block_numel=self.scale_block_numel, auto_exp_avg_mask=self.auto_exp_avg_mask,
                     precondition_compression=self.precondition_compression, overlap=self.overlap,
                     backward_passes_per_step=self.backward_passes_per_step,
                     compression=getattr(self.compression, "__name__", repr(self.compression)))
        for i, b in enumerate(self._buckets):
            layout = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(b.names, b.params)]
            items[f"bucket{i}"] = hashlib.sha1(repr((b.group_index, layout)).encode()).hexdigest()[:12] \
                if len(layout) > 64 else layout
        items["buckets"] = len(self._buckets)
        return items

    # -- elastic -------------------------------------------------------------------------------
    def on_reset(self) -> None:
        """Re-lay out this rank's world-size-dependent state for the current Horovod world.

        For ``hvd.elastic.run``: after a reset (``hvd.shutdown(); hvd.init()``) the world size
        and this process's rank may differ. Every bucket gets a new exchange plan and new,
        zeroed ``worker_error`` float32[padded_numel(n, P)] and ``server_error``
        float32[padded_numel(n, P) // P] (error feedback restarts, as after a resume on
        another world size); m, v, the anchor, the window and the schedule counters are
        untouched (``state.sync()`` broadcasts them from rank 0 right after). The settings
        and layout check of the first step runs again, on every rank. A half-done step
        (counted backward passes, a prepared exchange) is dropped.

        ``hvd.elastic.TorchState`` calls this from its ``sync()`` on every rank (hvd_zoadam
        registers a state handler for its optimizer); :meth:`step` also calls it when it
        finds the world size or rank changed. Collectives: none.
        """
        self.transport.refresh()
        self.world_size = self.transport.world_size
        self._uid = self._collective_prefix()
        for i, b in enumerate(self._buckets):
            numels = [p.numel() for p in b.params]
            b.exchange = Exchange(scale_segments(numels, self.scale_block_numel), self.transport,
                                  f"zoadam.{self._uid}.b{i}", device=self._device)
            if self._scratch["g"].numel() < b.exchange.padded_numel:
                self._scratch["g"] = torch.zeros(b.exchange.padded_numel, device=self._device)
        self._checked_layout = False
        self._pending = None
        self._synchronized = False
        self._exchanged = False
        self._early = None  # handles of the old world: dropped, not waited for
        self._reset_passes()

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
        armed = kind in (StepKind.VARIANCE, StepKind.COMPRESSED) and self._can_overlap()  # the same on every rank
        self._check_params_unchanged()
        if not self._checked_layout:
            self._check_layout()
        if self._early is not None and (self._early["step"] != step or self._early["kind"] not in (kind, None)):
            self._drain_early()  # the schedule moved under us (a load between backward and step)
        if armed:
            self.transport.counter.kind = kind.value
            self._early_changed_anywhere(step, kind)
        skip = False
        self._exchanged = kind in (StepKind.VARIANCE, StepKind.COMPRESSED) and self.world_size > 1
        if self._exchanged:
            self.transport.counter.kind = kind.value
            skip = not (self._average_grads() if kind is StepKind.VARIANCE else self._compress_grads(step))
        self._early = None
        self._launch_pos = len(self._buckets)  # nothing more starts from the hooks this step
        self._pending = (step, kind, skip)
        self._synchronized = True

    def _fp16_wire(self) -> bool:
        return self.compression is not None and getattr(self.compression, "__name__", "") == "FP16Compressor"

    def _early_changed_anywhere(self, step: int, kind: StepKind) -> bool:
        """Whether some rank's gradients changed after the hooks started their exchange
        (e.g. clipped without synchronize()). One 4-byte allreduce, on every VARIANCE and
        COMPRESSED step where overlap is armed (a rank-independent condition), so all ranks
        agree; True means the early results are dropped and the step exchanges the gradients
        as they are now, like overlap=False (a COMPRESSED step's early worker side only
        staged its error: ``worker_error`` is untouched until round 2)."""
        changed = 0.0
        for bi, seen in (self._early or {}).get("seen", {}).items():
            b = self._buckets[bi]
            if any(p.grad is not grad or (grad is not None and grad._version != version)
                   for p, (grad, version) in zip(b.params, seen)):
                changed = 1.0
        flag = self.transport.allreduce_average_(torch.tensor([changed]), f"zoadam.{self._uid}.grads_changed.{step}")
        if float(flag[0]) == 0.0:
            return False
        # Every rank completes the early allreduces of every bucket once (starting, with its
        # current gradients, the ones its hooks did not start), so the names pair up; the
        # results are dropped and the step then exchanges the current gradients.
        early = self._early or {"handles": {}, "scales": {}, "pre": {}}
        for bi in self._launch_order:
            b = self._buckets[bi]
            if kind is StepKind.VARIANCE:
                started = early["handles"].pop(bi, None)
                if started is None:
                    started = self._start_average(b, copy=True)
                for handle, _, _ in started:
                    self.transport.wait(handle)
            else:
                handle = early["scales"].pop(bi, None)
                if handle is None:
                    handle = self._start_compressed(bi, step, early["pre"])
                self.transport.wait(handle)
        self._early = None
        if not self._warned_changed:
            self._warned_changed = True
            warnings.warn("hvd_zoadam: gradients changed after backward() had already started their exchange "
                          "(overlap with the backward pass, as in hvd.DistributedOptimizer); the step exchanges "
                          "them again as they are now, which doubles its traffic. To modify gradients (e.g. clip "
                          "them) call opt.synchronize() first and then `with opt.skip_synchronize(): opt.step()`, "
                          "or build the optimizer with overlap=False.")
        return True

    def _start_average(self, b: _Bucket, copy: bool = False) -> list:
        """Start Horovod's in-place average of each gradient of bucket ``b`` (names fixed per
        tensor, so the hook path and the synchronize path pair up across ranks). Counted as
        one round of the bucket's bytes, as Horovod fuses them. Returns per-tensor
        (handle, wire tensor, float32 tensor) triples for :meth:`_finish_average`."""
        f = self.gradient_predivide_factor
        width = 2 if self._fp16_wire() else 4
        p_ = self.world_size
        self.transport.counter.add(2 * (p_ - 1) / p_ * width * b.numel)
        out = []
        for j, (p, name) in enumerate(zip(b.params, b.names)):
            g = p.grad
            if g is None:
                g = p.grad = torch.zeros_like(p)
            elif g.is_sparse:
                if not self.sparse_as_dense:
                    raise ValueError(f"parameter {name!r} got a sparse gradient; pass sparse_as_dense=True "
                                     "to hvd_zoadam.DistributedOptimizer (0/1 Adam exchanges dense tensors)")
                g = p.grad = g.to_dense()
            g32 = g if (g.dtype == torch.float32 and g.is_contiguous() and not copy) else g.float().contiguous()
            if g32 is g and copy:
                g32 = g.clone()
            if self._inv_grad_scale is not None:
                g32.mul_(self._inv_grad_scale)
            if f != 1.0:
                g32.div_(f)
            wire = g32.to(torch.float16) if width == 2 else g32
            if p_ == 1 and width == 4:  # the average of one float32 tensor is itself: no collective
                out.append((None, wire, g32))
                continue
            out.append((self.transport.start("allreduce", wire.view(-1), f"{b.exchange.name}.avg.{j}", count=False),
                        wire, g32))
        return out

    def _finish_average(self, b: _Bucket, started: list) -> list:
        """Wait for :meth:`_start_average`'s allreduces; write the float32 averages into p.grad.
        Returns the float32 averages, for one finiteness check of the whole step."""
        f, averages = self.gradient_predivide_factor, []
        for p, (handle, wire, g32) in zip(b.params, started):
            if handle is not None:
                self.transport.wait(handle)
            if wire is not g32:
                g32.copy_(wire)
            if f != 1.0:
                g32.mul_(f)
            averages.append(g32)
            if p.grad is None:  # dropped after the hooks started its allreduce
                p.grad = torch.zeros_like(p)
            if g32 is not p.grad:
                p.grad.copy_(g32.view_as(p.grad))
        return averages

    def _average_grads(self) -> bool:
        early = self._early if (self._early and self._early.get("kind") is StepKind.VARIANCE) else None
        started = {}
        for bi in self._launch_order:
            if early is not None and bi in early["handles"]:
                started[bi] = early["handles"].pop(bi)
            else:
                started[bi] = self._start_average(self._buckets[bi])
        averages = []
        for bi in self._launch_order:
            averages += self._finish_average(self._buckets[bi], started[bi])
        return native.all_finite_many(averages)  # on a GPU, one host synchronisation per step

    def _exchange_all(self, buckets, fill, consume, consume_packed=None, started=None) -> bool:
        """C(.) of every bucket in ``buckets``, in order. Returns False when skipped.

        ``fill(bucket, buf)`` writes the input into the padded scratch ``buf``;
        ``consume(bucket, w)`` receives the float32[n] result, or, when P > 1 and
        ``consume_packed`` is given, ``consume_packed(bucket, packed, server_scales)`` receives
        it still packed (a fused kernel then unpacks it). All buckets' scales are exchanged
        first, so a non-finite input anywhere skips every bucket before any error buffer
        changes (algorithm.md §5). At P > 1 each bucket is filled once, into its exchange's own input
        buffer, which the worker side turns into the new error; at P = 1 with several buckets
        the shared scratch is filled again for the second phase (bitwise alike). ``started``
        (P > 1) maps ``id(bucket)`` to a round 1 the backward hooks already started from the
        bucket's exchange input; those buckets are not filled again.
        """
        g, w = self._scratch["g"], self._scratch["w"]
        if self.world_size == 1 and len(buckets) == 1:  # C(y) = y: fill once, hand y itself over
            b = buckets[0]
            buf = g[:b.exchange.padded_numel]
            fill(b, buf)
            if b.exchange.prepare(buf) is None:
                return False
            consume(b, buf[:b.numel])
            return True
        if self.world_size == 1:
            prepared = []
            for b in buckets:
                buf = g[:b.exchange.padded_numel]
                fill(b, buf)
                scales = b.exchange.prepare(buf)
                if scales is None:
                    return False
                prepared.append(scales)
            for b, scales in zip(buckets, prepared):
                buf = g[:b.exchange.padded_numel]
                fill(b, buf)
                consume(b, b.exchange.finish(buf, scales, w[:b.numel]))
            return True
        # Pipelined in bucket order (the same on every rank, as MPI requires): each bucket's
        # collective is in flight while the next bucket's scales / signs / server chunk are
        # computed. Round 1 of every bucket completes before any error buffer changes.
        handles = {}
        for b in buckets:
            if started and id(b) in started:
                handles[id(b)] = started[id(b)]
                continue
            fill(b, b.exchange.input)
            handles[id(b)] = b.exchange.start_scales(b.exchange.input)
        prepared = [b.exchange.wait_scales(handles[id(b)]) for b in buckets]
        if any(scales is None for scales in prepared):
            return False
        handles = [b.exchange.start_signs(scales) for b, scales in zip(buckets, prepared)]
        handles = [b.exchange.start_server(h, scales) for b, h, scales in zip(buckets, handles, prepared)]
        for b, h in zip(buckets, handles):
            if consume_packed is not None:
                consume_packed(b, *b.exchange.gather(h))
            else:
                consume(b, b.exchange.finish_gather(h, w[:b.numel]))
        return True

    def _compress_denom(self, b: _Bucket, step: int):
        """(s, clip) of bucket ``b`` for the preconditioned exchange of a COMPRESSED step, or None."""
        if not self.precondition_compression:
            return None
        k = self._counters["exp_avg_sq_steps"]
        h = self._hyper(self.param_groups[b.group_index], step, k)
        return kinds.adam_denom(b.exp_avg_sq, h), kinds.normalized_gradient_bound(h, k)

    def _fill_compressed(self, b: _Bucket, buf: torch.Tensor, step: int, pre=None) -> None:
        """buf <- the exchange input of a COMPRESSED step: g, or g/s clipped (see _compress_grads)."""
        pre = self._compress_denom(b, step) if pre is None else (pre or None)
        buf[b.numel:].zero_()
        self._grads_into(b, buf)
        if pre is not None:
            native.clamp_finite_(buf[:b.numel].div_(pre[0]), pre[1])  # a NaN/Inf must reach the scales

    def _compress_grads(self, step: int) -> bool:
        """C(g) of every bucket into p.grad.

        With ``precondition_compression`` the exchange runs on y = g/s (s = sqrt(v̂) + eps,
        identical on all ranks), clipped to |y| <= sqrt(1 − β2^(k+1)) / sqrt(1 − β2) — the
        largest |g|/sqrt(v̂) Adam itself allows once v has seen g — and the result is multiplied
        back by s. Each coordinate's compression error then scales with its own s, and a
        coordinate whose gradient appears after v was last updated cannot blow up the scale of
        its block (README: "Compression domain").
        """
        early = self._early if (self._early and self._early.get("kind") is StepKind.COMPRESSED) else None
        cached = early["pre"] if early is not None else {}
        pre = {id(b): cached[bi] if bi in cached else self._compress_denom(b, step)
               for bi, b in enumerate(self._buckets)}
        started = {id(self._buckets[bi]): handle for bi, handle in early["scales"].items()} if early else {}
        if early is not None:
            early["scales"] = {}

        def fill(b, buf):
            self._fill_compressed(b, buf, step, pre[id(b)] or False)

        def consume(b, w):
            if pre[id(b)] is not None:
                w.mul_(pre[id(b)][0])
            mask = self._mask_of(b)
            if mask is not None:
                w.mul_(mask)
                b.exchange.mask_errors(mask)
            self._write_grads(b, w)
        # In launch order, as the hooks start them (MPI pairs collectives by their order).
        return self._exchange_all([self._buckets[bi] for bi in self._launch_order], fill, consume, started=started)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Context in which ``step()`` does not call ``synchronize()`` (Horovod's clipping pattern)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; also resets the backward-pass count of ``backward_passes_per_step``."""
        self._reset_passes()
        super().zero_grad(set_to_none=set_to_none)

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
            self._inv_grad_scale = 1.0 / float(grad_scale)
            self._amp_seen = True
        try:
            return self._step(loss)
        finally:
            self._inv_grad_scale = None

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
        if kind in (StepKind.LOCAL, StepKind.SYNC) and step == self.schedule.var_freeze_step + 1:
            self._enter_freeze(counters)
        k = counters["exp_avg_sq_steps"] + (1 if kind is StepKind.VARIANCE and not skip else 0)
        self.transport.counter.kind = kind.value
        if not skip:
            {StepKind.VARIANCE: self._variance_step, StepKind.COMPRESSED: self._compressed_step,
             StepKind.LOCAL: self._local_step, StepKind.SYNC: self._sync_step}[kind](step, k)
        self._record(kind, skip)
        counters.update(step=step, exp_avg_sq_steps=k)
        if self._step_log:
            self._write_step_log(step, kind, skip, loss)
        self._reset_passes()
        return loss

    def _enter_freeze(self, counters: dict) -> None:
        """algorithm.md §4 'At the freeze': zero both error buffers, anchor <- x, remember lr."""
        counters["freeze_lr"] = float(self.param_groups[0]["lr"])
        for b in self._buckets:
            b.exchange.zero_errors()
            b.anchor.copy_(self._load_x(b))
        for group in self.param_groups:
            group["lr_sum"], group["decay_product"] = 0.0, 1.0

    def _mask_of(self, b: _Bucket):
        """The momentum mask in force for bucket ``b`` (None when there is none).

        With ``auto_exp_avg_mask``, a coordinate whose ``exp_avg_sq`` is exactly 0 is masked:
        its averaged gradient was exactly 0 on all ranks in every VARIANCE step so far. Such a
        coordinate cannot take an Adam step with the (frozen) v: the step would be m/eps, and
        sign compression hands it ±scale noise. No extra memory: the test reads v.
        """
        if not self.auto_exp_avg_mask:
            return b.mask
        # Cached until exp_avg_sq changes (its version counter moves on every in-place write:
        # a VARIANCE step, a load, a broadcast); None when nothing is masked, which saves a
        # pass over the bucket in every step and is bitwise the same as an all-ones mask.
        key = (b.exp_avg_sq._version, id(b.mask))
        cached = self._mask_cache.get(id(b))
        if cached is None or cached[0] != key:
            seen = b.exp_avg_sq != 0
            mask = seen if b.mask is None else seen & b.mask.bool()
            cached = (key, None if bool(mask.all()) else mask)
            self._mask_cache[id(b)] = cached
        return cached[1]

    def _load_x(self, b: _Bucket) -> torch.Tensor:
        """x as float32[n]: the fp32 params gathered, or the master weights of fp16/bf16 params.

        Master weights are re-read from the params when someone else changed them since our
        last write (a model load or a broadcast), detected by comparing the rounded values.
        """
        if b.master is None:
            x = self._scratch["x"][:b.numel]
            torch.cat([p.detach().reshape(-1).float() for p in b.params], out=x)
            return x
        views = b.master.split([p.numel() for p in b.params])
        for p, v in zip(b.params, views):
            if not torch.equal(v.to(p.dtype), p.detach().reshape(-1)):
                v.copy_(p.detach().reshape(-1))
        return b.master

    def _variance_step(self, step, k):
        g = self._scratch["g"]
        for b in self._buckets:
            h = self._hyper(self.param_groups[b.group_index], step, k)
            self._grads_into(b, g, raw=not self._exchanged)
            x = self._load_x(b)
            # Only the user's mask here: with the exact average, v == 0 after this step means every
            # ḡ so far was exactly 0, so m is already 0 there (the automatic mask is a no-op).
            kinds.variance_step(x, g[:b.numel], b.exp_avg, b.exp_avg_sq, h, b.mask, denom_out=self._scratch_d(b.numel))
            self._scatter(x, b.params)

    def _compressed_step(self, step, k):
        g = self._scratch["g"]
        for b in self._buckets:
            h = self._hyper(self.param_groups[b.group_index], step, k)
            self._grads_into(b, g, raw=not self._exchanged)
            x = self._load_x(b)
            denom = kinds.adam_denom(b.exp_avg_sq, h, out=self._scratch_d(b.numel))
            kinds.momentum_step(x, g[:b.numel], b.exp_avg, denom, h, self._mask_of(b))
            self._scatter(x, b.params)

    def _scratch_d(self, numel: int) -> torch.Tensor:
        """A reusable float32 buffer for a denominator used at once (not kept across buckets)."""
        d = self._scratch.get("d")
        if d is None or d.numel() < numel:
            d = self._scratch["d"] = torch.empty(max(numel, max(b.numel for b in self._buckets)), device=self._device)
        return d[:numel]

    def _local_update(self, b: _Bucket, h: kinds.Hyper, denom) -> torch.Tensor:
        g = self._scratch["g"]
        self._grads_into(b, g)
        x = self._load_x(b)
        if native.all_finite(g[:b.numel]):
            if self.precondition_compression:
                # v is frozen: bound |g|/s as Adam would once v had seen g (see _compress_grads)
                native.clamp_by(g[:b.numel], denom, kinds.normalized_gradient_bound(h, self._counters["exp_avg_sq_steps"]))
            kinds.momentum_step(x, g[:b.numel], b.exp_avg, denom, h, self._mask_of(b))
        return x

    def _advance_window(self, step):
        for group in self.param_groups:
            lr = float(group["lr"])
            group["lr_sum"] = group["lr_sum"] + lr
            if group["weight_decay"] and group.get("decoupled_weight_decay", False):
                group["decay_product"] = group["decay_product"] * (1 - lr * group["weight_decay"])

    def _local_step(self, step, k):
        for b in self._buckets:
            h = self._hyper(self.param_groups[b.group_index], step, k)
            x = self._local_update(b, h, kinds.adam_denom(b.exp_avg_sq, h, out=self._scratch_d(b.numel)))
            self._scatter(x, b.params)
        self._advance_window(step)

    def _sync_step(self, step, k):
        in_scratch = {"d": None, "x": None}  # whose denominator / x the shared scratch holds now

        def denom_of(b):
            # recomputed into the shared scratch where it is used (bitwise the same each time, v is
            # frozen): keeping every bucket's denominator alive through the exchange cost a fresh
            # bucket-sized allocation per bucket and step, slower than the recomputation
            if in_scratch["d"] is not b:
                h = self._hyper(self.param_groups[b.group_index], step, k)
                kinds.adam_denom(b.exp_avg_sq, h, out=self._scratch_d(b.numel))
                in_scratch["d"] = b
            return self._scratch_d(b.numel)

        def x_of(b):
            # x as the local update left it (and scattered it): no second gather when it is still there
            if in_scratch["x"] is not b:
                self._load_x(b)
                in_scratch["x"] = b
            return b.master if b.master is not None else self._scratch["x"][:b.numel]

        # With one bucket its x stays in the scratch until the sync rebuilds it, so the local
        # update's x is written to the parameters only if the bucket is not rebuilt after all.
        defer = len(self._buckets) == 1
        rebuilt = set()
        for b in self._buckets:
            h = self._hyper(self.param_groups[b.group_index], step, k)
            x = self._local_update(b, h, denom_of(b))
            if not defer:
                self._scatter(x, b.params)
            in_scratch["x"] = b
        self._advance_window(step)

        def fill(b, buf):
            group = self.param_groups[b.group_index]
            buf[b.numel:].zero_()
            if self.precondition_compression:  # the common case in one pass
                native.sync_prepare(x_of(b), b.anchor, group["decay_product"], buf[:b.numel])
            else:
                kinds.sync_prepare(x_of(b), b.anchor, denom_of(b), group["decay_product"], buf[:b.numel], False)

        def consume(b, w):
            group = self.param_groups[b.group_index]
            x = b.master if b.master is not None else self._scratch["x"][:b.numel]
            in_scratch["x"] = None  # overwritten with the new x below
            mask = self._mask_of(b)
            h = self._hyper(group, step, k)
            if mask is None and self.precondition_compression:  # the common case in one pass
                native.sync_rebuild(w, b.anchor, x, b.exp_avg, denom_of(b), h.bias_correction1 / group["lr_sum"],
                                    group["decay_product"])
            else:
                if group["decay_product"] != 1.0:
                    b.anchor.mul_(group["decay_product"])
                kinds.sync_finish(x, b.anchor, b.exp_avg, denom_of(b), w, group["lr_sum"], h, mask,
                                  self.precondition_compression)
            if mask is not None:
                b.exchange.mask_errors(mask)
            self._scatter(x, b.params)
            rebuilt.add(id(b))

        def consume_packed(b, packed, server_scales):
            # the same as consume(), fused: w is unpacked straight into x, m and the anchor
            group = self.param_groups[b.group_index]
            x = b.master if b.master is not None else self._scratch["x"][:b.numel]
            in_scratch["x"] = None  # overwritten with the new x below
            mask = self._mask_of(b)
            native.decompress_sync(packed, server_scales, b.exchange.plan, anchor=b.anchor, param=x,
                                   exp_avg=b.exp_avg, denom=denom_of(b),
                                   factor=self._hyper(group, step, k).bias_correction1 / group["lr_sum"],
                                   decay_product=group["decay_product"], mask=mask,
                                   preconditioned=self.precondition_compression)
            if mask is not None:
                b.exchange.mask_errors(mask)
            self._scatter(x, b.params)
            rebuilt.add(id(b))

        # A window whose learning rates sum to 0 did not move: nothing to send, m stays.
        live = [b for b in self._buckets if self.param_groups[b.group_index]["lr_sum"] > 0]
        if self._exchange_all(live, fill, consume, consume_packed):
            for group in self.param_groups:
                group["lr_sum"], group["decay_product"] = 0.0, 1.0
        if defer and id(self._buckets[0]) not in rebuilt:  # skipped, or a window that did not move
            b = self._buckets[0]
            self._scatter(x_of(b), b.params)

    def _record(self, kind: StepKind, skip: bool) -> None:
        c = self.transport.counter
        s = self._stats[kind.value]
        s["steps"] += 1
        s["rounds"], s["bytes_sent"] = c.rounds[kind.value], int(round(c.bytes_sent[kind.value]))
        self._stats_extra["skipped_steps"] += int(skip)
        p = self.world_size
        n = sum(b.numel for b in self._buckets)
        self._adam_equivalent_bytes += 2 * (p - 1) / p * 4 * n
        self._stats_extra["adam_equivalent_bytes"] = int(round(self._adam_equivalent_bytes))

    def log_loss(self, loss) -> None:
        """Give the coming step's loss (a float or 0-dim tensor) to the per-step log."""
        self._loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)

    def _write_step_log(self, step, kind, skip, loss) -> None:
        stats = self.comm_stats()
        if loss is not None:
            self._loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        record = {"step": step, "kind": kind.value, "lr": float(self.param_groups[0]["lr"]), "loss": self._loss,
                  "skipped": skip, "bytes_sent": stats["bytes_sent_total"], "rounds": stats["rounds_total"]}
        self._loss = None
        with open(self._step_log, "a") as f:
            f.write(json.dumps(record) + "\n")

    # -- reporting -----------------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """What this rank communicated so far.

        Returns a dict: for each kind (``variance``, ``compressed``, ``local``, ``sync``) a dict
        of ``steps``, ``rounds`` (collective calls) and ``bytes_sent``; ``bytes_sent_total``,
        ``rounds_total``, ``skipped_steps``, ``adam_equivalent_bytes`` (what
        ``hvd.DistributedOptimizer(torch.optim.Adam)`` at fp32 would have sent over the same
        steps: an allreduce of every trainable fp32 gradient per step), ``transport`` and
        ``world_size``. Bytes follow the table in :mod:`hvd_zoadam.transport`.
        """
        out = {k: dict(v) for k, v in self._stats.items()}
        out["bytes_sent_total"] = sum(v["bytes_sent"] for v in self._stats.values())
        out["rounds_total"] = sum(v["rounds"] for v in self._stats.values())
        out.update(self._stats_extra)
        out.update(transport=self.transport.describe(), world_size=self.world_size)
        return out

    def memory_bytes(self) -> dict:
        """Bytes this optimizer holds: ``state`` (exp_avg, exp_avg_sq, anchor, and float32 master
        weights for fp16/bf16 parameters), ``error_buffers``,
        ``scratch`` (reused every step) and ``total``."""
        state = sum((3 + (b.master is not None)) * 4 * b.numel + (b.mask is not None) * b.numel
                    for b in self._buckets)
        errors = sum(b.exchange.memory_bytes()["error_buffers"] for b in self._buckets)
        scratch = sum(t.numel() * t.element_size() for t in self._scratch.values()) \
            + sum(b.exchange.memory_bytes()["scratch"] for b in self._buckets)
        return {"state": state, "error_buffers": errors, "scratch": scratch, "total": state + errors + scratch}

    def schedule_state(self) -> dict:
        """The schedule after the last step: step, frozen, var_interval, var_counter,
        exp_avg_sq_steps, local_step_interval, local_step_counter, freeze_lr."""
        c = self._counters
        out = self.schedule.describe(c["step"], lr=float(self.param_groups[0]["lr"]), freeze_lr=c["freeze_lr"])
        out.update(exp_avg_sq_steps=c["exp_avg_sq_steps"], freeze_lr=c["freeze_lr"],
                   lr_sum=[g["lr_sum"] for g in self.param_groups])
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def rank_state_dict(self) -> dict:
        """This rank's own state, which ``state_dict()`` leaves out: the error buffers.

        Returns a dict with ``world_size``, ``rank``, ``layout`` (the collective prefix, a
        digest of the parameter layout) and per bucket float32 ``worker_error`` and
        ``server_error``, copied to the CPU (no second copy on a GPU). See
        :mod:`hvd_zoadam.checkpoint` for files.
        """
        return {"version": 1, "world_size": self.world_size, "rank": self.transport.rank,
                "layout": self._uid.split(".")[0],
                "buckets": [{"worker_error": b.exchange.worker_error.to("cpu", copy=True),
                             "server_error": b.exchange.server_error.to("cpu", copy=True)} for b in self._buckets]}

    def load_rank_state_dict(self, rank_state: dict | None) -> bool:
        """Restore :meth:`rank_state_dict`. Returns True when the buffers were restored.

        When ``rank_state`` is None or comes from another world size, rank or layout, the
        error buffers are zeroed instead (their sizes and chunks depend on the world size):
        error feedback restarts, everything else resumes as loaded.
        """
        usable = (rank_state is not None and rank_state.get("world_size") == self.world_size
                  and rank_state.get("rank") == self.transport.rank
                  and rank_state.get("layout") == self._uid.split(".")[0]
                  and len(rank_state.get("buckets", ())) == len(self._buckets))
        for i, b in enumerate(self._buckets):
            if usable:
                b.exchange.worker_error.copy_(rank_state["buckets"][i]["worker_error"])
                b.exchange.server_error.copy_(rank_state["buckets"][i]["server_error"])
            else:
                b.exchange.zero_errors()
        return usable

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, then the loaded m, v and anchor are copied into the flat
        buffers in float32 (no cast through a low-precision parameter dtype). The counters in
        ``param_groups`` are restored exactly, so the schedule resumes where it was. This
        rank's error buffers are kept; use a per-rank save to restore them too.

        The buffers' tensors bypass torch's loader, which would first cast each of them to
        its parameter's device and dtype: a transient second copy of m, v and the anchor on
        the GPU when a checkpoint was loaded to the CPU."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        originals = {p: saved[i] for i, p in zip(ids, params) if i in saved}
        self._pending = None
        buffers = ("exp_avg", "exp_avg_sq", "anchor", "exp_avg_mask")
        super().load_state_dict({**state_dict, "state": {i: {k: v for k, v in st.items() if k not in buffers}
                                                         for i, st in saved.items()}})
        for b in self._buckets:
            for key in b.views:
                skey = "exp_avg_mask" if key == "mask" else key
                for p, view in zip(b.params, b.views[key]):
                    if p in originals and skey in originals[p]:
                        view.copy_(originals[p][skey].reshape(view.shape))
                    self.state[p][skey] = view
        for group in self.param_groups:
            group.setdefault("lr_sum", 0.0)
            group.setdefault("decay_product", 1.0)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=None, gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                         process_set=None, *, var_freeze_step=100000, var_update_scaler=16,
                         local_step_scaler=32768, local_step_clipper=16, local_step_policy="steps",
                         bias_correction=True, transport="auto", bucket_cap_mb=25.0, scale_block_numel=2048,
                         exp_avg_mask=None, auto_exp_avg_mask=True, precondition_compression=True,
                         step_log=None, overlap=True):
    """Wrap a ``torch.optim.Adam``/``AdamW`` into a 0/1 Adam optimizer that communicates
    through Horovod. A drop-in replacement for ``hvd.DistributedOptimizer``.

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
    * ``process_set``: the ranks this optimizer trains with (default: all).

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
    ``step()``. False: everything starts in ``synchronize()``. Same results either way).

    Returns:
        A :class:`ZeroOneAdamOptimizer` sharing ``optimizer.param_groups``.

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
    if hvd is not None:
        compression = hvd.Compression.none if compression is None else compression
        if compression not in (hvd.Compression.none, hvd.Compression.fp16):
            raise ValueError("compression must be hvd.Compression.none or hvd.Compression.fp16 (applied to the "
                             f"full-precision VARIANCE steps); got {compression!r}")
        op = hvd.Average if op is None else op
        if op == hvd.Adasum:
            raise ValueError("op=hvd.Adasum cannot be combined with 0/1 Adam, which compresses and averages "
                             "updates itself; use op=hvd.Average (the default) or hvd.DistributedOptimizer for "
                             "Adasum")
        if op != hvd.Average:
            raise ValueError(f"op must be hvd.Average for 0/1 Adam (its updates are averages); got {op!r}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
        raise TypeError(f"backward_passes_per_step must be an int, got {backward_passes_per_step!r}")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if not isinstance(gradient_predivide_factor, (int, float)) or not gradient_predivide_factor > 0 \
            or not math.isfinite(gradient_predivide_factor):
        raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {gradient_predivide_factor!r}")
    if groups is not None:
        raise ValueError("groups is not supported by hvd_zoadam, which fuses parameters into buckets itself; "
                         "pass groups=None and tune bucket_cap_mb instead")
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
    if not isinstance(bias_correction, bool):
        raise TypeError(f"bias_correction must be a bool, got {bias_correction!r}")
    if local_step_policy not in LOCAL_STEP_POLICIES:
        raise ValueError(f"local_step_policy must be one of {LOCAL_STEP_POLICIES}, got {local_step_policy!r}")
    if scale_block_numel is not None:
        scale_block_numel = check_positive_int(scale_block_numel, "scale_block_numel",
                                               "Use a multiple of 8 such as 2048, or None for one scale per tensor.")
        if scale_block_numel % 8:
            raise ValueError(f"scale_block_numel must be a multiple of 8 (whole bytes of sign bits per block), "
                             f"got {scale_block_numel}")
    if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a number > 0 (MiB), got {bucket_cap_mb!r}")
    schedule = Schedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper,
                        local_step_policy)
    transport = make_transport(transport, process_set)
    return ZeroOneAdamOptimizer(
        optimizer, named_parameters, schedule=schedule, transport=transport, compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=float(gradient_predivide_factor), sparse_as_dense=sparse_as_dense,
        bias_correction=bias_correction, bucket_cap_numel=max(1, int(bucket_cap_mb * 2 ** 20 / 4)),
        scale_block_numel=scale_block_numel, exp_avg_mask=exp_avg_mask, auto_exp_avg_mask=bool(auto_exp_avg_mask),
        precondition_compression=bool(precondition_compression), step_log=step_log, overlap=bool(overlap))
