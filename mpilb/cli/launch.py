"""`mpilb train`: validate on rank 0, then serve (rank 0), work (ranks > 0) or train serially.

Every step of the start-up runs through :func:`together`: each rank runs its part inside one
``try`` that catches *anything*, then all ranks learn in one collective whether some rank
failed. A failure anywhere is one line from rank 0 and the same exit code on every rank
(2 for the user's input, 1 otherwise), never a traceback per rank and never a job whose
other ranks wait forever for a rank that gave up. New start-up code goes inside a step and
is covered without naming its exceptions. After start-up, an exception on any rank ends the
whole job at once (:func:`_fail`).

The imports of mpilb's own parts sit inside the steps on purpose: an import that fails
(a missing h5py, a broken install) is then a failure of that step, on that rank, caught and
agreed on like any other; and mpi4py, which starts MPI, is imported only once the launcher
check has run.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

from mpilb.errors import MpilbError, UsageError, report_exception


class JobStop(Exception):
    """A start-up step failed on some rank; every rank raises this with the same code."""

    def __init__(self, code: int, text: str):
        super().__init__(text)
        self.code = code
        self.text = text


def exit_code(exc: BaseException) -> int:
    """2 for the user's input (options, config, data), the error's own code for other mpilb
    errors, 130 for an interrupt, 1 for anything else."""
    if isinstance(exc, MpilbError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1


def describe(exc: BaseException, rank: int) -> str:
    """One line for `exc`, naming the rank unless it is an mpilb error of rank 0."""
    if isinstance(exc, KeyboardInterrupt):
        text = "interrupted"
    elif isinstance(exc, MpilbError):
        text = str(exc)
    else:
        text = report_exception(exc, rank)
    # rank 0's own errors are about the job's input; anything else says where it happened
    if (rank or not isinstance(exc, MpilbError)) and not text.startswith("rank "):
        text = f"rank {rank}: {text}"
    return text


def together(comm, rank: int, step: Callable[[], Any],
             on_fail: Optional[Callable[[Any], None]] = None) -> Any:
    """Run `step` on this rank, then agree with every rank on the outcome (collective).

    Returns `step`'s value when it succeeded on every rank. Otherwise every rank raises
    :class:`JobStop` carrying the first failing rank's message and exit code; `on_fail`
    (if given) is called first with this rank's value, to release what the step made.
    `step` must not itself communicate: a rank that fails before a collective inside it
    would leave the others waiting there.
    """
    from mpilb.mpi import comm as C

    value, problem = None, None
    try:
        value = step()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the job's verdict
        problem = (exit_code(exc), describe(exc, rank))
    # The others wait here while rank 0 checks the job (a second or more): asleep in a
    # nonblocking barrier, not spinning in MPI's blocking collective, which on a node with
    # more ranks than cores takes the cores rank 0 needs (measured on a 2-core VM: a 4-rank
    # one-epoch run took 3.6 CPU-seconds with the spin, 2.9 without, medians of 5)
    C.wait(comm.Ibarrier())
    problems = comm.allgather(problem)
    first = next((p for p in problems if p is not None), None)
    if first is None:
        return value
    if on_fail is not None and value is not None:
        try:
            on_fail(value)
        except Exception:  # noqa: BLE001 - the original failure is what the user must see
            pass
    raise JobStop(*first)


def _validate(config_file, cli_values, world_size, all_args, nodes):
    """Rank 0's part of the start-up: the configuration built and every check of it
    (mpilb.config.validate) run against this job, its data and its model."""
    from mpilb.config import validate
    from mpilb.config.build import build_config, load_toml, settle_correction
    from mpilb.data.verified import verify_dataset
    from mpilb.runfiles.paths import check_paths, resolve_data, run_identity
    from mpilb.core.topology import store_ranks
    from mpilb.run.components import config_model, hold_out_validation
    from mpilb.server.store import store_bounds

    file_values = load_toml(config_file) if config_file else {}
    cfg = build_config(file_values, cli_values, source=config_file or "")
    cfg.store_ranks = tuple(store_ranks(nodes, cfg.updates.servers))
    validate.same_options(all_args[0], all_args)
    validate.check_injects(cfg, world_size)
    data_dir = resolve_data(cfg)
    # files checked before are not re-hashed
    dataset = hold_out_validation(cfg.inputs, verify_dataset(data_dir, cached=True))
    validate.check_world(cfg, world_size, dataset)
    validate.check_optimizer(cfg, world_size)
    model = config_model(cfg, dataset)   # shape errors (e.g. cnn on flat samples) surface here
    validate.check_model_step(cfg, model, dataset)
    validate.check_servers(cfg, world_size, model.num_params, model.num_state, nodes)
    bounds = store_bounds(cfg, model)   # the default correction by the model's size
    cfg = settle_correction(cfg, max(b - a for a, b in zip(bounds, bounds[1:])),
                            world_size - len(cfg.store_ranks))
    check_paths(cfg, dataset, config_file)   # the log and checkpoint names, once decided
    run_id = run_identity(cfg)   # on --resume: the log and the checkpoint are one run's
    if cfg.network.device == "gpu" and world_size == 1:
        from mpilb.backend import select_backend

        select_backend("gpu", 0)
    # what rank 0 verified, for the other nodes' copies (--store local: node_copies.py)
    files = [(s.file, s.samples, s.sha256) for s in dataset.shards]
    return dict(cfg.values), data_dir, run_id, files


def _start(comm, rank: int, size: int, config_file, cli_values: dict):
    """The start-up steps; returns (cfg, role) on every rank or raises JobStop everywhere."""
    import json

    from mpilb.mpi import comm as C
    from mpilb.config.sections import Config
    from mpilb.core.topology import placement_note, store_ranks, workers_of

    all_args = comm.allgather((config_file, cli_values))
    nodes = C.nodes(comm)   # node index by rank: where the parameter stores go
    verdict = together(comm, rank, lambda: _validate(config_file, cli_values, size, all_args,
                                                     nodes) if rank == 0 else None)
    values, data_dir, run_id, files = comm.bcast(verdict, root=0)
    cfg = Config.from_values(values)   # (validated on rank 0)
    # the same list on every rank: computed from the same node split and option
    cfg.store_ranks = tuple(store_ranks(nodes, cfg.updates.servers))
    cfg.rank_nodes = tuple(nodes)   # which pairs talk across a network (mpi/chunks.py)
    hosts = C.hostnames(comm)
    if cfg.inputs.store == "local":   # each other node's first rank checks the copies placed there
        from mpilb.worker.node_copies import shards_to_verify, verify_node_copies

        mine = shards_to_verify(hosts, rank, workers_of(cfg, size), cfg.inputs.replicas, len(files))
        together(comm, rank, lambda: verify_node_copies(data_dir, files, mine, hosts, rank))
    mpi_library = C.library_version()
    from mpilb.mpi import doorbell

    doorbell.open_job(comm, rank, size)   # rank 0 and the ranks on its node ring each other
    from mpilb.mpi import cores

    everyone = cores.facts(comm)
    cores.start_waits(comm, cfg.store_ranks, everyone)   # a rank with a CPU of its own polls first
    cpus = [usable for _, _, usable, _ in everyone]   # for the log: replays model shared cores

    def make_role():
        from mpilb.data.dataset import open_dataset
        from mpilb.run.components import hold_out_validation

        # rank 0 checked the files just now
        dataset = hold_out_validation(cfg.inputs, open_dataset(data_dir, check_files=False))
        run_attrs = {"config": json.dumps(dict(cfg.values, data=data_dir), sort_keys=True),
                     "run_id": run_id, "mpi_library": mpi_library, "world_size": size,
                     "hostnames": json.dumps(hosts), "nodes": json.dumps(nodes),
                     "stores": json.dumps(list(cfg.store_ranks)), "cpus": json.dumps(cpus)}
        if size == 1:
            from mpilb.run.serial import SerialTrainer

            return SerialTrainer(cfg, dataset, run_attrs)
        if rank == 0:
            from mpilb.server.loop import ParameterServer

            return ParameterServer(cfg, dataset, comm, run_attrs)
        if rank in cfg.store_ranks:
            from mpilb.server.store import SliceRank

            return SliceRank(cfg, dataset, comm, rank)
        from mpilb.worker.loop import Worker

        return Worker(cfg, dataset, comm, rank, hosts)

    role = together(comm, rank, make_role, on_fail=lambda r: getattr(r, "abandon", lambda: None)())
    note = placement_note(nodes, cfg.updates.servers) if size > 1 else None
    if rank == 0 and note:
        print(f"mpilb: {note}", file=sys.stderr, flush=True)
    return cfg, role


def train(config_file, cli_values: dict, raise_errors: bool = False,
          result: Optional[dict] = None) -> int:
    """Entry point of `mpilb train` on every rank. Returns the exit code.

    With ``raise_errors`` (the Python API), a configuration or set-up error raises
    :class:`UsageError` (exit code 2) or :class:`MpilbError` on every rank instead of
    printing; ``result`` receives the run's config as ``result["cfg"]``.
    """
    from mpilb.mpi import comm as C

    comm, rank, size = C.world()
    if size == 1:
        from mpilb.mpi.launcher import mismatch

        problem = mismatch(size, C.library_named())
        if problem:   # N one-process runs, each writing its own log: refuse before any file
            raise UsageError(problem)
    _install_signal_handlers(size)   # a preemption during start-up stops the run once it starts
    try:
        cfg, role = _start(comm, rank, size, config_file, cli_values)
    except JobStop as stop:
        if raise_errors:
            raise (UsageError(stop.text) if stop.code == 2 else MpilbError(stop.text)) from None
        if rank == 0:
            print(f"mpilb: error: {stop.text}", file=sys.stderr, flush=True)
            if size > 1 and C.exit_codes_ignored():
                C.abort(stop.code)   # the one way the code reaches mpirun's exit there
        return stop.code
    if result is not None:
        result["cfg"] = cfg
    try:
        if size == 1:
            from mpilb.run.serial import run_serial

            code = run_serial(role)
            _ignore_stop_signals()
            return code
        if rank == 0:
            from mpilb.server.ending import serve

            code = serve(role)
        else:
            role.run()
            code = 0
        from mpilb.mpi import departure

        left = rank != 0 and getattr(role, "left", False)   # let go before the end (roster.py)
        if left and departure.leaves_alone():
            departure.finalize_alone()   # MPI_Finalize without the others, who run on
            _ignore_stop_signals()
            return 0
        # Leave together: under Hydra, after a forwarded SIGTERM, a rank that is still
        # finalising when another exits can be killed, turning a clean stop into exit 9.
        # (Not MPI_Ibarrier: a rank that left never joins it.)
        gone = role.members.left if rank == 0 and departure.leaves_alone() else ()
        together_at_end, alone = departure.end_together(
            comm, rank, skip=gone, timeout=None if left else 30.0,
            on_poll=(lambda: C.leave_if_told(comm)) if rank else None)
        if rank == 0 and getattr(role, "members", None) is not None and role.members.admissions:
            role.members.admissions.finish()   # workers that joined: the same, then disconnect
        elif rank != 0 and hasattr(role, "disconnect_joined"):
            role.disconnect_joined()   # a store of --servers K > 1: from the joiners too
        if alone:
            departure.finalize_alone()   # a collective MPI_Finalize would wait for those gone
        if rank == 0:
            C.drain(comm)   # control messages sent before the barrier (preemption notices)
        _ignore_stop_signals()
        if not together_at_end:
            # a rank never arrived (it died, e.g. under -disable-auto-cleanup): MPI_Finalize
            # would wait for it forever; the log and checkpoint are written, so end here
            sys.stdout.flush()
            C.abort(code)
        return code
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure must end the whole job
        _fail(exc, comm, rank, size)
        return exit_code(exc)


def _install_signal_handlers(size: int) -> None:
    """SIGTERM/SIGUSR1 (Slurm preemption, time limit, `scancel --signal`) and Ctrl-C: checkpoint
    and stop.
    In a multi-rank job SIGUSR1 is only a notice until rank 0 has ruled out a failed rank
    (see signals.USR1_NOTICE)."""
    import signal

    from mpilb.run import signals
    from mpilb.run.signals import PREEMPTED, USR1_NOTICE

    def on_signal(signum):
        if signum == signal.SIGUSR1 and size > 1:
            USR1_NOTICE.set()
        else:
            PREEMPTED.set()

    signals.install(on_signal)


def _ignore_stop_signals() -> None:
    """The run is complete: a SIGTERM now (a time limit, a preemption a moment too late) must
    not kill the process while the interpreter and MPI shut down (that gave exit 15)."""
    from mpilb.run import signals

    signals.ignore()


def _fail(exc: BaseException, comm, rank: int, size: int) -> None:
    """End the job after an exception on this rank, with the message shown once."""
    from mpilb.mpi import comm as C

    text = describe(exc, rank)
    if size == 1:
        print(f"mpilb: error: {text.removeprefix('rank 0: ')}", file=sys.stderr, flush=True)
        return
    if rank == 0:
        print(f"mpilb: error: {text}", file=sys.stderr, flush=True)
        C.abort(1)
        return
    # A worker: let rank 0 record the failure and end the job; if it cannot, end it here.
    C.send_error(comm, text.removeprefix(f"rank {rank}: "), exit_code(exc))
    time.sleep(5.0)
    print(f"mpilb: error: {text}", file=sys.stderr, flush=True)
    C.abort(exit_code(exc))
