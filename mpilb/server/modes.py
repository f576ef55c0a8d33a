"""Update rules (--mode): how a pushed gradient reaches the parameters, and when a reply waits.

A rule owns a :class:`ParamRing` (a flat float32 vector, or a slice of one, with its
optimizer, staleness correction and version) and decides, per push, whether the gradient is
applied now (async, ssp) or joins a round (sync), and whether the worker's reply goes out now
or is held (ssp: a worker more than --staleness-bound steps ahead of the slowest waits; sync:
every member waits for the round). Rules are pure: peers are any objects with the
:class:`~mpilb.server.peers.Peer` attributes they read, so unit tests drive them without MPI.

    @register("ssp")
    class StaleSynchronous(UpdateRule): ...
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, NamedTuple, Optional

import numpy as np

from mpilb.core.corrections import Extrapolated
from mpilb.errors import UsageError

RULES: dict[str, type] = {}


def register(name: str):
    """Class decorator: make an :class:`UpdateRule` available as ``--mode name``."""
    def deco(cls):
        cls.name = name
        RULES[name] = cls
        return cls
    return deco


class Update(NamedTuple):
    """One worker's gradient as applied: a row of the run log's `updates/`."""

    rank: int
    epoch: int
    shard: int
    lo: int
    hi: int
    batch: int
    loss: float       # summed over the batch
    staleness: int


class ParamRing:
    """A flat parameter vector (or a contiguous slice of one), its optimizer and version.

    Replies are sent straight from the parameters, without a copy: while a send still reads
    the current vector, the next step is written out of place into a free buffer of a small
    ring (one more than the sends in flight at once, at most), which then becomes current.
    When the caller may give up the gradient's buffer (``consume=True``: a push's receive
    buffer), that step is written over the gradient instead: the buffer is read anyway, so
    no third vector streams through memory (measured: a third less time per out-of-place
    sgd step on 10^6 floats). The gradient's buffer then joins the ring, and a free ring
    buffer is given back in exchange (:meth:`exchange`) to receive the next gradient.

    Args:
        params: float32 vector (the first buffer of the ring).
        optimizer: an mpilb optimizer over `params`.
        correction: a staleness correction (corrections.py).
        nominal_batch: --batch; a gradient of batch b moves the parameters b/--batch as far
            (the same learning rate per sample as serial runs: linear scaling rule).
        keep_sent: how many versions last sent to each worker stay available (for dc's
            params_then: 2 when pipelined, 1 otherwise, 0 when no correction needs them).
        schedule: version -> factor on the learning rate (--lr-schedule, --warmup), or None.
        new_buffer: () -> a new vector for the ring (the server's are the payloads of push
            message buffers, so that any of them can receive a push; `params` is copied into
            one). None: plain vectors, and `params` itself is the first.
        finished: request -> whether a send is done (the server's counts a send that MPI
            failed, to a dead worker, as done: comm.finished); default ``req.Test()``.
        clip_norm: --clip-norm for a sync round's mean gradient (:meth:`apply_sum`); a
            gradient applied on arrival was clipped by its worker, so :meth:`apply` never clips.
    """

    def __init__(self, params: np.ndarray, optimizer, correction, nominal_batch: int,
                 keep_sent: int = 0, schedule: Optional[Callable[[int], float]] = None,
                 new_buffer: Optional[Callable[[], np.ndarray]] = None,
                 finished: Optional[Callable[[object], bool]] = None,
                 clip_norm: Optional[float] = None):
        self.clip_norm = clip_norm
        self.finished = finished or (lambda req: req.Test())
        if new_buffer is not None:
            first = new_buffer()
            first[...] = params
            params = first
        self.new_buffer = new_buffer or (lambda: np.empty_like(params))
        self._exchanged: Optional[np.ndarray] = None
        self.ring = [params]
        correction.bind(params.size)
        self.versions = [0]
        self.sends: list[list] = [[]]   # per buffer: requests (anything with Test()) reading it
        self.cur = 0
        self.optimizer = optimizer
        self.correction = correction
        self.nominal_batch = nominal_batch
        self.keep_sent = keep_sent
        self.schedule = schedule
        self._factor, self._factor_version = 1.0, -1
        self.sent: dict[int, list[int]] = {}   # rank -> versions last sent to it
        # counters for the run log's servers/ group
        self.updates = 0
        self.apply_s = 0.0
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def params(self) -> np.ndarray:
        """The current parameters (do not keep a reference across steps)."""
        return self.ring[self.cur]

    @property
    def version(self) -> int:
        return self.versions[self.cur]

    @version.setter
    def version(self, value: int) -> None:
        self.versions[self.cur] = value

    def sending(self, req, rank: Optional[int] = None) -> None:
        """`req` (a send of the current parameters) reads them until it completes."""
        self.sends[self.cur].append(req)
        if rank is not None:
            self.sent_version(rank)

    def sent_version(self, rank: int) -> None:
        """`rank` was sent the current version (from a copy: --wire): kept for dc."""
        if self.keep_sent:
            kept = self.sent.setdefault(rank, [])
            kept.append(self.version)
            del kept[:-self.keep_sent]

    def params_of(self, version: int) -> Optional[np.ndarray]:
        """The parameters of `version`, if a buffer still holds them."""
        for v, buf in zip(self.versions, self.ring):
            if v == version:
                return buf
        return None

    def params_then(self, version: int, predicted: tuple[float, int] = (0.0, -1)):
        """The parameters a gradient was computed on, for a correction that reads them (dc,
        gap): those of `version`, or, where the worker predicted them (`predicted`: the push's
        factor f and the version it extrapolated from), w_v + f (w_v - w_from) as it did
        (core/prediction.py), unbuilt (:class:`~mpilb.core.corrections.Extrapolated`); None
        when a buffer no longer holds a version needed, or the correction reads none."""
        if not self.correction.needs_old_params:
            return None
        now = self.params_of(version)
        f, since = predicted
        if now is None or not f:
            return now
        old = self.params_of(since)
        return None if old is None else Extrapolated(now, old, f)

    def _busy(self, i: int) -> bool:
        self.sends[i] = [r for r in self.sends[i] if not self.finished(r)]
        if self.sends[i]:
            return True
        return any(self.versions[i] in kept for kept in self.sent.values())

    def _target(self) -> int:
        """The buffer the next step writes: the current one unless a send still reads it or
        a worker's version kept for the correction is its version."""
        if not self._busy(self.cur):
            return self.cur
        for i in range(len(self.ring)):
            if i != self.cur and not self._busy(i):
                return i
        self.ring.append(self.new_buffer())
        self.versions.append(-1)
        self.sends.append([])
        return len(self.ring) - 1

    def writable(self) -> np.ndarray:
        """The current parameters, to be stepped in place (server/store_streams.py): moved
        into a free buffer first while a send still reads them."""
        t = self._target()
        if t != self.cur:
            self.ring[t][...] = self.params
            self.versions[t] = self.version
            self.cur = t
        return self.params

    def _begin(self, grad: np.ndarray, consume: bool) -> int:
        """The buffer a step writes: :meth:`_target`'s, whose place the gradient takes where
        the optimizer steps over it (`consume`; see :meth:`exchange`)."""
        t = self._target()
        if t != self.cur and consume and self.optimizer.into_grad:
            self._exchanged, self.ring[t] = self.ring[t], grad
        return t

    def _done(self, t: int, seconds: float) -> None:
        """A step into buffer `t` is done: it holds the next version (`version` reads the
        current buffer's: counted before `t` becomes current)."""
        version = self.version + 1
        self.cur = t
        self.version = version
        self.updates += 1
        self.apply_s += seconds

    def _step(self, grad: np.ndarray, lr_scale: float, consume: bool) -> None:
        t0 = time.perf_counter()
        t = self._begin(grad, consume)
        self.optimizer.step(self.params, grad, lr_scale, out=self.ring[t])
        self._done(t, time.perf_counter() - t0)

    def forget(self, worker: int) -> None:
        """`worker` left the run: drop what the optimizer keeps for it alone (`dana`)."""
        forget = getattr(self.optimizer, "forget", None)
        if forget is not None:
            forget(worker)

    def apply(self, grad: np.ndarray, batch: int, staleness: int,
              then: Optional[np.ndarray] = None, consume: bool = False,
              worker: int = -1) -> float:
        """Apply one mean gradient (of `worker`'s); returns its learning-rate scale.
        `consume`: the gradient's buffer may become the parameters (see :meth:`exchange`)."""
        lr_scale = batch / self.nominal_batch * self._scheduled()
        self.correction.source(self.optimizer, worker)
        self.correction.tune(self.optimizer, staleness)
        lr_scale *= self.correction.apply(grad, staleness, self.params, then)
        self._step(grad, lr_scale, consume)
        return lr_scale

    def apply_chunks(self, grad: np.ndarray, batch: int, staleness: int, spans,
                     arrive: Callable[[int], None], answer: Callable[[int, np.ndarray], list],
                     then: Optional[np.ndarray] = None, consume: bool = False,
                     worker: int = -1) -> float:
        """:meth:`apply` chunk by chunk (mpi/chunks.py): ``arrive(i)`` makes
        ``grad[spans[i]]`` ready (it may wait for it), the chunk is stepped, and
        ``answer(i, new)`` sends that chunk of the new parameters `new` (returning the
        requests that read them) before the next chunk is waited for. The floats are those
        of :meth:`apply` (the optimizers are elementwise); an optimizer that steps only
        whole vectors (``ranged`` False) takes every chunk first, then answers each."""
        lr_scale = batch / self.nominal_batch * self._scheduled()
        self.correction.source(self.optimizer, worker)
        self.correction.tune(self.optimizer, staleness)
        piecewise = self.optimizer.ranged
        if not piecewise:
            for i in range(len(spans)):
                arrive(i)
        t0 = time.perf_counter()
        waited = 0.0
        t = self._begin(grad, consume)
        params, out = self.params, self.ring[t]
        if not piecewise:
            lr_scale *= self.correction.apply(grad, staleness, params, then)
            self.optimizer.step(params, grad, lr_scale, out=out)
        sends: list = []
        for i, (lo, hi) in enumerate(spans):
            if piecewise:
                w0 = time.perf_counter()
                arrive(i)
                waited += time.perf_counter() - w0
                self.correction.source(self.optimizer, worker)   # (whatever ran while it waited)
                if i == 0 or self.correction.needs_old_params:   # (dc and gap read each chunk)
                    scale = self.correction.apply(
                        grad[lo:hi], staleness, params[lo:hi],
                        None if then is None else then[lo:hi], at=lo)
                    if i == 0:
                        lr_scale *= scale
                self.optimizer.step_range(params, grad, lr_scale, out, lo, hi, first=i == 0)
            w0 = time.perf_counter()
            sends += answer(i, out)
            waited += time.perf_counter() - w0
        self._done(t, time.perf_counter() - t0 - waited)
        self.sends[t].extend(sends)
        return lr_scale

    def apply_sum(self, grad_sum: np.ndarray, batch: int, consume: bool = False) -> float:
        """Apply a sum of gradients over `batch` samples as one mean (a sync round)."""
        grad_sum /= max(1, batch)
        if self.clip_norm is not None:   # as DDP + clip_grad_norm_: the averaged gradient
            from mpilb.core.optimizers import clip_grad_norm

            clip_grad_norm(grad_sum, self.clip_norm)
        lr_scale = batch / self.nominal_batch * self._scheduled()
        self._step(grad_sum, lr_scale, consume)
        return lr_scale

    def exchange(self) -> Optional[np.ndarray]:
        """After ``apply(consume=True)``: the buffer to use from now on in place of the
        gradient's, when the step kept that one as the parameters; None when it did not
        (the gradient's buffer is the caller's again)."""
        given, self._exchanged = self._exchanged, None
        return given

    def _scheduled(self) -> float:
        return self.factor()

    def factor(self) -> float:
        """The schedule's factor on --lr for the next update, fixed once per version so that
        rank 0 and the other stores (told it with each command) apply the same one."""
        if self._factor_version != self.version:
            self._factor = 1.0 if self.schedule is None else float(self.schedule(self.version))
            self._factor_version = self.version
        return self._factor

    def follow(self, factor: float) -> None:
        """A store s > 0: the next update uses rank 0's factor."""
        self._factor, self._factor_version = factor, self.version

    def pending(self) -> list:
        """Sends still reading some buffer (to wait for at the end)."""
        return [r for reqs in self.sends for r in reqs]


