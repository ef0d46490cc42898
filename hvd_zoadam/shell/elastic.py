"""``hvd.elastic`` support: a TorchState handler that re-lays out hvd_zoadam's buffers on reset.

``hvd.elastic.TorchState(model=model, optimizer=opt)`` picks a state handler per attribute
type from Horovod's handler registry. :func:`register_state_handler` puts
``ZeroOneAdamStateHandler`` first for the optimizer class it is given
(:class:`~hvd_zoadam.shell.optimizer.DistributedAdamOptimizer`); ``hvd_zoadam.DistributedOptimizer``
calls it, so users write nothing extra. This module imports nothing of hvd_zoadam. The handler
is Horovod's optimizer handler (deep copy of ``state_dict()`` on commit,
``load_state_dict`` on restore), plus:

* on commit, a CPU copy of this rank's error buffers (``rank_state_dict()``), restored with
  the rest on ``restore()``, so the buffers belong to the same step as m, v and the anchor;
* ``sync()`` calls :meth:`~hvd_zoadam.shell.optimizer.DistributedAdamOptimizer.on_reset` and
  :meth:`~hvd_zoadam.shell.optimizer.DistributedAdamOptimizer.pool_errors_after_reset` on every
  rank, then ``hvd.broadcast_optimizer_state(opt, root_rank=0)``: m, v, the anchor, the
  window and the schedule counters come from rank 0, and the error feedback the surviving
  ranks owe is carried over to buffers laid out for the new world size;
* a reset after which Horovod skips ``sync()`` (hosts only removed: every rank left is a
  survivor) is noticed by the next ``step()``, which re-lays out and carries the survivors'
  error feedback over in the same way, since every rank of the new world gets there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_registered: set = set()  # optimizer classes registered so far


def register_state_handler(optimizer_cls: type) -> bool:
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
        """Horovod's optimizer handler, plus the error buffers on commit and restore, and a
        re-layout for the current world (carrying the error feedback over) in ``sync()``."""

        def __init__(self, optimizer: torch.optim.Optimizer):
            super().__init__(optimizer)
            self._saved_rank_state = optimizer.rank_state_dict()
            # A reset that skips sync() (hosts only removed) then reaches step() on every
            # survivor alone, and step() may pool the error feedback there.
            optimizer._elastic_state_handler = True

        def save(self):
            super().save()
            self._saved_rank_state = self.value.rank_state_dict()

        def restore(self):
            super().restore()
            self.value.load_rank_state_dict(self._saved_rank_state)

        def sync(self):
            self.value.on_reset()
            self.value.pool_errors_after_reset()
            super().sync()

    elastic_state.get_handler_registry().insert(0, (optimizer_cls, ZeroOneAdamStateHandler))
    _registered.add(optimizer_cls)
    return True
