"""Communication: the wire protocol of the 1-bit exchange (:mod:`.protocol`), the transports
that carry it (:mod:`.transport`: the interface, thread ranks, Horovod's
collectives and mpi4py; :mod:`.torch_distributed`: a torch.distributed process group;
:mod:`.select`: which one a job gets), and the two-level exchange (:mod:`.hierarchical`).

Nothing here imports the shell or the benchmarks.
"""
