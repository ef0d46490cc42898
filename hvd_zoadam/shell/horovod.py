"""The Horovod front end: ``hvd_zoadam.DistributedOptimizer`` and ``hvd_zoadam.OnebitAdam``,
drop-in replacements for ``hvd.DistributedOptimizer`` that take Horovod's arguments with
Horovod's meaning, check every argument before Horovod is asked anything, and return the
optimizer of :mod:`hvd_zoadam.shell.optimizer` over a Horovod (or mpi4py) transport.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hvd_zoadam.comm.select import make_transport
from hvd_zoadam.core.schedule import (
    DEFAULT_LOCAL_STEP_CLIPPER,
    DEFAULT_LOCAL_STEP_POLICY,
    DEFAULT_LOCAL_STEP_SCALER,
    DEFAULT_VAR_UPDATE_WEIGHTING,
)
from hvd_zoadam.shell.elastic import register_state_handler
from hvd_zoadam.shell.optimizer import DistributedAdamOptimizer, build_optimizer
from hvd_zoadam.shell.options import check_horovod_arguments, documents_knobs, horovod_groups

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from horovod.common.process_sets import ProcessSet
    from horovod.torch.compression import Compressor

    from hvd_zoadam.comm.transport import Transport


@documents_knobs()
def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] | None = None, backward_passes_per_step: int = 1,
                         op: int | None = None, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | list[list[torch.Tensor]] | None = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet | None = None, *, var_freeze_step: int | str = "auto",
                         var_update_scaler: int | str = "auto", local_step_scaler: int = DEFAULT_LOCAL_STEP_SCALER,
                         local_step_clipper: int = DEFAULT_LOCAL_STEP_CLIPPER,
                         local_step_policy: str = DEFAULT_LOCAL_STEP_POLICY,
                         var_update_weighting: str = DEFAULT_VAR_UPDATE_WEIGHTING, bias_correction: bool = True,
                         transport: str | Transport = "auto", bucket_cap_mb: float = 25.0,
                         scale_block_numel: int | str | None = "auto",
                         exp_avg_mask: dict[torch.Tensor | str, torch.Tensor] | None = None,
                         auto_exp_avg_mask: bool = True,
                         precondition_compression: bool = True, step_log: str | None = None, overlap: bool = True,
                         algorithm: str = "zoadam", hierarchical: bool | str = False):
    """Wrap a ``torch.optim.Adam``/``AdamW`` into a 0/1 Adam (or 1-bit Adam) optimizer that
    communicates through Horovod. A drop-in replacement for ``hvd.DistributedOptimizer``.

    1-bit Adam (Tang et al. 2021, algorithm.md §9) is ``algorithm="onebit"``, or
    :func:`OnebitAdam` with DeepSpeed's name ``freeze_step``.

    Horovod's arguments keep Horovod's meaning:

    * ``named_parameters``: ``(name, param)`` tuples; names key the layout check across ranks.
    * ``compression``: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16``, which
      casts the full-precision VARIANCE-step averages to fp16 on the wire, as Horovod does.
      The 1-bit phases are already compressed and do not change.
    * ``op``: only ``hvd.Average`` (the default); 0/1 Adam is defined on the average.
    * ``gradient_predivide_factor``: as Horovod, splits the VARIANCE average into a
      divide by f before and a multiply by f/P after the sum. The 1-bit exchange is
      scale-free and does not use it.
    * ``num_groups``, ``groups``: accepted and checked as Horovod checks them (``num_groups``
      is Horovod's deprecated name for ``groups``); hvd_zoadam fuses parameters into buckets
      of ``bucket_cap_mb`` itself, so they change neither the buckets nor the results.
    * ``sparse_as_dense``: sparse gradients are densified when True and refused otherwise.
    * ``process_set``: the ranks this optimizer trains with (default: all). Unlike Horovod,
      a rank outside it cannot build the optimizer (ValueError): it would hold buffers laid
      out for a world it is not part of, and a ``step()`` there could only be a no-op.

    ``backward_passes_per_step``, and 0/1 Adam's and 1-bit Adam's keyword-only knobs
    (docs/algorithm.md §4), each winning over its default when set:

    {knobs}

    ``transport`` here: ``"horovod"`` (Horovod's collectives), ``"mpi"`` (the 1-bit phases over
    mpi4py on Horovod's MPI world), ``"gloo"`` (over a Gloo group of hvd_zoadam's own under
    Horovod's Gloo controller), each a ValueError naming the reason where it cannot work;
    ``"auto"``: ``"mpi"`` under Horovod's MPI controller with ``MPI_THREAD_MULTIPLE`` and mpi4py,
    ``"gloo"`` under its Gloo controller outside an elastic job with CPU parameters, else
    ``"horovod"``. ``hierarchical`` needs ``transport="mpi"`` (True under the others is a
    ValueError) and the same number of ranks on every node: nodes are MPI's shared-memory
    domains, or blocks of ``HVD_ZOADAM_RANKS_PER_NODE`` consecutive ranks; ``"auto"`` splits
    where there are several nodes of several ranks.

    Every argument is checked before Horovod is (``hvd.init()`` called, this rank in
    ``process_set``), as ``hvd.DistributedOptimizer`` does.

    Returns:
        A :class:`~hvd_zoadam.shell.optimizer.ZeroOneAdamOptimizer` (an
        :class:`~hvd_zoadam.shell.optimizer.OnebitAdamOptimizer` under ``algorithm="onebit"``)
        sharing ``optimizer.param_groups``; it is also an
        instance of ``type(optimizer)`` (``isinstance(opt, torch.optim.Adam)`` holds, as for
        Horovod's wrapper), though none of that class's code runs.

    Raises:
        TypeError: ``optimizer`` is not a plain ``torch.optim.Adam``/``AdamW``, a knob
            has the wrong type, or a parameter is on neither the CPU nor a CUDA device.
        ValueError: an unsupported option (``amsgrad``, ``op=hvd.Adasum``, ...)
            or a knob out of range, the message naming the option and the fix; or two
            trainable parameters on different devices (one device per rank, as Horovod).
        RuntimeError: CUDA parameters where numba's CUDA target sees no device.
    """
    try:
        import horovod.torch as hvd
    except ImportError:
        if compression is not None or op is not None:
            raise
        hvd = None  # an explicit transport (e.g. thread-ranks in tests) or torch.distributed needs no Horovod

    groups = horovod_groups(num_groups, groups)
    register_state_handler(DistributedAdamOptimizer)
    compression, op = check_horovod_arguments(hvd, compression, op)
    return build_optimizer(
        optimizer, named_parameters, lambda: make_transport(transport, process_set, _device(optimizer)),
        front_end="hvd_zoadam.DistributedOptimizer", compression=compression,
        backward_passes_per_step=backward_passes_per_step, gradient_predivide_factor=gradient_predivide_factor,
        groups=groups, sparse_as_dense=sparse_as_dense, var_freeze_step=var_freeze_step,
        var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
        local_step_clipper=local_step_clipper, local_step_policy=local_step_policy,
        var_update_weighting=var_update_weighting, bias_correction=bias_correction,
        bucket_cap_mb=bucket_cap_mb, scale_block_numel=scale_block_numel, exp_avg_mask=exp_avg_mask,
        auto_exp_avg_mask=auto_exp_avg_mask, precondition_compression=precondition_compression, step_log=step_log,
        overlap=overlap, algorithm=algorithm, hierarchical=hierarchical)

def OnebitAdam(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
               freeze_step: int, **kwargs: object):
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


def _device(optimizer):
    """The device of the optimizer's first trainable parameter (what ``transport="auto"``
    weighs; the engine then requires every trainable parameter on it), or None."""
    return next((p.device for g in optimizer.param_groups for p in g["params"] if p.requires_grad), None)
