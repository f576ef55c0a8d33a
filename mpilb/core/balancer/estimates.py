"""Rate estimates and the time model of a :class:`~mpilb.core.balancer.base.Balancer`.

Projected times are wall-clock: ``samples * (1 / rate + overhead)``, where ``rate`` is
the worker's compute + I/O speed and ``overhead`` its communication seconds per sample
(see :mod:`mpilb.core.rates`). The methods live in :class:`RateEstimates`, a mixin of the
Balancer; they use its ``_rates``, ``_step_over``, caches and queues.
"""

from __future__ import annotations

import numpy as np

from mpilb.core.rates import TrendRate

# Gains smaller than this many seconds are rounding, not improvement.
_EPS = 1e-9
# A worker's projected time is not linear in its samples (a forecast slowdown).
_NONLINEAR = -1.0

STEP_ALPHA = 0.1   # EWMA weight of a new per-step overhead


class RateEstimates:
    """Per-worker rate and overhead estimates of a Balancer, and the projected times
    built on them (mixed into :class:`~mpilb.core.balancer.base.Balancer`)."""

    # -- rates ------------------------------------------------------------------------------
    def _new_estimator(self) -> TrendRate:
        return TrendRate(self.config.ewma_alpha, self.config.window, self.config.rate_bucket_s)

    def observe(self, worker: int, t: float, samples: int, busy_s: float,
                comm_s: float | None = None, step_s: float | None = None) -> None:
        """Take one report: ``samples`` done in ``busy_s`` seconds of compute + I/O, at ``t``.

        ``comm_s``, when the caller knows it, is the communication time that went with them
        (not idle or held time); otherwise the overhead is inferred from report times.
        ``step_s``: what the step cost whoever waits for it, from the parameters sent to
        the gradient received (compute, I/O and both transfers); the step-time fit of
        proportional batches uses it when given, ``busy_s`` otherwise.

        A worker's first report carries no communication of its own: it waited for its
        first work, which counts as idle, and its push's transfer counts in the next
        report. Behind a slow link that read as a fast worker (comm_s 0 in a 0.45 s step),
        and the plan of its first report gave it work it ended the epoch late with. Until
        it has an overhead estimate, its communication is therefore at least the time
        from when it was handed its work to this report, less the busy seconds.
        """
        self.now = max(self.now, t)
        handed = self._handed.pop(worker, None)
        if handed is not None and comm_s is not None and not self._overhead_known(worker):
            comm_s = max(comm_s, t - handed - busy_s)
        left = None
        if worker in self._committed:
            left = self._committed[worker] = max(0, self._committed[worker] - int(samples))
            self._dirty.add(worker)
        if worker in self._rates:
            est = self._rates[worker]
            if est.ewma.stale and left == 0 and not self._queues.get(worker):
                # The last report of a probe (see LoadBalancer._probe_silent): what the probe
                # measured is the new estimate now, however short it was. A probe shard done
                # at full speed may take less busy time than one bucket, and a silent worker
                # gets nothing more until its estimate says it is fast again.
                bucket = est.ewma.bucket_s
                est.ewma.bucket_s = 0.0
                est.update(t, samples, busy_s, comm_s)
                est.ewma.bucket_s = bucket
            else:
                est.update(t, samples, busy_s, comm_s)
            if est.ewma.closed:
                self._estimates_changed(worker)
            if step_s is not None:
                over = max(0.0, step_s - busy_s)
                old = self._step_over.get(worker)
                self._step_over[worker] = over if old is None else old + STEP_ALPHA * (over - old)

    def step_model(self, worker: int) -> tuple[float, float]:
        """(a, c): ``worker``'s step at batch b is expected to take ``a + c * b`` seconds.

        c is 1 / its (forecast) rate, a its per-step cost beyond compute and I/O. Both are
        measured at the batch it uses now, so the model is exact there and proportional
        sizes converge to equal step times over successive rebalances; a slow worker's
        fixed costs, which a fit over small batches could not pin down, show up in the
        rounds it slows (the server's sit-out check) rather than here.
        """
        return self._step_over.get(worker) or 0.0, 1.0 / self._planning_rate(worker)

    def _overhead_known(self, worker: int) -> bool:
        est = self._rates.get(worker)
        return est is not None and est.overhead is not None

    def rate_known(self, worker: int) -> bool:
        """True once ``worker`` has a rate estimate of its own."""
        est = self._rates.get(worker)
        return est is not None and est.value is not None

    def _estimates_changed(self, worker: int | None = None) -> None:
        """A worker's estimates changed (None: any may have): drop what was derived."""
        if worker is None:
            self._spp.clear()
            self._spp_fallback.clear()
            self._vec = None
        else:
            self._spp.pop(worker, None)
            self._dirty.add(worker)
        self._means = None
        for w in self._spp_fallback:
            self._spp.pop(w, None)
            self._dirty.add(w)
        self._spp_fallback.clear()

    def _touch(self, worker: int) -> None:
        """``worker``'s queue or committed samples changed."""
        self._qsum.pop(worker, None)
        self._dirty.add(worker)

    def _vectors(self) -> tuple:
        """(workers, position of each, load, seconds per sample, has a queue), as arrays over
        ``self.workers``, brought up to date for the workers touched since the last call."""
        vec = self._vec
        if vec is None or vec[0] != self.workers:
            workers = list(self.workers)
            pos = {w: i for i, w in enumerate(workers)}
            load = np.array([self._load(w) for w in workers], dtype=float)
            spp = np.array([self._seconds_per_sample(w) for w in workers], dtype=float)
            queued = np.array([bool(self._queues.get(w)) for w in workers])
            self._vec = vec = (workers, pos, load, spp, queued)
        else:
            _, pos, load, spp, queued = vec
            for w in self._dirty:
                i = pos.get(w)
                if i is not None:
                    load[i] = self._load(w)
                    spp[i] = self._seconds_per_sample(w)
                    queued[i] = bool(self._queues.get(w))
        self._dirty.clear()
        return vec

    def _times_at(self, vec: tuple, samples: np.ndarray) -> np.ndarray:
        """``_time_for`` of every worker of ``vec`` for its entry of ``samples``."""
        workers, _, _, spp, _ = vec
        out = samples * spp
        for i in np.flatnonzero(spp < 0.0):
            out[i] = self._time_nonlinear(workers[i], float(samples[i]))
        return out

    def _mean_estimates(self) -> tuple[float, float]:
        """(mean rate, mean overhead) over the workers that have them (1.0 and 0 if none)."""
        if self._means is None:
            rates = [e.value for e in self._rates.values() if e.value is not None]
            overs = [e.overhead for e in self._rates.values() if e.overhead is not None]
            self._means = (sum(rates) / len(rates) if rates else 1.0,
                           sum(overs) / len(overs) if overs else 0.0)
        return self._means

    def has_rates(self) -> bool:
        """True once any worker has reported."""
        return any(est.value is not None for est in self._rates.values())

    def _fallback_rate(self, worker: int) -> float:
        est = self._rates.get(worker)
        if est is None or est.value is None:   # the mean over all is the others' mean
            return self._mean_estimates()[0]
        known = [e.value for w, e in self._rates.items() if w != worker and e.value is not None]
        return sum(known) / len(known) if known else 1.0

    def rate(self, worker: int) -> float:
        """Current rate estimate in samples/s (before any report: the others' mean, or 1.0)."""
        value = self._rates[worker].value if worker in self._rates else None
        return value if value is not None else self._fallback_rate(worker)

    def predicted_rate(self, worker: int) -> float:
        """Forecast rate over the next interval (equal to :meth:`rate` unless predictive)."""
        return self.rate(worker)

    def overhead(self, worker: int) -> float:
        """Seconds per sample ``worker`` spends outside compute and I/O (communication).

        Before its first estimate: the others' mean, or 0.
        """
        est = self._rates.get(worker)
        if est is not None and est.overhead is not None:
            return est.overhead
        # no estimate of its own: the mean over all the others' (cached)
        return self._mean_estimates()[1]

    def effective_rate(self, worker: int) -> float:
        """Samples per wall-clock second, communication included: what to split work by."""
        return 1.0 / (1.0 / self._planning_rate(worker) + self.overhead(worker))

    def measured_rate(self, worker: int) -> float:
        """:meth:`rate` with the worker's communication included (the time its updates take
        to reach the server and the replies to come back): what a worker behind a slow
        link really delivers, as the run log's ``workers/rate`` reports it."""
        return 1.0 / (1.0 / max(self.rate(worker), 1e-12) + self.overhead(worker))

    def _planning_rate(self, worker: int) -> float:
        return max(self.predicted_rate(worker), 1e-12)

    def _time_for(self, worker: int, samples: float) -> float:
        """Projected wall-clock seconds for ``worker`` to do ``samples`` more samples."""
        spp = self._seconds_per_sample(worker)
        return samples * spp if spp >= 0.0 else self._time_nonlinear(worker, samples)

    def _seconds_per_sample(self, worker: int) -> float:
        """``_time_for(worker, n) / n`` when that is the same for every n (cached), else
        ``_NONLINEAR``."""
        spp = self._spp.get(worker)
        if spp is None:
            spp = self._spp[worker] = self._linear_cost(worker)
            est = self._rates.get(worker)
            if est is None or est.value is None or est.overhead is None:
                self._spp_fallback.add(worker)   # depends on the others' means
        return spp

    def _linear_cost(self, worker: int) -> float:
        return 1.0 / self._planning_rate(worker) + self.overhead(worker)

    def _time_nonlinear(self, worker: int, samples: float) -> float:
        raise NotImplementedError

    def seed_rate(self, worker: int, samples: float, busy_s: float) -> None:
        """Start ``worker``'s estimates afresh from one measurement (a readmitted worker's
        probe step): it is planned and sized at that rate at once, not at the others' mean
        until 50 ms of busy time have filled a bucket."""
        self.forget(worker)
        est = self._rates.get(worker)
        if est is not None and samples > 0 and busy_s > 0:
            bucket = est.ewma.bucket_s
            est.ewma.bucket_s = 0.0      # this one measurement is the first bucket
            est.update(self.now, samples, busy_s)
            est.ewma.bucket_s = bucket
            self._estimates_changed(worker)

    def forget(self, worker: int) -> None:
        """Drop ``worker``'s rate and per-step overhead (it changed speed, e.g. back from
        the bench): until it reports again it is planned at the others' mean rate."""
        self._step_over[worker] = None
        if worker in self._rates:
            self._rates[worker] = self._new_estimator()
        self._estimates_changed(worker)
