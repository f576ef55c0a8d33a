"""Learning-rate schedules (mpilb.core.schedules): pure functions of the update count and time."""

import math

import pytest

from mpilb.config.build import build_config
from mpilb.errors import UsageError
from mpilb.core.schedules import Schedule, build_schedule, parse_warmup


def test_constant_step_cosine():
    assert Schedule("constant", 100)(57) == 1.0
    step = Schedule("step", 100)
    assert [step(v) for v in (0, 49, 50, 74, 75, 99)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    cos = Schedule("cosine", 100)
    assert cos(0) == 1.0 and cos(50) == pytest.approx(0.5) and cos(100) == pytest.approx(0.0)
    assert cos(200) == pytest.approx(0.0)   # past the planned end it stays at the floor


def test_warmup_in_updates_and_in_seconds():
    s = Schedule("constant", 100, warmup_updates=4)
    assert [s(v) for v in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])
    t = Schedule("cosine", 100, warmup_s=2.0)
    assert t(0, 1.0) == pytest.approx(0.5) and t(0, 3.0) == 1.0
    assert parse_warmup("200") == (200, 0.0) and parse_warmup("5s") == (0, 5.0)


def test_build_schedule_counts_updates_per_mode():
    cfg = build_config({}, {"epochs": 3, "batch": 10, "lr_schedule": "cosine", "warmup": "5"})
    assert build_schedule(cfg, 1000, workers=4).total_updates == 300
    assert build_schedule(cfg, [15, 15], workers=4).total_updates == 3 * 4   # 10 + 5 per shard
    sync = build_config({}, {"epochs": 3, "batch": 10, "mode": "sync"})
    assert build_schedule(sync, 1000, workers=4).total_updates == math.ceil(1000 / 40) * 3


@pytest.mark.parametrize("value", ["-1", "x", "5m", "1.5"])
def test_bad_warmup(value):
    with pytest.raises(UsageError, match="--warmup"):
        build_config({}, {"warmup": value})
