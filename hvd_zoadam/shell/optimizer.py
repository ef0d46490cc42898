"""The optimizer a user holds, composed of the shell's three parts and its reports:

* :class:`~hvd_zoadam.shell.horovod_contract.HorovodContract`: Horovod's contract (hooks,
  ``synchronize``, ``skip_synchronize``, ``zero_grad``, ``step``, elastic);
* :class:`~hvd_zoadam.shell.driver.StepDriver`: the step driver;
* :class:`~hvd_zoadam.shell.agreement.StepAgreement`: what the ranks agree on about a step;
* :class:`~hvd_zoadam.shell.torch_optim.ParamGroupsMixin` and
  :class:`~hvd_zoadam.shell.torch_optim.StateDictMixin`: torch's optimizer contract;
* :class:`~hvd_zoadam.shell.stats.ReportsMixin`: ``comm_stats``, ``memory_bytes``,
  ``schedule_state``.

:class:`DistributedAdamOptimizer` builds the state they share; :class:`ZeroOneAdamOptimizer`
(0/1 Adam) and :class:`OnebitAdamOptimizer` (1-bit Adam) say which algorithm it runs. It
does no math and names no collective: the math is :mod:`hvd_zoadam.core` (engine,
algorithms), every collective :mod:`hvd_zoadam.comm`.
"""
from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from hvd_zoadam import native
from hvd_zoadam.comm.hierarchical import node_levels
from hvd_zoadam.comm.protocol import CollectiveNames
from hvd_zoadam.comm.transport import Transport
from hvd_zoadam.core.algorithms.onebit import OnebitAdam as _OnebitAdam
from hvd_zoadam.core.algorithms.zeroone import ZeroOneAdam
from hvd_zoadam.core.engine import Engine
from hvd_zoadam.core.schedule import SCHEDULE_DEFAULTS, AutoFreeze, Schedule
from hvd_zoadam.shell.agreement import StepAgreement
from hvd_zoadam.shell.driver import StepDriver
from hvd_zoadam.shell.horovod_contract import HorovodContract
from hvd_zoadam.shell.options import (
    AUTO,
    STATE_KEY,
    check_arguments,
    check_group,
    check_named_parameters,
    resolve_schedule,
)
from hvd_zoadam.shell.overlap import Overlap
from hvd_zoadam.shell.stats import CommStats, ReportsMixin, StepLog
from hvd_zoadam.shell.torch_optim import ParamGroupsMixin, StateDictMixin

if TYPE_CHECKING:
    from horovod.torch.compression import Compressor


