"""The shell: what users hold.

* :mod:`.horovod`: ``hvd_zoadam.DistributedOptimizer`` / ``OnebitAdam`` and Horovod's contract
  (backward hooks, ``backward_passes_per_step``, ``synchronize()``/``skip_synchronize()``,
  elastic resets);
* :mod:`.torch_optim`: torch's optimizer contract (``param_groups``, ``state_dict``);
* :mod:`.driver`: the step driver that every front end shares;
* :mod:`.overlap`, :mod:`.options`, :mod:`.stats`, :mod:`.elastic`: what they name.

The layers below (:mod:`hvd_zoadam.core`, :mod:`hvd_zoadam.comm`) never import from here.
"""
