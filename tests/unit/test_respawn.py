"""--respawn without mpiexec: the option's refusals, where spawning is not tried, and the
configuration a joiner or a replacement works with (tests/mpi/test_respawn.py runs it)."""

from __future__ import annotations

import pytest

from mpilb.config.build import build_config
from mpilb.errors import UsageError


@pytest.mark.parametrize("values, says", [
    ({"mode": "sync"}, "--mode sync"),
    ({"store": "local"}, "--store local"),
    ({"servers": "2"}, "--servers 2"),
])
def test_respawn_refuses_what_a_replacement_cannot_join(values, says):
    with pytest.raises(UsageError, match="--respawn cannot be combined with " + says):
        build_config({}, {"respawn": True, **values})


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_respawn_is_taken_with_async_and_ssp(mode):
    assert build_config({}, {"respawn": True, "mode": mode}).faults.respawn


@pytest.mark.parametrize("env, says", [
    ({"PMI_SIZE": "4", "MPI_LOCALNRANKS": "4"}, ""),                  # mpiexec (Hydra)
    ({"OMPI_COMM_WORLD_SIZE": "4"}, ""),                               # mpirun: tried at the loss
    ({"PMI_SIZE": "4", "SLURM_STEP_ID": "0"}, "srun cannot spawn"),   # srun
    ({}, "no MPI launcher"),
])
def test_where_spawning_is_not_tried(env, says):
    from mpilb.mpi.spawning import unsupported

    why = unsupported(env)
    assert (says in why) if says else why == "", why


def test_a_joiner_works_without_the_runs_inject(synth_dir):
    """--inject names the job's ranks: a joiner (or a replacement) whose world has 2 ranks
    failed its check on `2:crash@1` at once (`rank 2 is not in this job of 2 rank(s)`)."""
    from mpilb.run.worker_join import prepare

    values = dict(build_config({}, {"data": synth_dir, "inject": ["2:crash@1"]}).values)
    ready = prepare(values)
    assert ready.cfg.experiment.inject == []
