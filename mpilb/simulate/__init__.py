"""`mpilb simulate`: what-if replays of real runs, and simulated clusters of 10^3 workers.

The engine (:mod:`.engine`, its workers and configuration in :mod:`.workers`) drives the
live server's decisions (:mod:`mpilb.core.decisions`: rebalances, first sizes, waking idle
workers, batch sizes), balancer (:mod:`mpilb.core.balancer`),
rate estimators (:mod:`mpilb.core.rates`), batch policies, task ledger (:mod:`mpilb.core.tasks`,
through :mod:`.ledger`), sit-out policy (:mod:`mpilb.core.sitout`) and coverage tracker on
simulated workers (:mod:`.cluster`: profiles and parameter stores; on a network of nodes,
:mod:`.network` and :mod:`.netengine`: links, store layout, wire format); :mod:`.run` runs one
configuration; :mod:`.replay` reads a run log for ``--from``; :mod:`.main` is the command.
The model and its assumptions: docs/simulate.md.

The package reaches only the pure core (no MPI, no server: tests/unit/test_layers.py); the
epochs' order and coverage counter are the server's own (:mod:`mpilb.core.epochs`); only
:mod:`.replay` reads run logs (:mod:`mpilb.runfiles`).
"""
