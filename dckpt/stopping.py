"""The preemption half of CheckpointManager: agree on a step, save it once, stop.

See dckpt.preemption for the protocol. ``preempted`` is a collective on dckpt's control group:
call it on every rank after every step (it costs one all-reduce of one integer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from .dist.comm import Comm
from .errors import CheckpointError, SaveError
from .preemption import DEFAULT_SIGNALS, Preemption
from .save.background import BackgroundWriter, SaveHandle, SaveResult

__all__ = ["StoppingMixin"]

log = logging.getLogger("dckpt")


class StoppingMixin:
    """Mixed into CheckpointManager (see its attributes)."""

    rank: int
    _ctl: Comm
    _writer: BackgroundWriter
    _preemption: Preemption | None
    _last_committed_step: int | None

    def save(self, step: int) -> SaveHandle:  # provided by CheckpointManager
        raise NotImplementedError

    def _check_open(self) -> None:  # provided by CheckpointManager
        raise NotImplementedError

    def watch_preemption(
        self, signals: Sequence[str] = DEFAULT_SIGNALS, *, deadline_s: float = 120.0
    ) -> Preemption:
        """Make ``signals`` request a final save instead of killing the process; see
        ``preempted``. ``deadline_s``: the longest the final save may take (leave it below the
        scheduler's grace period, e.g. SLURM's ``--signal=USR1@120``). Main thread only."""
        self._check_open()
        if self._preemption is not None:
            self._preemption.uninstall()
        self._preemption = Preemption(signals, deadline_s)
        self._preemption.install()
        return self._preemption

    def preempted(self, step: int) -> bool:
        """True once any rank received a preemption signal, after ``step`` was saved.

        A collective: every rank calls it after every step. When it returns True the step is
        committed (SaveError otherwise) and the script should close the manager and exit 0.
        """
        self._check_open()  # after close() the collective would land on the training group
        watch = self._preemption
        if watch is None:
            return False
        if not self._ctl.any(watch.requested):
            return False
        t0 = time.perf_counter()
        who = self._ctl.all_gather(watch.received)
        senders = ", ".join(f"{name} on rank {r}" for r, name in enumerate(who) if name)
        result = self._final_save(step, t0 + watch.deadline_s)
        took = time.perf_counter() - t0
        if self.rank == 0:
            log.warning(
                "dckpt: preempted (%s): the ranks agreed on step %d; final checkpoint %s in "
                "%.2f s (deadline %.0f s); exit now, the next start resumes from it",
                senders,
                step,
                result.path if result is not None else "(already committed)",
                took,
                watch.deadline_s,
            )
        return True

    def _final_save(self, step: int, deadline: float) -> SaveResult | None:
        in_flight = self._writer.current
        if in_flight is not None and in_flight.step == step:
            return self._within(in_flight, deadline)
        if in_flight is not None:  # an older save: let it finish first, it may be the fallback
            try:
                self._within(in_flight, deadline)
            except SaveError as exc:
                if not in_flight.done():  # still writing at the deadline: no room for ours
                    raise
                log.error("dckpt: the save in flight failed during preemption: %s", exc)
            self._writer.clear_failed()
        if self._last_committed_step == step:
            return None
        if deadline - time.perf_counter() <= 0:
            raise SaveError(f"no time left before the preemption deadline to save step {step}")
        return self._within(self.save(step), deadline)

    @staticmethod
    def _within(handle: SaveHandle, deadline: float) -> SaveResult:
        """The handle's result, or SaveError once the deadline passes or the save fails."""
        remaining = deadline - time.perf_counter()
        if remaining <= 0 and not handle.done():
            raise SaveError(f"no time left before the preemption deadline for step {handle.step}")
        try:
            return handle.result(timeout=max(remaining, 0.0))
        except CheckpointError as exc:
            late = not handle.done()
            raise SaveError(
                f"the preemption save of step {handle.step} "
                + ("did not commit before the deadline" if late else "failed")
                + f": {exc}. The newest committed checkpoint is what the next start resumes from."
            ) from exc
