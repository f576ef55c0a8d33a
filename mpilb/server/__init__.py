"""The parameter server on rank 0 (see loop.py for the protocol).

Parts: loop.py (the protocol: decode, update rule, task ledger, reply or hold), chores.py
(liveness and timers), outbox.py (replies and send orders), peers.py (each worker's link and
state), tasks.py (the task ledger), modes.py (update rules: async, ssp, sync), sitout.py
(sitting sync rounds out). tasks, modes, sitout and peers are pure: no MPI, no run log.
"""

from .chores import WorkerFailed
from .loop import ParameterServer, serve

__all__ = ["ParameterServer", "WorkerFailed", "serve"]
