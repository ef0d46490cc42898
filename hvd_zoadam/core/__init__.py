"""The math, pure: the schedule, the bucket layout, the step kinds, the engine that holds one
rank's flat state, and the algorithms (0/1 Adam, 1-bit Adam) as step functions.

Nothing here issues a collective except through the exchange objects the engine is handed
(:mod:`hvd_zoadam.comm`); nothing here imports the shell or the benchmarks.
"""
