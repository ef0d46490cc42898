"""The checks of hvd_zoadam's arguments and the keys of its state in ``param_groups``.

Every check raises ``ValueError`` or ``TypeError`` naming the option and the fix, with
Horovod's texts where Horovod has the same check. Imported by the shell and by the
checkpoint contract (:mod:`hvd_zoadam.shell.torch_optim`); imports only :mod:`hvd_zoadam.core.schedule`.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from hvd_zoadam.core.schedule import (
    LOCAL_STEP_POLICIES,
    NEVER,
    AutoFreeze,
    Schedule,
    check_positive_int,
    var_update_interval_max,
)

if TYPE_CHECKING:
    from types import ModuleType

    from horovod.torch.compression import Compressor

STATE_KEY = "zoadam"            # param_groups[0][STATE_KEY]: the step counters shared by all ranks
ADOPT_KEY = "adopt_at_next_step"  # in the counters after loading an Adam checkpoint, until the next step


def check_group(group: dict, index: int) -> None:
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


def check_named_parameters(param_groups: list[dict],
                           named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> dict:
    """{param: name} from ``named_parameters`` (None: ``noname.<group>.<index>``), with
    Horovod's checks and messages (ValueError)."""
    params = [p for g in param_groups for p in g["params"]]
    if named_parameters is None:
        return {p: f"noname.{i}.{j}" for i, g in enumerate(param_groups) for j, p in enumerate(g["params"])}
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


def check_horovod_arguments(hvd: ModuleType | None, compression: type[Compressor] | None, op: int | None):
    """``compression`` and ``op`` with Horovod's defaults filled in (both as given when ``hvd`` is
    None: an explicit transport without Horovod). Returns (compression, op)."""
    if hvd is None:
        return compression, op
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
    return compression, op


