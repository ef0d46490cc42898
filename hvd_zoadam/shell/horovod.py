"""The Horovod front end: ``hvd_zoadam.DistributedOptimizer`` and ``hvd_zoadam.OnebitAdam``,
drop-in replacements for ``hvd.DistributedOptimizer`` that take Horovod's arguments with
Horovod's meaning, check every argument before Horovod is asked anything, and return the
optimizer of :mod:`hvd_zoadam.shell.optimizer` over a Horovod (or mpi4py) transport.
"""
from __future__ import annotations

from hvd_zoadam.comm.select import make_transport
from hvd_zoadam.shell.elastic import register_state_handler
from hvd_zoadam.shell.optimizer import DistributedAdamOptimizer, build_optimizer
from hvd_zoadam.shell.options import check_horovod_arguments, horovod_groups


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=None, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=None, *, var_freeze_step="auto", var_update_scaler="auto",
                         local_step_scaler=32768, local_step_clipper=8, local_step_policy="lr",
                         var_update_weighting="interval", bias_correction=True, transport="auto", bucket_cap_mb=25.0, scale_block_numel="auto",
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
    * ``num_groups``, ``groups``: accepted and checked as Horovod checks them (``num_groups``
      is Horovod's deprecated name for ``groups``); hvd_zoadam fuses parameters into buckets
      of ``bucket_cap_mb`` itself, so they change neither the buckets nor the results.
    * ``sparse_as_dense``: sparse gradients are densified when True and refused otherwise.
    * ``process_set``: the ranks this optimizer trains with (default: all). Unlike Horovod,
      a rank outside it cannot build the optimizer (ValueError): it would hold buffers laid
      out for a world it is not part of, and a ``step()`` there could only be a no-op.

    0/1 Adam's keyword-only knobs (algorithm.md §4): ``var_freeze_step`` (T_f, steps),
    ``var_update_scaler`` (κ), ``local_step_scaler`` (α, steps), ``local_step_clipper``
    (H_max, steps), ``local_step_policy`` (``"steps"``, ``"lr"`` or ``"constant"``),
    ``var_update_weighting`` (``"interval"``, the default: an update of v at t in T_v weighs as
    the steps since the previous one, so that v weighs time as Adam's does; ``"paper"``: as one
    step, the paper's and DeepSpeed's rule), ``bias_correction``, ``transport`` (``"horovod"``: Horovod's collectives; ``"mpi"``: the
    1-bit phases over mpi4py on Horovod's MPI world; ``"gloo"``: the 1-bit phases over a Gloo
    group of hvd_zoadam's own under Horovod's Gloo controller; each of those two a ``ValueError``
    naming the reason where it cannot work; ``"auto"``: ``"mpi"`` when Horovod runs the MPI
    controller with ``MPI_THREAD_MULTIPLE`` and mpi4py works, ``"gloo"`` when it runs the Gloo
    controller outside an elastic job and the parameters are on the CPU, else ``"horovod"``; ``comm_stats()["transport"]`` says
    which), ``bucket_cap_mb``
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
    step, kind, lr, loss (from ``step(closure)`` or :meth:`~hvd_zoadam.shell.stats.ReportsMixin.log_loss`),
    skipped, and the cumulative bytes sent and rounds; rank 0 only unless the path holds
    ``{rank}``), and ``overlap`` (default True: with P > 1, from the second step on, the
    gradient hooks start a VARIANCE step's allreduces and a COMPRESSED or SYNC step's round 1 for
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


def _device(optimizer):
    """The device of the optimizer's first trainable parameter (what ``transport="auto"``
    weighs; the engine then requires every trainable parameter on it), or None."""
    return next((p.device for g in optimizer.param_groups for p in g["params"] if p.requires_grad), None)
