"""Rank 0's --eval-interval evaluations run in the background (server/epochs.py): the run goes
on while one runs, one due meanwhile is skipped, and a --target-* it meets stops the run when
its result is in."""

from types import SimpleNamespace

import numpy as np

from mpilb.core.decisions import Interval, SampleInterval
from mpilb.core.stop import StopRule
from mpilb.server.epochs import Epochs


class FakeSession:
    """Session's evaluation calls, the background ones left pending until `finish`."""

    def __init__(self):
        self.now_calls, self.later_calls = [], []
        self.evaluation = None
        self._then = None

    @property
    def evaluating(self) -> bool:
        return self._then is not None

    def collect(self, wait: bool = False) -> bool:
        return False

    def evaluate(self, params, t, version, epoch) -> None:
        self.now_calls.append(version)
        self.evaluation = SimpleNamespace(decides=(0.95, None))

    def evaluate_later(self, params, t, version, epoch, then=None) -> None:
        self.later_calls.append(version)
        self._then = then

    def finish(self, accuracy: float) -> None:
        """The background evaluation is in (as Session.collect logs it and calls `then`)."""
        self.evaluation = SimpleNamespace(decides=(accuracy, None))
        then, self._then = self._then, None
        then()


def fake_epochs(num_state: int = 0, target: float = 0.9):
    stops = []
    ep = SimpleNamespace(
        model=SimpleNamespace(num_state=num_state), session=FakeSession(),
        slices=SimpleNamespace(full_params=lambda: np.zeros(3, np.float32),
                               local=SimpleNamespace(version=7)),
        clock=SimpleNamespace(now=lambda: 1.0), ledger=SimpleNamespace(epoch=2),
        eval_timer=Interval(0.1), stop=StopRule(50, None, target),
        tracker=SimpleNamespace(epoch=2), replies=SimpleNamespace(begin_stop=lambda: stops.append(1)))
    ep._after_interval = lambda: Epochs._after_interval(ep)
    ep.evaluate = lambda epoch=None: Epochs.evaluate(ep, epoch)
    ep._evaluate_meanwhile = lambda skip_if_running: Epochs._evaluate_meanwhile(ep, skip_if_running)
    return ep, stops


def test_an_interval_evaluation_runs_in_the_background_and_its_target_stops_the_run():
    ep, stops = fake_epochs()
    Epochs.evaluate_interval(ep)
    assert ep.session.later_calls == [7] and ep.session.now_calls == []
    assert not stops and not ep.stop.reason   # nothing decided before the result is in
    ep.session.finish(0.95)
    assert ep.stop.reason == "target_accuracy" and stops == [1]


def test_one_due_while_the_last_runs_is_skipped():
    ep, stops = fake_epochs()
    Epochs.evaluate_interval(ep)
    Epochs.evaluate_interval(ep)   # the first is still running: no second, no wait
    assert ep.session.later_calls == [7]
    ep.session.finish(0.5)         # under the target: the run goes on
    assert not stops and not ep.stop.reason
    Epochs.evaluate_interval(ep)
    assert ep.session.later_calls == [7, 7]


def test_a_model_with_state_is_evaluated_at_once():
    ep, stops = fake_epochs(num_state=4)
    Epochs.evaluate_interval(ep)
    assert ep.session.now_calls == [7] and ep.session.later_calls == []
    assert ep.stop.reason == "target_accuracy" and stops == [1]


def test_an_eval_every_one_queues_behind_the_one_running_instead_of_being_skipped():
    ep, stops = fake_epochs()
    ep.session.eval_samples = SampleInterval(100)
    Epochs.applied(ep, 64)             # not due yet
    assert ep.session.later_calls == []
    Epochs.applied(ep, 64)             # 128: due
    Epochs.applied(ep, 80)             # 208: due while the first still runs, handed on all the same
    assert ep.session.later_calls == [7, 7] and not stops
