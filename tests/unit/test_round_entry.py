"""A joiner of a --mode sync run waits for the open round's close (server/round_entry.py)."""

from types import SimpleNamespace

from mpilb.server.round_entry import Entry, RoundEntry


def test_a_joiner_waits_for_the_open_round_and_enters_at_its_close():
    rule = SimpleNamespace(rounds=True, members=[1])   # worker 1 pushed into the round
    entry = RoundEntry(lambda: rule)
    first = Entry("comm", "offer", {}, None)
    assert entry.defer(first)
    admitted = []
    rule.members = []   # the round closed
    entry.closed(admitted.append)
    assert admitted == [first] and not entry.waiting
    assert not entry.defer(first)   # no round open: admitted at once


def test_no_round_no_wait_and_the_run_end_takes_the_waiting():
    assert not RoundEntry(lambda: SimpleNamespace(rounds=False, members=[1])).defer(Entry(1, 2, {}, None))
    rule = SimpleNamespace(rounds=True, members=[2])
    entry = RoundEntry(lambda: rule)
    entry.defer(Entry(1, 2, {}, 5))
    assert [e.reserved for e in entry.take_all()] == [5] and not entry.waiting
