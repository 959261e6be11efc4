"""One save as its caller sees it (``SaveHandle``, ``SaveResult``) and as dckpt tracks it
(``SaveTicket``).

The ticket is the only mutable record of a save in flight. ``staged`` is set by the staging
planner (or, on failure, by the pipeline and ``finish``); ``decided`` by the pipeline once every
rank learned the commit; ``stall_s`` by ``save()`` (when it returns) and ``wait_staged`` (which
adds); the outcome by the save thread, or first by the watchdog, which cancels it. ``fate``
changes under a lock, so a save that committed never reads as cancelled. The handle reads.

A save's fate is one of ``Fate``: pending until it ends, then committed, failed, skipped (it never
started: ``if_busy="skip"``, rank 0's ``when`` said no, or it would only have written the step
just resumed from again) or cancelled (called off: the watchdog gave up on it, or
``wait_staged`` gave up waiting for its copy; a cancelled save never takes a copy nor commits).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ..errors import CheckpointError, SaveError

__all__ = ["Fate", "SaveHandle", "SaveResult", "SaveTicket"]


class Fate(str, Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """A committed save, as seen from one rank."""

    step: int
    path: Path
    bytes: int
    files: int
    stall_s: float
    """How long the training loop was held: inside save() plus the wait before the next step."""
    commit_s: float
    """From save() being called to the checkpoint being durable and visible."""
    replicas_s: float | None = None
    """A memory save with a partner node: this rank's seconds sending its file to the partner
    and receiving the ones it keeps, each hashed as it arrived (after the commit)."""


class SaveTicket:
    """dckpt's record of one save in flight; see the module docstring."""

    def __init__(self, step: int, started: float) -> None:
        self.step = step
        self.started = started
        self.staged = threading.Event()
        """Set once this rank's copy of the state is taken (also when the save failed)."""
        self.cancelled = threading.Event()
        """Set when the save is called off; rank 0 reads it right before the commit point."""
        self.decided = False
        """Set once every rank learned that rank 0 committed the save: what follows only tidies
        up, and the watchdog no longer watches it."""
        self.failing = False
        """Set once the save failed and its thread is wording the error (naming who was
        late, within its own deadlines): not stuck, so the watchdog leaves it to finish."""
        self.stall_s = 0.0
        self.fate = Fate.PENDING
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._why = ""
        self.save_id = ""
        """The save's id (its manifest's ``save_id``), once the save is prepared."""

    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, result: SaveResult | None, error: BaseException | None) -> bool:
        """Record the outcome once; False if it was already recorded (the watchdog first)."""
        with self._lock:
            if self._done.is_set():
                return False
            self._result, self._error = result, error
            if result is not None:
                self.fate = Fate.COMMITTED
            elif self.fate is Fate.PENDING:
                self.fate = Fate.FAILED
            self.staged.set()
            self._done.set()
            return True

    def cancel(self, error: BaseException | None = None) -> None:
        """Call the save off: it never takes a copy nor commits. With ``error``, it ends now
        and whoever waits on it gets that error; without, it fails at its next check."""
        self.cancelled.set()
        with self._lock:
            if not self._done.is_set():
                self.fate = Fate.CANCELLED
        if error is not None:
            self.finish(None, error)

    def skip(self, why: str = "") -> None:
        with self._lock:
            self.fate = Fate.SKIPPED
            self._why = why
        self.finish(None, None)

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)

    def outcome(self) -> SaveResult:
        if self._error is not None:
            raise self._error
        if self._result is None:
            why = f": {self._why}" if self._why else ""
            raise CheckpointError(f"save of step {self.step} was skipped{why}")
        return self._result


class SaveHandle:
    """What ``save()`` returns: wait for the staging or the commit, and read the outcome."""

    def __init__(self, ticket: SaveTicket) -> None:
        self._ticket = ticket

    @property
    def step(self) -> int:
        return self._ticket.step

    @property
    def save_id(self) -> str:
        """The id its manifest will record ("" for a save that never started)."""
        return self._ticket.save_id

    @property
    def started(self) -> float:
        """``time.perf_counter()`` when ``save()`` was called."""
        return self._ticket.started

    @property
    def stall_s(self) -> float:
        """How long this save held the caller so far (in ``save()`` and in ``wait_staged``)."""
        return self._ticket.stall_s

    @property
    def fate(self) -> Fate:
        return self._ticket.fate

    @property
    def skipped(self) -> bool:
        return self._ticket.fate is Fate.SKIPPED

    @property
    def staged(self) -> threading.Event:
        """Set once this save's copy of the state is taken (also when the save failed).
        Waiting on it neither counts as a stall nor cancels the save (``wait_staged`` does)."""
        return self._ticket.staged

    def done(self) -> bool:
        return self._ticket.done()

    def wait_staged(self, timeout: float) -> float:
        """Block until this save's copy of the state is taken; returns the seconds waited.

        After ``timeout`` seconds the save is cancelled (its copy must never be taken after
        training moved on) and ``SaveError`` is raised."""
        ticket = self._ticket
        if ticket.staged.is_set():
            return 0.0
        t0 = time.perf_counter()
        if not ticket.staged.wait(timeout):
            ticket.cancel()
            raise SaveError(
                f"staging of step {ticket.step} did not finish within {timeout:.0f} s: the "
                "background save is blocked, most likely waiting for another rank. The save is "
                "cancelled and will not commit; the job's process group is probably unusable: "
                "restart the job (it resumes from the last committed checkpoint)."
            )
        waited = time.perf_counter() - t0
        ticket.stall_s += waited
        return waited

    def result(self, timeout: float | None = None) -> SaveResult:
        """The committed save; raises its error if it failed, or SaveError on timeout."""
        if not self._ticket.wait(timeout):
            raise SaveError(f"save of step {self.step} still running after {timeout} s")
        return self._ticket.outcome()
