"""``hvd.elastic`` support: a TorchState handler that re-lays out hvd_zoadam's buffers on reset.

``hvd.elastic.TorchState(model=model, optimizer=opt)`` picks a state handler per attribute
type from Horovod's handler registry. :func:`register_state_handler` puts
``ZeroOneAdamStateHandler`` first for the optimizer class it is given
(:class:`~hvd_zoadam.optimizer.ZeroOneAdamOptimizer`); ``hvd_zoadam.DistributedOptimizer``
calls it, so users write nothing extra. This module imports nothing of hvd_zoadam. The handler
is Horovod's optimizer handler (deep copy of ``state_dict()`` on commit,
``load_state_dict`` on restore) whose ``sync()`` first calls
:meth:`~hvd_zoadam.optimizer.ZeroOneAdamOptimizer.on_reset` on every rank, then
``hvd.broadcast_optimizer_state(opt, root_rank=0)``, so m, v, the anchor, the window and
the schedule counters come from rank 0 and the error buffers fit the new world size.
"""
from __future__ import annotations

_registered: set = set()  # optimizer classes registered so far


def register_state_handler(optimizer_cls) -> bool:
    """Register ``ZeroOneAdamStateHandler`` for ``optimizer_cls`` (a class with an
    ``on_reset()`` method) with ``horovod.torch.elastic``. Idempotent.

    Returns False when Horovod's elastic module cannot be imported (nothing registered).
    """
    if optimizer_cls in _registered:
        return True
    try:
        from horovod.torch.elastic import state as elastic_state
    except ImportError:
        return False

    class ZeroOneAdamStateHandler(elastic_state.OptimizerStateHandler):
        """Horovod's optimizer handler, plus a re-layout for the current world in ``sync()``."""

        def sync(self):
            self.value.on_reset()
            super().sync()

    elastic_state.get_handler_registry().insert(0, (optimizer_cls, ZeroOneAdamStateHandler))
    _registered.add(optimizer_cls)
    return True
