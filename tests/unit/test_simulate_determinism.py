"""mpilb simulate gives the same figures for the same seed, whatever the process (#33)."""

import json
import os
import subprocess
import sys

# The case where it showed (sync, fixed batches, load: a read time was keyed by a
# task's id, which a later task could get once the first was freed) and async beside it
ARGS = ["simulate", "--workers", "16", "--rates", "lognormal:mean=100,sigma=0.3",
        "--epochs", "3", "--batch", "32", "--mode", "sync,async",
        "--batch-policy", "fixed", "--inject", "3:compute=4",
        "--balancer", "load", "--rebalance-interval", "0.5", "--json"]


def simulate_in_a_process(hash_seed: str) -> list:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-m", "mpilb", *ARGS], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out)


def test_two_processes_with_different_hash_seeds_give_identical_json():
    first, *others = [simulate_in_a_process(seed) for seed in ("0", "1", "2")]
    assert len(first) == 2 and all(r["coverage"] for r in first)
    for other in others:
        assert other == first
