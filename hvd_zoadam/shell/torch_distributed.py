"""The torch.distributed front end: 0/1 Adam and 1-bit Adam without Horovod.

For scripts launched by ``torchrun`` (or ``srun ... torchrun``) that own a ``torch.distributed``
process group: Gloo on CPU tensors, NCCL on CUDA tensors. The one-line change from a
``torchrun`` + AdamW script that used ``DistributedDataParallel``::

    import hvd_zoadam.distributed as zd
    dist.init_process_group("gloo")                # or "nccl"; as before
    # model = DDP(model)                           # drop this: 0/1 Adam does the exchange
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = zd.DistributedOptimizer(opt, model.named_parameters())
    zd.broadcast_parameters(model.state_dict(), root_rank=0)
    zd.broadcast_optimizer_state(opt, root_rank=0)

Every 0/1 Adam and 1-bit Adam option has the name and default of
:func:`hvd_zoadam.DistributedOptimizer`; Horovod's own arguments (``compression``, ``op``,
``groups``, ``gradient_predivide_factor``, ``process_set``) are replaced by ``process_group``
(default: the default group; a group from ``torch.distributed.new_group`` takes the place of
a Horovod process set). Results are those of the Horovod front end over the same exchange.
"""
from __future__ import annotations

import gc
import inspect
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from hvd_zoadam.comm.select import torch_distributed_transport
from hvd_zoadam.comm.torch_distributed import torch_distributed_unavailable_reason
from hvd_zoadam.comm.transport import Transport
from hvd_zoadam.core.schedule import (
    DEFAULT_LOCAL_STEP_CLIPPER,
    DEFAULT_LOCAL_STEP_POLICY,
    DEFAULT_LOCAL_STEP_SCALER,
    DEFAULT_VAR_UPDATE_WEIGHTING,
)
from hvd_zoadam.shell.optimizer import build_optimizer
from hvd_zoadam.shell.options import documents_knobs

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DistributedOptimizer", "OnebitAdam", "broadcast_parameters", "broadcast_optimizer_state"]


@documents_knobs()
def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         process_group: ProcessGroup | None = None, *, backward_passes_per_step: int = 1,
                         var_freeze_step: int | str = "auto", var_update_scaler: int | str = "auto",
                         local_step_scaler: int = DEFAULT_LOCAL_STEP_SCALER,
                         local_step_clipper: int = DEFAULT_LOCAL_STEP_CLIPPER,
                         local_step_policy: str = DEFAULT_LOCAL_STEP_POLICY,
                         var_update_weighting: str = DEFAULT_VAR_UPDATE_WEIGHTING, bias_correction: bool = True,
                         transport: str | Transport = "auto", bucket_cap_mb: float = 25.0,
                         scale_block_numel: int | str | None = "auto",
                         exp_avg_mask: dict[torch.Tensor | str, torch.Tensor] | None = None,
                         auto_exp_avg_mask: bool = True, precondition_compression: bool = True,
                         step_log: str | None = None, overlap: bool = True, algorithm: str = "zoadam",
                         hierarchical: bool | str = False):
    """Wrap a ``torch.optim.Adam``/``AdamW`` into 0/1 Adam (or 1-bit Adam) over a
    ``torch.distributed`` process group, without Horovod.

    Args:
        optimizer: a plain ``torch.optim.Adam`` or ``AdamW`` over the model's parameters.
        named_parameters: ``model.named_parameters()``; the names key the settings and layout
            check across ranks (recommended; without them parameters are named by position).
        process_group: the ranks that train together (default: the default group).

    The knobs, each winning over its default when set (``transport`` here: ``"auto"`` or
    ``"torch.distributed"``, the same, or a :class:`~hvd_zoadam.comm.transport.Transport`;
    ``hierarchical``'s nodes: ``LOCAL_WORLD_SIZE`` ranks, what torchrun sets, or blocks of
    ``HVD_ZOADAM_RANKS_PER_NODE`` consecutive ranks when that is set):

    {knobs}

    Returns:
        A :class:`~hvd_zoadam.shell.optimizer.ZeroOneAdamOptimizer` (or
        :class:`~hvd_zoadam.shell.optimizer.OnebitAdamOptimizer`), also an instance of
        ``type(optimizer)``, with ``synchronize()``/``skip_synchronize()`` for gradient clipping.

    Raises:
        TypeError, ValueError: as :func:`hvd_zoadam.DistributedOptimizer`; also ValueError when
            ``torch.distributed`` is not initialised, when a parameter's device does not suit
            the group's backend (CUDA over Gloo, CPU over NCCL), or when a parameter belongs
            to a model wrapped in ``DistributedDataParallel`` (which would average every
            gradient a second time), each naming the fix.
    """
    knobs = {name: value for name, value in locals().items() if name in KNOBS}
    if transport not in ("auto", "torch.distributed") and not isinstance(transport, Transport):
        raise ValueError(f"transport must be 'auto' or 'torch.distributed' here (or a Transport instance), got "
                         f"{transport!r}; for Horovod's collectives use hvd_zoadam.DistributedOptimizer")
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    refuse_ddp(optimizer)

    def resolve():
        if isinstance(transport, Transport):
            return transport
        reason = torch_distributed_unavailable_reason()
        if reason is not None:
            raise ValueError(f"hvd_zoadam.distributed.DistributedOptimizer: {reason}")
        made = torch_distributed_transport(process_group)
        for group in optimizer.param_groups:
            for p in group["params"]:
                made.check_device(p.device)
        return made
    return build_without_horovod(optimizer, named_parameters, resolve,
                                 "hvd_zoadam.distributed.DistributedOptimizer", knobs)


