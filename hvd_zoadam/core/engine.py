"""Buckets and flat state of one rank: where parameters, gradients and optimizer state meet.

The engine lays the trainable parameters of every param group out in fused buckets
(:class:`Bucket`, consecutive parameters of one group and dtype, at most
``bucket_cap_numel`` elements), each with flat float32 ``exp_avg``, ``exp_avg_sq`` and
``anchor`` buffers whose per-parameter views are what ``optimizer.state[p]`` holds, and
one :class:`~hvd_zoadam.comm.protocol.Exchange` (error buffers, plan) per bucket. It gives
each bucket flat storage (:mod:`hvd_zoadam.core.bucket`: the parameters, and their
gradients, views of one buffer each) and hands x and g out as flat float32 tensors, keeps
fp32 master weights of fp16/bf16 parameters, resolves momentum masks and owns the reusable
scratch.

No collectives run here, and no step math: :mod:`hvd_zoadam.comm.protocol` exchanges, the
algorithms (:mod:`hvd_zoadam.core.algorithms`) compute, and the shell's step driver
(:mod:`hvd_zoadam.shell.driver`) drives them.
"""
from __future__ import annotations

import weakref

import torch

from hvd_zoadam import native
from hvd_zoadam.comm.hierarchical import HierarchicalExchange
from hvd_zoadam.comm.protocol import CollectiveNames, Exchange
from hvd_zoadam.comm.transport import Transport
from hvd_zoadam.core import bucket as flat_storage
from hvd_zoadam.core import step_math
from hvd_zoadam.core.bucket import Bucket
from hvd_zoadam.core.layout import make_buckets, scale_segments


