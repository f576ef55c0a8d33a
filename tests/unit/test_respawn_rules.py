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


class FakeServer:
    """What Respawns reads of a ParameterServer."""

    def __init__(self, ranks=(1, 2, 3)):
        from types import SimpleNamespace

        from mpirun import config_stub

        self.cfg = config_stub(respawn=True)
        self.cfg.values = {"respawn": True}
        self.ranks = list(ranks)
        self.stop = SimpleNamespace(reason="")
        self.receiver = SimpleNamespace(bell=SimpleNamespace(invitation=lambda: None))

    def now(self) -> float:
        return 4.0


def respawns(monkeypatch, spawn):
    from types import SimpleNamespace

    from mpilb.mpi import spawning
    from mpilb.server.respawn import Respawns

    monkeypatch.setattr(spawning, "unsupported", lambda env=None: "")
    monkeypatch.setattr(spawning, "spawn", spawn)
    monkeypatch.setattr(spawning, "await_ready", lambda comm: None)
    return Respawns(FakeServer(), SimpleNamespace(nodes=[0, 0, 1, 1]), ["a", "a", "b", "b"])


def test_a_spawn_that_fails_turns_respawn_off_with_one_line(monkeypatch, capsys):
    from mpilb.mpi.spawning import SpawnRefused

    tried = []

    def refuse(args, host=""):
        tried.append(host)
        raise SpawnRefused("Other MPI error")

    r = respawns(monkeypatch, refuse)
    r.lost(2)
    r.poll()
    assert tried == ["b"] and not r.on and r.wanted == []   # on the lost one's host, once
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the replacement of rank 2 could not be started" in err[0], err
    assert "MPI_Comm_spawn failed (Other MPI error)" in err[0] and "goes on" in err[0]
    r.lost(1)
    r.poll()
    assert tried == ["b"]


def test_only_the_jobs_own_workers_are_replaced(monkeypatch, capsys):
    started = []
    r = respawns(monkeypatch, lambda args, host="": started.append((args[2], host)) or object())
    r.lost(5)   # a joiner, or a replacement itself
    r.poll()
    assert started == [] and "worker 5 was not one of the job's own workers" in capsys.readouterr().err
    r.lost(3)
    r.poll()
    assert started == [("3", "b")] and r.spawned[0].node == 1 and r.wanted == []


def test_a_replacement_goes_to_rank_0s_host_when_every_rank_of_its_own_is_lost(monkeypatch):
    """Host b holds ranks 2 and 3: one lost, b answers (its other rank is there); both lost,
    b may be down, and the replacement starts on rank 0's host a."""
    from types import SimpleNamespace

    started = []
    quiet = SimpleNamespace(Iprobe=lambda **kw: False)   # a replacement that sends no error
    r = respawns(monkeypatch, lambda args, host="": started.append((args[2], host)) or quiet)
    monkeypatch.setattr(type(r), "check", lambda self, spawned, mono: None)   # not ready yet
    r.lost(2)
    r.poll()
    r.lost(3)
    r.poll()
    assert started == [("2", "b"), ("3", "a")]
    assert [s.node for s in r.spawned] == [1, 0]