def build_without_horovod(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                          resolve: Callable[[], Transport], front_end: str, knobs: dict):
    """:func:`~hvd_zoadam.shell.optimizer.build_optimizer` for a front end without Horovod's
    own arguments: ``knobs``, the keyword-only arguments of :func:`DistributedOptimizer`
    (:data:`KNOBS`; ``transport`` is resolved by ``resolve`` and dropped here)."""
    knobs = {name: value for name, value in knobs.items() if name != "transport"}
    return build_optimizer(optimizer, named_parameters, resolve, front_end=front_end, compression=None,
                           gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False, **knobs)


KNOBS = {name: p.default for name, p in inspect.signature(DistributedOptimizer).parameters.items()
         if p.kind is p.KEYWORD_ONLY}  # every 0/1 Adam and 1-bit Adam knob, and its default


def OnebitAdam(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
               process_group: ProcessGroup | None = None, *, freeze_step: int, **kwargs: object):
    """1-bit Adam (Tang et al., arXiv 2102.02888) over a ``torch.distributed`` process group:
    ``DistributedOptimizer(optimizer, named_parameters, process_group, algorithm="onebit",
    var_freeze_step=freeze_step, **kwargs)`` (see :func:`hvd_zoadam.OnebitAdam`)."""
    return DistributedOptimizer(optimizer, named_parameters, process_group, algorithm="onebit",
                                var_freeze_step=freeze_step, **kwargs)


def refuse_ddp(optimizer: torch.optim.Optimizer) -> None:
    """ValueError when a parameter of ``optimizer`` belongs to a live ``DistributedDataParallel``."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    ddp = torch.nn.parallel.DistributedDataParallel
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, which some live objects
        # answer with a warning (torch.distributed.reduce_op's FutureWarning)
        if issubclass(type(obj), ddp) and any(id(p) in params for p in obj.parameters()):
            raise ValueError("the model is wrapped in torch.nn.parallel.DistributedDataParallel, which averages "
                             "every gradient in full precision before 0/1 Adam's own exchange: build the "
                             "optimizer on the plain model (drop the DDP wrapper) and let hvd_zoadam exchange")


def _group_root(root_rank: int, process_group):
    import torch.distributed as dist
    return dist.get_global_rank(process_group, root_rank) if process_group is not None else root_rank


def broadcast_parameters(params: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int = 0,
                         process_group: ProcessGroup | None = None) -> None:
    """``hvd.broadcast_parameters`` over ``torch.distributed``: every rank's tensors become
    ``root_rank``'s, in place. ``params``: ``model.state_dict()``, ``model.named_parameters()``
    or a list of ``(name, tensor)``; the order of the names is what pairs the tensors, and it
    must be the same on every rank. ``root_rank`` is a rank of ``process_group``.
    Collective over the group."""
    import torch.distributed as dist
    src = _group_root(root_rank, process_group)
    broadcast_tensors(params, lambda tensor: dist.broadcast(tensor.data, src=src, group=process_group))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_group: ProcessGroup | None = None) -> None:
    """``hvd.broadcast_optimizer_state`` over ``torch.distributed``: every rank takes
    ``root_rank``'s ``state_dict()`` (m, v, the anchor, the schedule counters, lr and the other
    group settings), then ``load_state_dict`` of it. The error buffers stay each rank's own.
    Collective over the group.

    Raises:
        ValueError: the ranks' optimizers hold different state layouts (both named).
    """
    import torch.distributed as dist
    src = _group_root(root_rank, process_group)

    def broadcast_object(obj: object):
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=process_group)
        return box[0]

    def all_agree(ok: bool) -> bool:
        on = "cuda" if str(dist.get_backend(process_group)).lower() == "nccl" else "cpu"
        flag = torch.tensor([int(ok)], device=on)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=process_group)
        return bool(flag.item())
    broadcast_state(optimizer, root_rank, broadcast_object,
                    lambda tensor: dist.broadcast(tensor, src=src, group=process_group), all_agree)


def broadcast_tensors(params: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                      broadcast: Callable[[torch.Tensor], object]) -> None:
    """:func:`broadcast_parameters` over any collective: ``broadcast(tensor)`` makes one
    tensor the root's in place, on every rank, in the order of ``params``' names."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    with torch.no_grad():
        for _, tensor in items:
            if isinstance(tensor, torch.Tensor):
                broadcast(tensor)


def broadcast_state(optimizer: torch.optim.Optimizer, root_rank: int, broadcast_object: Callable[[object], object],
                    broadcast: Callable[[torch.Tensor], object], all_agree: Callable[[bool], bool]) -> None:
    """:func:`broadcast_optimizer_state` over any collective: ``broadcast_object(obj)``
    returns the root's plain object (param groups and each state tensor's key, shape and
    dtype, pickled by this job's own root rank), ``broadcast(tensor)`` makes one tensor the
    root's in place, ``all_agree(ok)`` is whether ``ok`` holds on every rank.

    Raises:
        ValueError: on every rank, the root included, when the ranks' optimizers hold
            different state layouts (the root's and this rank's named).
    """
    state = optimizer.state_dict()
    keys = [(pid, k, tuple(v.shape), str(v.dtype)) for pid in sorted(state["state"])
            for k, v in sorted(state["state"][pid].items()) if isinstance(v, torch.Tensor)]
    root_groups, root_keys = broadcast_object((state["param_groups"], keys))
    if not all_agree(root_keys == keys):
        raise ValueError(f"broadcast_optimizer_state: the ranks' optimizers hold different state tensors (rank "
                         f"{root_rank}'s {root_keys[:4]}..., this rank's {keys[:4]}...): build the same model and "
                         "optimizer on every rank")
    with torch.no_grad():
        for pid, k, _, _ in keys:
            broadcast(state["state"][pid][k])
    optimizer.load_state_dict({"state": state["state"], "param_groups": root_groups})
