"""Per-worker rate estimators (samples/s) for the balancer. Pure: times are passed in.

Each gradient push carries a report: ``samples`` processed in ``busy_s`` seconds of compute
and I/O. One report's rate ``samples / busy_s`` is noisy (jitter, a GC pause, a transient
straggler), so the estimators smooth it:

- :class:`EwmaRate` (``load`` policy): report buckets, a median-of-3 guard, a level-shift
  reset, and an exponentially weighted moving average. Reports are first pooled into
  buckets of at least ``bucket_s`` busy seconds, whose rate is the ratio of sums
  (samples / seconds): a fast worker pushes every millisecond or so, and on a shared node
  single steps are stretched by preemption several times over, so per-report rates are
  heavy-tailed and their mean is biased high; a bucket's ratio of sums is not. A bucket
  fills with the wall time its reports cover (busy seconds plus the communication that went
  with them, when the caller gives it): a worker behind a slow link computes 14 ms of a
  0.3 s step, and buckets of busy time alone would close once a second on it. The median
  of the last three bucket rates ignores a single outlier entirely (a 50x spike does not
  move the estimate). The EWMA with weight ``alpha`` averages out jitter: with
  ``alpha = 0.1`` (the balancer's default) +-20% multiplicative noise keeps the estimate
  within 10% of the truth. A slow EWMA alone would take ~20 buckets to follow a real change
  of speed, so when the last three buckets all lie beyond ``SHIFT_FACTOR`` of the estimate
  on the same side, the estimate is reset to their median: a 2x step is then tracked to
  within 10% after 3 buckets. With ``bucket_s = 0`` every report is its own bucket.
- :class:`TrendRate` (``predictive`` policy, and every policy's projections): double
  exponential smoothing. The trend is the least-squares slope of the bucket rates against
  time over the last ``window`` buckets, used only when it is at least ``TREND_T`` standard
  errors from zero, and the forecast is the EWMA level, corrected for its lag and
  extrapolated to the mean rate over the next ``horizon`` seconds, clamped to [0.05, 20]
  times the EWMA. Least squares on times copes with reports arriving at
  irregular intervals, where Holt's recursions assume evenly spaced ones. It also estimates
  the worker's *overhead*: seconds per sample spent outside compute and I/O (sending the
  gradient, waiting for the reply, being scheduled), from the report times themselves
  (time since the worker's previous report minus its busy seconds), with gaps far longer
  than a step's usual cycle taken as idle time and left out. Projected finish times need
  both: a worker's wall-clock seconds per sample are ``1 / rate + overhead``. The overhead
  is smoothed as the rate is (the first ``1 / alpha`` buckets averaged evenly, then the EWMA)
  and reset by the same level-shift rule: a link that becomes slower, or a worker on a slow
  node, is planned at its true cost after three buckets, not after the ~20 an EWMA with
  ``alpha = 0.1`` needs.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

# Forecasts stay within this factor range of the EWMA (never negative, never wild).
FORECAST_MIN_FACTOR = 0.05
FORECAST_MAX_FACTOR = 20.0
# A fitted trend is used only when it is this many standard errors away from zero.
TREND_T = 3.0
# Three reports in a row beyond this factor of the estimate (same side) mean a real change.
SHIFT_FACTOR = 1.3
# A bucket more than this factor away from the median of the last three is an outlier.
OUTLIER_FACTOR = 2.0
# A report whose time since the previous one exceeds this many usual cycles (busy seconds +
# overhead) came after an idle wait (epoch end, no work): its gap is not overhead.
IDLE_FACTOR = 4.0


class EwmaRate:
    """EWMA of bucketed rates behind a median-of-3 outlier guard.

    Args:
        alpha: EWMA weight of the newest guarded bucket rate (0 < alpha <= 1); larger reacts
            faster and is noisier.
        bucket_s: busy seconds pooled into one bucket before it updates the estimate (0:
            every report is a bucket).
    """

    def __init__(self, alpha: float = 0.1, bucket_s: float = 0.0):
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"ewma alpha must be in (0, 1], got {alpha}")
        if bucket_s < 0.0:
            raise ValueError(f"rate bucket must be >= 0 seconds, got {bucket_s}")
        self.alpha = alpha
        self.bucket_s = bucket_s
        self.value: float | None = None
        self.count = 0
        self.last_input: float | None = None
        self.shifted = False  # did the last update reset the estimate (a level shift)?
        self.closed = False   # did the last update close a bucket (change the estimate)?
        self.buckets = 0      # buckets closed so far
        self.stale = False    # the next bucket replaces the estimate (see mark_stale)
        self._recent: deque[float] = deque(maxlen=3)
        self._bucket = [0.0, 0.0]   # samples, busy seconds of the open bucket
        self._span = 0.0            # wall seconds of the open bucket's reports

    def _guard(self, rate: float) -> float:
        self._recent.append(rate)
        if len(self._recent) == 3:
            median = sorted(self._recent)[1]
            # A report far off its neighbours' median is an outlier: use the median instead.
            # Ordinary reports pass through raw, which averages noise better than medians do.
            return rate if median / OUTLIER_FACTOR <= rate <= median * OUTLIER_FACTOR else median
        if self.value is None:
            return rate
        # Two reports only: trust the one nearer the current estimate.
        return min(self._recent, key=lambda r: abs(np.log(r / self.value)))

    def update(self, samples: float, busy_s: float, span_s: float | None = None) -> float | None:
        """Add one report and return the estimate (reports with no work are ignored).

        ``span_s``: the wall seconds the report covers (busy plus communication), which fill
        the bucket; ``busy_s`` when not given. The estimate changes when the report closes
        a bucket (see :attr:`closed`).
        """
        self.closed = self.shifted = False
        if samples <= 0 or busy_s <= 0:
            return self.value
        self.count += 1
        self._bucket[0] += samples
        self._bucket[1] += busy_s
        self._span += max(busy_s, span_s if span_s is not None else busy_s)
        if self._span < self.bucket_s:
            return self.value
        rate = self._bucket[0] / self._bucket[1]
        self._bucket = [0.0, 0.0]
        self._span = 0.0
        self.closed = True
        self.buckets += 1
        guarded = self._guard(rate)
        self.last_input = guarded
        if self.stale:   # a worker back after a long silence: what it does now counts
            self.stale = False
            self._recent.clear()
            self._recent.append(rate)
            self.value = guarded = rate
            self.shifted = True
            self.buckets = 1      # and the next few are averaged evenly with it
        elif self.value is None:
            self.value = guarded
        elif len(self._recent) == 3 and (
                min(self._recent) > SHIFT_FACTOR * self.value
                or max(self._recent) * SHIFT_FACTOR < self.value):
            self.value = guarded
            self.shifted = True
        else:
            # The first 1/alpha buckets are averaged evenly (a bias-corrected EWMA): the
            # first estimate comes from a worker's first steps, and the next few refine it at
            # once instead of moving it by alpha each (a run's first plans are made on these).
            weight = max(self.alpha, 1.0 / self.buckets)
            self.value = (1.0 - weight) * self.value + weight * guarded
        return self.value

    def mark_stale(self) -> None:
        """The estimate is old (the worker got no work for a while): keep it until the
        next bucket closes, then replace it by that bucket's rate."""
        if self.value is not None:
            self.stale = True
            self._bucket = [0.0, 0.0]
            self._span = 0.0

    def state_dict(self) -> dict:
        """JSON-serialisable state."""
        return {"alpha": self.alpha, "bucket_s": self.bucket_s, "value": self.value,
                "count": self.count, "recent": list(self._recent), "bucket": list(self._bucket),
                "buckets": self.buckets, "span": self._span}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.alpha = state["alpha"]
        self.bucket_s = state.get("bucket_s", 0.0)
        self.value = state["value"]
        self.count = state["count"]
        self._recent = deque(state["recent"], maxlen=3)
        self._bucket = list(state.get("bucket", [0.0, 0.0]))
        self.buckets = state.get("buckets", self.count)
        self._span = state.get("span", self._bucket[1])


