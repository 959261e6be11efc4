"""The background writer: runs one save at a time on a worker thread and latches its error.

Why a thread and not a process: staging copies into buffers owned by the training process, and
the write path (file I/O, xxh3/sha256 hashing, tensor serialisation) runs in C and releases the
GIL, so a thread writes at disk speed without pickling the state across a process boundary or
holding it twice in shared memory. docs/ARCHITECTURE.md has the measurement.

Invariants:
- at most one save in flight: ``submit`` refuses while the previous job runs (the manager waits
  or skips first, and says which);
- a job's exception is kept and raised, once, by the next ``raise_if_failed`` (the manager calls
  it at the next ``save()``, ``wait()`` or ``close()``); it is never lost and never raised twice;
- the thread is started and joined by the manager's public methods, never by a finalizer; it is
  not a daemon, so an interpreter that exits after ``save()`` still finishes the write;
- a watchdog (a timer per job) declares a job stuck once it outlives its deadline: it latches a
  ``SaveError`` that says where the job was, so the next ``save()`` raises at once instead of
  waiting on a write that may never return. A stuck thread cannot be stopped from Python; the
  manager refuses further saves and asks for a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, SaveError

__all__ = ["BackgroundWriter", "SaveHandle", "SaveResult"]

log = logging.getLogger("dckpt")


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


class SaveHandle:
    """One save: its progress (staged, done) and, once done, its result or error."""

    def __init__(self, step: int, started: float) -> None:
        self.step = step
        self.started = started
        self.staged = threading.Event()
        self.stall_s = 0.0
        self.skipped = False
        self.cancelled = False
        self.past_commit = False
        """Set once the commit is decided: the tidying up after it is not watched."""
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def add_stall(self, seconds: float) -> None:
        self.stall_s += seconds

    def wait_staged(self, timeout: float) -> float:
        """Block until this save's copy of the state is taken; returns the seconds waited."""
        if self.staged.is_set():
            return 0.0
        t0 = time.perf_counter()
        if not self.staged.wait(timeout):
            self.cancelled = True  # the copy must never be taken after training moved on
            raise SaveError(
                f"staging of step {self.step} did not finish within {timeout:.0f} s: the "
                "background save is blocked, most likely waiting for another rank. The save is "
                "cancelled and will not commit; the job's process group is probably unusable: "
                "restart the job (it resumes from the last committed checkpoint)."
            )
        waited = time.perf_counter() - t0
        self.add_stall(waited)
        return waited

    def result(self, timeout: float | None = None) -> SaveResult:
        """The committed save; raises its error if it failed, or SaveError on timeout."""
        if not self._done.wait(timeout):
            raise SaveError(f"save of step {self.step} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise CheckpointError(f"save of step {self.step} was skipped")
        return self._result

    def _finish(self, result: SaveResult | None, error: BaseException | None) -> None:
        if self._done.is_set():  # the watchdog finished it first: that is what was reported
            return
        self._result, self._error = result, error
        self.staged.set()
        self._done.set()


class BackgroundWriter:
    """Runs save jobs one at a time on a worker thread; see the module docstring."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._current: SaveHandle | None = None
        self._failed: BaseException | None = None
        self._lock = threading.Lock()
        self.stuck: SaveHandle | None = None
        """The save the watchdog gave up on; its thread may still be blocked."""

    @property
    def current(self) -> SaveHandle | None:
        """The save in flight, if any."""
        handle = self._current
        return handle if handle is not None and not handle.done() else None

    def submit(
        self,
        handle: SaveHandle,
        job: Callable[[SaveHandle], SaveResult],
        *,
        deadline_s: float | None = None,
        describe_stuck: Callable[[], str] = lambda: "",
    ) -> None:
        """Run ``job`` on a new thread; after ``deadline_s`` the watchdog declares it stuck
        and latches an error naming ``describe_stuck()`` (which ranks are behind, and where)."""
        if self.current is not None:
            raise CheckpointError("a save is already in flight; wait for it first")

        def run() -> None:
            try:
                result = job(handle)
            except BaseException as exc:
                with self._lock:
                    if self.stuck is not handle:  # the watchdog already reported this save
                        self._failed = exc
                handle._finish(None, exc)
            else:
                handle._finish(result, None)
            finally:
                if watchdog is not None:
                    watchdog.cancel()

        def fire() -> None:
            if handle.done() or handle.past_commit:
                return
            where = describe_stuck()
            error = SaveError(
                f"the save of step {handle.step} is stuck: not committed after {deadline_s:.0f} "
                f"s (save_timeout_s){f'; {where}' if where else ''}. Storage may be hung or a "
                "rank may have died. Nothing of it is committed; restart the job, it resumes "
                "from the last committed checkpoint."
            )
            with self._lock:
                self.stuck = handle
                self._failed = error
            handle.cancelled = True  # rank 0 checks it right before the commit rename
            handle._finish(None, error)  # whoever waits on this save learns it now
            log.error("dckpt: %s", error)

        watchdog: threading.Timer | None = None
        if deadline_s is not None:
            watchdog = threading.Timer(deadline_s, fire)
            watchdog.daemon = True  # only ever reports; must not keep the process alive
            watchdog.name = f"dckpt-watchdog-{handle.step}"
        self._current = handle
        self._thread = threading.Thread(target=run, name=f"dckpt-save-{handle.step}")
        self._thread.start()
        if watchdog is not None:
            watchdog.start()

    def join(self, timeout: float) -> None:
        """Wait for the save in flight to end (committed or failed)."""
        thread = self._thread
        if thread is None:
            return
        deadline = time.monotonic() + timeout
        while thread.is_alive() and self.stuck is None and time.monotonic() < deadline:
            thread.join(min(0.5, max(deadline - time.monotonic(), 0.0)))
        if self.stuck is not None and thread.is_alive():
            return  # the watchdog gave up on it and latched its error: raise_if_failed tells
        if thread.is_alive():
            step = self._current.step if self._current else "?"
            raise SaveError(
                f"the save of step {step} did not finish within {timeout:.0f} s; it is stuck "
                "(storage hung, or a rank stopped answering). Nothing of it is committed."
            )
        self._thread = None

    def clear_failed(self) -> None:
        """Forget the latched error (it was delivered another way)."""
        with self._lock:
            self._failed = None

    def raise_if_failed(self) -> None:
        """Raise the latched error of an earlier save, once."""
        with self._lock:
            failed, self._failed = self._failed, None
        if failed is not None:
            raise failed
