"""The network model's two regimes for request/reply exchanges (issue 33).

    python benchmarks/fluid_regimes.py [--seconds 20] [--out FILE]

`mpilb simulate`'s fabrics (mpilb/simulate/fabric.py) driven by the raw-TCP pattern of
benchmarks/request_reply.py's "a store per node" case, with nothing of mpilb in between:
3 nodes, a server and a client on each; a client sends a 4 MB message split over the 3
servers (the slice to its own node's server stays off the links), each server answers its
slice with as many bytes as soon as the slice is in, and the client sends again when both
far answers are in. The clients start 0, 3 and 7 ms apart, the latency is 50 us one way.

For each link rate, sharing (coupled along the paths, or each link on its own) and token
bucket (none, or `--link-burst` MS spent at a peak of X times the rate): the exchanges per
second over the last half of ``--seconds`` of simulated time, against the wire bound (each
link carries 4 of the 1.33 MB slices a round of 3 exchanges). Deterministic: no repeats.
Writes benchmarks/results/fluid_regimes.json (or ``--out``); ``python benchmarks/gendocs.py``
renders it into docs/simulate.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

NAME = "fluid_regimes"
NODES = 3
MESSAGE = 4e6            # bytes, (b)'s 1M floats
LATENCY_S = 5e-5
STARTS = (0.0, 0.003, 0.007)
CASES = [   # (label, link-sharing, burst in ms, peak over rate)
    ("coupled, no bucket", "coupled", 0.0, 1.0),
    ("coupled, 5 ms bucket spent at 40x the rate", "coupled", 5.0, 40.0),
    ("coupled, 0.2 ms bucket at 40x", "coupled", 0.2, 40.0),
    ("coupled, 5 ms bucket at 1.2x", "coupled", 5.0, 1.2),
    ("per link, no bucket", "per-link", 0.0, 1.0),
    ("per link, 5 ms bucket at 40x", "per-link", 5.0, 40.0),
]
RATES = {"1gbit": 125e6, "250mbit": 31.25e6}


def exchanges(rate: float, sharing: str, burst_ms: float, peak_x: float,
              seconds: float) -> float:
    """Exchanges per second of all clients over the second half of `seconds`."""
    from mpilb.simulate.fabric import Fabric, PerLinkFabric

    up, down = list(range(NODES)), list(range(NODES, 2 * NODES))
    banks = [rate * burst_ms / 1e3] * (2 * NODES) if burst_ms else None
    peaks = [rate * peak_x] * (2 * NODES) if burst_ms else None
    kind = Fabric if sharing == "coupled" else PerLinkFabric
    fab = kind([rate] * (2 * NODES), [math.inf] * (2 * NODES), LATENCY_S, banks, peaks)
    part = MESSAGE / NODES

    def send(t, src, dst, token):
        if fab.coupled:
            flows = fab.path(t, (up[src], down[dst]), part)
        else:
            flows = [fab.flow(t, up[src], part), fab.flow(t, down[dst], part)]
        fab.transfer(t, flows, token)

    waiting = [0] * NODES
    done = 0
    for k, t0 in enumerate(STARTS):
        fab.later(t0, ("go", k, None))
    while True:
        t, kind_, token = fab.pop()
        if t > seconds:
            break
        if kind_ == 0:
            continue
        what, k, j = token
        if what == "go":
            waiting[k] = NODES - 1
            for far in range(NODES):
                if far != k:
                    send(t, k, far, ("slice", k, far))
        elif what == "slice":        # server j has client k's slice: it answers
            send(t, j, k, ("answer", k, j))
        else:
            waiting[k] -= 1
            if waiting[k] == 0:
                if t >= seconds / 2:
                    done += 1
                fab.later(t, ("go", k, None))
    return done / (seconds / 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _results.add_output_args(ap, NAME)
    ap.add_argument("--seconds", type=float, default=20.0, help="simulated time per case")
    opts = ap.parse_args()
    if opts.quick:
        opts.seconds = 1.0
    if opts.seconds <= 0:
        ap.error("--seconds must be > 0")
    res = _results.Results(NAME, "The network model's regimes for request/reply exchanges", opts)
    for rate_name, rate in RATES.items():
        bound = rate / (4 * MESSAGE / NODES) * NODES
        g = res.group(f"a store per node's exchanges over raw links, {rate_name}: the model's "
                      f"exchanges/s ÷ the wire bound ({bound:.1f}/s)",
                      f"python benchmarks/fluid_regimes.py --seconds {opts.seconds:g}")
        for i, (label, sharing, burst, peak) in enumerate(CASES):
            x = exchanges(rate, sharing, burst, peak, opts.seconds)
            res.figure(g, f"{rate_name}.{i}", label, [x / bound], unit="x")
            print(f"{rate_name}, {label}: {x:.1f} exchanges/s = {x / bound:.2f} of the bound",
                  flush=True)
    res.write(_results.out_path(opts, NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main())
