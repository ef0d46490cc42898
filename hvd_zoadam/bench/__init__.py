"""Benchmarks: ``python -m hvd_zoadam.bench {network,step,model,kernels,convergence,scaling,resume,
load,chaos}`` (:mod:`.cli`), each printing JSON, and the simulated hosts of :mod:`.netsim`.
Nothing in the library imports this package."""
import torch


def group_loss(model, batch, loss_fn, data_ranks: int, world_size: int, rank: int):
    """Rank ``rank``'s loss on the same global batch at any world size, for benchmarks that
    resume at another one: of the ``data_ranks`` batches of a step (``batch(i)`` gives batch i
    as ``(x, y)``), its contiguous group's (:func:`hvd_zoadam.checkpoint.old_ranks`), weighted
    by the group's share |G|·P'/P, so that the ranks' average gradient is the global batch's.
    Its own batch alone when ``world_size == data_ranks``; a zero loss (zero gradient) for an
    empty group (more ranks than batches). ``loss_fn(model(x), y)`` is the mean loss."""
    from hvd_zoadam.checkpoint import old_ranks
    if world_size == data_ranks:
        x, y = batch(rank)
        return loss_fn(model(x), y)
    group = old_ranks(data_ranks, world_size, rank)
    if not group:
        return 0.0 * sum(p.sum() for p in model.parameters())
    x, y = (torch.cat(t) for t in zip(*(batch(i) for i in group)))
    return len(group) * world_size / data_ranks * loss_fn(model(x), y)
