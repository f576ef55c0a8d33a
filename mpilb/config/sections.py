"""A run's configuration, typed: one frozen dataclass per part of the engine that reads it.

:func:`mpilb.config.build.build_config` parses the command line and the TOML file once,
validates every value (mpilb.config.validate) and returns a :class:`Config` made of these
sections; each part is handed the section it needs (``cfg.optim`` to the optimizer,
``cfg.balancing`` to the balancer, ``cfg.output`` to the run's files).

Every option belongs to exactly one section (checked below, at import); code reads an
option from its section (``cfg.optim.lr``), and :attr:`Config.values` gives the flat
{option: value} that the run log, the checkpoint and the other ranks receive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

from mpilb.config.options import INT32_MAX, OPTIONS
from mpilb.errors import UsageError


def parse_hidden(text) -> tuple[int, ...]:
    """Parse `--hidden 256,128` into (256, 128); UsageError for anything else."""
    if isinstance(text, (list, tuple)):
        parts = [str(p) for p in text]
    else:
        parts = [p.strip() for p in str(text).split(",")]
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if not sizes or any(s < 1 or s > INT32_MAX for s in sizes):
        raise UsageError(f"--hidden {text!r}: expected comma-separated positive layer sizes, e.g. 256,128")
    return sizes


@dataclass(frozen=True)
class DataConfig:
    """The dataset and where its shards are read (--store local: each rank its own)."""

    data: Optional[str]
    store: str
    replicas: int
    cache_mb: float
    validation_fraction: float


@dataclass(frozen=True)
class ModelConfig:
    """The model and the device the workers compute on."""

    model: str
    hidden: str
    model_arg: list
    device: str
    cuda_aware: bool

    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        return parse_hidden(self.hidden)

    @property
    def workers_cuda_aware(self) -> bool:
        return bool(self.cuda_aware) or os.environ.get("MPILB_CUDA_AWARE", "") == "1"


@dataclass(frozen=True)
class UpdateConfig:
    """How gradients are applied: the mode, its staleness correction, the parameter stores."""

    mode: str
    staleness_bound: int
    correction: str
    dc_lambda: float
    pipeline: int
    servers: Union[int, str]   # K, or "per-node"
    wire: str = "fp32"         # element type of pushes and replies (wire_format.py)
    weight_prediction: str = "off"   # workers extrapolate the parameters (core/prediction.py)
    chunk_kb: int = 128        # pushes and replies between nodes in chunks (mpi/chunks.py)


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer the parameter stores run, and the learning rate's schedule."""

    optimizer: str
    optimizer_arg: list
    clip_norm: Optional[float]
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: Optional[float]   # None: a torch.optim class's own default
    lr_schedule: str
    warmup: str

    def divergence_hint(self) -> str:
        """What to try when a gradient is not finite: the options that set the step."""
        tries = [f"a lower --lr (now {self.lr:g})"]
        if self.weight_decay:
            tries.append(f"--weight-decay (now {self.weight_decay:g})")
        if self.clip_norm is None:
            tries.append("--clip-norm")
        return "try " + ", ".join(tries[:-1]) + (" or " if len(tries) > 1 else "") + tries[-1]


@dataclass(frozen=True)
class BalancingConfig:
    """Batches and the balancer that hands out shards."""

    batch: int
    batch_policy: str
    min_batch: int
    max_batch: int
    sit_out: int
    balancer: str
    rebalance_interval: float


@dataclass(frozen=True)
class StopConfig:
    """When the run stops, and how often it is evaluated."""

    epochs: int
    max_seconds: Optional[float]
    target_accuracy: Optional[float]
    target_metric: Optional[float]
    eval_interval: float
    eval_every: Optional[int]


@dataclass(frozen=True)
class OutputConfig:
    """The run's files (log, checkpoints, TensorBoard) and its progress line."""

    log: Optional[str]
    checkpoint: Optional[str]
    checkpoint_interval: float
    resume: bool
    overwrite: bool
    save_best: bool
    tensorboard: Optional[str]
    progress: bool
    progress_interval: Optional[float]


@dataclass(frozen=True)
class FaultConfig:
    """Lost workers (and their replacements, --respawn), ranks killed by a signal, and
    workers that join (--no-join)."""

    worker_timeout: float
    survive_signals: bool
    join: bool
    respawn: bool


@dataclass(frozen=True)
class ExperimentConfig:
    """The seed of every draw, and simulated heterogeneity (--inject)."""

    inject: list
    seed: int


# Config's attribute -> its section's class (no attribute is also an option's name)
SECTIONS: dict[str, type] = {
    "inputs": DataConfig, "network": ModelConfig, "updates": UpdateConfig,
    "optim": OptimizerConfig, "balancing": BalancingConfig, "stopping": StopConfig,
    "output": OutputConfig, "faults": FaultConfig, "experiment": ExperimentConfig,
}
# option name -> the attribute of the section that holds it
SECTION_OF: dict[str, str] = {f.name: attr for attr, kind in SECTIONS.items() for f in fields(kind)}


@dataclass
class Config:
    """A run's validated configuration: one attribute per section (see :data:`SECTIONS`).

    Built by :func:`mpilb.config.build.build_config` (or :meth:`from_values` from the flat
    values rank 0 broadcast). Read-only: the one change after validation is the run's file
    names, once decided (:meth:`set_files`).
    """

    inputs: DataConfig
    network: ModelConfig
    updates: UpdateConfig
    optim: OptimizerConfig
    balancing: BalancingConfig
    stopping: StopConfig
    output: OutputConfig
    faults: FaultConfig
    experiment: ExperimentConfig
    # where each option the user set came from: "" the command line, else the config
    # file's path (only in the Config that build_config returns; for refusing or warning
    # about an option with no effect, see validate.no_effect)
    given: dict = field(default_factory=dict, compare=False, repr=False)
    # the parameter stores' ranks, placed by node at start-up (launch.py; topology.stores_of)
    store_ranks: tuple = field(default=(), compare=False, repr=False)
    # the node index of every rank of the job, from the same split (launch.py; mpi/chunks.py)
    rank_nodes: tuple = field(default=(), compare=False, repr=False)

    @classmethod
    def from_values(cls, values: Mapping[str, Any], given: Optional[dict] = None) -> "Config":
        """The sections from flat {option: value} (every option; already validated)."""
        sections = {attr: kind(**{f.name: values[f.name] for f in fields(kind)})
                    for attr, kind in SECTIONS.items()}
        return cls(**sections, given=dict(given or {}))

    @property
    def values(self) -> Mapping[str, Any]:
        """Flat {option: value} in the option table's order (read-only): what the run log,
        the checkpoint and the other ranks receive."""
        return MappingProxyType({o.name: getattr(getattr(self, SECTION_OF[o.name]), o.name)
                                 for o in OPTIONS})

    def to_json(self) -> str:
        import json

        return json.dumps(dict(self.values), sort_keys=True)

    def set_files(self, log: Optional[str] = None, checkpoint: Optional[str] = None) -> None:
        """The run log's and the checkpoint's names, once decided (runfiles/paths.py)."""
        changes = {k: v for k, v in (("log", log), ("checkpoint", checkpoint)) if v is not None}
        self.output = replace(self.output, **changes)

    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        return self.network.hidden_sizes

    @property
    def workers_cuda_aware(self) -> bool:
        return self.network.workers_cuda_aware


_unplaced = {o.name for o in OPTIONS} ^ set(SECTION_OF)
if _unplaced:   # an option added to the table must be given a section (and vice versa)
    raise AssertionError(f"options without a section (or sections without an option): {sorted(_unplaced)}")
