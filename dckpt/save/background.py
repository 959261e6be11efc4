"""The save thread: runs one save at a time beside training and latches its error.

Why a thread and not a process: staging copies into buffers owned by the training process, and
the write path (file I/O, xxh3/sha256 hashing, tensor serialisation) runs in C and releases the
GIL, so a thread writes at disk speed without pickling the state across a process boundary or
holding it twice in shared memory. docs/ARCHITECTURE.md has the measurement.

Invariants:
- at most one save in flight: ``start`` refuses while the previous one runs (the manager waits
  or skips first, and says which);
- a save's exception is kept and raised, once, by the next ``raise_if_failed`` (the manager
  calls it at the next ``save()``, ``wait()`` or ``close()``); never lost, never raised twice;
- the thread is started and joined by the manager's public methods, never by a finalizer; it is
  not a daemon, so an interpreter that exits after ``save()`` still finishes the write;
- a watchdog (a timer per save) gives up on a save that outlives its deadline and is not yet
  decided: the save is cancelled with a ``SaveError`` that says where it was, and the thread is
  ``stuck``, so the next ``save()`` raises at once instead of waiting on a write that may never
  return. A stuck thread cannot be stopped from Python; the manager refuses further saves and
  asks for a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import CheckpointError, SaveError
from .handle import SaveResult, SaveTicket

__all__ = ["SaveThread"]

log = logging.getLogger("dckpt")


class SaveThread:
    """Runs saves one at a time on a worker thread; see the module docstring."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._current: SaveTicket | None = None
        self._failed: BaseException | None = None
        self._lock = threading.Lock()
        self.stuck: SaveTicket | None = None
        """The save the watchdog gave up on; this thread may still be blocked in it."""

    @property
    def current(self) -> SaveTicket | None:
        """The save in flight on this rank, if any."""
        ticket = self._current
        return ticket if ticket is not None and not ticket.done() else None

    @property
    def latest(self) -> SaveTicket | None:
        """The newest save started, done or not: the same save on every rank (saves are
        collective), where ``current`` is this rank's view of whether it is still running."""
        return self._current

    def start(
        self,
        ticket: SaveTicket,
        run: Callable[[], SaveResult],
        *,
        deadline_s: float | None = None,
        where: Callable[[], str] = lambda: "",
        soft: bool = False,
    ) -> None:
        """Run ``run`` for ``ticket`` on a new thread; after ``deadline_s`` the watchdog cancels
        it with an error that names ``where()`` (which ranks are behind, and where). With
        ``soft`` (a memory save), a SaveError every rank agreed on fails only its handle: it
        was logged, and the next ``save()`` goes on (a lost group still stops them)."""
        if self.current is not None:
            raise CheckpointError("a save is already in flight; wait for it first")

        def body() -> None:
            try:
                result = run()
            except BaseException as exc:
                with self._lock:
                    agreed = soft and isinstance(exc, SaveError)
                    if self.stuck is not ticket and not agreed:  # the watchdog reported it
                        self._failed = exc
                ticket.finish(None, exc)
            else:
                ticket.finish(result, None)
            finally:
                if watchdog is not None:
                    watchdog.cancel()

        def give_up() -> None:
            if ticket.done() or ticket.decided:
                return
            seen = where()
            error = SaveError(
                f"the save of step {ticket.step} is stuck: not committed after {deadline_s:.0f} "
                f"s (save_timeout_s){f'; {seen}' if seen else ''}. Storage may be hung or a "
                "rank may have died. Nothing of it is committed; restart the job, it resumes "
                "from the last committed checkpoint."
            )
            with self._lock:
                self.stuck = ticket
                self._failed = error
            ticket.cancel(error)  # whoever waits learns it now; rank 0 never commits it
            log.error("dckpt: %s", error)

        watchdog: threading.Timer | None = None
        if deadline_s is not None:
            watchdog = threading.Timer(deadline_s, give_up)
            watchdog.daemon = True  # only ever reports; must not keep the process alive
            watchdog.name = f"dckpt-watchdog-{ticket.step}"
        self._current = ticket
        self._thread = threading.Thread(target=body, name=f"dckpt-save-{ticket.step}")
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
