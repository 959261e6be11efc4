"""The save thread: runs one save at a time beside training and latches its error.

Why a thread and not a process: staging copies into buffers owned by the training process, and
the write path (file I/O, xxh3/sha256 hashing, tensor serialisation) runs in C and releases the
GIL, so a thread writes at disk speed without pickling the state across a process boundary or
holding it twice in shared memory. docs/ARCHITECTURE.md has the measurement.

Invariants:
- at most one save in flight: ``start`` refuses while the previous one runs (the manager waits
  or skips first, and says which);
- a save's exception is kept and raised, once, by the next ``raise_if_failed`` (the manager
  calls it at the next ``save()``, ``wait()`` or ``close()``, and at the next ``observe()``
  when the save lost a rank: a wait of it on the others failed, so no later save can run and
  the training thread hears of it before a collective of its own stalls on the same rank);
  never lost, never raised twice. Its ticket ends only after it is kept, so waiting for the
  ticket is waiting for the verdict;
- the thread is started and joined by the manager's public methods, never by a finalizer. It
  is a daemon, so no save can keep a process alive: an interpreter that exits after
  ``save()`` still finishes the write, because an exit handler joins the save in flight, for
  at most its deadline (``deadline_s``, the watchdog's), then leaves it with one error line
  (a write blocked on a dead link or a hung file system must not hold the process forever);
- a save that fails in the background says so at once, on each rank that saw it fail (the
  training loop may be stuck in a collective of its own by the time it would call ``save()``
  again), and is raised again by the next ``save()``, ``wait()`` or ``close()``;
- a watchdog (a timer per save) gives up on a save that outlives its deadline and is not yet
  decided: the save is cancelled with a ``SaveError`` that says where it was, and the thread is
  ``stuck``, so the next ``save()`` raises at once instead of waiting on a write that may never
  return. A stuck thread cannot be stopped from Python; the manager refuses further saves and
  asks for a restart.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

from ..errors import CheckpointError, SaveError
from .handle import SaveResult, SaveTicket

__all__ = ["SaveThread"]

log = logging.getLogger("dckpt")


FAILING_GRACE_S = 20.0
"""How long a join waits past its deadline for a save that already failed and is wording its
error (a few bounded store calls: dckpt.collective.store)."""
_LIVE: weakref.WeakSet[SaveThread] = weakref.WeakSet()
"""Every SaveThread of this process, for the exit handler."""


@atexit.register
def _finish_at_exit() -> None:
    """At interpreter exit: let each save in flight finish, for at most its deadline, then
    leave it (its thread is a daemon) with one line saying so."""
    for saver in list(_LIVE):
        saver.join_at_exit()


class SaveThread:
    """Runs saves one at a time on a worker thread; see the module docstring."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        _LIVE.add(self)
        self._deadline_s: float | None = None
        self._started = 0.0
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
                    agreed = soft and isinstance(exc, SaveError) and exc.agreed
                    reported = self.stuck is ticket  # the watchdog said it already
                    if not reported and not agreed:
                        self._failed = exc
                if not reported and not agreed:
                    log.error(
                        "dckpt: rank %d: %s (raised again by the next save(), wait() or close())",
                        self.rank,
                        exc,
                    )
                ticket.finish(None, exc)
            else:
                ticket.finish(result, None)
            finally:
                if watchdog is not None:
                    watchdog.cancel()

        def give_up() -> None:
            if ticket.done() or ticket.decided or ticket.failing:
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
        self._deadline_s, self._started = deadline_s, time.monotonic()
        self._thread = threading.Thread(target=body, name=f"dckpt-save-{ticket.step}", daemon=True)
        self._thread.start()
        if watchdog is not None:
            watchdog.start()

    def join(self, timeout: float) -> None:
        """Wait for the save in flight to end (committed or failed)."""
        thread = self._thread
        if thread is None:
            return
        deadline = time.monotonic() + timeout
        while thread.is_alive() and self.stuck is None:
            now = time.monotonic()
            failing = self._current is not None and self._current.failing
            # a save that failed is naming who was late, within its own deadlines (store
            # calls of HINT_S each): it gets that long past the join's deadline to finish
            if now >= deadline + (FAILING_GRACE_S if failing else 0.0):
                break
            thread.join(0.5)
        if self.stuck is not None and thread.is_alive():
            return  # the watchdog gave up on it and latched its error: raise_if_failed tells
        if thread.is_alive():
            step = self._current.step if self._current else "?"
            raise SaveError(
                f"the save of step {step} did not finish within {timeout:.0f} s; it is stuck "
                "(storage hung, or a rank stopped answering). Nothing of it is committed."
            )
        self._thread = None

    def join_at_exit(self) -> None:
        """The interpreter is exiting: wait for the save in flight until its deadline (from
        its start), then leave it, saying so once."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        limit = self._deadline_s if self._deadline_s is not None else 60.0
        left = max(limit - (time.monotonic() - self._started), 1.0)
        if self.stuck is None:
            thread.join(left)
        if thread.is_alive():
            step = self._current.step if self._current is not None else "?"
            log.error(
                "dckpt: rank %d: the process exits with the save of step %s still blocked "
                "(storage hung, or a peer unreachable): it is left unfinished and nothing of "
                "it is committed; the next start resumes from the newest committed checkpoint",
                self.rank,
                step,
            )

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
