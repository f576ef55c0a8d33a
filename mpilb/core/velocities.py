"""One momentum vector per worker (the `dana` correction: corrections.PerWorkerMomentum), for
the momentum optimizer (optimizers.Momentum, which takes this mixin).

A key's velocity is a vector of its own; its blocks are views of it beside the optimizer's
shared scratch, so that :meth:`PerKeyVelocity.select` switches what a step reads and
writes by swapping one list, with no copy."""

from __future__ import annotations

import numpy as np


class PerKeyVelocity:
    """Keyed velocities for an optimizer with a ``velocity`` buffer walked through
    ``_spans`` (optimizers.Optimizer): ``(lo, hi, (velocity block, *scratch blocks))``."""

    def _own_init(self) -> None:
        self._shared = self._spans   # the blocks of the one velocity
        self._own: dict = {}         # key -> (its velocity, its blocks)

    def select(self, key) -> None:
        """Step with `key`'s own velocity from now on (None: the one velocity again). A
        key's starts as :attr:`velocity` is at its first step (zero in a fresh run; as
        checkpointed in a resumed one). Checkpoints and transfers between stores keep the
        mean of the keys' velocities (:meth:`state_slice`), so the momentum they carry in
        all is kept for as many workers."""
        if key is None:
            self._spans = self._shared
            return
        own = self._own.get(key)
        if own is None:
            v = self.velocity.copy()
            spans = [(lo, hi, (v[lo:hi],) + views[1:]) for lo, hi, views in self._shared]
            own = self._own[key] = (v, spans)
        self._spans = own[1]

    def forget(self, key) -> None:
        """Drop `key`'s own velocity (a worker that left the run)."""
        self._own.pop(key, None)
        self._spans = self._shared

    def _kept(self):
        """The velocity as checkpointed where keys have their own: their mean (else None)."""
        if not self._own:
            return None
        vs = [v for v, _ in self._own.values()]
        out = vs[0].copy()
        for v in vs[1:]:
            out += v
        out *= np.float32(1.0 / len(vs))
        return out.get() if hasattr(out, "get") else out

    def state_dict(self) -> dict:
        state = super().state_dict()
        kept = self._kept()
        if kept is not None:
            state["velocity"] = kept
        return state

    def state_slice(self, buf: str, lo: int, hi: int) -> np.ndarray:
        kept = self._kept() if buf == "velocity" else None
        return super().state_slice(buf, lo, hi) if kept is None else kept[lo:hi].copy()

    def load_state_slice(self, buf: str, lo: int, hi: int, values) -> None:
        self.select(None)   # a state loaded replaces the keys' own: each starts from it again
        self._own.clear()
        super().load_state_slice(buf, lo, hi, values)

    def load_state_dict(self, state: dict) -> None:
        self.select(None)
        self._own.clear()
        super().load_state_dict(state)
