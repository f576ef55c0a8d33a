"""mpilb.core.cuts.first_cut: where a part-way move may cut a donor's task, pipelined or not."""

import pytest

from mpilb.core.balancer import BalancerConfig, build_balancer
from mpilb.core.tasks import TaskLedger
from mpilb.core.cuts import first_cut

B = 32


def donor(pipeline: bool):
    """Rank 1 holding shard 0 (1000 samples) at position 96, its batch 32."""
    bal = build_balancer("load", [1, 2], [1000, 1000], BalancerConfig(batch=B))
    bal.plan_epoch(0, [0, 1])
    ledger = TaskLedger(bal, [1000, 1000], [1, 2], pipeline=pipeline)
    ledger.assign(1, 0, 0, 1000)
    ledger.take_reply(1, B)
    ledger.of[1].tasks[0].pos = 96
    return ledger, ledger.of[1], ledger.of[1].tasks[0]


def test_unpipelined_one_batch_past_where_it_stands():
    ledger, h, task = donor(False)
    assert first_cut(ledger, h, task, current=True) == 96 + B
    assert first_cut(ledger, h, task, current=False) == 96    # not started: untouched


@pytest.mark.parametrize("announced, cut", [
    ((0, 160), 160 + B),      # a batch of this shard announced: one past it (was two)
    ((5, 40), 96 + B),        # a batch of another shard: this task's first batch at most
    ((-1, 0), 96 + 2 * B),    # none: it may have pushed [96, 128) and compute [128, 160)
])
def test_pipelined_past_what_it_may_have_pushed_and_computes(announced, cut):
    # The simulator's pipelined workers found the third case: a worker that announced no
    # batch (nothing was left), was given this task by its reply, pushed the first batch
    # and computed the second before rank 0 heard of either; one batch past pos cut into
    # the second (benchmarks/cluster.py (f)'s layout, seed 0: a batch pushed past its cut)
    ledger, h, task = donor(True)
    ledger.note_next(1, *announced)
    assert first_cut(ledger, h, task, current=True) == cut
