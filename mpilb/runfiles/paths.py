"""Where a run reads and writes: the dataset it trains on, its log and its checkpoint.

Kept apart from training.py (pure bookkeeping that the simulator shares), because these
touch the file system and the dataset reader. docs/logs.md: one log per run,
`runs/NNN.h5` by default, existing files refused unless --resume or --overwrite, distinct
paths, the checkpoint beside the log.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import h5py

from mpilb.config.options import default_cache_dir
from mpilb.config.sections import Config
from mpilb.data.dataset import open_dataset
from mpilb.data.prepare import prepare_synthetic
from mpilb.errors import UsageError
from mpilb.runfiles.files import default_checkpoint
from mpilb.runfiles.runlog import file_kind, open_for_reading

DEFAULT_DATASET = dict(samples=24000, features=64, classes=10, shards=12, noise=0.0,
                       test_fraction=0.2, seed=0)


def default_dataset_dir() -> str:
    """The built-in dataset, generated once into $MPILB_CACHE (used when --data is not given)."""
    root = default_cache_dir() / "default-synthetic-v1"
    try:
        open_dataset(root)
        return str(root)
    except Exception:  # noqa: BLE001 - absent or half-written: (re)generate it
        pass
    try:
        return _generate_default(root)
    except OSError as exc:
        raise UsageError(f"cannot write the built-in dataset into {root.parent} "
                         f"({exc.strerror or exc}): set MPILB_CACHE to a writable directory, "
                         f"or pass --data DIR") from None


def _generate_default(root) -> str:
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.with_name(root.name + f".tmp{time.time_ns()}")
    try:
        prepare_synthetic(tmp, **DEFAULT_DATASET)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(root)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return str(root)


def resolve_data(cfg: Config) -> str:
    if cfg.inputs.data:
        return cfg.inputs.data
    return default_dataset_dir()


RUNS_DIR = "runs"


def next_run_log(directory: str = RUNS_DIR) -> str:
    """Reserve and return `runs/NNN.h5`, the next free number (created empty, exclusively,
    so two runs started at once in one folder never get the same file)."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {d.resolve()} for the run log ({exc.strerror}): "
                         f"pass --log RUN.h5") from None
    # a number is taken by its log, or by a checkpoint left without one (NNN.ckpt.h5)
    taken = [int(p.name.split(".")[0]) for p in d.glob("*.h5") if p.name.split(".")[0].isdigit()]
    n = max(taken, default=0) + 1
    while True:
        path = d / f"{n:03d}.h5"
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return str(path)
        except FileExistsError:
            n += 1
        except OSError as exc:
            raise UsageError(f"cannot create {path} ({exc.strerror}): pass --log RUN.h5") from None


def check_paths(cfg: Config, dataset, config_file=None) -> None:
    """Decide the log and checkpoint files (docs/logs.md) and refuse names that would
    destroy something: an existing log or checkpoint (unless --resume or --overwrite), or one
    file named twice among --log, --checkpoint, the config file and the dataset's files.
    Fills in `cfg.output.log` (a new `runs/NNN.h5`) and `cfg.output.checkpoint` when they were not given.
    """
    if cfg.output.log:
        check_writable_dir(cfg.output.log, "--log")
    if cfg.output.checkpoint:
        check_writable_dir(cfg.output.checkpoint, "--checkpoint")
    keep = cfg.output.resume or cfg.output.overwrite
    named = [("--log", cfg.output.log)] + ([("--checkpoint", cfg.output.checkpoint)] if cfg.output.checkpoint else [])
    if not cfg.output.checkpoint and cfg.output.log:
        named.append(("the checkpoint beside --log", default_checkpoint(cfg.output.log)))
    for what, path in named:
        if path and not keep and Path(path).exists():
            raise UsageError(f"{what} {path} exists (an earlier run's file): pass --overwrite "
                             f"to replace it, --resume to continue that run, or another name")
    others = [("the config file", config_file)] if config_file else []
    others += [("the dataset's manifest", str(Path(dataset.root) / "manifest.json")),
               ("the dataset's test set", str(dataset.test_path))]
    others += [("a shard of the dataset", str(dataset.shard_path(i)))
               for i in range(len(dataset.shards))]
    seen: list[tuple[str, str]] = []
    for what, path in named + others:
        if not path:
            continue
        for prior, prior_path in seen:
            if _same_file(path, prior_path):
                if (what, path) in named or (prior, prior_path) in named:
                    fix = "give the log and the checkpoint names of their own"
                elif prior == "the config file":
                    fix = "the config file cannot be a file of the dataset"
                else:   # the manifest names one file twice: nothing a run option can mend
                    fix = (f"{Path(dataset.root) / 'manifest.json'} names one file twice (an "
                           f"edited or damaged manifest): prepare the dataset again")
                raise UsageError(f"{prior} {prior_path} and {what} {path} are the same file: {fix}")
        seen.append((what, path))
    if not cfg.output.log:
        cfg.set_files(log=os.path.relpath(next_run_log(os.path.join(os.getcwd(), RUNS_DIR))))
    if not cfg.output.checkpoint:
        cfg.set_files(checkpoint=default_checkpoint(cfg.output.log))


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_writable_dir(path: str, option: str) -> None:
    """Fail at start-up, not an hour in, when a file cannot be written where asked."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mpilb-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write in {parent} ({exc.strerror})") from None


def run_identity(cfg: Config) -> str:
    """The id that ties a run's log and checkpoint together: a new one for a new run; on
    --resume the one its log and checkpoint share.

    Raises:
        UsageError: on --resume, a log that is missing or unreadable (its coverage cannot
            be continued), or a checkpoint written by another run than the log's.
    """
    if not cfg.output.resume:
        return uuid.uuid4().hex
    log, ckpt = cfg.output.log, cfg.output.checkpoint
    if not Path(log).is_file():
        raise UsageError(f"--resume: the run log {log} does not exist: without it the run's "
                         f"coverage cannot be continued (the checkpoint {ckpt} still holds "
                         f"its weights: mpilb export); start a new run")
    try:
        with open_for_reading(log) as f:
            log_attrs = dict(f.attrs)
    except OSError as exc:
        raise UsageError(f"--resume: the run log {log} is damaged ({exc}); its coverage cannot "
                         f"be continued: start a new run") from None
    if file_kind(log_attrs) != "log":
        raise UsageError(f"--resume: {log} is not an mpilb run log")
    try:
        with h5py.File(ckpt, "r", locking=False) as f:
            ckpt_id = f.attrs.get("run_id")
    except OSError:
        return _text(log_attrs.get("run_id")) or uuid.uuid4().hex   # checkpoint.load says why
    log_id, ckpt_id = _text(log_attrs.get("run_id")), _text(ckpt_id)
    if log_id != ckpt_id:
        raise UsageError(f"--resume: the checkpoint {ckpt} was written by another run than the "
                         f"log {log} (run id {ckpt_id or 'none'} vs {log_id or 'none'}): resume "
                         f"with the checkpoint that run wrote, or start a new run")
    return log_id or uuid.uuid4().hex   # logs and checkpoints of mpilb before run ids


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else (str(value) if value else "")
