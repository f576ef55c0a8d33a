"""Injected heterogeneity: the ``--inject`` grammar and the per-rank :class:`Injector`.

Experiments need slow, flaky or dead ranks on one homogeneous machine (docs/cli.md,
"Injected heterogeneity"). A spec reads ``RANKS:KIND[=VALUE][@START[-END]][,p=PROB]``:

- RANKS: ``3``, ``1,3``, ``2-4`` or ``*`` (every worker). Ranks come before the colon, so the
  comma in ``1,3:...`` is never confused with the ``,p=`` that may only follow the colon.
- KIND: ``compute=F`` (F >= 1), ``io=F`` (F >= 1), ``readbw=MBPS`` (> 0), ``delay=S`` (>= 0),
  ``hang`` and ``crash`` (no value).
- ``@START[-END]``: window in seconds since training start (END > START); for hang/crash the
  moment it happens.
- ``p=PROB``: each step independently affected with that probability, 0 < PROB <= 1.

The worker asks the :class:`Injector` how much extra time to spend; the injected time counts as
the kind of time it simulates (compute or I/O). This module only computes durations: it never
sleeps, so it is pure and testable.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from mpilb.errors import UsageError

GRAMMAR = "RANKS:KIND[=VALUE][@START[-END]][,p=PROB]"
_EXAMPLES = "e.g. 3:compute=4, 2:readbw=10, 1:compute=3@10-30, *:compute=2,p=0.05, 2:hang@15"

# kind -> (needs a value, check on the value, what the value must be)
_KINDS = {
    "compute": (True, lambda v: v >= 1.0, "a slowdown factor F >= 1"),
    "io": (True, lambda v: v >= 1.0, "a slowdown factor F >= 1"),
    "readbw": (True, lambda v: v > 0.0, "a bandwidth in MB/s > 0"),
    "delay": (True, lambda v: v >= 0.0, "seconds S >= 0"),
    "hang": (False, None, ""),
    "crash": (False, None, ""),
}
FAULT_KINDS = ("hang", "crash")

_RANK_RANGE = re.compile(r"^(\d+)-(\d+)$")


@dataclass(frozen=True)
class InjectRule:
    """One parsed ``--inject`` spec.

    Attributes:
        ranks: the ranks it applies to, or None for ``*`` (every worker).
        kind: one of compute, io, readbw, delay, hang, crash.
        value: F, MBPS or S; None for hang and crash.
        start: window start, seconds since training start.
        end: window end (exclusive), or None for "until the run ends".
        prob: probability that a given step is affected.
        text: the spec as the user wrote it, for messages and logs.
    """

    ranks: frozenset[int] | None
    kind: str
    value: float | None
    start: float = 0.0
    end: float | None = None
    prob: float = 1.0
    text: str = ""

    def applies_to(self, rank: int) -> bool:
        """True if this rule targets ``rank``."""
        return self.ranks is None or rank in self.ranks

    def in_window(self, elapsed: float) -> bool:
        """True if ``elapsed`` seconds since training start fall in the rule's window."""
        return elapsed >= self.start and (self.end is None or elapsed < self.end)


def _bad(text: str, what: str) -> UsageError:
    return UsageError(f"bad --inject spec {text!r}: {what}; expected {GRAMMAR}, {_EXAMPLES}")


def _number(text: str, field: str, spec: str) -> float:
    try:
        value = float(field)
    except ValueError:
        raise _bad(spec, f"{field!r} is not a number") from None
    if not math.isfinite(value):
        raise _bad(spec, f"{field!r} is not a finite number")
    return value


def _parse_ranks(field: str, spec: str) -> frozenset[int] | None:
    field = field.strip()
    if field == "*":
        return None
    if not field:
        raise _bad(spec, "no ranks before the colon")
    ranks: set[int] = set()
    for part in field.split(","):
        part = part.strip()
        span = _RANK_RANGE.match(part)
        if span:
            lo, hi = int(span.group(1)), int(span.group(2))
            if hi < lo:
                raise _bad(spec, f"rank range {part!r} runs backwards")
            ranks.update(range(lo, hi + 1))
        elif part.isdigit():
            ranks.add(int(part))
        else:
            raise _bad(spec, f"{part!r} is not a rank, a range like 2-4, or *")
    return frozenset(ranks)


