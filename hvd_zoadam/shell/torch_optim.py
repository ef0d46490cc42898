"""The optimizer's checkpoint contract: torch's ``state_dict``/``load_state_dict`` (including
taking over an Adam checkpoint) and each rank's own state (the error buffers), and the error feedback pooled over ranks
that any world size can load.

:class:`StateDictMixin` is a base of :class:`hvd_zoadam.shell.optimizer.DistributedAdamOptimizer`;
files are :mod:`hvd_zoadam.checkpoint`'s. The one collective, in
:meth:`StateDictMixin.error_feedback_state`, is :func:`hvd_zoadam.comm.protocol.pool_error_feedback`'s.
"""
from __future__ import annotations

import copy
import weakref

import torch

from hvd_zoadam.comm.protocol import pool_error_feedback
from hvd_zoadam.core.layout import segment_offsets
from hvd_zoadam.shell.options import ADOPT_KEY, STATE_KEY, check_group, check_named_parameters


class StateDictMixin:
    """State-dict methods of the optimizer (they read its engine, counters and schedule)."""

    def rank_state_dict(self) -> dict:
        """This rank's own state, which ``state_dict()`` leaves out: the error buffers.

        Returns a dict with ``world_size``, ``rank``, ``layout`` (the collective prefix, a
        digest of the parameter layout) and per bucket float32 ``worker_error`` and
        ``server_error``, copied to the CPU (no second copy on a GPU), and ``params``: the
        bucket's parameters in order as ``[pid, name, numel]`` (``pid`` as in
        :meth:`state_dict`), which places each parameter in the flat buffers whatever their
        padding (:func:`hvd_zoadam.checkpoint.group_worker_error`). See :mod:`hvd_zoadam.checkpoint` for files.
        """
        ids = self._param_ids()
        return {"version": 1, "world_size": self.world_size, "rank": self.transport.rank,
                "layout": self._collectives.layout_digest, "hierarchical": self._engine.topology(),
                "buckets": [{"worker_error": b.exchange.worker_error.to("cpu", copy=True),
                             "server_error": b.exchange.server_error.to("cpu", copy=True),
                             "params": [[ids[p], name, p.numel()] for p, name in zip(b.params, b.names)]}
                            for b in self._buckets]}

    def _param_ids(self) -> dict:
        """{parameter: its id in :meth:`state_dict`}."""
        return {p: i for i, p in enumerate(q for g in self.param_groups for q in g["params"])}

    def load_rank_state_dict(self, rank_state: dict | None) -> bool:
        """Restore :meth:`rank_state_dict`. Returns True when the buffers were restored.

        When ``rank_state`` is None or comes from another world size, rank or layout, the
        error buffers are zeroed instead (their sizes and chunks depend on the world size):
        error feedback restarts, everything else resumes as loaded.
        """
        usable = (rank_state is not None and rank_state.get("world_size") == self.world_size
                  and rank_state.get("rank") == self.transport.rank
                  and rank_state.get("layout") == self._collectives.layout_digest
                  and rank_state.get("hierarchical") == self._engine.topology()
                  and len(rank_state.get("buckets", ())) == len(self._buckets))
        for i, b in enumerate(self._buckets):
            if usable:
                b.exchange.worker_error.copy_(rank_state["buckets"][i]["worker_error"])
                b.exchange.server_error.copy_(rank_state["buckets"][i]["server_error"])
            else:
                b.exchange.zero_errors()
        return usable

    def error_feedback_state(self) -> dict:
        """The error feedback the job still owes, in a form any world size can load
        (algorithm.md §6). **Collective**: call it on every rank at the same step
        (:func:`hvd_zoadam.checkpoint.save` does).

        Returns, the same on every rank, ``{"version": 1, "world_size": P, "names": {pid: name},
        "worker_error": {pid: float32[numel]}, "server_error": {pid: float32[numel]}}`` on the
        CPU, with ``pid`` the parameter ids of :meth:`state_dict`, for every trainable
        parameter: the mean over ranks of ``worker_error`` (over nodes with the two-level
        exchange, whose workers are the nodes), and the server errors of all ranks (each rank
        holds one chunk) in the parameter's own shape, flattened. The padding's
        errors are left out: they never reach a parameter.
        """
        ids = self._param_ids()
        state = {"version": 1, "world_size": self.world_size, "names": {}, "worker_error": {}, "server_error": {}}
        for index, b in enumerate(self._buckets):
            worker, server, contributors = b.exchange.error_contribution()
            worker, server = pool_error_feedback(worker, server, contributors, self.transport,
                                                 self._collectives.pool(index))
            offsets = segment_offsets(p.numel() for p in b.params)
            for p, name, a, z in zip(b.params, b.names, offsets, offsets[1:]):
                state["names"][ids[p]] = name
                state["worker_error"][ids[p]] = worker[a:z].to("cpu", copy=True)
                state["server_error"][ids[p]] = server[a:z].to("cpu", copy=True)
        return state

    def window_mean_state_dicts(self, model: torch.nn.Module) -> tuple | None:
        """``(model.state_dict(), self.state_dict())`` with x and m replaced by their means over
        the ranks, as copies, inside a window of local steps; None outside one (before the
        freeze, at a SYNC step, 1-bit Adam) and at world size 1. The anchor, Λ and D are the same on every rank and
        stay; the job's own parameters and momentum are put back as they were.

        Why the mean: a SYNC step exchanges the mean of u = x_a·D − x over the ranks, which is
        linear in x, and the local steps move x by −γ·m̂/s with m linear in the gradients, so
        ranks that all continue from the means of x and m owe the next sync what the ranks did
        together, where rank 0's state alone would drop the other ranks' progress since the
        anchor (algorithm.md §6). :func:`hvd_zoadam.checkpoint.save` writes these into
        ``{prefix}.pt``.

        **Collective**: every rank at the same step (two uncounted full-precision averages per
        bucket). Memory: a copy of x and m for the time of the call.
        """
        algorithm = self.algorithm
        if self.world_size == 1 or not hasattr(algorithm, "window_open") or not algorithm.window_open(self._engine):
            return None
        kept = [(self._engine.load_x(b).clone(), b.exp_avg.clone()) for b in self._buckets]

        def average_(tensor: torch.Tensor, name: str):
            return self.transport.wait(self.transport.start("allreduce", tensor, name, count=False))
        try:
            for index, b in enumerate(self._buckets):
                x = average_(self._engine.load_x(b).clone(), f"{self._collectives.pool(index)}.window.x")
                self._engine.store_x(b, x)
                b.exp_avg.copy_(average_(b.exp_avg.clone(), f"{self._collectives.pool(index)}.window.m"))
            return copy.deepcopy(model.state_dict()), copy.deepcopy(self.state_dict())
        finally:
            for b, (x, m) in zip(self._buckets, kept):
                self._engine.store_x(b, x)
                b.exp_avg.copy_(m)

    def load_error_feedback(self, state: dict | None, worker_error: dict | None = None) -> bool:
        """Load :meth:`error_feedback_state` (from any world size) into this rank's buffers:
        ``worker_error`` becomes the saved mean, ``server_error`` this rank's chunk of the
        saved global vector, so the amount the job owes is kept exactly (algorithm.md §6).
        At world size 1 past 0/1 Adam's freeze, where no exchange would deliver it, what is
        owed moves the parameters and the anchor at once and the buffers stay at zero.
        Parameters the state does not cover start at zero. Returns False (buffers zeroed) when
        ``state`` is None. Collectives: none.

        ``worker_error`` (``{pid: float32[numel]}``, e.g. :func:`hvd_zoadam.checkpoint.group_worker_error`'s), when
        given, is this rank's worker error instead of the saved mean; the server errors still
        come from ``state``. Parameters of ``state`` it leaves out start at zero.

        Raises:
            ValueError: the state was saved for other parameters (a name or size differs).
        """
        for b in self._buckets:
            b.exchange.zero_errors()
        if state is None:
            return False
        ids = self._param_ids()
        for b in self._buckets:
            ex = b.exchange
            worker = torch.zeros(ex.padded_numel, device=ex.worker_error.device)
            server = torch.zeros_like(worker)
            offsets = segment_offsets(p.numel() for p in b.params)
            for p, name, a, z in zip(b.params, b.names, offsets, offsets[1:]):
                pid = ids[p]
                if pid not in state["worker_error"]:
                    continue
                saved_name, saved = state["names"].get(pid), state["worker_error"][pid]
                if saved_name != name or saved.numel() != z - a:
                    raise ValueError(f"the error feedback was saved for parameter {saved_name!r} of "
                                     f"{saved.numel()} elements at position {pid}, but this optimizer has "
                                     f"{name!r} of {z - a} elements there: load a checkpoint of this model")
                if worker_error is not None:
                    saved = worker_error.get(pid, torch.zeros(z - a))
                    if saved.numel() != z - a:
                        raise ValueError(f"the worker error given for parameter {name!r} has {saved.numel()} "
                                         f"elements, not {z - a}")
                worker[a:z] = saved.to(worker.device)
                server[a:z] = state["server_error"][pid].to(worker.device)
            if self._delivers_owed():
                counters = self.param_groups[0][STATE_KEY]
                self.algorithm.deliver_owed(self._engine, b, (worker + server)[:b.numel], counters["step"],
                                            counters["exp_avg_sq_steps"])
            else:
                ex.set_errors(worker, server)
        return True

    def _delivers_owed(self) -> bool:
        return (self.world_size == 1 and hasattr(self.algorithm, "deliver_owed")
                and self.param_groups[0][STATE_KEY]["step"] > self.schedule.var_freeze_step)

    def __setstate__(self, state: dict) -> None:
        # torch.optim.Optimizer's; Adam's (next in the MRO of DistributedOptimizer's class) would
        # look for a per-parameter "step" that 0/1 Adam keeps in the counters instead.
        torch.optim.Optimizer.__setstate__(self, state)

    def state_dict(self) -> dict:
        """torch's ``state_dict`` (the schedule counters copied, so a kept state dict does not
        move with later steps; the tensors are references, as torch's). What the engine derives
        from ``exp_avg_sq`` is recomputed at its next use: Horovod's broadcast writes the tensors
        handed out without moving their version counters. The state exists from construction,
        so ``hvd.broadcast_optimizer_state`` runs no dummy ``step()`` before the first step,
        and leaves the gradients as they are (Horovod's dummy step left zeros)."""
        self._engine.derived.forget()  # the tensors handed out may be written behind torch's back
        state = super().state_dict()
        for group in state["param_groups"]:  # the counters as they are now, not a live view of them
            if STATE_KEY in group:
                group[STATE_KEY] = dict(group[STATE_KEY])
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, then the loaded m, v and anchor are copied into the flat
        buffers in float32 (no cast through a low-precision parameter dtype). The loaded group
        settings are written into the group dicts this optimizer already holds, which it shares
        with the optimizer it wraps: an LR scheduler built on either goes on driving the step. The counters in
        ``param_groups`` are restored exactly, so the schedule resumes where it was. This
        rank's error buffers are kept; use a per-rank save to restore them too. The
        backward-pass count is reset, as Horovod does.

        **An Adam checkpoint** (``state_dict()`` of ``torch.optim.Adam``/``AdamW`` or of
        ``hvd.DistributedOptimizer`` over one; no ``"zoadam"`` counters) is taken over as 0/1
        Adam that had run every step as a VARIANCE step: ``exp_avg`` and ``exp_avg_sq`` become
        m and v, and the schedule continues at Adam's step count t (``step`` and
        ``exp_avg_sq_steps`` both t), so the next step is t + 1 of the schedule and the bias
        corrections of m and v are exactly Adam's; lr, betas, eps and weight_decay come from
        the checkpoint, the weight-decay kind (Adam or AdamW) and the implementation flags
        (``foreach``, ``fused``, ...) stay this optimizer's. If t >= ``var_freeze_step`` v is
        frozen from the next step on, with the checkpoint's lr as the lr at the freeze. At the
        next step, on every rank, the anchor is set to the parameters as they are then (so the
        model may be loaded or broadcast after the optimizer) and the error buffers and the
        window are zeroed. A parameter without Adam state gets m = v = 0. ``amsgrad`` or
        ``maximize`` checkpoints are refused (ValueError) before anything changes.

        The buffers' tensors bypass torch's loader, which would first cast each of them to
        its parameter's device and dtype: a transient second copy of m, v and the anchor on
        the GPU when a checkpoint was loaded to the CPU."""
        if STATE_KEY not in state_dict["param_groups"][0]:
            state_dict = self._from_adam_state_dict(state_dict)
        self._check_loadable(state_dict)
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        originals = {p: saved[i] for i, p in zip(ids, params) if i in saved}
        self._drain_sync_started()
        self._pending = None
        for p in self._passes:
            self._passes[p] = 0
        buffers = ("exp_avg", "exp_avg_sq", "anchor", "exp_avg_mask")
        groups = self.param_groups
        super().load_state_dict({**state_dict, "state": {i: {k: v for k, v in st.items() if k not in buffers}
                                                         for i, st in saved.items()}})
        # torch's load makes new group dicts; the loaded values go into the ones this optimizer
        # shares with the optimizer it wraps, so an LR scheduler built on either keeps driving
        for mine, loaded in zip(groups, self.param_groups):
            mine.clear()
            mine.update(loaded)
        self.param_groups = groups
        self._share_state_with_wrapped()
        for b in self._buckets:
            for key in b.views:
                skey = "exp_avg_mask" if key == "mask" else key
                for p, view in zip(b.params, b.views[key]):
                    if p in originals and skey in originals[p]:
                        view.copy_(originals[p][skey].reshape(view.shape))
                    self.state[p][skey] = view
        self._engine.derived.forget()
        for group in self.param_groups:
            group.setdefault("lr_sum", 0.0)
            group.setdefault("decay_product", 1.0)

    def _check_loadable(self, state_dict: dict) -> None:
        """ValueError, before anything changes, for a state dict whose groups lack an option of
        this optimizer or whose counters are not what 0/1 Adam keeps (a damaged file that still
        unpickles): ``step`` and ``exp_avg_sq_steps`` ints with 0 <= k <= step, ``freeze_lr`` a
        number or None, ``lr_sum`` and ``decay_product`` numbers."""
        def number(value: object):
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        counters = state_dict["param_groups"][0][STATE_KEY]
        if not isinstance(counters, dict) or not {"step", "exp_avg_sq_steps", "freeze_lr"} <= set(counters):
            raise ValueError(f"the state dict's {STATE_KEY!r} counters must be a dict with step, exp_avg_sq_steps and "
                             f"freeze_lr, got {counters!r}")
        step, k = counters["step"], counters["exp_avg_sq_steps"]
        if not (type(step) is int and type(k) is int and 0 <= k <= step):
            raise ValueError(f"the state dict's counters step={step!r} and exp_avg_sq_steps={k!r} must be ints "
                             "with 0 <= exp_avg_sq_steps <= step")
        if counters["freeze_lr"] is not None and not number(counters["freeze_lr"]):
            raise ValueError(f"the state dict's freeze_lr must be a number or None, got {counters['freeze_lr']!r}")
        for index, group in enumerate(state_dict["param_groups"]):
            missing = sorted(set(self.defaults) - set(group))
            if missing:
                raise ValueError(f"param group {index} of the state dict lacks {missing}: not a state dict of "
                                 f"this optimizer")
            for key in ("lr_sum", "decay_product"):
                if key in group and not number(group[key]):
                    raise ValueError(f"param group {index} of the state dict has {key}={group[key]!r}, not a number")

    def _from_adam_state_dict(self, state_dict: dict) -> dict:
        """An Adam ``state_dict`` as the 0/1 Adam ``state_dict`` it is taken over as (see
        :meth:`load_state_dict`); raises ValueError for what 0/1 Adam cannot continue."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        keep = ("decoupled_weight_decay", "foreach", "fused", "capturable", "differentiable")
        groups, steps = [], [0]
        for index, (mine, saved) in enumerate(zip(self.param_groups, saved_groups)):
            group = {**saved, **{k: mine[k] for k in keep if k in mine}, "lr_sum": 0.0, "decay_product": 1.0}
            try:
                check_group(group, index)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"cannot take over this Adam checkpoint: {exc}") from None
            groups.append(group)
        state = {}
        for pid, st in state_dict["state"].items():
            state[pid] = {k: v for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")}
            if "step" in st:
                steps.append(int(round(float(st["step"]))))
        t = max(steps)
        frozen = t >= self.schedule.var_freeze_step
        groups[0][STATE_KEY] = {"step": t, "exp_avg_sq_steps": t,
                                "freeze_lr": float(groups[0]["lr"]) if frozen else None, ADOPT_KEY: True}
        return {"state": state, "param_groups": groups}


_registered = {}  # id(param) -> (weakref to param, weakref to the optimizer that owns it)


class ParamGroupsMixin:
    """torch's ``param_groups``: names, masks and layout of the trainable parameters, one
    optimizer per parameter, and ``add_param_group`` (new, zeroed buffers for the new group)."""

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
        :class:`~hvd_zoadam.comm.protocol.CollectiveNames`)."""
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
        if self._ready:
            index = len(self.param_groups) - 1
            check_group(self.param_groups[index], index)
            for j, p in enumerate(self.param_groups[index]["params"]):
                self._names.setdefault(p, f"noname.{index}.{j}")
            self._build_group(index)
            self._overlap.ready.extend([0] * (len(self._buckets) - len(self._overlap.ready)))
            self._checked_layout = False
