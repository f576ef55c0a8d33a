"""The parameter server on rank 0 (see loop.py for the protocol).

Parts: loop.py (the protocol: decode, update rule, task ledger, reply or hold), chores.py
(liveness and timers), outbox.py (replies and send orders), peers.py (each worker's link and
state), tasks.py (the task ledger), modes.py (update rules: async, ssp, sync), sitout.py
(sitting sync rounds out). tasks, modes, sitout and peers are pure: no MPI, no run log.
"""

__all__ = ["ParameterServer", "WorkerFailed", "serve"]


def __getattr__(name):
    # Lazy: the pure parts (tasks, modes, peers, sitout) are imported by the simulator, which
    # must not initialise MPI by importing the loop (and through it mpi4py).
    if name == "WorkerFailed":
        from mpilb.server.chores import WorkerFailed
        return WorkerFailed
    if name == "ParameterServer":
        from mpilb.server.loop import ParameterServer
        return ParameterServer
    if name == "serve":
        from mpilb.server.ending import serve
        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
