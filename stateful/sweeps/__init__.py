"""Sweeps: many seeds x configurations through the lockstep checks, locally or on a Dask cluster.

``sweep`` plans and drives them, ``runs`` is one (configuration, seed) task, ``journal`` records
each finished run, ``cluster``/``worker_gate``/``fingerprint`` check that every machine runs the
same code, and ``watchdog`` (a local pool) and ``nanny_watch`` (a Dask worker's nanny) end a run
stuck in C from outside its process.
"""
