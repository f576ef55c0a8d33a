"""Statistical efficiency of a run: samples to each accuracy, what staleness cost, warnings.

Pure functions over a run log's columns (``updates/`` and ``eval/``, docs/logs.md), for
`mpilb report` and the benchmarks. Samples count the gradients applied up to the version an
evaluation read, so they do not depend on the machine's speed; a run is compared with its
own reference (a sync or serial run of the same recipe: `mpilb report --compare`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from mpilb.core.corrections import ASYNC_DEFAULT, CORRECTIONS, MOMENTUM_RULES, implicit_momentum

# Total momentum (explicit + what asynchrony adds) above which a run is warned about.
HIGH_MOMENTUM = 0.95
# A plateau: the last third of the evaluations stays this far below the trend of the
# earlier ones (accuracy points / 100).
PLATEAU_MARGIN = 0.01
# Below this mean staleness, a run's accuracy is not the staleness' doing.
MIN_STALENESS = 0.5
# Unstable: an evaluation this far below the best one before it (accuracy points / 100;
# evaluations of a healthy run here moved by up to 0.035 between two evaluations).
UNSTABLE_DROP = 0.05


def samples_at_evals(up: dict, ev: dict) -> np.ndarray:
    """Samples applied up to the version each evaluation read (eval/version)."""
    if not ev["version"].size:
        return np.zeros(0, np.int64)
    order = np.argsort(up["version"], kind="stable")
    versions = np.asarray(up["version"])[order]
    cum = np.concatenate([[0], np.cumsum(np.asarray(up["batch"], np.int64)[order])])
    return cum[np.searchsorted(versions, np.asarray(ev["version"]), side="right")]


def _first_reaching(accuracy: np.ndarray, target: float) -> Optional[int]:
    """Index of the first evaluation that reached `target` (None: none did)."""
    hit = np.nonzero(np.asarray(accuracy) >= target)[0]
    return int(hit[0]) if hit.size else None


def samples_to(samples: np.ndarray, accuracy: np.ndarray, target: float) -> Optional[int]:
    """Samples at the first evaluation that reached `target` (None: never)."""
    i = _first_reaching(accuracy, target)
    return None if i is None else int(samples[i])


def reached_after(samples: np.ndarray, accuracy: np.ndarray, target: float) -> Optional[int]:
    """Samples at the evaluation before the first that reached `target` (0 before the first
    evaluation; None: never reached): the target was reached somewhere after this count and
    by :func:`samples_to`'s, a range as wide as the evaluations' spacing there."""
    i = _first_reaching(accuracy, target)
    if i is None:
        return None
    return int(samples[i - 1]) if i > 0 else 0


def levels(accuracy: np.ndarray, count: int = 5) -> list[float]:
    """Up to `count` accuracies the reference reached, evenly spread between its first
    evaluation and its best (rounded to 0.001, increasing)."""
    acc = np.asarray(accuracy, dtype=np.float64)
    acc = acc[np.isfinite(acc)]
    if not acc.size:
        return []
    lo, hi = float(acc[0]), float(acc.max())
    if hi <= lo:
        return [round(hi, 3)]
    out = sorted({np.floor(v * 1000) / 1000 for v in np.linspace(lo, hi, count + 1)[1:]})
    return [float(v) for v in out]


def against_reference(run: tuple[np.ndarray, np.ndarray], ref: tuple[np.ndarray, np.ndarray],
                      targets: Optional[list[float]] = None) -> list[dict]:
    """For each target accuracy (default: :func:`levels` of the reference): samples the
    reference and the run needed, and their ratio (None where one never got there), each
    count with the evaluation before it (`samples_after`, `reference_samples_after`: the
    accuracy was reached between the two).

    Args:
        run, ref: (samples at each evaluation, accuracy at each evaluation).
    """
    rows = []
    for target in targets if targets is not None else levels(ref[1]):
        a, b = samples_to(*run, target), samples_to(*ref, target)
        rows.append({"accuracy": target, "samples": a, "reference_samples": b,
                     "ratio": a / b if a is not None and b else None,
                     "samples_after": reached_after(*run, target),
                     "reference_samples_after": reached_after(*ref, target)})
    return rows


def coarsest(rows: list[dict]) -> Optional[tuple[int, int]]:
    """(gap, count) of the row count known least finely, relative to itself: the samples
    between the evaluation that reached an accuracy and the one before, and that count
    (None where no count was reached)."""
    worst = None
    for r in rows:
        for at, after in ((r["samples"], r["samples_after"]),
                          (r["reference_samples"], r["reference_samples_after"])):
            if at and after is not None and (worst is None or (at - after) / at > worst[0] / worst[1]):
                worst = (at - after, at)
    return worst


def explicit_used(config: dict, mean_staleness: float) -> float:
    """The optimizer momentum the run applied (at its mean staleness) under its correction."""
    mu = float(config.get("momentum") or 0.0) if config.get("optimizer") == "momentum" else 0.0
    rule = MOMENTUM_RULES.get(config.get("correction"))
    if rule is not None:
        return rule(mu, mean_staleness)
    return mu


def per_worker_staleness(up: dict, config: dict) -> list[dict]:
    """Per worker: mean and p99 staleness of its applied gradients, and the effective
    momentum (the optimizer's, as applied, plus what that staleness adds; under `dana` the
    recipe's: each worker's velocity steps once a push of its own, as a sync round's once a
    round, and it reads the parameters past the others' momentum)."""
    out = []
    workers = np.asarray(up["worker"])
    st_all = np.asarray(up["staleness"], dtype=np.float64)
    tau_all = float(st_all.mean()) if st_all.size else 0.0
    explicit = explicit_used(config, tau_all)
    policy = CORRECTIONS.get(config.get("correction"))
    implicit = policy is None or policy.adds_implicit
    for rank in sorted(set(int(w) for w in workers)):
        st = st_all[workers == rank]
        tau = float(st.mean())
        out.append({"rank": rank, "staleness_mean": tau,
                    "staleness_p99": float(np.percentile(st, 99)),
                    "effective_momentum": explicit + (implicit_momentum(tau) if implicit else 0.0)})
    return out


def _saturating_fit(s: np.ndarray, acc: np.ndarray) -> Optional[tuple[float, float, float]]:
    """Least-squares fit of acc = A - B * exp(-s / C), C on a grid of sample counts (A, B by
    linear least squares for each); (A, B, C), or None when no fit improves (B <= 0)."""
    best = None
    span = float(s.max())
    for c in span * np.geomspace(0.05, 5.0, 40):
        x = np.exp(-s / c)
        design = np.stack([np.ones_like(x), -x], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, acc, rcond=None)
        err = float(np.sum((design @ np.array([a, b]) - acc) ** 2))
        if b > 0 and (best is None or err < best[0]):
            best = (err, float(a), float(b), float(c))
    return None if best is None else best[1:]


def plateau(samples: np.ndarray, accuracy: np.ndarray) -> Optional[tuple[float, float]]:
    """(best of the last third, level the earlier evaluations trend to by the run's end) when
    the run stopped improving below that level by more than PLATEAU_MARGIN; None otherwise.

    The trend is a saturating fit, accuracy = A - B exp(-samples / C), of the first two
    thirds of the evaluations (6 or more, improving): it levels off where they do, so a run
    that converged is not taken for one that stalled.
    """
    s, acc = np.asarray(samples, np.float64), np.asarray(accuracy, np.float64)
    ok = np.isfinite(acc) & (s > 0)
    s, acc = s[ok], acc[ok]
    n = acc.size
    if n < 6:
        return None
    early = slice(0, (2 * n) // 3)
    fit = _saturating_fit(s[early], acc[early])
    if fit is None:
        return None
    a, b, c = fit
    expected = min(1.0, a - b * np.exp(-s[-1] / c))
    best_late = float(acc[(2 * n) // 3:].max())
    if best_late < expected - PLATEAU_MARGIN and best_late <= float(acc[early].max()) + PLATEAU_MARGIN:
        return best_late, float(expected)
    return None


def fell(accuracy: np.ndarray) -> Optional[tuple[float, float]]:
    """(peak, trough) of the largest fall of the accuracy below its best so far in the
    second half of the evaluations, when that is more than UNSTABLE_DROP (steps too large
    for the staleness: the run diverges, or swings and recovers); None otherwise. Falls in
    the first half are left alone: early evaluations of healthy async runs swing too."""
    acc = np.asarray(accuracy, np.float64)
    acc = acc[np.isfinite(acc)]
    if acc.size < 3:
        return None
    peaks = np.maximum.accumulate(acc)
    half = acc.size // 2
    i = half + int(np.argmax((peaks - acc)[half:]))
    return (float(peaks[i]), float(acc[i])) if peaks[i] - acc[i] > UNSTABLE_DROP else None


def warnings(config: dict, up: dict, samples: np.ndarray, accuracy: np.ndarray) -> list[str]:
    """One line per problem found, each naming the option to try."""
    out = []
    st = np.asarray(up["staleness"], dtype=np.float64)
    if config.get("mode") == "sync" or not st.size or st.mean() < MIN_STALENESS:
        return out     # no staleness to blame (sync, serial)
    tau = float(st.mean())
    mu = explicit_used(config, tau)
    total = mu + implicit_momentum(tau)
    policy = config.get("correction") in MOMENTUM_RULES
    fresher = ("--pipeline 0 (about half the staleness)" if config.get("pipeline")
               else "a lower --lr, or --mode sync")
    if config.get("weight_prediction") == "off" and config.get("optimizer") == "momentum":
        fresher = ("--weight-prediction on (gradients computed on where the parameters are "
                   "heading), " + fresher)
    if total > HIGH_MOMENTUM and mu > 0 and not policy:
        out.append(f"staleness is high for the momentum used: mean staleness {tau:.1f} adds "
                   f"momentum ~{implicit_momentum(tau):.2f} to --momentum {mu:g} (total "
                   f"{total:.2f}); try --correction {ASYNC_DEFAULT} (the default for async and "
                   f"ssp: it lowers the momentum by the staleness), or --momentum "
                   f"{MOMENTUM_RULES[ASYNC_DEFAULT](mu, tau):.2f}")
    dropped = fell(accuracy)
    hint = f"try --correction {ASYNC_DEFAULT}" if not policy and mu > 0 else f"try {fresher}"
    less = {"dana": "lookahead", "gap": "lookahead", "lookahead": "dynamic",
            "dynamic": "momentum"}.get(config.get("correction"))
    if less and mu > 0:   # the swings of more momentum: the policy that keeps less
        hint = (f"try --correction {less} (momentum "
                f"{MOMENTUM_RULES[less](float(config.get('momentum') or 0.0), tau):.2f} "
                f"instead of {mu:.2f} at this staleness), or {fresher}")
    if dropped is not None:
        out.append(f"accuracy fell from {dropped[0]:.4f} to {dropped[1]:.4f} (mean staleness "
                   f"{tau:.1f}, total momentum {total:.2f}): {hint}")
    flat = None if dropped is not None else plateau(samples, accuracy)
    if flat is not None:
        best, expected = flat
        out.append(f"accuracy plateaued at {best:.4f}, below the {expected:.4f} its earlier "
                   f"evaluations trend to (mean staleness {tau:.1f}): {hint}")
    return out


def efficiency(config: dict, up: dict, ev: dict, ref: Optional[tuple[dict, dict]] = None) -> dict:
    """The report's `efficiency` entry: samples at each evaluation, per-worker staleness and
    effective momentum, warnings, and (`ref`: the reference's (updates, eval) columns)
    samples to its accuracies against the reference's."""
    samples = samples_at_evals(up, ev)
    acc = np.asarray(ev["test_accuracy"], dtype=np.float64)
    out = {"samples_at_eval": [int(v) for v in samples],
           "per_worker": per_worker_staleness(up, config),
           "warnings": warnings(config, up, samples, acc)}
    target = config.get("target_accuracy")
    out["samples_to_target"] = samples_to(samples, acc, target) if target is not None else None
    if ref is not None:
        ref_samples = samples_at_evals(*ref)
        ref_acc = np.asarray(ref[1]["test_accuracy"], dtype=np.float64)
        out["against_reference"] = against_reference((samples, acc), (ref_samples, ref_acc))
    return out
