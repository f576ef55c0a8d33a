"""The pure core: the decisions of a run, with no MPI, no files and no clock of its own
(task ledger, balancer, rates, batch sizes, decisions due between pushes, epochs and
coverage, stop rules, update maths); driven alike by the server, the serial trainer and
the simulator.
"""