class DistributedAdamOptimizer(HorovodContract, StepDriver, StepAgreement, ParamGroupsMixin, ReportsMixin,
                               StateDictMixin, torch.optim.Optimizer):
    """The optimizer a user holds: 0/1 Adam or 1-bit Adam over a transport. Build it with
    :func:`hvd_zoadam.DistributedOptimizer` or :func:`hvd_zoadam.OnebitAdam`; what they return is
    a :class:`ZeroOneAdamOptimizer` or an :class:`OnebitAdamOptimizer`, both of this class.

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
    ``broadcast_optimizer_state`` never needs its dummy zero-gradient ``step()``. So it leaves
    ``p.grad`` as it found it (None before the first ``backward()``), where for a fresh
    ``torch.optim.Adam`` Horovod's leaves zeros: a ``step()`` then, with no gradient on any
    rank, changes nothing, as torch's Adam does without gradients (zeros would be a step).
    Such a step changes nothing wherever the ranks compare it (the first step, and where
    overlap is armed); at any other step a rank without a gradient raises.
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
    same pass; see :meth:`memory_bytes`). On the CPU the Adam denominators sqrt(v̂) + eps
    are kept as well (``4n``): v is frozen after the freeze, and recomputing them took three
    passes over the model in every LOCAL step and six in every SYNC step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None, *,
                 schedule: Schedule, transport: Transport, compression: type[Compressor] | None,
                 backward_passes_per_step: int, gradient_predivide_factor: float,
                 sparse_as_dense: bool, bias_correction: bool, bucket_cap_numel: int,
                 scale_block_numel: int | None = None,
                 exp_avg_mask: dict[torch.Tensor | str, torch.Tensor] | None = None, auto_exp_avg_mask: bool = False,
                 precondition_compression: bool = True, step_log: str | None = None, overlap: bool = True,
                 algorithm: str = "zoadam", hierarchical: bool | str = False, auto_freeze: AutoFreeze | None = None):
        self._ready = False
        # Not super(): built by DistributedOptimizer, this class sits before the wrapped
        # torch.optim.Adam/AdamW in the MRO, and their __init__ must not run (as in Horovod).
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, dict(optimizer.defaults))
        self.algorithm = ZeroOneAdam(schedule, precondition_compression, auto_freeze) if algorithm == "zoadam" \
            else _OnebitAdam(schedule)
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
        self._parameter_names = self._names  # Horovod's name for it, which Horovod's helpers read
        self._wrapped = weakref.ref(optimizer)
        self._share_state_with_wrapped()
        self._collectives = CollectiveNames.for_layout(self._layout_description(), transport.world_size)
        self._engine = Engine(self, self._names, self._resolve_masks(exp_avg_mask),
                              transport, self._collectives, bucket_cap_numel=bucket_cap_numel,
                              scale_block_numel=scale_block_numel, sparse_as_dense=sparse_as_dense,
                              bias_correction=bias_correction, auto_exp_avg_mask=auto_exp_avg_mask,
                              levels=node_levels(transport, hierarchical, self._collectives.prefix))
        self._average = self._new_average()
        self._hook_handles = []
        weakref.finalize(self, _remove_hooks, self._hook_handles)  # a dropped optimizer leaves no hook behind
        self._init_step_state()
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

    def _init_step_state(self) -> None:
        """What the step driver and Horovod's contract keep between steps, as a fresh optimizer has it."""
        self._passes = {}
        self._synchronized = False
        self._should_synchronize = True
        self._no_sync_depth = 0       # inside no_sync(): the hooks neither count nor start
        self._pending = None          # (step, kind, skip) prepared by synchronize()
        self._iteration = None        # set_iteration(): what the 1-bit exchanges announce
        self._announcing = (0, None)  # (optimizer step, iteration) of the exchange in progress
        self._exchanged = False       # p.grad holds this step's exchange result
        self._checked_layout = False
        self._amp_seen = False
        self._modified_after_backward = False
        self._warned_changed = False
        self._warned_no_gradient = False  # a step without a gradient at a LOCAL step, once
        self._warned_unsynchronized = False
        self._sync_started = {}       # SYNC: id(bucket) -> round 1 the hooks started, for step()
        self._stats = CommStats()

    @property
    def schedule(self) -> Schedule:
        """The schedule in force: the knobs', with the T_f decided so far under
        ``var_freeze_step="auto"`` (:data:`~hvd_zoadam.core.schedule.NEVER` while undecided)."""
        return self.algorithm.schedule(self.param_groups[0][STATE_KEY])

    def _share_state_with_wrapped(self) -> None:
        """The optimizer this one wraps holds the same ``state`` (and, from construction, the same
        ``param_groups`` dicts): its ``state_dict()`` is this optimizer's state, not an empty one."""
        wrapped = self._wrapped()
        if wrapped is not None:
            wrapped.state = self.state

    def _mark_wrapped_stepped(self) -> None:
        """Tell an LR scheduler built on the wrapped optimizer that a step ran: torch's schedulers
        read ``_opt_called`` (set by their wrapper of ``step``, which the wrapped optimizer's
        ``step`` never runs) and would otherwise warn that the scheduler stepped first."""
        wrapped = self._wrapped()
        if wrapped is not None:
            wrapped._opt_called = True

    def set_iteration(self, iteration: int) -> None:
        """Give the training loop's iteration number, so that a rank that skips or repeats a
        whole iteration (no ``backward()``/``step()``, or two) is caught at the next 1-bit
        exchange, naming the rank, instead of at the end of the job as a timeout.

        The ranks pair their exchanges by call order, and the optimizer step counts calls, so a
        rank one iteration behind still agrees with the others step by step. With this set, the
        COMPRESSED and SYNC exchanges announce ``iteration`` in round 1 where they otherwise
        announce the optimizer step (the same 4 bytes: nothing more is sent), and ranks that
        announce different values raise :class:`~hvd_zoadam.StepMismatchError` on every rank
        together, naming the odd ranks, their iterations and the step. Call it on every rank,
        every iteration, before ``backward()`` (the backward hooks start the exchange); on
        every rank or on none. VARIANCE and LOCAL steps announce nothing, so a skip is caught
        at the next COMPRESSED or SYNC step.

        Raises:
            TypeError: ``iteration`` is not an int.
            ValueError: ``iteration`` is outside [0, 2**31) (it travels as an int32).
        """
        if isinstance(iteration, bool) or not isinstance(iteration, numbers.Integral):
            raise TypeError(f"set_iteration(iteration) takes an int, got {type(iteration).__name__}")
        if not 0 <= iteration < 2 ** 31:
            raise ValueError(f"set_iteration(iteration) takes an int in [0, 2**31), got {iteration}")
        self._iteration = int(iteration)


