"""`mpilb simulate`: what-if replays of real runs, and simulated clusters of 10^3 workers.

The engine (:mod:`.engine`) drives the live server's balancer (:mod:`mpilb.core.balancer`),
rate estimators (:mod:`mpilb.core.rates`), batch policies, task ledger (:mod:`mpilb.core.tasks`,
through :mod:`.ledger`), sit-out policy (:mod:`mpilb.core.sitout`) and coverage tracker on
simulated workers (:mod:`.cluster`: profiles and parameter stores; on a network of nodes,
:mod:`.network` and :mod:`.netengine`: links, store layout, wire format); :mod:`.run` runs one
configuration; :mod:`.replay` reads a run log for ``--from``; :mod:`.main` is the command.
The model and its assumptions: docs/simulate.md.

The package and its engine are pure (no MPI, no HDF5: tests/unit/test_layers.py); reading logs
(replay) and the coverage counter of :mod:`mpilb.run.training` come in through :mod:`.run`.
"""
