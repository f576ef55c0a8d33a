"""What the simulated workers and parameter stores are made of.

A worker is a :class:`Profile`: seconds of compute per sample, seconds of I/O, and the
per-step cost of its link (push and reply transfers), each a function of time. Synthetic
clusters get constant profiles from a rate spec (``const:R``, ``lognormal:mean=R,sigma=S``,
``file:CSV``); replays of a run get piecewise-constant traces from its log
(:mod:`mpilb.simulate.replay`).

The parameter stores are :class:`Slices` (each holds a slice of the parameters): every update costs each of the K stores
``apply_s + bytes / K / bandwidth``; they see the same stream of updates, so they are one
FIFO queue of that service time, and an update waits while the stores are busy.
"""

from __future__ import annotations

import bisect
import csv
import math
import re
from dataclasses import dataclass

import numpy as np

from mpilb.errors import UsageError

# Defaults fitted to this machine's `mpilb bench ps` (sgd, 3 workers; see docs/simulate.md):
# 0.1M params 2819 updates/s, 1M params 537 updates/s -> 0.19 ms per update + 8 bytes per
# parameter (gradient in, parameters out) at 4.8 GB/s.
SERVER_GBPS = 4.8
APPLY_S = 0.00019
LINK_GBPS = 10.0      # a worker's link: push and reply each cross it once
LINK_LATENCY_S = 5e-5
READ_MBPS = 1000.0    # shard reads of a synthetic cluster


class Profile:
    """A worker's speeds as functions of time (constant pieces between ``edges``).

    Args:
        edges: start time of each piece (ascending, first 0); the last piece lasts forever.
        compute: seconds of compute per sample in each piece.
        io: seconds of I/O per sample charged to every step (a replayed run's measured
            wait for reads); 0 for synthetic workers, whose reads are modelled per task.
        link: seconds per step spent in transfers (push + reply), without the stores.
        read_bps: bytes/s of this worker's shard reads (synthetic workers).
    """

    def __init__(self, edges, compute, io=None, link=None, read_bps: float = READ_MBPS * 1e6):
        self.edges = [float(e) for e in edges]
        self.compute = [float(c) for c in compute]
        self.io = [float(v) for v in (io if io is not None else [0.0] * len(self.edges))]
        self.link = [float(v) for v in (link if link is not None else [0.0] * len(self.edges))]
        self.read_bps = float(read_bps)
        self.constant = len(self.edges) == 1

    def piece(self, t: float) -> int:
        return 0 if self.constant else max(0, bisect.bisect_right(self.edges, t) - 1)

    def mean_rate(self) -> float:
        """Samples per second of compute over the pieces (unweighted), for reports."""
        return 1.0 / float(np.mean(self.compute))


def constant(rate: float, link_s: float, read_bps: float) -> Profile:
    """A worker computing ``rate`` samples/s, ``link_s`` of transfers per step."""
    return Profile([0.0], [1.0 / rate], None, [link_s], read_bps)


def link_seconds(params: int, gbps: float = LINK_GBPS, latency: float = LINK_LATENCY_S) -> float:
    """One step's transfers over a worker's link: the gradient out, the parameters back."""
    return 2.0 * (latency + 4.0 * params / (gbps * 1e9))


_LOGNORMAL = re.compile(r"^lognormal:(.*)$")


def parse_rates(spec: str, workers: int | None, seed: int) -> list[float]:
    """Per-worker compute rates (samples/s) from a ``--rates`` spec.

    ``const:R`` every worker R; ``lognormal:mean=R,sigma=S`` each drawn from a lognormal of
    mean R and log-spread S (seeded); ``file:CSV`` one rate per line (or ``worker,rate``
    lines; a header line is skipped). Raises UsageError naming the spec when it does not
    parse, and for zero workers.
    """
    bad = f"bad --rates {spec!r}: expected const:R, lognormal:mean=R,sigma=S or file:CSV"
    kind, _, body = spec.partition(":")
    if kind == "file":
        rates = _rates_file(body, spec)
        if workers is not None and workers != len(rates):
            raise UsageError(f"--rates {spec}: the file has {len(rates)} workers, --workers says {workers}")
        workers = len(rates)
    if workers is None or workers < 1:
        raise UsageError(f"--workers must be at least 1 (got {workers})")
    if kind == "file":
        return rates
    if kind == "const":
        return [_positive(body, spec, bad)] * workers
    if kind == "lognormal":
        fields = dict(kv.partition("=")[::2] for kv in body.split(",")) if body else {}
        if set(fields) != {"mean", "sigma"}:
            raise UsageError(bad)
        mean, sigma = _positive(fields["mean"], spec, bad), _number(fields["sigma"], bad)
        if sigma < 0:
            raise UsageError(f"{bad} (sigma must be >= 0)")
        rng = np.random.default_rng([int(seed), 0x5A7E])
        mu = math.log(mean) - sigma * sigma / 2.0
        return [float(r) for r in rng.lognormal(mu, sigma, workers)]
    raise UsageError(bad)


def _number(text: str, bad: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(bad) from None
    if not math.isfinite(value):
        raise UsageError(bad)
    return value


def _positive(text: str, spec: str, bad: str) -> float:
    value = _number(text, bad)
    if value <= 0:
        raise UsageError(f"bad --rates {spec!r}: rates must be > 0")
    return value


def _rates_file(path: str, spec: str) -> list[float]:
    try:
        with open(path, newline="") as fh:
            rows = [r for r in csv.reader(fh) if r and any(c.strip() for c in r)]
    except OSError as exc:
        raise UsageError(f"--rates {spec}: cannot read {path} ({exc.strerror})") from None
    rates = []
    for i, row in enumerate(rows):
        try:
            value = float(row[-1])
        except ValueError:
            if i == 0:
                continue   # a header
            raise UsageError(f"--rates {spec}: line {i + 1} is not a rate: {','.join(row)}") from None
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--rates {spec}: line {i + 1}: rates must be > 0")
        rates.append(value)
    if not rates:
        raise UsageError(f"--rates {spec}: {path} holds no rates (zero workers)")
    return rates


@dataclass
class Slices:
    """K parameter stores sharing each update (FIFO; an update waits while they are busy).

    Args:
        params: parameters of the model (float32).
        k: number of stores (``--servers``).
        gbps: bytes per second (GB/s) one store moves and applies.
        apply_s: fixed seconds per update per store (headers, bookkeeping, optimizer call).
    """

    params: int
    k: int = 1
    gbps: float = SERVER_GBPS
    apply_s: float = APPLY_S

    def __post_init__(self):
        per_byte = 1.0 / (self.gbps * 1e9)
        share = 4.0 * self.params / self.k
        self.update_s = self.apply_s + 2.0 * share * per_byte     # gradient in, params out
        self.push_s = self.apply_s + share * per_byte             # sync: gradient in, summed
        self.reply_s = share * per_byte                           # sync: params to a member
        self.free = 0.0
        self.busy = 0.0

    def _serve(self, t: float, cost: float) -> float:
        start = self.free if self.free > t else t
        self.free = start + cost
        self.busy += cost
        return self.free

    def update(self, t: float) -> float:
        """An async update arriving at ``t``; returns when its reply leaves."""
        return self._serve(t, self.update_s)

    def push(self, t: float) -> float:
        """A sync member's gradient arriving at ``t`` (summed into the round)."""
        return self._serve(t, self.push_s)

    def round(self, t: float, members: int) -> float:
        """Apply a sync round whose last gradient came at ``t``; returns when replies leave."""
        return self._serve(t, self.apply_s + self.reply_s * (1 + members))
