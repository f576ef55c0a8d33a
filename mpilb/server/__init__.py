"""The parameter server on rank 0 (see loop.py for the protocol).

Parts, each an object that owns its state: loop.py (``ParameterServer``: the protocol: decode,
update rule, task ledger, reply or hold), receive.py (the receives and the waits between
pushes), epochs.py (epochs and handing out tasks, through the pure decisions of
mpilb/core/decisions.py), chores.py (the timers between pushes, checkpoints), liveness.py
(lost workers; ``WorkerFailed``), stopsignals.py and vote.py (stop signals: preemption or a
launcher's notice), lifecycle.py (the clock, start and finish), ending.py (``serve``: exit
codes and last lines), outbox.py (replies and send orders), peers.py (each worker's link and
state), modes.py (update rules: async, ssp, sync), group.py and store.py (the parameter
stores of --servers K). The task ledger, sit-out and the decisions are in mpilb/core.

Nothing is imported here: the pure parts (modes, peers, vote) import without MPI, the rest
from its module (``from mpilb.server.loop import ParameterServer``).
"""
