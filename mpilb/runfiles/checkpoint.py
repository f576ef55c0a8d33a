"""Checkpoints: everything needed to continue a run, written atomically by rank 0.

A checkpoint holds the parameters, the optimizer state, the version, the epoch and which
samples of it were applied, the balancer state, rank 0's staleness correction's state (what
`dynamic` measured: attribute ``correction``; absent from a serial run's and from
checkpoints written before it, whose resume measures afresh) and the config, plus
signatures of the model and the dataset so that `--resume` refuses a checkpoint that
belongs to something else.
There is no random-number stream to save for training: every shuffle (shard order, sample
permutation) is derived from `--seed` and the epoch. (Injected slowdowns with `p=` draw from a
per-rank stream seeded by `--seed` that restarts with the job; they simulate hardware, not
training state.)

It is written to a temporary file in the same directory, flushed, fsynced and renamed over
the old one, so a kill at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional


import h5py
import numpy as np

from mpilb import __version__
from mpilb.errors import MpilbError, UsageError
from mpilb.core.epochs import EpochStats

FORMAT = 1

# How positions of an epoch map to samples: the shard order and each shard's permutation are
# drawn from these seeds (core.epochs.epoch_order, shards.ShardReader.permutation). A checkpoint
# taken part-way through an epoch is only meaningful under the same plan.
PLAN_SCHEME = "order=default_rng([seed,epoch,0x5EED]);rows=default_rng([seed,epoch,shard])"


def plan_signature(seed: int, dataset) -> dict:
    """What decides which sample a position of an epoch is (see PLAN_SCHEME)."""
    return {"scheme": PLAN_SCHEME, "seed": int(seed), "shard_sizes": list(dataset.shard_sizes)}


def model_signature(model) -> dict:
    """What identifies the model (``mpilb.Model.signature()``), as JSON round-trips it."""
    return json.loads(json.dumps(model.signature()))


def dataset_signature(dataset) -> dict:
    return {"shard_sizes": list(dataset.shard_sizes),
            "sha256": [s.sha256 for s in dataset.shards],
            "sample_shape": list(dataset.sample_shape), "num_classes": int(dataset.num_classes),
            "target_shape": list(dataset.target_shape)}


@dataclass
class Checkpoint:
    """What a checkpoint restores."""

    params: np.ndarray
    optimizer: dict
    version: int
    epoch: int
    counts: np.ndarray            # per-sample applications in `epoch` so far
    completed: list               # EpochStats of finished epochs, as dicts
    balancer: dict
    train_s: float
    config: dict
    plan: dict = None             # plan_signature the epoch's positions were counted under
    path: str = ""
    correction: Optional[dict] = None   # rank 0's Correction.state_dict(), if saved

    @property
    def mid_epoch(self) -> bool:
        """True when part of `epoch` was applied (its positions must keep their meaning)."""
        return bool(np.any(self.counts))


def save(path: str, *, cfg, model, dataset, params, optimizer, version: int, epoch: int,
         tracker, balancer, train_s: float, run_id: str, best: Optional[dict] = None,
         correction=None) -> None:
    """Write a checkpoint atomically (tmp file, flush, fsync, rename). ``run_id`` is the
    run's id, also in its log: ``--resume`` refuses a checkpoint of another run. ``best``:
    the evaluation a --save-best checkpoint holds (best.py; ``--resume`` refuses those).
    ``correction``: rank 0's staleness correction, whose state is kept (None: none)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    remove_stale_temps(path)
    try:
        with h5py.File(tmp, "w", locking=False) as f:
            f.attrs["format"] = FORMAT
            f.attrs["mpilb_version"] = __version__
            f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            f.attrs["config"] = cfg.to_json()
            f.attrs["run_id"] = run_id
            if best is not None:
                f.attrs["best"] = json.dumps(best)
            f.attrs["model"] = json.dumps(model_signature(model))
            f.attrs["dataset"] = json.dumps(dataset_signature(dataset))
            counts = tracker.counts
            if tracker.complete:   # the epoch ended: what comes next is the following one
                epoch, counts = epoch + 1, np.zeros_like(counts)
            f.attrs["version"] = int(version)
            f.attrs["epoch"] = int(epoch)
            f.attrs["train_s"] = float(train_s)
            f.attrs["seed"] = int(cfg.experiment.seed)
            f.attrs["plan"] = json.dumps(plan_signature(cfg.experiment.seed, dataset))
            f.create_dataset("params", data=np.asarray(params, dtype=np.float32))
            state = model.get_state()   # e.g. BatchNorm statistics: the latest pushed
            if state is not None:
                f.create_dataset("state", data=np.asarray(state, dtype=np.float32))
            g = f.create_group("optimizer")
            for key, value in optimizer.state_dict().items():
                if isinstance(value, np.ndarray):
                    g.create_dataset(key, data=value)
                else:
                    g.attrs[key] = value
            f.create_dataset("coverage/counts", data=counts)
            f["coverage"].attrs["completed"] = json.dumps([vars(s) for s in tracker.completed_at(train_s)])
            f["coverage"].attrs["stray"] = int(tracker.stray)
            f.attrs["balancer"] = json.dumps(balancer.state_dict())
            if correction is not None:
                f.attrs["correction"] = json.dumps(correction.state_dict())
            f.flush()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except (OSError, RuntimeError) as exc:
        # a full disk shows as OSError, or as RuntimeError when h5py closes the file
        tmp.unlink(missing_ok=True)
        free = _free_bytes(path.parent)
        left = ("the previous checkpoint is intact" if path.exists() else
                "no checkpoint was written before this one: there is none to resume from")
        raise MpilbError(f"--checkpoint {path}: cannot write the checkpoint ({exc}; "
                         f"{free / 1e6:.1f} MB free there); {left}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def rescue(path: Optional[str], save) -> str:
    """Call `save()` after the run log failed; what the run's last line says of it."""
    if not path:
        return "no checkpoint (--checkpoint is off)"
    try:
        save()
    except Exception as exc:  # noqa: BLE001 - the log's failure is the line's subject
        return f"no checkpoint written either ({exc})"
    return f"the checkpoint {path} holds the run's weights: free space, then --resume"


def _free_bytes(directory: Path) -> float:
    try:
        st = os.statvfs(directory)
        return float(st.f_bavail * st.f_frsize)
    except OSError:
        return float("nan")


def remove_stale_temps(path) -> list[str]:
    """Delete temporary files a killed writer left beside `path` (`.NAME.tmpPID` of a process
    that no longer exists); returns what was removed."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{path.name}.tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            tmp.unlink()
            removed.append(str(tmp))
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load(path: str, model, dataset, seed: Optional[int] = None,
         validation_fraction: Optional[float] = None) -> Checkpoint:
    """Read a checkpoint and check it belongs to this model and dataset (and, given the
    run's `seed`, that the interrupted epoch keeps its plan: see `check_plan`).
    `validation_fraction`: this run's, to name it when it is what changed the dataset.

    Raises:
        UsageError: missing, unreadable or damaged file (JSON, non-finite values), a
            model/dataset mismatch, or a plan that would change the epoch's samples (named).
    """
    p = Path(path)
    if not p.exists():
        raise UsageError(f"--resume: checkpoint {path} does not exist (nothing to resume; "
                         f"drop --resume to start a new run)")
    try:
        f = h5py.File(p, "r", locking=False)
    except OSError as exc:
        raise UsageError(f"--resume: {path} is not a readable checkpoint ({exc})") from None
    with f:
        try:
            if int(f.attrs["format"]) != FORMAT:
                raise UsageError(f"--resume: {path} has checkpoint format {f.attrs['format']}, expected {FORMAT}")
            if "best" in f.attrs:
                raise UsageError(f"--resume: {path} is a --save-best checkpoint (the weights of "
                                 f"the best evaluation, for mpilb export/evaluate); resume from "
                                 f"the run's --checkpoint")
            saved_model = json.loads(f.attrs["model"])
            saved_data = json.loads(f.attrs["dataset"])
            want_model = model_signature(model)
            if saved_model != want_model:
                differ = [k for k in want_model if saved_model.get(k) != want_model[k]]
                layers = [n for n, _ in saved_model.get("layout", [])]
                raise UsageError(
                    f"--resume: {path} holds a different model ({', '.join(differ)} differ: "
                    f"{saved_model.get('model')}, {saved_model.get('num_params')} parameters, "
                    f"layers {layers[:6]}{'...' if len(layers) > 6 else ''}; this run builds "
                    f"{want_model['model']}, {want_model['num_params']} parameters): use the "
                    f"model options of the run that wrote it")
            want_data = dataset_signature(dataset)
            if saved_data != want_data:
                _refuse_dataset(path, dataset, saved_data, json.loads(f.attrs["config"]),
                                validation_fraction)
            opt = {k: f["optimizer"][k][()] for k in f["optimizer"]}
            opt.update({k: (v.decode() if isinstance(v, bytes) else v)
                        for k, v in f["optimizer"].attrs.items()})
            if "state" in f:
                model.set_state(f["state"][()])
            ck = Checkpoint(
                params=f["params"][()],
                optimizer=opt,
                version=int(f.attrs["version"]),
                epoch=int(f.attrs["epoch"]),
                counts=f["coverage/counts"][()],
                completed=json.loads(f["coverage"].attrs["completed"]),
                balancer=json.loads(f.attrs["balancer"]),
                train_s=float(f.attrs["train_s"]),
                config=json.loads(f.attrs["config"]),
                plan=json.loads(f.attrs["plan"]) if "plan" in f.attrs else None,
                path=str(path),
                correction=json.loads(f.attrs["correction"]) if "correction" in f.attrs else None,
            )
        except KeyError as exc:
            raise UsageError(f"--resume: {path} is not an mpilb checkpoint (missing {exc})") from None
        except (ValueError, TypeError, OSError) as exc:   # damaged JSON or data
            raise UsageError(f"--resume: {path} is damaged ({type(exc).__name__}: {exc}); "
                             f"resume from another checkpoint or start a new run") from None
    _check_values(ck, model, dataset)
    if seed is not None:
        check_plan(ck, seed, dataset)
    return ck


def _refuse_dataset(path, dataset, saved: dict, config: dict, fraction: Optional[float]) -> None:
    """UsageError for a checkpoint of other training shards: a changed
    --validation-fraction (the same files, another split) is named with both values."""
    was = float(config.get("validation_fraction") or 0.0)
    held = len(getattr(dataset, "validation", None) or ())
    every = len(dataset.shards) + held
    if fraction is not None and was != fraction and len(saved.get("shard_sizes", [])) != len(dataset.shards):
        raise UsageError(f"--resume: {path} was written with --validation-fraction {was:g} "
                         f"({every - len(saved['shard_sizes'])} of {every} shards held out); this run "
                         f"gives {fraction:g} ({held} held out), so it trains on other shards: "
                         f"resume with --validation-fraction {was:g}")
    raise UsageError(f"--resume: {path} was written for a different dataset "
                     f"(shards or checksums differ from {dataset.root})")


def _check_values(ck: Checkpoint, model, dataset) -> None:
    """A checkpoint that would poison the run (NaN/Inf parameters, impossible counts), or
    whose arrays do not fit the model and dataset its attributes name (an edited file)."""
    path = ck.path
    samples = int(sum(dataset.shard_sizes))
    for what, a, n in (("params", ck.params, model.num_params), ("coverage/counts", ck.counts, samples)):
        if a.ndim != 1 or a.size != n:
            raise UsageError(f"--resume: {path} is damaged: {what} holds {a.size} values of shape "
                             f"{a.shape}, expected {n} (one per {'parameter' if what == 'params' else 'training sample'})")
    if ck.counts.dtype.kind not in "iu" or (ck.counts.size and ck.counts.min() < 0):
        raise UsageError(f"--resume: {path} is damaged: coverage/counts are not counts of "
                         f"applications (dtype {ck.counts.dtype}, or a negative value)")
    stats = {f.name for f in fields(EpochStats)}
    if not isinstance(ck.completed, list) or any(not isinstance(e, dict) or set(e) != stats
                                                 for e in ck.completed):
        raise UsageError(f"--resume: {path} is damaged: coverage's `completed` is not a list of "
                         f"epochs with {', '.join(sorted(stats))}")
    bad = np.flatnonzero(~np.isfinite(ck.params))
    if bad.size:
        raise UsageError(f"--resume: {path} holds {bad.size} non-finite parameter value(s) "
                         f"(first at index {bad[0]}): resume from an earlier checkpoint")
    for key, value in ck.optimizer.items():
        if isinstance(value, np.ndarray) and value.dtype.kind == "f" and not np.isfinite(value).all():
            raise UsageError(f"--resume: {path} holds non-finite optimizer state {key!r}: "
                             f"resume from an earlier checkpoint")
    if ck.epoch < 0 or ck.version < 0 or not np.isfinite(ck.train_s):
        raise UsageError(f"--resume: {path} is damaged (epoch {ck.epoch}, version {ck.version})")


def check_plan(ck: Checkpoint, seed: int, dataset) -> None:
    """Refuse a resume that would give the interrupted epoch's positions other samples.

    Positions applied before the checkpoint are counted in the shard-permuted order of the
    plan it was written under; the rest of the epoch must be drawn from the same order, or
    some samples would be applied twice and others never while the counts said "exact".
    At an epoch boundary nothing is pending and any seed is fine from the next epoch on.
    """
    if not ck.mid_epoch:
        return
    want = plan_signature(seed, dataset)
    saved = ck.plan or {"scheme": PLAN_SCHEME, "seed": int(ck.config.get("seed", -1)),
                        "shard_sizes": want["shard_sizes"]}
    if saved != want:
        differ = [k for k in want if saved.get(k) != want[k]]
        what = (f"--seed {saved.get('seed')}" if differ == ["seed"]
                else "another sample plan (" + ", ".join(differ) + ")")
        raise UsageError(f"--resume: {ck.path} stopped part-way through epoch {ck.epoch + 1}, written "
                         f"with {what}; this run would map the epoch's remaining positions to "
                         f"other samples: resume with --seed {saved.get('seed')} (a new seed may "
                         f"be given at an epoch boundary)")


def resume_plan(order: list[int], counts: np.ndarray, offsets: np.ndarray,
                sizes: list[int]) -> tuple[list[int], dict[int, list[tuple[int, int]]]]:
    """Shards still to do in an interrupted epoch, and the position ranges left in each.

    A shard is usually consumed from position 0 upwards, so what is left is one range; a
    shard split between two workers can leave two.
    """
    remaining, ranges = [], {}
    for shard in order:
        seg = counts[offsets[shard]: offsets[shard] + sizes[shard]] == 0
        if not seg.any():
            continue
        edges = np.flatnonzero(np.diff(np.concatenate([[0], seg.view(np.int8), [0]])))
        remaining.append(shard)
        ranges[shard] = [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]
    return remaining, ranges


def restore_tracker(tracker, ckpt: Checkpoint, t: float) -> None:
    tracker.completed = [EpochStats(**s) for s in ckpt.completed]
    tracker.begin(ckpt.epoch, t, ckpt.counts)


def restore_correction(correction, ckpt: Optional[Checkpoint]) -> bool:
    """Go on with what the checkpoint's correction measured (its ``correction``, a
    :meth:`~mpilb.core.corrections.Correction.state_dict`), when it is this run's
    correction; True when it did. A checkpoint without it (written before it was kept, or
    by a serial run), or of another --correction, leaves the correction fresh: it measures
    again."""
    state = ckpt.correction if ckpt is not None else None
    if not isinstance(state, dict):
        return False
    try:
        return correction.load_state_dict(state)
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"--resume: {ckpt.path} is damaged: its correction state "
                         f"({type(exc).__name__}: {exc}); resume from another checkpoint") from None


def restore_balancer(balancer, state: dict) -> bool:
    """Take over the balancer's learnt state (rates) when it fits this job.

    A checkpoint written by another policy leaves the balancer fresh. One written by
    another set of workers (a worker had joined or left, or the resume has another number
    of ranks) gives the rates it learnt of the workers this job has too; the others are
    learnt afresh, and the queues are rebuilt at the epoch start from what the checkpoint
    says is left, as they are for a fresh balancer. Returns whether anything was taken.
    """
    if state.get("name") != balancer.name:
        return False
    saved = [int(w) for w in state.get("workers", [])]
    if saved == list(balancer.workers):
        balancer.load_state_dict(state)
        return True
    common = set(saved) & set(balancer.workers)
    if not common:
        return False
    merged = balancer.state_dict()     # this job's workers, queues and options
    merged.update(epoch=state["epoch"], now=state["now"])   # the rates' clock
    rates = state.get("rates", {})
    merged["rates"].update({str(w): rates[str(w)] for w in common if str(w) in rates})
    balancer.load_state_dict(merged)
    return True
