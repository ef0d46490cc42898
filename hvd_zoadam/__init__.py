"""hvd_zoadam: 0/1 Adam (Lu et al., arXiv 2202.06009) and 1-bit Adam (Tang et al., arXiv
2102.02888) as drop-in Horovod DistributedOptimizers, and without Horovod over
``torch.distributed`` (:mod:`hvd_zoadam.distributed`) or mpi4py (:mod:`hvd_zoadam.mpi`).

Public names (``__all__``): :func:`DistributedOptimizer` and :func:`OnebitAdam` (the Horovod
front end); the classes they return, :class:`DistributedAdamOptimizer`,
:class:`ZeroOneAdamOptimizer` and :class:`OnebitAdamOptimizer`; :func:`compressed_allreduce`
and :func:`padded_numel`; :class:`Schedule` and :class:`StepKind`; the errors
:class:`StepMismatchError`, :class:`NonFiniteError` and :class:`CollectiveTimeoutError`;
``__version__``. Modules: :mod:`hvd_zoadam.checkpoint` (``save``, ``load``),
:mod:`hvd_zoadam.distributed` (the torch.distributed front end) and :mod:`hvd_zoadam.mpi` (the
mpi4py front end).
"""
import sys

from hvd_zoadam import checkpoint  # noqa: F401  (hvd_zoadam.checkpoint.save after import hvd_zoadam)
from hvd_zoadam.comm.protocol import NonFiniteError, StepMismatchError, compressed_allreduce
from hvd_zoadam.comm.transport import CollectiveTimeoutError
from hvd_zoadam.core.layout import padded_numel
from hvd_zoadam.core.schedule import Schedule, StepKind
from hvd_zoadam.shell import mpi
from hvd_zoadam.shell import torch_distributed as distributed
from hvd_zoadam.shell.horovod import DistributedOptimizer, OnebitAdam
from hvd_zoadam.shell.optimizer import DistributedAdamOptimizer, OnebitAdamOptimizer, ZeroOneAdamOptimizer

sys.modules[__name__ + ".distributed"] = distributed  # import hvd_zoadam.distributed as zd
sys.modules[__name__ + ".mpi"] = mpi  # import hvd_zoadam.mpi as zm

__version__ = "0.1.0"
__all__ = ["DistributedOptimizer", "OnebitAdam", "DistributedAdamOptimizer", "ZeroOneAdamOptimizer",
           "OnebitAdamOptimizer", "StepMismatchError", "compressed_allreduce", "padded_numel",
           "Schedule", "StepKind", "NonFiniteError", "CollectiveTimeoutError", "__version__"]
