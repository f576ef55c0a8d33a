"""The waiting helpers in mpilb.mpi.comm: backoff schedule and wait estimates (no MPI needed)."""


import pytest

from mpilb.mpi import comm as C
from mpilb.mpi.waiting import WaitEstimate


class Clock:
    """A fake monotonic clock whose sleeps advance it; records every sleep."""

    def __init__(self, monkeypatch):
        self.now = 100.0
        self.sleeps = []
        monkeypatch.setattr(C.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(C.time, "sleep", self.sleep)
        # (an in-process run before this test may have made waits poll first: cores.py)
        monkeypatch.setattr(C.Backoff, "spin_s", 0.0)
        # the schedules below start at the first sleep (see the free-polls test)
        monkeypatch.setattr(C.Backoff, "FREE_POLLS", 0)

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += max(s, 50e-6)   # the kernel's timer slack: no sleep is shorter


def test_backoff_without_due_grows_to_the_cap(monkeypatch):
    clock = Clock(monkeypatch)
    b = C.Backoff(start=20e-6, cap=1e-3)
    b.reset()
    for _ in range(10):
        b.sleep()
    assert clock.sleeps[:3] == pytest.approx([20e-6, 40e-6, 80e-6])
    assert clock.sleeps[-1] == pytest.approx(1e-3)
    assert max(clock.sleeps) == pytest.approx(1e-3)


def test_backoff_with_due_sleeps_long_then_polls_finely_then_backs_off(monkeypatch):
    clock = Clock(monkeypatch)
    b = C.Backoff(start=20e-6, cap=1e-3, fine=50e-6)
    due = clock.now + 2.5e-3
    b.reset(due, grace=0.5e-3)
    woke = []
    while clock.now < due + 3e-3:
        b.sleep()
        woke.append(clock.now)
    before = [t for t in woke if t <= due - b.fine]
    # few wake-ups before the message is due, none of them past it by more than `fine`
    assert len(before) <= 3
    assert min(t for t in woke if t >= due - b.fine) <= due + 2 * b.fine
    # fine polling around the due time: every ~50 us up to `grace` after it
    window = [t for t in woke if due <= t <= due + 0.5e-3]
    assert len(window) >= 8
    # overdue: sleeps grow again
    late = [s for t, s in zip(woke, clock.sleeps) if t > due + 0.6e-3]
    assert late and late[-1] > 4 * b.fine


def test_backoff_due_in_the_past_falls_back_to_growing_sleeps(monkeypatch):
    clock = Clock(monkeypatch)
    b = C.Backoff(start=20e-6, cap=1e-3, fine=50e-6)
    b.reset(clock.now - 1.0, grace=1e-3)
    for _ in range(6):
        b.sleep()
    assert clock.sleeps == sorted(clock.sleeps)
    assert clock.sleeps[-1] > clock.sleeps[0]


def test_wait_estimate_tracks_the_short_waits():
    est = WaitEstimate()
    assert est.window(5.0) == (None, 0.0)
    # waits of 1 ms with every fifth one 5 ms: the estimate stays near the short ones
    for i in range(200):
        est.update(5e-3 if i % 5 == 0 else 1e-3)
    assert 0.8e-3 < est.value < 1.6e-3
    due, grace = est.window(10.0)
    assert 10.0 < due < 10.0 + est.value
    assert grace > est.value
    # a lasting change to longer waits is followed, if slowly
    for _ in range(200):
        est.update(4e-3)
    assert est.value == pytest.approx(4e-3, rel=0.05)


def test_a_long_wait_is_polled_less_finely_than_a_short_one(monkeypatch):
    """The polling interval is a share of the wait: 50 ms between pushes is polled every
    250 us near its end (each wake-up costs CPU), 2 ms every 50 us."""
    def wakeups_in_window(span):
        clock = Clock(monkeypatch)
        b = C.Backoff(start=20e-6, cap=1e-3, fine=50e-6)
        due = clock.now + span
        b.reset(due, grace=2e-3, span=span)
        woke = []
        while clock.now < due + 2e-3:
            b.sleep()
            woke.append(clock.now)
        assert min(t for t in woke if t >= due - b.poll) <= due + 2 * b.poll   # noticed soon
        return sum(1 for t in woke if due - 0.5e-3 <= t <= due + 2e-3), b.poll

    short, poll_short = wakeups_in_window(2e-3)
    long, poll_long = wakeups_in_window(50e-3)
    assert poll_short == pytest.approx(50e-6) and poll_long == pytest.approx(250e-6)
    assert long * 3 < short


def test_open_mpi_version_text_loses_its_nul_before_it_reaches_the_run_log(monkeypatch, tmp_path):
    # Open MPI's MPI_Get_library_version counts the terminating NUL; h5py refuses such a
    # string ("VLEN strings do not support embedded NULLs"): seen on a GPU machine whose
    # mpi4py had loaded the system's Open MPI.
    h5py = pytest.importorskip("h5py")
    text = "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6\x00"
    monkeypatch.setattr(C.MPI, "Get_library_version", lambda: text)
    assert C.library_version() == "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6"
    info = C.mpi_info()
    assert "\x00" not in info["library"]
    with h5py.File(tmp_path / "log.h5", "w") as f:
        f.attrs["mpi"] = C.library_version()
        f.attrs["library"] = info["library"]


def test_backoff_polls_a_few_times_at_once_before_its_first_sleep(monkeypatch):
    """A message already sent is often a progress call or two away: each wait's first
    polls do not sleep (a sleep on a busy node costs a scheduler's turn)."""
    clock = Clock(monkeypatch)
    monkeypatch.setattr(C.Backoff, "FREE_POLLS", 3)
    b = C.Backoff(start=20e-6, cap=1e-3)
    b.reset()
    for _ in range(3):
        b.sleep()
    assert clock.sleeps == []
    b.sleep()
    b.sleep()
    assert clock.sleeps == pytest.approx([20e-6, 40e-6])   # then the usual schedule
    b.reset()   # every wait has its free polls again
    for _ in range(3):
        b.sleep()
    assert len(clock.sleeps) == 2


def test_backoff_on_a_cpu_of_its_own_polls_before_it_sleeps(monkeypatch):
    clock = Clock(monkeypatch)
    monkeypatch.setattr(C.Backoff, "spin_s", 2e-3)
    b = C.Backoff(start=20e-6, cap=1e-3)
    b.reset()
    polls = 0
    while not clock.sleeps:
        b.sleep()
        polls += 1
        clock.now += 10e-6   # a poll (an MPI test) takes a moment
    # no sleep in the first 2 ms of the wait, then the usual schedule from its start
    assert clock.now >= 100.0 + 2e-3 and polls >= 2e-3 / 10e-6
    assert clock.sleeps == [pytest.approx(20e-6)]
    b.reset()   # every wait polls first again
    b.sleep()
    assert len(clock.sleeps) == 1


def test_a_transfer_that_never_completes_still_calls_the_poll(monkeypatch):
    """complete(): a message whose sender stopped mid-transfer never completes; the caller's
    poll (the watch on rank 0's silence) is called every COMPLETE_POLL_S meanwhile and can
    end the wait, where the loop used to spin for ever (a worker outlived a stopped rank 0)."""
    clock = Clock(monkeypatch)

    class Stuck:
        tests = 0

        def Test(self):
            self.tests += 1
            clock.now += 1e-3
            return False

    class Gone(Exception):
        pass

    polls = []

    def on_poll():
        polls.append(clock.now)
        if len(polls) == 3:
            raise Gone

    req = Stuck()
    with pytest.raises(Gone):
        C.complete(req, on_poll)
    assert len(polls) == 3
    gaps = [b - a for a, b in zip(polls, polls[1:])]
    assert all(C.COMPLETE_POLL_S <= g < 2 * C.COMPLETE_POLL_S for g in gaps), gaps


def test_a_transfer_that_completes_calls_no_poll(monkeypatch):
    Clock(monkeypatch)

    class Done:
        def Test(self):
            return True

    C.complete(Done(), on_poll=lambda: pytest.fail("polled a finished request"))


def test_ucx_tcp_fragment_is_set_before_mpi_starts_unless_the_user_set_it():
    """UCX's TCP transport moves a large message a fragment of UCX_TCP_RX_SEG_SIZE per
    progress call: mpilb raises it from 64 KB to 1 MB in each rank before MPI_Init (comm.py),
    and leaves a value the user gave alone."""
    import os
    import subprocess
    import sys

    probe = ("import os; import mpilb.mpi.comm as C; from mpi4py import MPI; "
             "assert MPI.Is_initialized(); print(os.environ['UCX_TCP_RX_SEG_SIZE'])")
    env = {k: v for k, v in os.environ.items() if k != "UCX_TCP_RX_SEG_SIZE"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1m"
    out = subprocess.run([sys.executable, "-c", probe], env=dict(env, UCX_TCP_RX_SEG_SIZE="64k"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "64k"