class ZeroOneAdamOptimizer(DistributedAdamOptimizer):
    """0/1 Adam (Lu, Li, Zhang, De Sa, He, arXiv 2202.06009): what :func:`hvd_zoadam.DistributedOptimizer`
    returns (with ``algorithm="zoadam"``, the default). See :class:`DistributedAdamOptimizer`."""


class OnebitAdamOptimizer(DistributedAdamOptimizer):
    """1-bit Adam (Tang et al., arXiv 2102.02888): what :func:`hvd_zoadam.OnebitAdam` (or
    ``DistributedOptimizer(..., algorithm="onebit")``) returns. See :class:`DistributedAdamOptimizer`."""


ALGORITHM_CLASSES = {"zoadam": ZeroOneAdamOptimizer, "onebit": OnebitAdamOptimizer}


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


_classes: dict = {}  # (algorithm, the wrapped optimizer's class) -> the class built for them


def optimizer_class(algorithm: str, base: type) -> type:
    """A subclass of the algorithm's class (:data:`ALGORITHM_CLASSES`) and of ``base`` (the wrapped
    ``torch.optim.Adam``, ``AdamW`` or a subclass of them), made once per pair: so
    ``isinstance(opt, base)`` holds, as for the class ``hvd.DistributedOptimizer`` builds. The
    algorithm's class comes first in the MRO and overrides what ``base`` defines (``__init__``,
    ``step``, ``__setstate__``), so none of ``base``'s own code runs."""
    cls = _classes.get((algorithm, base))
    if cls is None:
        algo_cls = ALGORITHM_CLASSES[algorithm]
        cls = _classes[(algorithm, base)] = type(algo_cls.__name__, (algo_cls, base),
                                                 {"__module__": algo_cls.__module__,
                                                  "__qualname__": algo_cls.__qualname__,
                                                  "__doc__": algo_cls.__doc__})
    return cls


def _check_onebit(knobs: dict, precondition_compression) -> int:
    """ValueError for a 0/1 Adam knob passed to 1-bit Adam, or for 1-bit Adam without its
    ``freeze_step``. Returns 1-bit Adam's κ: 1 (every warm-up step updates v)."""
    defaults = dict(SCHEDULE_DEFAULTS, var_update_scaler=AUTO, precondition_compression=True)
    given = {**knobs, "precondition_compression": precondition_compression}
    for name, default in defaults.items():
        if given[name] != default:
            raise ValueError(f"{name}={given[name]!r} is a 0/1 Adam knob; algorithm='onebit' (1-bit Adam) has only "
                             "var_freeze_step (its freeze_step): drop the argument or use algorithm='zoadam'")
    if knobs["var_freeze_step"] == AUTO:
        raise ValueError("algorithm='onebit' (1-bit Adam) needs var_freeze_step, its freeze_step, as a number of "
                         "steps: the paper advises 15-25 % of training (hvd_zoadam.OnebitAdam(..., freeze_step=T))")
    return 1


