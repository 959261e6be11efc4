"""Preemption: a signal asks the run to stop; the ranks agree on one step, save it, exit 0.

``Preemption`` is the local half (signal handlers that set a flag); ``PreemptionStop`` is the
collective half the manager delegates ``watch_preemption`` and ``preempted`` to. Protocol:

1. ``Preemption.install`` (main thread) makes SIGTERM and SIGUSR1 (by default) only set a
   flag and remember which signal came and when. Nothing else runs inside the handler: no I/O,
   no collective, no lock. A second signal while the first is pending is taken as "now":
   the previous handler is restored and the signal delivered again (for SIGTERM, the process
   ends), so a loop that never calls ``preempted`` can still be stopped.
2. Every rank calls ``manager.preempted(step)`` after each training step. It all-reduces the
   flag (MAX) on dckpt's control group, so the ranks agree on the same step even when only
   one of them received the signal (SLURM signals one task, a scheduler may signal one pod).
3. Once they agree, every rank waits for the save in flight, saves ``step`` synchronously
   (unless that step is already saved), bounded by the deadline counted from the agreement,
   and ``preempted`` returns True; the script closes the manager and exits 0. A final save that
   fails or misses the deadline raises ``SaveError``, so the job exits non-zero and the last
   committed checkpoint is what the next start resumes from.

The handlers are restored by ``uninstall`` (the manager's ``close`` calls it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from .collective.comm import Comm
from .errors import CheckpointError, SaveError
from .save.handle import SaveHandle, SaveResult
from .save.saver import Saver

__all__ = ["Preemption", "PreemptionStop"]

log = logging.getLogger("dckpt")

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preemption:
    """The local half: signal handlers that set a flag. See the module docstring."""

    def __init__(self, signals: Sequence[str] = DEFAULT_SIGNALS, deadline_s: float = 120.0):
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.signals = tuple(signals)
        for name in self.signals:
            if not isinstance(getattr(signal, name, None), signal.Signals):
                raise ValueError(f"{name!r} is not a signal name (e.g. 'SIGTERM', 'SIGUSR1')")
        self.deadline_s = deadline_s
        self.received: str | None = None
        self.received_at: float | None = None
        self._flag = False  # a plain attribute: an Event's lock could deadlock a re-entry
        self._previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None]
        self._previous = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install preemption handlers from the main thread")
        for name in self.signals:
            sig = signal.Signals[name]
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only change on the main thread; they only set a flag anyway
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if not self._flag:
            self.received = signal.Signals(signum).name
            self.received_at = time.time()
            self._flag = True
            return
        # A second signal: the first was not acted on (or not fast enough). Stop waiting.
        sig = signal.Signals(signum)
        previous = self._previous.pop(sig, None)
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    @property
    def requested(self) -> bool:
        """Whether this rank received a preemption signal."""
        return self._flag


class PreemptionStop:
    """The collective half: agree on a step, save it once, within the deadline."""

    def __init__(self, ctl: Comm, saver: Saver) -> None:
        self._ctl = ctl
        self._saver = saver
        self.rank = ctl.rank
        self._preemption: Preemption | None = None

    def watch(self, signals: Sequence[str], deadline_s: float) -> Preemption:
        """Install the handlers (main thread only), replacing earlier ones."""
        if self._preemption is not None:
            self._preemption.uninstall()
        self._preemption = Preemption(signals, deadline_s)
        self._preemption.install()
        return self._preemption

    def uninstall(self) -> None:
        if self._preemption is not None:
            self._preemption.uninstall()

    def preempted(self, step: int, save: Callable[[int], SaveHandle]) -> bool:
        """Steps 2-3 of the protocol: True once any rank received a signal, after ``step``
        was saved with ``save`` (the manager's, so the final save is an ordinary one)."""
        watch = self._preemption
        if watch is None:
            return False
        if not self._ctl.any(watch.requested):
            return False
        t0 = time.perf_counter()
        who = self._ctl.all_gather(watch.received)
        senders = ", ".join(f"{name} on rank {r}" for r, name in enumerate(who) if name)
        result = self._final_save(step, t0 + watch.deadline_s, save)
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

    def _final_save(
        self, step: int, deadline: float, save: Callable[[int], SaveHandle]
    ) -> SaveResult | None:
        ticket = self._saver.current
        in_flight = SaveHandle(ticket) if ticket is not None else None
        if in_flight is not None and in_flight.step == step:
            return self._within(in_flight, deadline)
        if in_flight is not None:  # an older save: let it finish first, it may be the fallback
            try:
                self._within(in_flight, deadline)
            except SaveError as exc:
                if not in_flight.done():  # still writing at the deadline: no room for ours
                    raise
                log.error("dckpt: the save in flight failed during preemption: %s", exc)
            self._saver.clear_failed()
        if self._saver.last_committed_step == step:
            return None
        if deadline - time.perf_counter() <= 0:
            raise SaveError(f"no time left before the preemption deadline to save step {step}")
        handle = save(step)
        if handle.skipped:  # the step just resumed from, nothing trained since: committed
            return None
        return self._within(handle, deadline)

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
