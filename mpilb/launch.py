"""`mpilb train`: validate on rank 0, then serve (rank 0), work (ranks > 0) or train serially.

Rank 0 checks the configuration and the dataset once and broadcasts the verdict, so a bad
option or a corrupt shard is one line from rank 0 and exit code 2 on every rank, not a
traceback per rank. After that, an exception on any rank ends the whole job at once.
"""

from __future__ import annotations

import json
import sys
import time

from .errors import MpilbError, UsageError, report_exception


def _validate(config_file, cli_values, world_size):
    from .config import build_config, load_toml
    from .dataset import verify_dataset
    from .inject import parse_injects
    from .training import check_world, config_model, hold_out_validation, resolve_data

    file_values = load_toml(config_file) if config_file else {}
    cfg = build_config(file_values, cli_values, source=config_file or "")
    parse_injects(cfg.inject, world_size)
    data_dir = resolve_data(cfg)
    dataset = hold_out_validation(cfg, verify_dataset(data_dir))
    check_world(cfg, world_size, dataset)
    config_model(cfg, dataset)   # shape errors (e.g. cnn on flat samples) surface here
    if cfg.device == "gpu" and world_size == 1:
        from .backend import select_backend

        select_backend("gpu", 0)
    return cfg, data_dir


def _verdict_error(kind: str, message: str) -> MpilbError:
    """The exception :func:`mpilb.train` raises where `mpilb train` prints and exits."""
    return UsageError(message) if kind == "usage" else MpilbError(message)


def train(config_file, cli_values: dict, raise_errors: bool = False, result: dict | None = None) -> int:
    """Entry point of `mpilb train` on every rank. Returns the exit code.

    With ``raise_errors`` (the Python API), a configuration or set-up error raises on every
    rank instead of printing; ``result`` receives the run's config as ``result["cfg"]``.
    """
    from . import comm as C

    comm, rank, size = C.world()
    verdict = None
    cfg = data_dir = None
    if rank == 0:
        try:
            cfg, data_dir = _validate(config_file, cli_values, size)
            verdict = ("ok", data_dir)
        except UsageError as exc:
            verdict = ("usage", str(exc))
        except MpilbError as exc:
            verdict = ("error", str(exc))
    verdict = comm.bcast(verdict, root=0)
    if verdict[0] != "ok":
        if raise_errors:
            raise _verdict_error(*verdict)
        if rank == 0:
            print(f"mpilb: error: {verdict[1]}", file=sys.stderr, flush=True)
        return 2 if verdict[0] == "usage" else 1
    if rank != 0:
        from .config import build_config, load_toml

        cfg = build_config(load_toml(config_file) if config_file else {}, cli_values)
        data_dir = verdict[1]
    from .dataset import open_dataset
    from .training import hold_out_validation

    if result is not None:
        result["cfg"] = cfg

    # Set-up on every rank (backend, model, shard store, run log); a problem on any rank is
    # reported once, by rank 0, and every rank exits with the same code.
    role = None
    problem = None
    try:
        dataset = hold_out_validation(cfg, open_dataset(data_dir, check_files=(rank == 0)))
        hosts = C.hostnames(comm)
        run_attrs = {"config": json.dumps(dict(cfg.values, data=data_dir), sort_keys=True),
                     "mpi_library": C.library_version(), "world_size": size,
                     "hostnames": json.dumps(hosts)}
        if size == 1:
            from .serial import SerialTrainer

            role = SerialTrainer(cfg, dataset, run_attrs)
        elif rank == 0:
            from .server import ParameterServer

            role = ParameterServer(cfg, dataset, comm, run_attrs)
        else:
            from .worker import Worker

            role = Worker(cfg, dataset, comm, rank)
    except UsageError as exc:
        problem = ("usage", f"rank {rank}: {exc}" if rank else str(exc))
    except MpilbError as exc:
        problem = ("error", f"rank {rank}: {exc}")
    except Exception as exc:  # noqa: BLE001 - reported once below
        problem = ("error", f"rank {rank}: {report_exception(exc, rank)}")
    if size == 1:
        if problem and raise_errors:
            raise _verdict_error(*problem)
        if problem:
            print(f"mpilb: error: {problem[1]}", file=sys.stderr, flush=True)
            return 2 if problem[0] == "usage" else 1
    problems = comm.allgather(problem)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        if rank == 0 and role is not None:
            role.abandon()
        if raise_errors:
            raise _verdict_error(*first)
        if rank == 0:
            print(f"mpilb: error: {first[1]}", file=sys.stderr, flush=True)
        return 2 if first[0] == "usage" else 1
    _install_signal_handlers()
    if size == 1:
        from .serial import run_serial

        try:
            return run_serial(role)
        except Exception as exc:  # noqa: BLE001 - one line, the run log says "failed"
            _fail(exc, comm, rank, size)
            return 1
    try:
        if rank == 0:
            from .server import serve

            code = serve(role)
        else:
            role.run()
            code = 0
        # Leave together: under Hydra, after a forwarded SIGTERM, a rank that is still
        # finalising when another exits can be killed, turning a clean stop into exit 9.
        C.wait(comm.Ibarrier(), timeout=30.0)
        if rank == 0:
            C.drain(comm)   # control messages sent before the barrier (preemption notices)
        return code
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure must end the whole job
        _fail(exc, comm, rank, size)
        return 1


def _install_signal_handlers() -> None:
    """SIGTERM/SIGUSR1 (Slurm preemption, time limit, `scancel --signal`): checkpoint and stop."""
    import signal

    from .training import PREEMPTED

    def handler(signum, frame):
        PREEMPTED.set()

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, handler)


def _fail(exc: BaseException, comm, rank: int, size: int) -> None:
    """End the job after an exception on this rank, with the message shown once."""
    from . import comm as C

    if isinstance(exc, KeyboardInterrupt):
        text = "interrupted"
    elif isinstance(exc, MpilbError):
        text = str(exc)
    else:
        text = report_exception(exc, rank)
    if size == 1:
        print(f"mpilb: error: {text}", file=sys.stderr, flush=True)
        return
    if rank == 0:
        if not text.startswith("rank "):
            text = f"rank 0: {text}"
        print(f"mpilb: error: {text}", file=sys.stderr, flush=True)
        C.abort(1)
        return
    # A worker: let rank 0 record the failure and end the job; if it cannot, end it here.
    C.send_error(comm, text)
    time.sleep(5.0)
    print(f"mpilb: error: rank {rank}: {text}", file=sys.stderr, flush=True)
    C.abort(1)
