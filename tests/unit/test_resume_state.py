"""What rank 0 learnt survives --resume across membership changes (issues 28 and 29): the
staleness correction's measurements (a resume used to start `dynamic`'s staleness average
afresh, its first gradients at the recipe's full momentum; an older checkpoint without
them still loads), and the balancer's rates of the workers the resumed job still has
(before, a checkpoint taken after a join or a leave left the balancer wholly fresh)."""

import json

import h5py
import numpy as np
import pytest

from mpilb.config.build import build_config
from mpilb.core.balancer import BalancerConfig, build_balancer
from mpilb.core.corrections import build_correction
from mpilb.core.optimizers import build_optimizer
from mpilb.data.dataset import open_dataset
from mpilb.errors import UsageError
from mpilb.run.session import Session
from mpilb.runfiles.checkpoint import restore_balancer


def measured(name="dynamic", stalenesses=(3, 5, 4, 6, 2, 7, 5, 4)):
    corr = build_correction(name)
    opt = build_optimizer("momentum", 10, lr=0.1, momentum=0.9)
    for tau in stalenesses:
        corr.tune(opt, tau)
    return corr, opt


@pytest.mark.parametrize("name", ["dynamic", "momentum"])
def test_the_staleness_average_round_trips(name):
    corr, opt = measured(name)
    state = json.loads(json.dumps(corr.state_dict()))
    again = build_correction(name)
    assert again.load_state_dict(state)
    assert (again.meter.count, again.meter.mean) == (corr.meter.count, corr.meter.mean)
    # the next gradient gets the momentum it would have had without the restart
    fresh_opt = build_optimizer("momentum", 10, lr=0.1, momentum=0.9)   # as --resume builds it
    corr.tune(opt, 4)
    again.tune(fresh_opt, 4)
    assert fresh_opt.momentum == opt.momentum < 0.9


def test_another_correction_state_is_not_taken():
    corr, _ = measured("dynamic")
    other = build_correction("momentum")
    assert not other.load_state_dict(corr.state_dict())
    assert other.meter.count == 0
    assert build_correction("none").state_dict() == {"name": "none"}
    assert not build_correction("inverse").load_state_dict({"name": "dc"})


def _session(digits_dir, tmp_path, **options):
    cfg = build_config(cli_values={"data": digits_dir, "model": "softmax", "epochs": 2,
                                   "progress": False, "log": str(tmp_path / "run.h5"),
                                   "checkpoint": str(tmp_path / "run.ckpt.h5"), "mode": "async",
                                   "optimizer": "momentum", **options})
    return Session(cfg, open_dataset(digits_dir), {"run_id": "r1", "world_size": 3}, [1, 2])


def _checkpointed(digits_dir, tmp_path):
    """A session that kept a measured `dynamic` correction and wrote its checkpoint."""
    first = _session(digits_dir, tmp_path)
    corr, _ = measured()
    first.keep_correction(corr)
    first.checkpoint(first.params, version=8, epoch=0, train_s=1.5)
    first.log.close("preempted")
    first.log.release()
    return corr


def test_a_resume_goes_on_from_the_checkpoints_correction(digits_dir, tmp_path):
    corr = _checkpointed(digits_dir, tmp_path)
    with h5py.File(tmp_path / "run.ckpt.h5", "r") as f:
        saved = json.loads(f.attrs["correction"])
    assert saved["name"] == "dynamic" and saved["meter"]["count"] == corr.meter.count
    again = _session(digits_dir, tmp_path, resume=True)
    fresh = build_correction("dynamic")
    again.keep_correction(fresh)
    assert fresh.meter.count == corr.meter.count
    assert fresh.meter.mean == pytest.approx(corr.meter.mean)
    again.log.close("failed")
    again.log.release()


def test_an_old_checkpoint_without_it_still_resumes(digits_dir, tmp_path):
    _checkpointed(digits_dir, tmp_path)
    with h5py.File(tmp_path / "run.ckpt.h5", "a") as f:
        del f.attrs["correction"]          # as written before the state was kept
    again = _session(digits_dir, tmp_path, resume=True)
    assert again.resumed.correction is None
    fresh = build_correction("dynamic")
    again.keep_correction(fresh)
    assert fresh.meter.count == 0           # measures afresh
    assert np.array_equal(again.params, again.resumed.params)
    again.log.close("failed")
    again.log.release()


def test_a_damaged_correction_state_is_one_line(digits_dir, tmp_path):
    _checkpointed(digits_dir, tmp_path)
    with h5py.File(tmp_path / "run.ckpt.h5", "a") as f:
        f.attrs["correction"] = json.dumps({"name": "dynamic", "meter": {"count": 3}})
    again = _session(digits_dir, tmp_path, resume=True)
    with pytest.raises(UsageError, match="run.ckpt.h5 is damaged: its correction state"):
        again.keep_correction(build_correction("dynamic"))
    again.log.close("failed")
    again.log.release()


def _learnt(workers, rates):
    bal = build_balancer("load", workers, [100] * 8, BalancerConfig())
    for step in range(1, 30):
        for w in workers:
            bal.observe(w, 0.1 * step, 10, 10 / rates[w])
    return bal


def test_the_rates_of_the_workers_still_there_are_taken_over():
    rates = {1: 100.0, 2: 400.0, 3: 50.0}
    before = _learnt([1, 2, 3], rates)          # rank 3 had joined; the resume lacks it
    state = json.loads(json.dumps(before.state_dict()))
    after = build_balancer("load", [1, 2], [100] * 8, BalancerConfig())
    assert restore_balancer(after, state)
    assert after.workers == [1, 2]
    for w in (1, 2):
        assert after.rate_known(w) and after.rate(w) == pytest.approx(before.rate(w))
    # a worker the checkpoint did not know (it had left) is learnt afresh
    back = build_balancer("load", [1, 2, 4], [100] * 8, BalancerConfig())
    assert restore_balancer(back, state)
    assert back.rate_known(2) and not back.rate_known(4)
    # nothing in common, or another policy: fresh
    assert not restore_balancer(build_balancer("load", [0], [100] * 8, BalancerConfig()), state)
    assert not restore_balancer(build_balancer("static", [1, 2], [100] * 8, BalancerConfig()), state)