class Engine:
    """The buckets, flat state and scratch of one rank's optimizer.

    Args:
        optimizer: the ``torch.optim.Optimizer`` whose ``param_groups`` and ``state`` the engine
            reads at every use (``load_state_dict`` replaces both objects); ``state[p]``
            receives the per-parameter views.
        names: {param: name}. user_masks: {param: 0/1 tensor of its shape}.
        transport: the collectives (fixes the world size of the exchanges).
        names_of_collectives: the :class:`~hvd_zoadam.comm.protocol.CollectiveNames` of the buckets.
        bucket_cap_numel, scale_block_numel, sparse_as_dense, bias_correction,
        auto_exp_avg_mask: the optimizer's options of those names.
        levels: ``(intra, cross)`` transports of the two-level exchange
            (:func:`hvd_zoadam.comm.hierarchical.node_levels`), or None for the flat one.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict, user_masks: dict, transport: Transport,
                 names_of_collectives: CollectiveNames, *, bucket_cap_numel: int, scale_block_numel: int | None,
                 sparse_as_dense: bool, bias_correction: bool, auto_exp_avg_mask: bool,
                 levels: tuple[Transport, Transport] | None = None):
        self._optimizer = weakref.ref(optimizer)  # the optimizer owns the engine: no cycle
        self.levels = levels
        self.names = names
        self.user_masks = user_masks
        self.transport = transport
        self.collective_names = names_of_collectives
        self.bucket_cap_numel = bucket_cap_numel
        self.scale_block_numel = scale_block_numel
        self.sparse_as_dense = sparse_as_dense
        self.bias_correction = bias_correction
        self.auto_exp_avg_mask = auto_exp_avg_mask
        self.buckets: list[Bucket] = []
        self.bucket_of: dict = {}   # param -> bucket index
        self.device = None          # the one device of every trainable parameter (CPU or one CUDA device)
        self._device_param = None
        self.scratch: dict = {}
        self.inv_grad_scale = None  # 1 / GradScaler's scale while scaler.step() drives the step
        self.derived = DerivedFromExpAvgSq(self)

    @property
    def param_groups(self) -> list:
        return self._optimizer().param_groups

    @property
    def state(self):
        return self._optimizer().state

    # -- layout ----------------------------------------------------------------------------------
    def check_param(self, p: torch.Tensor) -> None:
        """Refuse a parameter hvd_zoadam cannot lay out (TypeError/ValueError naming it)."""
        name = self.names.get(p)
        if p.is_sparse:
            raise TypeError(f"parameter {name!r} is sparse; 0/1 Adam needs dense parameters")
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; 0/1 Adam needs floating-point parameters")
        if p.device.type not in ("cpu", "cuda"):
            raise TypeError(f"parameter {name!r} is on {p.device}: hvd_zoadam runs on CPU and CUDA tensors; "
                            "move the model to a CUDA device or to the CPU")
        if self.device is None:
            self.device, self._device_param = p.device, name
        elif p.device != self.device:
            raise ValueError(f"parameter {name!r} is on {p.device} but parameter {self._device_param!r} is on "
                             f"{self.device}: hvd_zoadam needs every trainable parameter of a rank on one device, "
                             "as Horovod does (torch.cuda.set_device(hvd.local_rank()), then model.cuda())")

    def build_group(self, index: int, trainable: list) -> None:
        """Lay out the trainable params of param group ``index`` in buckets, by dtype."""
        for p in trainable:
            self.check_param(p)
        by_dtype = {}
        for p in trainable:
            by_dtype.setdefault(p.dtype, []).append(p)
        for params in by_dtype.values():
            for idx in make_buckets([p.numel() for p in params], self.bucket_cap_numel):
                self.add_bucket(index, [params[i] for i in idx])

    def _new_exchange(self, index: int, params: list):
        """The bucket's :class:`~hvd_zoadam.comm.protocol.Exchange`, or its
        :class:`~hvd_zoadam.comm.hierarchical.HierarchicalExchange` when ``levels`` is set."""
        segments = scale_segments([p.numel() for p in params], self.scale_block_numel)
        name = self.collective_names.bucket(index)
        if self.levels is not None:
            return HierarchicalExchange(segments, self.transport, self.levels, name, device=self.device)
        return Exchange(segments, self.transport, name, device=self.device)

    def add_bucket(self, group_index: int, params: list) -> None:
        """A new bucket of ``params``: zeroed m and v, the anchor at the current x."""
        for p in params:
            self.bucket_of[p] = len(self.buckets)
        numels = [p.numel() for p in params]
        dev = self.device
        exchange = self._new_exchange(len(self.buckets), params)
        n = exchange.numel
        bucket = Bucket(group_index, params, [self.names[p] for p in params], exchange,
                        torch.zeros(n, device=dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev),
                        kinds=[(p.dtype, p.device) for p in params])
        if params[0].dtype != torch.float32:
            bucket.master = torch.cat([p.detach().reshape(-1).float() for p in params])
        keys = ["exp_avg", "exp_avg_sq", "anchor"]
        if any(p in self.user_masks for p in params):
            bucket.mask = torch.cat([self.user_masks[p].reshape(-1).to(dev, torch.uint8) if p in self.user_masks
                                     else torch.ones(p.numel(), dtype=torch.uint8, device=dev) for p in params])
            keys.append("mask")
        for key in keys:
            flat = getattr(bucket, key)
            bucket.views[key] = [v.view_as(p) for v, p in zip(flat.split(numels), params)]
            for p, v in zip(params, bucket.views[key]):
                self.state[p]["exp_avg_mask" if key == "mask" else key] = v
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1).float() for p in params], out=bucket.anchor)
        flat_storage.lay_out(bucket)
        self.buckets.append(bucket)
        for key, size in (("x", n), ("g", exchange.padded_numel), ("w", n)):
            if self.scratch.get(key, torch.empty(0)).numel() < size:
                self.scratch[key] = torch.zeros(size, device=dev)

    def relayout(self) -> None:
        """New exchanges (plans, zeroed error buffers) for the transport's current world size."""
        for i, b in enumerate(self.buckets):
            b.exchange = self._new_exchange(i, b.params)
            if self.scratch["g"].numel() < b.exchange.padded_numel:
                self.scratch["g"] = torch.zeros(b.exchange.padded_numel, device=self.device)

    @property
    def _kinds(self) -> list:
        """(dtype, device) of every laid-out parameter, as it was when its bucket was made."""
        return [k for b in self.buckets for k in b.kinds]

    def layout_items(self) -> dict:
        """The bucket layout for the cross-rank check: names, shapes, dtypes per bucket."""
        items = {}
        for i, b in enumerate(self.buckets):
            layout = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(b.names, b.params)]
            items[f"bucket{i}"] = short_digest((b.group_index, layout)) if len(layout) > 64 else layout
        items["buckets"] = len(self.buckets)
        items["hierarchical"] = self.topology()
        return items

    def topology(self):
        """``[nodes, ranks per node]`` of the two-level exchange, or None for the flat one."""
        return None if self.levels is None else [self.levels[1].world_size, self.levels[0].world_size]

    # -- per-step access to flat data -----------------------------------------------------------
    def hyper(self, b: Bucket, step: int, exp_avg_sq_steps: int, var_update_steps: int = 1) -> step_math.Hyper:
        """The hyperparameters of bucket ``b``'s param group for step t = ``step``, K =
        ``exp_avg_sq_steps``, and I = ``var_update_steps`` for a VARIANCE step's update of v."""
        group = self.param_groups[b.group_index]
        beta1, beta2 = group["betas"]
        return step_math.Hyper(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=group["weight_decay"],
                           decoupled=bool(group.get("decoupled_weight_decay", False)),
                           bias_correction=self.bias_correction, step=step,
                           exp_avg_sq_steps=max(exp_avg_sq_steps, 1), var_update_steps=var_update_steps)

    def sparse_grad(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """``g`` densified, or the ValueError of a sparse gradient without ``sparse_as_dense``."""
        if not self.sparse_as_dense:
            raise ValueError(f"parameter {name!r} got a sparse gradient; pass sparse_as_dense=True "
                             "to hvd_zoadam.DistributedOptimizer (0/1 Adam exchanges dense tensors)")
        return g.to_dense()

    def grads_into(self, bucket: Bucket, out: torch.Tensor, raw: bool = True) -> torch.Tensor:
        """out[:n] <- the bucket's gradients as float32 (None counts as 0). Returns out[:n].

        ``raw``: ``p.grad`` holds this rank's own gradient (not an exchange result), which is
        still multiplied by a ``torch.amp.GradScaler`` loss scale when one drives the step.
        One copy where the gradients are, or become (:func:`.bucket.move_grads_to_storage`),
        views of the bucket's flat storage.
        """
        n = bucket.numel
        if flat_storage.grads_in_storage(bucket) or flat_storage.move_grads_to_storage(bucket):
            out[:n].copy_(bucket.grad)
        else:
            grads = []
            for p, name in zip(bucket.params, bucket.names):
                g = p.grad
                if g is None:
                    g = torch.zeros_like(p)
                elif g.is_sparse:
                    g = self.sparse_grad(name, g)
                grads.append(g.reshape(-1).float())
            torch.cat(grads, out=out[:n])
        if raw and self.inv_grad_scale is not None:
            out[:n].mul_(self.inv_grad_scale)
        return out[:n]

    def grads(self, b: Bucket, raw: bool = True) -> torch.Tensor:
        """Bucket ``b``'s gradients as float32[n], for reading only (as :meth:`grads_into`).

        Where the bucket has flat storage and every ``p.grad`` is a dense tensor of its
        parameter's shape, the gradients are copied into ``b.grad`` in one op (none when they
        are its views already) and each ``p.grad`` becomes its view, as DDP's
        ``gradient_as_bucket_view`` does: with ``zero_grad(set_to_none=False)`` backward then
        accumulates into them and no step copies. float32 gradients are then read where they
        are; others (and a loss scale to take out) go through the engine's scratch."""
        g = flat_storage.grad_storage(b)
        if g is not None and not (raw and self.inv_grad_scale is not None):
            return g
        return self.grads_into(b, self.scratch["g"], raw)

    scatter = staticmethod(flat_storage.scatter)

    def write_grads(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """p.grad <- the bucket's piece of ``flat`` (a dense gradient made where there is none)."""
        if flat_storage.grads_in_storage(bucket):
            bucket.grad.copy_(flat[:bucket.numel])
            return
        for p in bucket.params:
            if p.grad is None or p.grad.is_sparse:
                p.grad = torch.zeros_like(p)
        self.scatter(flat[:bucket.numel], [p.grad for p in bucket.params])

    def load_x(self, b: Bucket) -> torch.Tensor:
        """x as float32[n]: the flat storage of float32 params (:func:`.bucket.storage`; the parameters
        themselves, not a copy), the master weights of fp16/bf16 params, or else the params
        gathered into the scratch.

        Master weights are re-read from the params when someone else changed them since our
        last write (a model load or a broadcast), detected by comparing the rounded values.
        """
        flat = flat_storage.storage(b)
        if b.master is None:
            if flat is not None:
                return flat
            x = self.scratch["x"][:b.numel]
            torch.cat([p.detach().reshape(-1).float() for p in b.params], out=x)
            return x
        if flat is not None and torch.equal(b.master.to(flat.dtype), flat):
            return b.master
        views = b.master.split([p.numel() for p in b.params])
        for p, v in zip(b.params, views):
            if not torch.equal(v.to(p.dtype), p.detach().reshape(-1)):
                v.copy_(p.detach().reshape(-1))
        return b.master

    def store_x(self, b: Bucket, x: torch.Tensor) -> None:
        """The parameters of bucket ``b`` <- ``x`` (float32[n], cast to their dtype), after a step
        wrote x: nothing to copy when ``x`` is their flat storage itself (:meth:`load_x`), one
        copy into it otherwise. Moves each parameter's autograd version counter, as an in-place
        op on it would."""
        flat = b.flat
        if flat is None:
            self.scatter(x, b.params)
            return
        if not (x.data_ptr() == flat.data_ptr() and x.dtype == flat.dtype):
            flat.copy_(x)
        flat_storage.bump_versions(b.params)

    def x_buffer(self, b: Bucket) -> torch.Tensor:
        """Where :meth:`load_x` puts bucket ``b``'s x (without gathering it again)."""
        if b.master is not None:
            return b.master
        return b.flat if b.flat is not None else self.scratch["x"][:b.numel]

    def x_copy(self, b: Bucket) -> torch.Tensor:
        """A copy of bucket ``b``'s x, float32[n], that a step may change without changing the
        parameters (the scratch, or a clone of the master weights)."""
        x = self.load_x(b)
        if b.master is not None:
            return x.clone()
        return x if b.flat is None else self.scratch["x"][:b.numel].copy_(x)

    def scratch_d(self, numel: int) -> torch.Tensor:
        """A reusable float32 buffer for a denominator used at once (not kept across buckets)."""
        d = self.scratch.get("d")
        if d is None or d.numel() < numel:
            d = self.scratch["d"] = torch.empty(max(numel, max(b.numel for b in self.buckets)), device=self.device)
        return d[:numel]

    def mask_of(self, b: Bucket):
        """The momentum mask in force for bucket ``b`` (None when there is none): the user's,
        and with ``auto_exp_avg_mask`` also :meth:`DerivedFromExpAvgSq.mask`."""
        return self.derived.mask(b) if self.auto_exp_avg_mask else b.mask

    def denom(self, b: Bucket, h: step_math.Hyper) -> torch.Tensor:
        """s = sqrt(v̂) + eps of bucket ``b``, float32[n], for reading only
        (:meth:`DerivedFromExpAvgSq.denom`)."""
        return self.derived.denom(b, h)

    def memory_bytes(self) -> dict:
        """Bytes held: ``state`` (exp_avg, exp_avg_sq, anchor, and float32 master weights for
        fp16/bf16 parameters, uint8 masks), ``error_buffers``, ``gradient_storage`` (each flat
        bucket's gradients, whose views ``p.grad`` become: :meth:`grads`), ``scratch`` (reused every
        step; also the kept denominators of :meth:`denom`) and ``total``. The
        parameters' flat storage replaces their own and is not counted."""
        state = sum((3 + (b.master is not None)) * 4 * b.numel + (b.mask is not None) * b.numel
                    for b in self.buckets)
        errors = sum(b.exchange.memory_bytes()["error_buffers"] for b in self.buckets)
        scratch = sum(t.numel() * t.element_size() for t in self.scratch.values()) \
            + sum(b.exchange.memory_bytes()["scratch"] for b in self.buckets) \
            + self.derived.denom_bytes()
        grads = sum(b.grad.numel() * b.grad.element_size() for b in self.buckets if b.grad is not None)
        return {"state": state, "error_buffers": errors, "gradient_storage": grads, "scratch": scratch,
                "total": state + errors + grads + scratch}


def check_params_unchanged(engine: Engine) -> None:
    """The buffers of ``engine`` were laid out for the parameters at construction: refuse to go on when a
    parameter was replaced in param_groups, resized in place, or cast or moved to another
    dtype or device (ValueError naming it)."""
    current = [p for g in engine.param_groups for p in g["params"]
               if p.numel() and (p.requires_grad or p in engine.bucket_of)]  # frozen since: still laid out
    laid_out = [p for b in engine.buckets for p in b.params]
    if len(current) == len(laid_out) and all(a is b for a, b in zip(current, laid_out)) \
            and all(p.numel() == v.numel() for b in engine.buckets for p, v in zip(b.params, b.views["exp_avg"])) \
            and all((p.dtype, p.device) == kind for p, kind in zip(laid_out, engine._kinds)):
        return
    for p, (dtype, device), name in zip(laid_out, engine._kinds, (n for b in engine.buckets for n in b.names)):
        if (p.dtype, p.device) != (dtype, device):
            raise ValueError(f"parameter {name!r} changed from {dtype} on {device} to {p.dtype} on {p.device} "
                             "after the optimizer was built (so would its gradient); the buffers and the "
                             "exchange no longer fit. Move or cast the model first, then build "
                             "hvd_zoadam.DistributedOptimizer.")
    for b in engine.buckets:
        for p, v, name in zip(b.params, b.views["exp_avg"], b.names):
            if p.numel() != v.numel():
                raise ValueError(f"parameter {name!r} changed shape from {tuple(v.shape)} to {tuple(p.shape)} "
                                 "after the optimizer was built; its error buffers and chunks no longer fit. "
                                 "Build a new hvd_zoadam.DistributedOptimizer after changing the model.")
    names = {p: n for b in engine.buckets for p, n in zip(b.params, b.names)}
    in_groups = {p for g in engine.param_groups for p in g["params"]}
    for index, group in enumerate(engine.param_groups if all(p in in_groups for p in names) else ()):
        for j, p in enumerate(group["params"]):
            if p.requires_grad and p.numel() and p not in names:
                raise ValueError(f"param_groups[{index}]['params'][{j}] ({engine.names.get(p, 'unnamed')!r}) "
                                 "requires a gradient but had requires_grad=False when the optimizer was built, "
                                 "so hvd_zoadam holds no state for it: build the optimizer while it is trainable "
                                 "(a parameter frozen later keeps its state and stays still while frozen), or "
                                 "put it in a group of its own with add_param_group")
    raise ValueError("the trainable parameters in param_groups are not the ones hvd_zoadam laid out at "
                     "construction (a parameter was replaced or removed); build a new "
                     "hvd_zoadam.DistributedOptimizer after changing the model, or use add_param_group "
                     "for new parameters")


def grads_finite(engine: Engine) -> bool:
    """Whether every gradient of every bucket is finite (the agreed skip at P = 1, where
    nothing is exchanged), each bucket read flat (:meth:`Engine.grads`): one read-only pass per
    bucket on the CPU (:func:`native.all_finite`, stopping at the first bucket that is not),
    one host synchronisation in all on a GPU. Bucket by bucket, as the engine's scratch is
    shared."""
    return native.all_finite_many(engine.grads(b) for b in engine.buckets)


def skip_flags(engine: Engine) -> torch.Tensor:
    """int32[B, 2] on the engine's device (kept in its scratch), one row per bucket, zeroed when
    made: what the local step decided on the device counts there
    (:func:`native.local_step_on_device`: column 0 its running count, 0 between steps; column 1
    the last step's count of non-finite gradients). Made again, zeroed, when buckets were added
    since."""
    flags = engine.scratch.get("skip_flags")
    if flags is None or flags.shape[0] < len(engine.buckets):
        flags = engine.scratch["skip_flags"] = torch.zeros((len(engine.buckets), 2), dtype=torch.int32,
                                                           device=engine.device)
    return flags


def grads_finite_each(engine: Engine, buckets: list[Bucket]) -> list[bool] | None:
    """Whether each of ``buckets``' gradients are all finite, every bucket's read in one host
    synchronisation, where the local update cannot check them inside its kernel call (CUDA
    tensors, the simulator); None where it can (:func:`native.on_cpu_path`: nothing read here)
    or ``buckets`` is empty."""
    if not buckets or native.on_cpu_path(buckets[0].exp_avg):
        return None
    return native.read_flags([native.finite_flag(engine.grads(b)) for b in buckets])


def refresh_masks(engine: Engine) -> None:
    """With ``engine.auto_exp_avg_mask``, derive every bucket's mask that a change of v made stale
    in one host read (:meth:`DerivedFromExpAvgSq.refresh_masks`), before a step's first
    :meth:`Engine.mask_of`; otherwise nothing."""
    if engine.auto_exp_avg_mask:
        engine.derived.refresh_masks(engine.buckets)


class DerivedFromExpAvgSq:
    """What an engine derives from its buckets' ``exp_avg_sq`` and keeps between steps: the
    automatic momentum mask and the Adam denominators.

    Each is kept while the tensor's version counter stays. torch's in-place ops move it (a
    VARIANCE step, ``load_state_dict``'s copies), but Horovod's in-place broadcast writes the
    tensors from C++ without moving it, so whatever hands out references to the state
    (``state_dict()``, which ``hvd.broadcast_optimizer_state`` writes through) calls
    :meth:`forget` first.
    """

    def __init__(self, engine: Engine):
        self._engine = weakref.ref(engine)  # the engine owns this: no cycle
        self._masks: dict = {}
        self._denoms: dict = {}

    def mask(self, b: Bucket):
        """bool[n], False where ``exp_avg_sq`` is exactly 0 (or the user's mask is 0), or None
        when nothing is masked (bitwise the same as all True, and a pass fewer per step).

        A coordinate whose v is 0 had an averaged gradient of exactly 0 on all ranks in every
        VARIANCE step so far. It cannot take an Adam step with the (frozen) v: the step would be
        m/eps, and sign compression hands it ±scale noise."""
        self.refresh_masks([b])
        return self._masks[id(b)][1]

    def refresh_masks(self, buckets: list[Bucket]) -> None:
        """Derive :meth:`mask` again for each bucket of ``buckets`` whose v (or user mask) changed
        since, reading whether each is all True from the device in one host read for them all."""
        stale = []
        for b in buckets:
            key = (b.exp_avg_sq._version, b.exp_avg_sq.data_ptr(), id(b.mask))
            cached = self._masks.get(id(b))
            if cached is None or cached[0] != key:
                seen = b.exp_avg_sq != 0
                stale.append((b, key, seen if b.mask is None else seen & b.mask.bool()))
        if stale:
            full = torch.stack([mask.all() for _, _, mask in stale]).tolist()
            for (b, key, mask), everywhere in zip(stale, full):
                self._masks[id(b)] = (key, None if everywhere else mask)

    def denom(self, b: Bucket, h: step_math.Hyper) -> torch.Tensor:
        """s = sqrt(v̂) + eps of bucket ``b`` (:func:`~hvd_zoadam.core.step_math.adam_denom`),
        float32[n], for reading only.

        Kept per bucket until exp_avg_sq, its bias correction or eps change (after the
        variance freeze: never), which takes three passes over the bucket, and on a GPU three
        launches, off each LOCAL step and six off each SYNC step, for 4 bytes per element held
        (on a GPU, GPU memory): a LOCAL step is then one kernel launch per bucket
        (:func:`native.local_step_on_device`). Bitwise the values torch's ops give there.
        """
        engine = self._engine()
        key = (b.exp_avg_sq._version, b.exp_avg_sq.data_ptr(), h.bias_correction2, h.eps)
        cached = self._denoms.get(id(b))
        if cached is None or cached[0] != key:
            out = cached[1] if cached is not None else torch.empty(b.numel, device=engine.device)
            cached = self._denoms[id(b)] = (key, step_math.adam_denom(b.exp_avg_sq, h, out=out))
        return cached[1]

    def denom_out(self, b: Bucket) -> torch.Tensor:
        """The storage of bucket ``b``'s kept denominator, float32[n], for a VARIANCE step to
        write s into with v (:func:`native.variance_step`), then :meth:`denom_written`."""
        cached = self._denoms.get(id(b))
        if cached is None:
            cached = self._denoms[id(b)] = (None, torch.empty(b.numel, device=self._engine().device))
        return cached[1]

    def denom_written(self, b: Bucket, h: step_math.Hyper) -> None:
        """After a VARIANCE step wrote v and s (:meth:`denom_out`) of ``b`` for ``h``: v's version
        moved (a kernel writing through a view of it does not move it, and the mask derived from
        v must be derived again), and s kept as :meth:`denom` of that v: no pass over the
        bucket to derive it again before the next VARIANCE step."""
        v = b.exp_avg_sq
        torch.autograd.graph.increment_version(v)
        self._denoms[id(b)] = ((v._version, v.data_ptr(), h.bias_correction2, h.eps), self._denoms[id(b)][1])

    def denom_bytes(self) -> int:
        """Bytes of the kept denominators."""
        return sum(d.numel() * d.element_size() for _, d in self._denoms.values())

    def forget(self) -> None:
        """Derive everything again at its next use."""
        self._masks.clear()
        self._denoms.clear()


def hold_frozen(buckets: list, variance: bool) -> list:
    """Copies of what a step must not change for the parameters of ``buckets`` frozen since
    (``requires_grad`` now False), as torch's Adam leaves a parameter without a gradient:
    x (and its fp32 master), ``exp_avg``, the anchor, and on a VARIANCE step (``variance``)
    ``exp_avg_sq``. Their gradients count as 0 in the exchange, as Horovod's do. Empty when
    nothing is frozen (then this costs one pass over the parameters' flags)."""
    held = []
    for b in buckets:
        for j, p in enumerate(b.params):
            if p.requires_grad:
                continue
            keys = ("exp_avg", "anchor", "exp_avg_sq") if variance else ("exp_avg", "anchor")
            saved = {key: b.views[key][j].clone() for key in keys}
            held.append((b, j, p.detach().clone(), saved))
    return held


def restore_frozen(held: list) -> None:
    """Put back what :func:`hold_frozen` copied."""
    for b, j, x, saved in held:
        p = b.params[j]
        p.detach().copy_(x)
        if b.master is not None:
            b.master.split([q.numel() for q in b.params])[j].copy_(x.reshape(-1))
        for key, value in saved.items():
            b.views[key][j].copy_(value)


def params_digest(buckets: list) -> str:
    """A digest of the bits of every parameter of ``buckets`` (:func:`bits_checksum` of each),
    equal on ranks that hold the same values whatever their devices' thread counts. One host
    synchronisation; for the first step's check across ranks."""
    sums = torch.stack([bits_checksum(p.detach()) for b in buckets for p in b.params])
    return short_digest(sums.cpu().tolist())


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_checksum(t: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """int64[2] of ``t`` (any floating dtype, any device): the sum of its elements' bit patterns
    as integers, and the same sum weighted by (position mod 65521) + 1, both modulo 2**64.
    Integer sums do not depend on the order of the reduction, so equal tensors give equal
    checksums on any device and thread count; different ones, almost surely not. Works
    through ``chunk`` elements at a time (a transient int64 copy of at most that many)."""
    flat = t.contiguous().reshape(-1).view(_BITS[t.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for lo in range(0, flat.numel(), chunk):
        bits = flat[lo:lo + chunk].to(torch.int64)
        weight = torch.arange(lo, lo + bits.numel(), device=t.device, dtype=torch.int64).remainder_(65521).add_(1)
        out[0] += bits.sum()
        out[1] += (bits * weight).sum()
    return out


def short_digest(obj: object) -> str:
    """A short, rank-independent digest of ``repr(obj)`` (12 hex digits)."""
    import hashlib
    return hashlib.sha1(repr(obj).encode()).hexdigest()[:12]
