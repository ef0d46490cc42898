"""Benchmarks: ``python -m hvd_zoadam.bench {network,step,model,kernels,convergence,resume}``
(:mod:`.cli`), each printing JSON, and the simulated hosts of :mod:`.netsim`. Nothing in the
library imports this package."""
