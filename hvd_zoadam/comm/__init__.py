"""Communication: the wire protocol of the 1-bit exchange (:mod:`.protocol`), the transports
that carry it (:mod:`.transport`: the interface and thread ranks; :mod:`.horovod`: Horovod's
collectives and mpi4py), and the two-level exchange (:mod:`.hierarchical`).

Nothing here imports the shell or the benchmarks.
"""