def parse_inject(text: str) -> InjectRule:
    """Parse one ``--inject`` spec.

    Args:
        text: e.g. ``"1,3:compute=3@10-30,p=0.5"``.

    Returns:
        The rule. Ranks are not checked against the job size here (see :func:`parse_injects`).

    Raises:
        UsageError: naming the spec, what is wrong, and the grammar.
    """
    spec = text.strip()
    if ":" not in spec:
        raise _bad(text, "missing ':' between RANKS and KIND")
    rank_field, rest = spec.split(":", 1)
    ranks = _parse_ranks(rank_field, text)

    prob = 1.0
    body, sep, tail = rest.partition(",")
    if sep:
        key, eq, pval = tail.partition("=")
        if key.strip() != "p" or not eq:
            raise _bad(text, f"after the kind only ',p=PROB' may follow, got ',{tail}'")
        prob = _number(text, pval.strip(), text)
        if not 0.0 < prob <= 1.0:
            raise _bad(text, f"p={pval.strip()} is outside (0, 1]")

    start, end = 0.0, None
    body, at, window = body.partition("@")
    if at:
        lo, dash, hi = window.partition("-")
        if not lo.strip():
            raise _bad(text, "empty window after '@' (write @START or @START-END)")
        start = _number(text, lo.strip(), text)
        if start < 0:
            raise _bad(text, f"window start {lo.strip()} is negative")
        if dash:
            end = _number(text, hi.strip(), text)
            if end <= start:
                raise _bad(text, f"window end {hi.strip()} is not after its start {lo.strip()}")

    kind, eq, raw_value = body.partition("=")
    kind = kind.strip()
    if kind not in _KINDS:
        raise _bad(text, f"unknown kind {kind!r} (valid: {', '.join(_KINDS)})")
    needs_value, check, must_be = _KINDS[kind]
    value = None
    if needs_value:
        if not eq or not raw_value.strip():
            raise _bad(text, f"{kind} needs a value: {kind}=X with X {must_be}")
        value = _number(text, raw_value.strip(), text)
        if not check(value):
            raise _bad(text, f"{kind}={raw_value.strip()} is invalid: the value must be {must_be}")
    elif eq:
        raise _bad(text, f"{kind} takes no value (write just '{kind}')")
    return InjectRule(ranks, kind, value, start, end, prob, spec)


def parse_injects(texts: list[str], world_size: int) -> list[InjectRule]:
    """Parse every ``--inject`` spec and check its ranks against the job.

    Args:
        texts: the specs, in command-line order.
        world_size: number of MPI ranks. With more than one, rank 0 is the server and the
            valid targets are the workers 1..world_size-1; a serial run (1) has only rank 0.

    Raises:
        UsageError: on a malformed spec or a rank outside the job (naming rank and spec).
    """
    rules = [parse_inject(t) for t in texts]
    for rule in rules:
        for rank in sorted(rule.ranks or ()):
            if world_size > 1 and rank == 0:
                raise UsageError(
                    f"--inject {rule.text!r}: rank 0 is the parameter server, not a worker; "
                    f"target workers 1..{world_size - 1}")
            valid = range(1, world_size) if world_size > 1 else range(0, 1)
            if rank not in valid:
                where = (f"workers are 1..{world_size - 1}" if world_size > 1
                         else "a serial run has only rank 0")
                raise UsageError(
                    f"--inject {rule.text!r}: rank {rank} is not in this job of "
                    f"{world_size} rank(s); {where}")
    return rules


class Injector:
    """Per-rank view of the injected rules: how much extra time this step takes.

    Windows are relative to :meth:`start`; before it nothing is active. Each step's
    probability draws are made in :meth:`begin_step`, from a generator seeded by
    ``(seed, rank)``, so a rerun with the same seed slows the same steps.

    Args:
        rules: all rules of the job; those for other ranks are ignored.
        rank: this process's rank.
        seed: the run seed.
    """

    def __init__(self, rules: list[InjectRule], rank: int, seed: int):
        self.rank = rank
        self.rules = [r for r in rules if r.applies_to(rank)]
        self._rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(rank)])
        self._t0: float | None = None
        # Until the first begin_step every rule counts as hit, so a p=1 rule acts at once.
        self._hit = [True] * len(self.rules)
        self._fault: str | None = None

    def start(self, t0: float) -> None:
        """Mark training start (a ``time.monotonic()`` value); windows count from here."""
        self._t0 = t0

    def begin_step(self, now: float) -> None:
        """Draw this step's p-decisions (one draw per rule, whatever is active)."""
        draws = self._rng.random(len(self.rules))
        self._hit = [bool(d < r.prob) for d, r in zip(draws, self.rules)]

    def _active(self, now: float, kinds: tuple[str, ...]):
        if self._t0 is None:
            return
        elapsed = now - self._t0
        for rule, hit in zip(self.rules, self._hit):
            if rule.kind in kinds and hit and rule.in_window(elapsed):
                yield rule

    def compute_extra(self, now: float, compute_s: float) -> float:
        """Extra compute seconds for a step that really took ``compute_s``.

        ``compute=F`` adds (F-1)*compute_s and ``delay=S`` adds S, summed over active rules.
        """
        extra = 0.0
        for rule in self._active(now, ("compute", "delay")):
            extra += (rule.value - 1.0) * compute_s if rule.kind == "compute" else rule.value
        return extra

    def io_extra(self, now: float, nbytes: int, read_s: float) -> float:
        """Extra I/O seconds for a read of ``nbytes`` that really took ``read_s``.

        ``io=F`` adds (F-1)*read_s; ``readbw=MBPS`` pads the read up to nbytes/(MBPS*1e6).
        """
        extra = 0.0
        for rule in self._active(now, ("io", "readbw")):
            if rule.kind == "io":
                extra += (rule.value - 1.0) * read_s
            else:
                extra += max(0.0, nbytes / (rule.value * 1e6) - read_s)
        return extra

    def fault(self, now: float) -> str | None:
        """``"hang"`` or ``"crash"`` once such a rule has struck this rank, else None.

        Once struck it stays struck (a hung rank does not recover).
        """
        if self._fault is None:
            for rule in self._active(now, FAULT_KINDS):
                self._fault = rule.kind
                break
        return self._fault

    def describe(self) -> str:
        """One line saying what is injected on this rank, for logs."""
        if not self.rules:
            return f"rank {self.rank}: no injection"
        return f"rank {self.rank}: " + "; ".join(r.text for r in self.rules)
