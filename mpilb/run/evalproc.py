"""Evaluation in a process of its own, so that it never holds up rank 0's pushes.

At an epoch's end rank 0 hands out the next epoch and evaluates the parameters meanwhile.
On a thread (as it first did) the evaluation and the push handling share one interpreter
lock: each NumPy call of an optimizer step gives the lock up and waits to get it back, up
to Python's switch interval (5 ms) while the evaluation's Python holds it. Measured on a
16-core node (rank 0 on a core of its own, three workers on its GPU, `mlp 256,256`, batch
512): a push that arrived during an evaluation took 5-20 ms instead of 0.3 ms to be
applied, and the fast workers' mean round trip was 3.3 ms where its median was 1.0 ms. A
process has its own interpreter, and on a node with a core to spare, its own core.

The child (``python -m mpilb.run.evalproc``, started once per run with the MPI launcher's
variables removed, so that nothing in it joins the job) builds the run's model and test set
itself and then answers one request at a time: parameters in, an
:class:`~mpilb.run.evaluation.Evaluation` and its seconds out (a pickle: once per epoch, off the
hot path). On Linux the parameters travel through an anonymous shared mapping (a memfd
the child inherits, gone when both have closed it, whatever way they end): rank 0 copies
them there and writes an empty request, so a large model costs rank 0 one memcpy, not a
pipe transfer paced by the child's reads. Elsewhere they go through the pipe. Its errors
come back as messages and are raised by :meth:`EvalProcess.result`. It ignores the signals
a launcher or a batch system sends the job (Ctrl-C, preemption notices: rank 0 handles
those) and ends when rank 0 closes its pipe or exits.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import traceback
from typing import Optional

import numpy as np

from mpilb.errors import MpilbError

LENGTH = struct.Struct("<Q")
# variables by which MPI libraries and launchers find their job: a child that saw them and
# imported MPI would try to join it
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "HYDRA_", "OMPI_",
                     "I_MPI_", "MPICH_", "SLURM_PROCID", "SLURM_STEP")


def child_env(environ) -> dict:
    """The environment without the launcher's variables."""
    return {k: v for k, v in environ.items() if not k.startswith(LAUNCHER_PREFIXES)}


def _write(stream, payload: bytes) -> None:
    stream.write(LENGTH.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def _read(stream) -> Optional[bytes]:
    head = stream.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None   # the other side has gone
    (n,) = LENGTH.unpack(head)
    data = stream.read(n)
    return data if len(data) == n else None


class EvalProcessGone(MpilbError):
    """The evaluation process ended (killed, out of memory): evaluate in rank 0 instead."""


class EvalProcess:
    """A child process that evaluates parameters of the run described by ``cfg`` and
    ``dataset``: :meth:`submit` one vector, then :meth:`done` / :meth:`result`."""

    def __init__(self, cfg, dataset, num_params: int):
        self.shared: Optional[np.ndarray] = None   # the parameters' shared mapping (Linux)
        self._last: Optional[bytes] = None         # else the bytes last sent
        fd = -1
        if hasattr(os, "memfd_create") and num_params > 0:
            fd = os.memfd_create("mpilb-eval-params")
            os.ftruncate(fd, 4 * num_params)
            self._map = mmap.mmap(fd, 4 * num_params)
            self.shared = np.frombuffer(self._map, dtype=np.float32)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "mpilb.run.evalproc"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         env=child_env(os.environ),
                                         pass_fds=(fd,) if fd >= 0 else ())
        finally:
            if fd >= 0:
                os.close(fd)   # (the mapping and the child's copy keep it)
        # with rank 0's import path: a user's model may come from a directory it added
        _write(self.proc.stdin, pickle.dumps((dict(cfg.values), dataset, fd, num_params,
                                              list(sys.path))))
        self.busy = False

    def submit(self, params: np.ndarray) -> None:
        assert not self.busy, "one evaluation at a time"
        if self.shared is not None and params.size == self.shared.size:
            np.copyto(self.shared, params, casting="same_kind")
            self._last = None
            _write(self.proc.stdin, b"")
        else:
            self._last = np.ascontiguousarray(params, dtype=np.float32).tobytes()
            _write(self.proc.stdin, self._last)
        self.busy = True

    def submitted(self) -> np.ndarray:
        """A copy of the parameters last submitted (to evaluate them elsewhere)."""
        if self._last is None:
            return self.shared.copy()
        return np.frombuffer(self._last, dtype=np.float32).copy()

    def done(self) -> bool:
        """The result can be read without waiting."""
        ready, _, _ = select.select((self.proc.stdout,), (), (), 0)
        return bool(ready)

    def result(self):
        """(Evaluation, seconds) of the last :meth:`submit`, waiting for it if need be."""
        data = _read(self.proc.stdout)
        self.busy = False
        if data is None:
            code = self.proc.wait()
            raise EvalProcessGone(f"the evaluation process ended (exit {code})")
        kind, value = pickle.loads(data)
        if kind == "error":
            raise MpilbError(f"evaluation failed in its process:\n{value}")
        return value

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


NICE = 10
"""The evaluations' niceness increment (MPILB_EVAL_NICE), in their process or on rank 0's
thread: where the job's ranks need the node's cores after all (the cluster in a box shares
the machine's; 2 cores for 5 ranks), training comes first."""


def lower_priority(increment: str, thread: bool = False) -> None:
    """Lower this process's priority by `increment` (MPILB_EVAL_NICE's text; NICE where it
    is not an integer, with a warning), or with `thread` the calling thread's alone: Linux
    keeps a nice value per thread; elsewhere a thread's is left as it is, since it would
    be the whole process's, rank 0's serving included."""
    try:
        n = int(increment)
    except ValueError:
        print(f"mpilb: warning: MPILB_EVAL_NICE={increment!r} is not an integer; the "
              f"evaluations run at nice {NICE}", file=sys.stderr, flush=True)
        n = NICE
    if not n:
        return
    try:
        if not thread:
            os.nice(n)
        elif sys.platform.startswith("linux"):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + n)
    except OSError:   # a negative increment without the privilege: as it is
        pass


def main() -> int:
    """The child: build the evaluator, then answer requests until stdin closes."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)   # the job's signals are rank 0's to act on
    lower_priority(os.environ.get("MPILB_EVAL_NICE", str(NICE)))
    src, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr   # anything a user's module prints must not corrupt the replies
    data = _read(src)
    if data is None:
        return 0
    try:
        from mpilb.config.sections import Config
        from mpilb.run.evaluation import build_evaluator
        from mpilb.run.components import config_model

        values, dataset, fd, num_params, path = pickle.loads(data)
        sys.path[:] = path + [p for p in sys.path if p not in path]
        shared = None
        if fd >= 0:
            shared = np.frombuffer(mmap.mmap(fd, 4 * num_params), dtype=np.float32)
        evaluator = build_evaluator(config_model(Config.from_values(values), dataset), dataset)
    except Exception:
        evaluator, setup_error = None, traceback.format_exc()
    while (data := _read(src)) is not None:
        if evaluator is None:
            _write(out, pickle.dumps(("error", setup_error)))
            continue
        try:
            before = evaluator.seconds
            params = shared.copy() if data == b"" else np.frombuffer(data, dtype=np.float32).copy()
            ev = evaluator.evaluate(params)
            _write(out, pickle.dumps(("ok", (ev, evaluator.seconds - before))))
        except Exception:
            _write(out, pickle.dumps(("error", traceback.format_exc())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
