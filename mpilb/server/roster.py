"""Who is in the run, as it changes (rank 0): workers let go while the run goes on, and
(admission.py) workers that join it.

A worker leaves when asked (a worker that joined, or a replacement, too: its connection
to rank 0 is then closed, farewell.py): by SIGUSR2 to its process (it tells rank 0, stopsignals.py) or
by `mpilb leave RUN.h5 --rank R` (cli/membership.py), which writes a request file into the
directory beside the run log (runfiles/requests.py) that rank 0 looks into among its chores.
Rank 0 lets the worker finish its step: the worker's next reply (to its push, or at once if
it is idle) is LEAVE instead of parameters, its unstarted work goes back to the ledger for
the others (no --worker-timeout wait: the task ledger hands it back as for a lost worker),
and nothing more is sent to it. The worker ends alone (mpi/departure.py) with exit 0; the
run ends `finished`, not `degraded`. The last worker is never let go: the run would stop.

Every change is a row of the `members/` log group: `t`, `worker`, `node`, `event` (`join`,
`leave`, `lost`, `respawn`: a replacement for a lost worker, respawn.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Callable, Optional

from mpilb.mpi.wire import Cmd
from mpilb.run.signals import LEAVE_ASKED
from mpilb.runfiles.requests import ANSWER_SUFFIX, JOIN_PREFIX, LEAVE_PREFIX, requests_dir, write_atomically
from mpilb.server.admission import Admissions
from mpilb.server.respawn import Respawns



class Members:
    """Membership changes of a run (rank 0).

    Args:
        log: the run log (`members/` rows); its path locates the requests directory.
        clock: the run's clock.
        roster: the workers (:class:`~mpilb.server.peers.Roster`).
        nodes: node index of every rank (the run log's `nodes`).
        stop: the stop rule (a run that is stopping lets no one leave: it ends anyway).
        hand_back: gives a departed worker's work to the others
            (:meth:`~mpilb.server.liveness.Liveness.hand_back`).
        send_leave: sends a worker its LEAVE.
        log_row: logs a worker's last `workers/` row.
        sole_copies: the shards only this worker still holds (--store local), [] otherwise.
        note_departure: tells the stop signals a worker left (the launcher's SIGUSR1 that
            may follow is no preemption: stopsignals.py).
    """

    POLL_S = 0.5   # how often the requests directory is looked into

    def __init__(self, log, clock, roster, nodes: list, stop, hand_back: Callable,
                 send_leave: Callable, log_row: Callable,
                 sole_copies: Callable[[int], list] = lambda rank: [],
                 note_departure: Callable[[int], None] = lambda rank: None):
        self.log = log
        self.clock = clock
        self.roster = roster
        self.nodes = nodes
        self.stop = stop
        self.hand_back = hand_back
        self.send_leave = send_leave
        self.log_row = log_row
        self.sole_copies = sole_copies
        self.note_departure = note_departure
        self.requests = requests_dir(getattr(log, "path", "") or "")
        if os.path.isdir(self.requests):   # left by a killed run of this log: not for this one
            shutil.rmtree(self.requests, ignore_errors=True)
        self.next_poll = 0.0
        self.left: list[int] = []   # ranks that left, in order
        self.admissions = None      # joins (admission.py; a live server's only)
        self.respawns = None        # replacements of lost workers (respawn.py; --respawn)

    @classmethod
    def of_server(cls, server, nodes: list) -> "Members":
        """The membership of `server`'s run (a :class:`~mpilb.server.loop.ParameterServer`)."""
        members = cls(server.log, server.clock, server.roster, nodes, server.stop,
                   hand_back=lambda w: server.liveness.hand_back(w),
                   send_leave=lambda w: server.outbox.reply(w, server.ring, Cmd.LEAVE),
                   log_row=lambda w: server.chores.log_worker_row(w, server.now()),
                   sole_copies=lambda rank: sole_copies(server.ledger, rank),
                   note_departure=lambda rank: server.chores.signals.note_departure(rank))
        members.admissions = Admissions(server, members)
        if server.cfg.faults.respawn:
            members.respawns = Respawns(server, members, server.hostnames)
        return members

    # ----------------------------------------------------------------- the log
    def note(self, rank: int, event: str, node: Optional[int] = None) -> None:
        """A `members/` row: `rank` joined, left, was lost or was replaced now (`node`: where
        the job does not know it, a joiner's; -1 unknown)."""
        if node is None:
            node = self.nodes[rank] if rank < len(self.nodes) else -1
        self.log.append("members", t=self.clock.now(), worker=rank, node=node, event=event)

    def lost(self, rank: int) -> None:
        """Worker `rank` was declared lost (liveness.py): its row, and (--respawn) its
        replacement at the next chores."""
        self.note(rank, "lost")
        if self.respawns is not None:
            self.respawns.lost(rank)

    # ----------------------------------------------------------------- requests
    def poll(self, mono: float) -> None:
        """Among the chores: the reports of workers that joined (each time), replacements
        of lost workers (--respawn, each time), the requests written by `mpilb leave` and
        `mpilb join` (twice a second; each time while a joiner offered a port has not
        connected yet: admission.py)."""
        if self.admissions is not None and self.admissions.joined:
            self.admissions.poll_reports()
            self.poll_joiners_rows_and_ends()
        if self.respawns is not None:
            self.respawns.poll()
        if mono < self.next_poll and not (self.admissions is not None and self.admissions.offers):
            return
        self.next_poll = mono + self.POLL_S
        if LEAVE_ASKED.is_set():   # on rank 0 itself: nothing to let go
            LEAVE_ASKED.clear()
            print("mpilb: SIGUSR2 reached rank 0 (the parameter server): only a worker can "
                  "leave (send it to that worker's process); ignored", file=sys.stderr, flush=True)
        try:
            names = os.listdir(self.requests)
        except OSError:
            return   # no request was ever made
        if self.admissions is not None:
            self.admissions.poll(self.requests, names)
        for name in sorted(names):
            if not name.startswith(LEAVE_PREFIX) or "." in name:
                continue
            path = os.path.join(self.requests, name)
            text = name[len(LEAVE_PREFIX):]
            answer = (self.request(int(text), "mpilb leave") if text.isdigit()
                      else f"refused: {name} names no rank")
            try:
                write_atomically(path + ANSWER_SUFFIX, answer + "\n")
                os.unlink(path)
            except OSError:
                pass

    def request(self, rank: int, how: str) -> str:
        """Worker `rank` is asked to leave (`how`: what asked). Returns the answer."""
        w = self.roster.peers.get(rank)
        if w is None:
            answer = f"refused: rank {rank} is not a worker of this run"
        elif w.left or w.leaving:
            answer = f"refused: rank {rank} has left the run already" if w.left else f"rank {rank} is leaving already"
        elif w.lost:
            answer = f"refused: rank {rank} was lost"
        elif not w.present or self.stop.reason:
            answer = f"refused: the run is stopping ({self.stop.reason or 'stopped'}): every worker ends with it"
        elif not [p for p in self.roster.present() if p is not w and not p.leaving]:
            answer = (f"refused: rank {rank} is the last worker, and the run cannot go on without one "
                      f"(to end the run, stop it: Ctrl-C or SIGTERM to mpiexec)")
        elif sole := self.sole_copies(rank):
            answer = (f"refused: rank {rank} holds the only copy left of shard(s) "
                      f"{', '.join(map(str, sole))} (--store local; --replicas 2 or more keeps "
                      f"other copies): the run cannot go on without it")
        else:
            w.leaving = True
            answer = f"rank {rank} leaves after its current step"
            if w.idle:   # no push to come: it goes now
                self.depart(w)
        print(f"mpilb: {how}: {answer}", file=sys.stderr, flush=True)
        return answer

    # ----------------------------------------------------------------- departures
    def depart(self, w) -> None:
        """Let `w` go now (its reply is due, or it is idle): LEAVE, its work to the others."""
        w.leave()
        w.awaiting = False
        w.last_seen = time.monotonic()
        self.send_leave(w)
        self.note_departure(w.rank)
        self.left.append(w.rank)
        self.log_row(w)
        self.note(w.rank, "leave")
        print(f"mpilb: rank {w.rank} left the run at {self.clock.now():.1f} s; its unstarted "
              f"work goes to the other workers", file=sys.stderr, flush=True)
        self.hand_back(w)
        if w.link is not None and w.link.comm is not None and self.admissions is not None:
            self.admissions.farewells.begin(w)   # a joiner: then both disconnect (farewell.py)

    def poll_joiners_rows_and_ends(self) -> None:
        """Among the chores, where workers joined: rows relayed to them (--store local,
        relay.py) and the connections of those let go (farewell.py)."""
        if self.admissions.relay is not None:
            self.admissions.relay.progress()
        if self.admissions.farewells.ends:
            self.admissions.farewells.poll()

    def close(self) -> None:
        """The run is over: requests not taken are answered, the directory goes."""
        if self.admissions is not None:
            self.admissions.turn_away(self.requests)
        try:
            names = os.listdir(self.requests)
        except OSError:
            return
        for name in names:
            if name.startswith((LEAVE_PREFIX, JOIN_PREFIX)) and "." not in name:
                path = os.path.join(self.requests, name)
                try:
                    write_atomically(path + ANSWER_SUFFIX, "refused: the run has ended\n")
                    os.unlink(path)
                except OSError:
                    pass
        # an answer still unread is left for its reader, who removes the directory
        if not [n for n in os.listdir(self.requests) if n.endswith(ANSWER_SUFFIX)]:
            shutil.rmtree(self.requests, ignore_errors=True)


def sole_copies(ledger, rank: int) -> list[int]:
    """Shards that only `rank` still holds (--store local; none where every rank reads all)."""
    holders, readers = ledger.holders, getattr(ledger, "readers", set())
    if holders is None or rank in readers:
        return []   # (a joiner's copies are no one else's source)
    # (a joiner reads its node's copies but sends none: ledger.readers, relay.py)
    return [s for s, ranks in sorted(holders.items())
            if rank in ranks and all(r == rank or r in ledger.gone or r in readers for r in ranks)]
