"""Trained weights out: ``mpilb export CKPT.h5 OUT.pt|OUT.npz`` and ``mpilb evaluate``.

A checkpoint holds the flat parameter vector, the model's state (e.g. BatchNorm statistics),
the config of the run and the signatures of its model and dataset. From those the model is
rebuilt exactly as the run built it (same spec, ``--model-arg``, ``--seed`` and data shapes)
and the vector is cut into its named arrays.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import h5py
import numpy as np

from mpilb.config.build import parse_hidden
from mpilb.data.dataset import open_dataset
from mpilb.errors import UsageError
from mpilb.models import build_model, is_user_spec, parse_model_args
from mpilb.models.user import model_spec
from mpilb.runfiles.files import default_checkpoint, replace_file
from mpilb.runfiles.runlog import checkpoint_of_log, file_kind


class UntrustedModel(UsageError):
    """The checkpoint names user code that the user has not named."""


@dataclass
class TrainedCheckpoint:
    path: str
    params: np.ndarray
    state: Optional[np.ndarray]
    config: dict
    model: dict       # the model's signature
    dataset: dict     # the dataset's signature (sample_shape, num_classes, target_shape)


def read_checkpoint(path) -> TrainedCheckpoint:
    """Read what :mod:`mpilb.runfiles.checkpoint` wrote, without needing the dataset.

    Raises:
        UsageError: a missing file or one that is not an mpilb checkpoint.
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{path}: checkpoint not found")
    try:
        f = h5py.File(p, "r", locking=False)
    except OSError as exc:
        raise UsageError(f"{path}: not a readable checkpoint ({exc})") from None
    with f:
        not_checkpoint(path, f.attrs)
        try:
            return TrainedCheckpoint(
                path=str(path), params=f["params"][()],
                state=f["state"][()] if "state" in f else None,
                config=json.loads(f.attrs["config"]), model=json.loads(f.attrs["model"]),
                dataset=json.loads(f.attrs["dataset"]))
        except KeyError as exc:
            raise UsageError(f"{path}: not an mpilb checkpoint (missing {exc})") from None


def not_checkpoint(path, attrs) -> None:
    """UsageError saying what the file is when it is a run log or another HDF5 file rather
    than a checkpoint (a run log names the checkpoint its run left, when there is one)."""
    kind = file_kind(attrs)
    if kind == "log":
        ckpt = checkpoint_of_log(str(path), attrs)
        use = (f"use its run's checkpoint {ckpt}" if ckpt else
               f"its run's checkpoint ({default_checkpoint(str(path))} by default) was not "
               "found; give the checkpoint file the run wrote")
        raise UsageError(f"{path}: an mpilb run log, not a checkpoint; {use}")
    if kind == "other":
        raise UsageError(f"{path}: not an mpilb checkpoint: an HDF5 file without a "
                         "checkpoint's attributes (a dataset shard?)")


def build_from_checkpoint(ckpt: TrainedCheckpoint, model=None):
    """The model the checkpoint's run built (or ``model``, checked against it)."""
    cfg = ckpt.config
    spec = str(cfg.get("model", "mlp"))
    if model is not None:
        spec = model_spec(model)
    elif spec.startswith("python:"):
        raise UsageError(f"{ckpt.path}: the run trained a model handed to mpilb.train "
                         f"({spec[7:]}); pass it: mpilb.load({ckpt.path!r}, model={spec[7:]})")
    elif is_user_spec(spec):
        # A checkpoint is data: the code it names is only run when the user names it too.
        raise UntrustedModel(f"{ckpt.path}: the run trained the user model {spec}; a "
                             f"checkpoint's own model name is never imported: name the model "
                             f"yourself with --model {spec} (mpilb.load(..., model=...))")
    data = ckpt.dataset
    built = build_model(spec, tuple(data["sample_shape"]), int(data["num_classes"]),
                        parse_hidden(cfg.get("hidden", "256,128")),
                        target_shape=tuple(data.get("target_shape", [])),
                        model_args=parse_model_args(cfg.get("model_arg", [])),
                        seed=int(cfg.get("seed", 0)))
    want = json.loads(json.dumps(built.signature()))
    if want.get("num_params") != ckpt.model.get("num_params") or want.get("layout") != ckpt.model.get("layout"):
        raise UsageError(f"{ckpt.path}: holds {ckpt.model.get('model')} with "
                         f"{ckpt.model.get('num_params')} parameters; {spec} builds "
                         f"{want.get('num_params')}: not the model of that run")
    return built


