"""The MPI layer: the only package that imports mpi4py (comm), the message format (wire),
and the waits between messages (waiting, doorbell, cores); the launcher checks and the
watchdog of a rank whose rank 0 is gone.
"""
