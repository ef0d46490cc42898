"""A bucket (:class:`Bucket`) and its flat storage: its parameters, and its gradients once a
step has read them, as views of one buffer each (as FSDP's flat parameter and DDP's
``gradient_as_bucket_view``), so that a step's kernels cover a bucket and nothing is gathered or
scattered.

A view is broken by whoever replaces the tensor (``p.data = t``, a module's ``_apply``, autograd's
fresh ``.grad`` after ``zero_grad(set_to_none=True)``); it is noticed by its data pointer (or the
gradient's identity) and made again with the values found there. Shapes, dtypes and devices
are checked elsewhere (:func:`hvd_zoadam.core.engine.check_params_unchanged`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hvd_zoadam.comm.protocol import Exchange


@dataclass
class Bucket:
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
    flat: torch.Tensor | None = None    # [n] of the params' dtype whose views the params are (flat storage)
    grad: torch.Tensor | None = None    # [n] of the params' dtype: the flat storage of their gradients
    grad_views: list = field(default_factory=list)  # per-param views of ``grad``, shaped as the params
    views: dict = field(default_factory=dict)  # key -> list of per-param views of the flat buffers
    kinds: list = field(default_factory=list)  # (dtype, device) of each param when laid out

    @property
    def numel(self) -> int:
        return self.exchange.numel


def lay_out(b: Bucket) -> None:
    """Give bucket ``b`` flat storage where every parameter is contiguous: ``b.flat`` ([n], the
    parameters' dtype) holding their values, each parameter's ``.data`` its view, and an empty
    ``b.grad`` of the same size with the views its gradients will be (``b.grad_views``). A
    bucket with a parameter that is not contiguous (channels_last, a transpose) keeps none, so
    that the memory format the user chose stays."""
    if not all(p.is_contiguous() for p in b.params):
        return
    numels = [p.numel() for p in b.params]
    b.flat = torch.cat([p.detach().reshape(-1) for p in b.params])
    for p, v in zip(b.params, b.flat.split(numels)):
        p.data = v.view_as(p)
    b.grad = torch.zeros_like(b.flat)
    b.grad_views = [v.view_as(p) for v, p in zip(b.grad.split(numels), b.params)]


def storage(b: Bucket) -> torch.Tensor | None:
    """Bucket ``b``'s flat storage, ``b.flat`` ([n], the parameters' dtype), with every
    parameter a view of it again, or None when the bucket has none (a parameter was not
    contiguous when it was laid out: its x is gathered and scattered).

    A parameter whose ``.data`` was replaced since (``p.data = t``, a module's
    ``_apply``) by a tensor of the same shape, dtype and device (anything else is refused by
    :func:`hvd_zoadam.core.engine.check_params_unchanged`) has its values copied into its place in
    ``b.flat`` and becomes its view again. Costs a data pointer per parameter; no host synchronisation."""
    flat = b.flat
    if flat is None:
        return None
    base, size, offset = flat.data_ptr(), flat.element_size(), 0
    for p in b.params:
        if p.data_ptr() != base + offset * size:
            view = flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
        offset += p.numel()
    return flat


def grads_in_storage(b: Bucket) -> bool:
    """Whether every ``p.grad`` of bucket ``b`` is its view of the bucket's flat gradient
    storage ``b.grad`` (as :func:`move_grads_to_storage` leaves them). One identity test per
    parameter."""
    return b.grad is not None and all(p.grad is v for p, v in zip(b.params, b.grad_views))


def move_grads_to_storage(b: Bucket) -> bool:
    """Each ``p.grad`` of bucket ``b`` into ``b.grad`` and made its view (``Engine.grads``), or
    False, changing nothing, where some gradient is missing, sparse or of another shape."""
    grads = [p.grad for p in b.params]
    if b.grad is None or any(g is None or g.is_sparse or g.shape != p.shape or g.dtype != p.dtype
                             for g, p in zip(grads, b.params)):
        return False
    torch._foreach_copy_(b.grad_views, grads)
    for p, v in zip(b.params, b.grad_views):
        p.grad = v
    return True


def grad_storage(b: Bucket) -> torch.Tensor | None:
    """Bucket ``b``'s flat gradient storage ``b.grad`` (float32[n]) with every ``p.grad`` its
    view (:func:`move_grads_to_storage`), for an exchange that averages the gradients in place
    and so leaves the result in ``p.grad``; None where the bucket has no flat storage, its
    gradients are not float32, or some ``p.grad`` is missing, sparse or of another shape."""
    if b.grad is None or b.grad.dtype != torch.float32:
        return None
    return b.grad if grads_in_storage(b) or move_grads_to_storage(b) else None


def bump_versions(params: list[torch.Tensor]) -> None:
    """Move each parameter's autograd version counter, as torch's in-place ops would after a
    kernel, or an op on their flat storage, wrote into it (a view made by ``p.data = view``
    keeps a counter of its own; one tensor a call: torch before 2.5 takes no list)."""
    for p in params:
        torch.autograd.graph.increment_version(p)


def scatter(flat: torch.Tensor, targets: list[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``targets`` (cast to each target's dtype)."""
    torch._foreach_copy_([t.detach() for t in targets],
                         [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in targets]), targets)])