class TrendRate:
    """EWMA plus a linear-trend forecast (double exponential smoothing, Brown-style).

    The trend is the least-squares slope of the (outlier-guarded) bucket rates over the last
    ``window`` buckets, against their times, and counts only when it stands clear of the
    noise (``TREND_T`` standard errors). Fitting the raw buckets rather than the EWMA levels
    keeps the residuals independent, so the standard error is honest. On a ramp an EWMA
    lags the truth by ``(1 - alpha) / alpha`` bucket intervals, so the forecast adds the
    slope over that lag plus the time ahead. After a level shift (see :class:`EwmaRate`) the
    window restarts, so a step is not read as a trend.

    :attr:`overhead` is the EWMA (same buckets, same ``alpha``, the same even start and
    level-shift reset) of the seconds per sample the worker spends outside compute and
    I/O: the caller's ``comm_s`` when it has one, otherwise the time since the previous
    report minus this report's busy seconds. A gap longer than
    ``IDLE_FACTOR`` usual cycles is an idle wait, not overhead, and counts as a usual one.

    Args:
        alpha: weight of the underlying :class:`EwmaRate`.
        window: number of recent buckets the slope is fitted on; longer is steadier but
            slower to notice a change of trend.
        bucket_s: busy seconds per bucket (see :class:`EwmaRate`).
    """

    def __init__(self, alpha: float = 0.1, window: int = 8, bucket_s: float = 0.0):
        if window < 3:
            raise ValueError(f"trend window must be >= 3 reports, got {window}")
        self.ewma = EwmaRate(alpha, bucket_s)
        self.window = window
        self._points: deque[tuple[float, float]] = deque(maxlen=window)
        self.overhead: float | None = None     # seconds per sample outside compute + I/O
        self._last_t: float | None = None
        self._over = [0.0, 0.0]                 # overhead seconds, samples of the open bucket
        self._over_recent: deque[float] = deque(maxlen=3)   # the last buckets' overheads
        self._over_buckets = 0                  # buckets folded since the last reset
        self._slope: float | None = None        # slope() of the current points (cached)

    @property
    def value(self) -> float | None:
        """The EWMA estimate (samples/s), None before any report."""
        return self.ewma.value

    @property
    def count(self) -> int:
        """Number of reports taken in."""
        return self.ewma.count

    @property
    def last_t(self) -> float | None:
        """When the last report arrived (``update``'s ``t``), None before any."""
        return self._last_t

    def update(self, t: float, samples: float, busy_s: float,
               comm_s: float | None = None) -> float | None:
        """Add one report observed at time ``t``; returns the EWMA estimate.

        Args:
            t: when the report arrived (seconds, any fixed origin).
            samples: samples the report covers.
            busy_s: compute + I/O seconds they took.
            comm_s: seconds of communication (and other non-idle overhead) that went with
                them, if the caller measures it; otherwise inferred from report times.
        """
        last, self._last_t = self._last_t, t
        if samples <= 0 or busy_s <= 0:
            return self.ewma.value
        over = self._overhead_of(t - last if last is not None else None, samples, busy_s, comm_s)
        self._over[0] += over
        self._over[1] += samples
        self.ewma.update(samples, busy_s, busy_s + over)
        if not self.ewma.closed:
            return self.ewma.value
        per_sample = self._over[0] / self._over[1]
        self._over = [0.0, 0.0]
        self._smooth_overhead(per_sample)
        if self.ewma.shifted:
            self._points.clear()
        self._points.append((t, self.ewma.last_input))
        self._slope = None
        return self.ewma.value

    def _smooth_overhead(self, per_sample: float) -> None:
        """Fold one bucket's overhead per sample into :attr:`overhead`, as the rate is
        folded (see :class:`EwmaRate`): the first ``1 / alpha`` buckets averaged evenly,
        then the EWMA, reset to the median of the last three when all three lie beyond
        ``SHIFT_FACTOR`` of it on the same side (a link that became slower, contention)."""
        recent = self._over_recent
        recent.append(per_sample)
        self._over_buckets += 1
        old = self.overhead
        if old is None:
            self.overhead = per_sample
        elif len(recent) == 3 and (min(recent) > SHIFT_FACTOR * old
                                   or max(recent) * SHIFT_FACTOR < old):
            self.overhead = sorted(recent)[1]
            self._over_buckets = 1
        else:
            weight = max(self.ewma.alpha, 1.0 / self._over_buckets)
            self.overhead = old + weight * (per_sample - old)

    def _overhead_of(self, gap: float | None, samples: float, busy_s: float,
                     comm_s: float | None) -> float:
        """Overhead seconds of one report (see the class docstring)."""
        if comm_s is not None:
            return max(0.0, comm_s)
        usual = self.overhead * samples if self.overhead is not None else None
        if gap is None:
            return usual or 0.0
        over = max(0.0, gap - busy_s)
        if usual is not None and over > IDLE_FACTOR * (usual + busy_s):
            return usual
        return over

    def slope(self) -> float:
        """Trend of the rate in samples/s per second.

        0.0 with fewer than 3 buckets, and when the fitted slope is within ``TREND_T``
        standard errors of zero: jitter on a steady worker is not a trend, and
        extrapolating it would only move shards back and forth.
        """
        if self._slope is None:
            self._slope = self._fit_slope()
        return self._slope

    def _fit_slope(self) -> float:
        # plain floats: at most `window` points, where numpy's per-call cost dominates
        n = len(self._points)
        if n < 3:
            return 0.0
        t_mean = sum(p[0] for p in self._points) / n
        r_mean = sum(p[1] for p in self._points) / n
        dt = [p[0] - t_mean for p in self._points]
        dr = [p[1] - r_mean for p in self._points]
        denom = sum(d * d for d in dt)
        if denom <= 0:
            return 0.0
        slope = sum(a * b for a, b in zip(dt, dr)) / denom
        rss = sum((b - slope * a) ** 2 for a, b in zip(dt, dr))
        stderr = math.sqrt(rss / (n - 2) / denom)
        return slope if abs(slope) > TREND_T * stderr else 0.0

    def forecast(self, now: float, horizon: float) -> float | None:
        """Mean rate expected over ``[now, now + horizon]`` (None before any report)."""
        current = self.ewma.value
        if current is None:
            return None
        slope = self.slope()
        if slope == 0.0:
            return current
        t_first, t_last = self._points[0][0], self._points[-1][0]
        spacing = (t_last - t_first) / (len(self._points) - 1)
        lag = (1.0 - self.ewma.alpha) / self.ewma.alpha * spacing
        value = current + slope * (lag + max(0.0, now - t_last) + horizon / 2.0)
        return float(np.clip(value, FORECAST_MIN_FACTOR * current, FORECAST_MAX_FACTOR * current))

    def time_for(self, samples: float, now: float) -> float:
        """Seconds to do ``samples`` from ``now`` if the rate keeps falling along its trend.

        The rate falls linearly, down to a floor of 0.05x the EWMA; a rising or flat trend
        is not extrapolated (the EWMA rate is assumed), so a speed-up is believed only once
        it has shown in the estimate.
        """
        current = self.ewma.value
        if current is None or samples <= 0:
            return 0.0 if samples <= 0 else float("inf")
        slope = self.slope()
        start = self.forecast(now, 0.0)
        if slope >= 0.0 or start is None:
            return samples / current
        floor = FORECAST_MIN_FACTOR * current
        start = max(start, floor)
        to_floor = (start - floor) / -slope                 # seconds until the floor
        done_by_floor = (start + floor) / 2.0 * to_floor
        if samples >= done_by_floor:
            return to_floor + (samples - done_by_floor) / floor
        # start*x + slope*x^2/2 = samples, the smaller root
        return (start - np.sqrt(start * start + 2.0 * slope * samples)) / -slope

    def state_dict(self) -> dict:
        """JSON-serialisable state."""
        return {"ewma": self.ewma.state_dict(), "window": self.window,
                "points": [list(p) for p in self._points], "overhead": self.overhead,
                "last_t": self._last_t, "over": list(self._over),
                "over_recent": list(self._over_recent), "over_buckets": self._over_buckets}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.ewma.load_state_dict(state["ewma"])
        self.window = state["window"]
        self._points = deque((tuple(p) for p in state["points"]), maxlen=self.window)
        self._slope = None
        self.overhead = state.get("overhead")
        self._last_t = state.get("last_t")
        self._over = list(state.get("over", [0.0, 0.0]))
        self._over_recent = deque(state.get("over_recent", []), maxlen=3)
        self._over_buckets = state.get("over_buckets", self.ewma.buckets)