def build_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                    resolve_transport: Callable[[], Transport], *, front_end: str,
                    compression: type[Compressor] | None, backward_passes_per_step: int,
                    gradient_predivide_factor: float, groups: int | list[list[torch.Tensor]] | None,
                    sparse_as_dense: bool, var_freeze_step: int | str, var_update_scaler: int | str,
                    local_step_scaler: int, local_step_clipper: int, local_step_policy: str,
                    var_update_weighting: str, bias_correction: bool,
                    bucket_cap_mb: float, scale_block_numel: int | str | None,
                    exp_avg_mask: dict[torch.Tensor | str, torch.Tensor] | None, auto_exp_avg_mask: bool,
                    precondition_compression: bool, step_log: str | None, overlap: bool, algorithm: str,
                    hierarchical: bool | str):
    """What every front end does (``hvd_zoadam.DistributedOptimizer``,
    ``hvd_zoadam.distributed.DistributedOptimizer``): check the wrapped optimizer and every knob,
    then ``resolve_transport()`` (a callable returning the :class:`Transport`: only once every
    argument is checked), then build the optimizer of ``algorithm``'s class. ``front_end``: the
    name the error texts give. Raises as the front ends' docstrings say."""
    if isinstance(optimizer, DistributedAdamOptimizer):
        raise TypeError("this optimizer is already an hvd_zoadam optimizer; wrap the plain torch.optim.Adam once")
    if type(optimizer).__module__ == "horovod.torch.optimizer":
        raise TypeError("this optimizer was already wrapped by hvd.DistributedOptimizer; pass the plain "
                        f"torch.optim.Adam/AdamW to {front_end} instead")
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError(f"{front_end} supports torch.optim.Adam (L2 weight decay) and "
                        f"torch.optim.AdamW (decoupled weight decay); got {type(optimizer).__name__}")
    scale_block_numel = check_arguments(
        backward_passes_per_step=backward_passes_per_step, gradient_predivide_factor=gradient_predivide_factor,
        groups=groups, sparse_as_dense=sparse_as_dense, bias_correction=bias_correction,
        local_step_policy=local_step_policy, scale_block_numel=scale_block_numel, bucket_cap_mb=bucket_cap_mb)
    if not (isinstance(hierarchical, bool) or hierarchical == "auto"):
        raise ValueError(f"hierarchical must be False, True or 'auto', got {hierarchical!r}")
    if algorithm not in ("zoadam", "onebit"):
        raise ValueError(f"algorithm must be 'zoadam' (0/1 Adam) or 'onebit' (1-bit Adam), got {algorithm!r}")
    knobs = dict(var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                 local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper,
                 local_step_policy=local_step_policy, var_update_weighting=var_update_weighting,
                 scale_block_numel=scale_block_numel)
    if algorithm == "onebit":
        knobs["var_update_scaler"] = _check_onebit(knobs, precondition_compression)
    beta2 = optimizer.param_groups[0]["betas"][1]
    resolve_schedule(1, beta2, **knobs)  # the schedule's checks, before the transport is asked anything
    # Every argument is checked before the transport is asked anything (initialised? in the group?).
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    check_named_parameters(optimizer.param_groups, named_parameters)
    for index, group in enumerate(optimizer.param_groups):
        check_group(group, index)
    transport = resolve_transport()
    schedule, auto_freeze, scale_block_numel = resolve_schedule(transport.world_size, beta2, **knobs)
    return optimizer_class(algorithm, type(optimizer))(
        optimizer, named_parameters, schedule=schedule, auto_freeze=auto_freeze, transport=transport,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        gradient_predivide_factor=float(gradient_predivide_factor), sparse_as_dense=sparse_as_dense,
        bias_correction=bias_correction, bucket_cap_numel=max(1, int(bucket_cap_mb * 2 ** 20 / 4)),
        scale_block_numel=scale_block_numel, exp_avg_mask=exp_avg_mask, auto_exp_avg_mask=bool(auto_exp_avg_mask),
        precondition_compression=bool(precondition_compression), step_log=step_log, overlap=bool(overlap),
        algorithm=algorithm, hierarchical=hierarchical)