class UpdateRule:
    """Base: apply each gradient on arrival and reply at once (async).

    Args:
        ring: the parameters (a :class:`ParamRing`).
        has_work: rank -> True while the worker holds tasks or is owed some.
        staleness_bound: --staleness-bound (ssp).
        sitout: the sync rule's sit-out policy (sitout.py), None elsewhere.
    """

    name = ""
    rounds = False    # gradients join rounds (sync) instead of being applied on arrival
    holds_replies = False   # holds() and releasable() may say otherwise than "no" (ssp)

    def __init__(self, ring: ParamRing, has_work: Callable[[int], bool], staleness_bound: int = 0,
                 sitout=None):
        self.ring = ring
        self.has_work = has_work
        self.staleness_bound = staleness_bound
        self.sitout = None

    def push(self, peer, update: Update, grad: np.ndarray, then: Optional[np.ndarray] = None,
             consume: bool = False) -> Optional[tuple[list[Update], float]]:
        """Take a worker's mean gradient. Returns ([updates applied], lr_scale), or None
        when it joined a round that is not complete yet (the reply waits). `consume`: the
        gradient's buffer may become the parameters (:meth:`ParamRing.exchange`)."""
        lr_scale = self.ring.apply(grad, update.batch, update.staleness, then, consume,
                                   worker=update.rank)
        return [update], lr_scale

    def holds(self, peer, peers: Iterable) -> bool:
        """After its gradient was applied: must `peer`'s reply wait?"""
        return False

    def releasable(self, peers: Iterable) -> Iterable:
        """Held peers whose replies may go now (after another reply went, or a loss), each
        judged when it is reached."""
        return ()

    def round_complete(self, peers: Iterable) -> bool:
        return False

    def close_round(self) -> tuple[list[Update], float, list[int]]:
        raise NotImplementedError