def named_arrays(ckpt: TrainedCheckpoint) -> dict[str, np.ndarray]:
    """Every parameter array by name (the model's layout), plus its state arrays."""
    out, pos = {}, 0
    for name, shape in ckpt.model.get("layout", [["params", [ckpt.params.size]]]):
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = ckpt.params[pos:pos + n].reshape(shape)
        pos += n
    pos = 0
    for name, shape in ckpt.model.get("state", []):
        n = int(np.prod(shape, dtype=np.int64))
        out[name] = ckpt.state[pos:pos + n].reshape(shape)
        pos += n
    return out


def export(checkpoint, out, model=None, overwrite: bool = False) -> str:
    """Write ``out``: ``.pt`` a torch ``state_dict`` (torch models), ``.npz`` named arrays.

    An existing ``out`` is replaced only with ``overwrite``; the file is written beside it
    and renamed into place, so a failed export leaves what was there, and a symbolic link
    named ``out`` is replaced itself, never written through.

    Returns:
        A one-line description of what was written.

    Raises:
        UsageError: a bad checkpoint, an unknown format, or ``out`` exists (without
            ``overwrite``), is a directory or cannot be written.
    """
    ckpt = read_checkpoint(checkpoint)
    suffix = Path(out).suffix.lower()
    if suffix not in (".npz", ".pt", ".pth"):
        raise UsageError(f"{out}: unknown format; write OUT.pt (torch state_dict) or OUT.npz")
    _check_out(out, overwrite)
    if suffix == ".npz":
        arrays = named_arrays(ckpt)
        replace_file(out, lambda fh: np.savez(fh, **arrays), str(out))
        return f"{out}: {len(arrays)} arrays, {ckpt.params.size} parameters"
    if not str(ckpt.model.get("model", "")).startswith("torch:"):
        raise UsageError(f"{checkpoint}: {ckpt.model.get('model')} is not a torch model; "
                         "export it as OUT.npz")
    from mpilb.models import torch_adapter   # imports torch: only for a torch export

    try:
        state = build_from_checkpoint(ckpt, model).state_dict(ckpt.params, ckpt.state)
    except UsageError:
        if model is not None:
            raise
        # the module cannot be rebuilt here (not importable): its parameters and buffers by
        # name are the same state_dict, short of aliases of shared parameters
        state = {k: np.ascontiguousarray(v) for k, v in named_arrays(ckpt).items()}
    replace_file(out, lambda fh: torch_adapter.save_state_dict(state, fh), str(out))
    return f"{out}: torch state_dict of {len(state)} tensors, {ckpt.params.size} parameters"


def _check_out(out, overwrite: bool) -> None:
    """UsageError naming ``out`` when it cannot or must not be written."""
    p = Path(out)
    if p.is_dir():
        raise UsageError(f"{out}: is a directory; give a file name such as {p / 'model.npz'}")
    parent = p.parent
    if not parent.is_dir():
        raise UsageError(f"{out}: the directory {parent} does not exist")
    if os.path.lexists(p) and not overwrite:
        raise UsageError(f"{out} exists: pass --overwrite to replace it, or give another name")


def evaluate_checkpoint(checkpoint, data, model=None) -> dict:
    """The test metrics of a checkpoint's parameters on the dataset ``data``."""
    ckpt = read_checkpoint(checkpoint)
    ds = open_dataset(data)
    saved = ckpt.dataset
    if (list(ds.sample_shape) != saved["sample_shape"] or ds.num_classes != saved["num_classes"]
            or list(ds.target_shape) != saved.get("target_shape", [])):
        raise UsageError(f"{data}: samples {tuple(ds.sample_shape)} / {ds.num_classes} classes do not "
                         f"match the checkpoint's data ({tuple(saved['sample_shape'])} / "
                         f"{saved['num_classes']} classes)")
    built = build_from_checkpoint(ckpt, model)
    if ckpt.state is not None:
        built.set_state(ckpt.state)
    x, y = ds.load_test()
    result = {k: float(v) for k, v in built.evaluate(ckpt.params, x, y).items()}
    return {"metric": built.metric, "samples": int(len(y)), **result}