def horovod_groups(num_groups: int, groups: int | list[list[torch.Tensor]] | None):
    """Horovod's ``groups``, with its deprecated alias ``num_groups`` (an int >= 0) taken as
    Horovod takes it: a DeprecationWarning, and ``groups = num_groups`` when ``groups`` is None."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a non-negative int (Horovod's deprecated name for groups), "
                         f"got {num_groups!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    return groups


def check_groups(groups: int | list[list[torch.Tensor]] | None) -> None:
    """Horovod's check of ``groups`` (ValueError with Horovod's texts): None, an int >= 0, or a
    list of lists of tensors in which no tensor appears twice. hvd_zoadam fuses parameters into
    buckets of ``bucket_cap_mb`` itself, so valid groups change neither the buckets nor the
    results; they are accepted so that Horovod scripts run unchanged."""
    if groups is None:
        return
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups >= 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))


AUTO = "auto"  # a knob's default that the optimizer decides (from the world size, or during training)

# The knobs every front end takes, each documented once: meaning, unit, when to change it (the
# default comes from the front end's signature). Rendered into the front ends' docstrings by
# :func:`documents_knobs`.
KNOB_DOCS = {
    "backward_passes_per_step": "gradients of that many ``backward()`` calls are summed locally (torch semantics) "
                                "before ``step()``; more raise Horovod's error.",
    "var_freeze_step": "T_f, steps: the last step before v (``exp_avg_sq``) freezes; after it the ranks take local "
                       "steps between syncs. ``\"auto\"`` decides it during training from the learning rate: twice "
                       "the warm-up, no earlier than v's min(4κ, 32)-th update (step 120 at κ = 8, 56 at κ = 14) "
                       "nor a quarter of 1/(1 − β2) (docs/algorithm.md §4). "
                       "Set it where the rate has no warm-up to read, or to freeze sooner over a slow link.",
    "var_update_scaler": "κ: updates of v (full-precision VARIANCE steps) per interval before the interval "
                         "doubles. ``\"auto\"``: 8, or 14 from 64 ranks. Higher: closer to Adam, more bytes.",
    "local_step_scaler": "α, steps: under the ``\"steps\"`` policy the sync interval H doubles every α steps "
                         "past the freeze (DeepSpeed's rule). Read by that policy only.",
    "local_step_clipper": "H_max, steps, a power of 2: the longest window of local steps between syncs. Longer: "
                          "fewer rounds, ranks further apart between syncs.",
    "local_step_policy": "``\"lr\"``: H doubles each time the learning rate halves from its value at the freeze "
                         "(H = 1 at a constant rate); ``\"steps\"``: every α steps; ``\"constant\"``: H = H_max.",
    "var_update_weighting": "``\"interval\"``: an update of v weighs as the steps since the last one, so v "
                            "weighs time as Adam's does; ``\"paper\"``: as one step (the paper's and DeepSpeed's).",
    "bias_correction": "Adam's bias corrections of m and v, as ``torch.optim.Adam``.",
    "transport": "what moves the bytes (below); ``\"auto\"`` picks for the launcher, and "
                 "``comm_stats()[\"transport\"]`` says which. The results are the same whichever does.",
    "bucket_cap_mb": "MiB of float32 per fused bucket; each bucket's 1-bit exchange takes two rounds, and the "
                     "buckets pipeline. On slow links give the model four buckets or more.",
    "scale_block_numel": "elements per 1-bit scale: a multiple of 8, or None for one scale per tensor. "
                         "``\"auto\"``: 256, or 64 from 32 ranks. Smaller: less compression error, more bytes.",
    "exp_avg_mask": "``{param or name: 0/1 tensor of its shape}``: coordinates at 0 never move (sign compression "
                    "cannot send an exact 0). DeepSpeed's group option ``exp_avg_mask`` works too.",
    "auto_exp_avg_mask": "hold still the coordinates whose v is exactly 0 (their average gradient was 0 at every "
                         "VARIANCE step; a frozen v would give them m/eps steps). False: DeepSpeed's behaviour.",
    "precondition_compression": "compress g/s and x_a − x instead of the paper's g and (x_a − x)·s, so that each "
                                "coordinate's compression error scales with its own Adam denominator.",
    "step_log": "a path: one JSON line per step (step, kind, lr, loss, skipped, bytes, rounds), rank 0's unless "
                "the path holds ``{rank}``.",
    "overlap": "the backward hooks start each bucket's exchange while backward runs (from the second step; "
               "not under ``torch.amp.GradScaler``). The results are those of False.",
    "algorithm": "``\"zoadam\"`` (0/1 Adam) or ``\"onebit\"`` (1-bit Adam: Adam up to ``var_freeze_step``, then "
                 "the momentum's 1-bit exchange at every step; the 0/1 Adam knobs must keep their defaults).",
    "hierarchical": "True or ``\"auto\"``: the two-level exchange for nodes of several ranks, full precision "
                    "inside a node and 1 bit between nodes (docs/algorithm.md §3); where nodes come from: below.",
}


def documents_knobs(like: Callable[..., object] | None = None):
    """A decorator: put one line per knob of a front end (its name, its default from the
    signature, and :data:`KNOB_DOCS`) where the decorated function's docstring has the line
    ``{knobs}``. The knobs are the parameters with a default that :data:`KNOB_DOCS` documents,
    of the decorated function or of ``like`` (for a front end that takes them as ``**options``)."""
    def render(func: Callable[..., object]):
        import inspect
        import textwrap
        lines = []
        for name, param in inspect.signature(like or func).parameters.items():
            if param.default is not param.empty and name in KNOB_DOCS:
                text = f"* ``{name}`` (default ``{param.default!r}``): {KNOB_DOCS[name]}"
                lines += textwrap.wrap(text, 96, initial_indent="    ", subsequent_indent="      ")
        func.__doc__ = func.__doc__.replace("    {knobs}\n", "\n".join(lines) + "\n")
        return func
    return render


def auto_var_update_scaler(world_size: int) -> int:
    """κ under ``var_update_scaler="auto"``: 8 below 64 ranks, 14 from 64 (at 64 and more ranks one
    rank's gradient is mostly noise, and the steps between VARIANCE steps are what costs
    quality; measured in docs/performance.md, "Quality at 2 to 128 workers")."""
    return 8 if world_size < 64 else 14


def auto_scale_block_numel(world_size: int) -> int:
    """Elements per 1-bit scale under ``scale_block_numel="auto"``: 256 below 32 ranks, 64 from 32
    (the 1-bit error weighs more as the average's own noise falls)."""
    return 256 if world_size < 32 else 64


def resolve_schedule(world_size: int, beta2: float, *, var_freeze_step: int | str, var_update_scaler: int | str,
                     local_step_scaler: int, local_step_clipper: int, local_step_policy: str,
                     var_update_weighting: str, scale_block_numel: int | str | None):
    """The knobs with their ``"auto"`` values decided for ``world_size`` ranks and the first
    param group's ``beta2``, as the optimizer decides them: ``(schedule, auto_freeze,
    scale_block_numel)``, ``auto_freeze`` an :class:`~hvd_zoadam.core.schedule.AutoFreeze` under
    ``var_freeze_step="auto"`` (the schedule's T_f is then :data:`~hvd_zoadam.core.schedule.NEVER`
    until it decides), else None. Raises as :class:`~hvd_zoadam.core.schedule.Schedule`."""
    kappa = auto_var_update_scaler(world_size) if var_update_scaler == AUTO else var_update_scaler
    schedule = Schedule(NEVER if var_freeze_step == AUTO else var_freeze_step, kappa, local_step_scaler,
                        local_step_clipper, local_step_policy, var_update_weighting,
                        var_update_interval_max(beta2) if var_update_weighting == "interval" else NEVER)
    auto_freeze = AutoFreeze(kappa, beta2) if var_freeze_step == AUTO else None
    scale = auto_scale_block_numel(world_size) if scale_block_numel == AUTO else scale_block_numel
    return schedule, auto_freeze, scale


def check_arguments(*, backward_passes_per_step: int, gradient_predivide_factor: float,
                    groups: int | list[list[torch.Tensor]] | None, sparse_as_dense: bool, bias_correction: bool,
                    local_step_policy: str, scale_block_numel: int | str | None, bucket_cap_mb: float):
    """The factory's other arguments (the schedule's knobs are :class:`~hvd_zoadam.core.schedule.Schedule`'s).
    Returns ``scale_block_numel`` as an int (or None, or ``"auto"``)."""
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
        raise TypeError(f"backward_passes_per_step must be an int, got {backward_passes_per_step!r}")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if not isinstance(gradient_predivide_factor, (int, float)) or not gradient_predivide_factor > 0 \
            or not math.isfinite(gradient_predivide_factor):
        raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {gradient_predivide_factor!r}")
    check_groups(groups)
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
    if not isinstance(bias_correction, bool):
        raise TypeError(f"bias_correction must be a bool, got {bias_correction!r}")
    if local_step_policy not in LOCAL_STEP_POLICIES:
        raise ValueError(f"local_step_policy must be one of {LOCAL_STEP_POLICIES}, got {local_step_policy!r}")
    if scale_block_numel is not None and scale_block_numel != AUTO:
        scale_block_numel = check_positive_int(scale_block_numel, "scale_block_numel",
                                               "Use 'auto', a multiple of 8 such as 256, or None for one scale "
                                               "per tensor.")
        if scale_block_numel % 8:
            raise ValueError(f"scale_block_numel must be a multiple of 8 (whole bytes of sign bits per block), "
                             f"got {scale_block_numel}")
    if not isinstance(bucket_cap_mb, (int, float)) or isinstance(bucket_cap_mb, bool) or \
            not 0 < bucket_cap_mb < 2 ** 40:
        raise ValueError(f"bucket_cap_mb must be a number > 0 and below 2**40 (MiB), got {bucket_cap_mb!r}")
    return scale_block_numel