@register("async")
class Asynchronous(UpdateRule):
    """Apply each gradient on arrival; never hold a reply."""


@register("ssp")
class StaleSynchronous(UpdateRule):
    """Apply on arrival, but a worker more than --staleness-bound steps ahead of the slowest
    busy worker waits until it catches up."""

    holds_replies = True

    def too_far_ahead(self, peer, peers: Iterable) -> bool:
        others = [o.step for o in peers if o is not peer and not o.idle and self.has_work(o.rank)]
        return bool(others) and peer.step - min(others) > self.staleness_bound

    def holds(self, peer, peers) -> bool:
        return self.too_far_ahead(peer, list(peers))

    def releasable(self, peers):
        # lazily: each reply sent may let the next one go (or have released it already)
        peers = list(peers)
        for o in peers:
            if o.held and not self.too_far_ahead(o, peers):
                yield o


@register("sync")
class Synchronous(UpdateRule):
    """Rounds: wait for every busy worker, combine the gradients weighted by batch size,
    apply once. Workers too slow for the rounds may sit them out (sitout.py)."""

    rounds = True

    def __init__(self, ring, has_work, staleness_bound=0, sitout=None):
        super().__init__(ring, has_work, staleness_bound)
        self.sitout = sitout
        self.grad = ring.new_buffer()   # the round's sum; its buffer may join the ring
        self.grad[...] = 0
        self.batch = 0
        self.members: list[int] = []
        self.updates: list[Update] = []

    def push(self, peer, update, grad, then=None, consume=False):
        np.multiply(grad, update.batch, out=grad)      # back to the sum: rounds weight by batch
        self.grad += grad
        self.batch += update.batch
        self.members.append(peer.rank)
        self.updates.append(update)
        return None

    def holds(self, peer, peers) -> bool:
        return False   # a member's reply waits for the round, not for the others' steps

    def round_complete(self, peers) -> bool:
        """Every busy worker still in the run has pushed (a lost one no longer counts)."""
        if not self.members:
            return False
        expected = {p.rank for p in peers if not p.idle}
        return expected <= set(self.members)

    def close_round(self) -> tuple[list[Update], float, list[int]]:
        """Apply the round. Returns (its updates, lr_scale, member ranks)."""
        lr_scale = self.ring.apply_sum(self.grad, self.batch, consume=True)
        given = self.ring.exchange()
        if given is not None:   # the sum's buffer holds the parameters now
            self.grad = given
        updates, members = self.updates, self.members
        self.grad[:] = 0
        self.batch = 0
        self.members, self.updates = [], []
        return updates, lr_scale, members


def build_rule(mode: str, ring: ParamRing, has_work: Callable[[int], bool],
               staleness_bound: int = 0, sitout=None) -> UpdateRule:
    """The update rule registered as `mode`."""
    if mode not in RULES:
        raise UsageError(f"--mode {mode!r}: choose one of {', '.join(sorted(RULES))}")
    return RULES[mode](ring, has_work, staleness_bound, sitout)
