"""Preemption: a signal asks the run to stop; the ranks agree on one step, save it, exit 0.

Protocol (``CheckpointManager.watch_preemption`` and ``CheckpointManager.preempted``):

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

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

__all__ = ["Preemption"]

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
