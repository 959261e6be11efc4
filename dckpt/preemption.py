"""Preemption: a signal asks the run to stop; the ranks agree on one step, save it, exit 0.

``Preemption`` is the local half (signal handlers that set a flag); ``PreemptionStop`` is the
collective half the manager delegates ``watch_preemption`` and ``preempted`` to. Protocol:

1. ``Preemption.install`` (main thread) makes SIGTERM and SIGUSR1 (by default) only set a
   flag and remember which signal came and when. Nothing else runs inside the handler: no I/O,
   no collective, no lock. A second signal while the first is pending is taken as "now":
   the previous handler is restored and the signal delivered again (for SIGTERM, the process
   ends), so a loop that never calls ``preempted`` can still be stopped.
2. Every rank calls ``manager.preempted(step)`` after each training step. Most calls make no
   collective at all. Every K-th call is a *check*: it reads the agreement issued at the
   previous check (an all-reduce, MAX, of every rank's flag on dckpt's control group, issued
   without waiting) and issues the next one. The ranks read the same agreement at the same
   call, so they agree on the same step even when only one of them received the signal
   (SLURM signals one task, a scheduler may signal one pod); the training steps between two
   checks hide the all-reduce's latency, which grows with the world (a ring of 2(N-1) hops).
   The very first call is a blocking check (a signal that came before the first step is
   acted on at once) of two agreements: the first lines the ranks up, and rank 0 times the
   second: the agreement's latency. K is rank 0's proposal,
   carried in the same all-reduce (every rank reads the same K): about ``check_every_s`` of
   training between checks, or twice that latency if longer (a ring all-reduce at 16k ranks
   takes over a second), doubled when an agreement was still in flight at its read anyway,
   never so many that two intervals exceed a quarter of the final save's deadline. A signal
   is acted on at most two intervals after it came.
3. Once they agree, every rank waits for the save in flight, saves ``step`` synchronously
   (unless that step is already saved), bounded by the deadline counted from the first
   signal any rank received (its wall time rides the agreement, reduced to the earliest), and
   ``preempted`` returns True; what a rank's own view decides on the way (whether a save
   is still running: one rank's may have ended while another's runs; the save in flight
   still writing at the deadline; no time left) is agreed before anything depends on it. The
   script closes the manager and exits 0. A final save that fails or misses the deadline
   raises ``SaveError``, so the job exits non-zero and the last committed checkpoint is what
   the next start resumes from.

Invariants: every rank issues the same agreements at the same calls (the schedule depends
only on what the agreements carried), so none is left unmatched; ``uninstall`` (the manager's
``close``) waits for the one still in flight, which every rank issued too.
The handlers are restored by ``uninstall`` (the manager's ``close`` calls it).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from .collective.comm import Comm
from .errors import CheckpointError, SaveError
from .save.handle import SaveHandle, SaveResult
from .save.saver import Saver

__all__ = ["Preemption", "PreemptionStop"]

log = logging.getLogger("dckpt")

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
CHECK_EVERY_S = 1.0
"""Seconds of training between two agreements, by default (``watch_preemption``)."""
_NO_SIGNAL_MS = 1 << 62  # what a rank with no signal sends as its signal's time (never the min)


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


class _Schedule:
    """When the next check comes, and what rank 0 proposes for the interval after it.

    Only rank 0's proposal counts (the others send 0 into the MAX); rank 0 measures the time
    between calls. The interval starts at 1 call: the first checks come one step apart, the
    following ones about ``every_s`` apart."""

    def __init__(self, every_s: float, deadline_s: float) -> None:
        self.every_s = every_s
        self.longest_s = deadline_s / 8  # two intervals stay within a quarter of the deadline
        self.calls = 0
        self.next_check = 1
        self._last: float | None = None
        self._step_s: float | None = None
        self.latency_s = 0.0
        """How long the first check (the one that waits) took on this rank: the agreement's
        latency, which the interval must cover so a read never waits."""

    def tick(self) -> bool:
        """Count this call; whether it is a check."""
        self.calls += 1
        now = time.perf_counter()
        if self._last is not None:
            took = now - self._last
            # a smoothed step time: one slow step (a save, an evaluation) moves it a little
            self._step_s = took if self._step_s is None else 0.8 * self._step_s + 0.2 * took
        self._last = now
        return self.calls >= self.next_check

    def propose(self, interval: int, late: bool) -> int:
        """Rank 0: the calls between the next two checks. ``late``: the agreement just read
        had not completed by its read (the interval did not hide its latency)."""
        if self._step_s is None or self._step_s <= 0 or self.every_s <= 0:
            return 1
        k = max(1, math.ceil(max(self.every_s, 2 * self.latency_s) / self._step_s))
        if late:
            k = max(k, 2 * interval)
        return max(1, min(k, math.floor(self.longest_s / self._step_s)))


class PreemptionStop:
    """The collective half: agree on a step, save it once, within the deadline."""

    def __init__(self, ctl: Comm, saver: Saver) -> None:
        self._ctl = ctl
        self._saver = saver
        self.rank = ctl.rank
        self._preemption: Preemption | None = None
        self._schedule: _Schedule | None = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._interval = 1
        self._first_signal: float | None = None
        """The wall time of the first signal any rank received, once the ranks agreed."""
        self.checks = 0
        """Checks made so far (each issues one all-reduce; the first, three), for the benchmarks."""

    def watch(
        self, signals: Sequence[str], deadline_s: float, check_every_s: float = CHECK_EVERY_S
    ) -> Preemption:
        """Install the handlers (main thread only), replacing earlier ones."""
        if check_every_s < 0:
            raise ValueError(f"check_every_s must be >= 0, got {check_every_s}")
        preemption = Preemption(signals, deadline_s)
        self._drain()
        if self._preemption is not None:
            self._preemption.uninstall()
        self._preemption = preemption
        self._preemption.install()
        self._schedule = _Schedule(check_every_s, deadline_s)
        self._interval = 1
        return self._preemption

    def uninstall(self) -> None:
        self._drain()
        if self._preemption is not None:
            self._preemption.uninstall()

    def preempted(self, step: int, save: Callable[[int], SaveHandle]) -> bool:
        """Steps 2-3 of the protocol: True once the ranks agreed that some rank received a
        signal, after ``step`` was saved with ``save`` (the manager's, so the final save is an
        ordinary one)."""
        watch, schedule = self._preemption, self._schedule
        if watch is None or schedule is None:
            return False
        if not schedule.tick():
            return False
        if not self._check(watch, schedule):
            return False
        t0 = time.perf_counter()
        # The deadline runs from the first signal any rank received (the agreement carried
        # its wall time), not from the agreement, which may come up to two intervals later:
        # a deadline set just under the scheduler's grace period must hold from the signal.
        since = max(0.0, time.time() - self._first_signal) if self._first_signal else 0.0
        deadline = t0 - since + watch.deadline_s
        who = self._ctl.gather(watch.received)  # only rank 0 names them
        senders = ", ".join(f"{name} on rank {r}" for r, name in enumerate(who or []) if name)
        result = self._final_save(step, deadline, save)
        took = time.perf_counter() - t0
        if self.rank == 0:
            log.warning(
                "dckpt: preempted (%s): the ranks agreed on step %d, %.2f s after the first "
                "signal; final checkpoint %s in %.2f s (deadline %.0f s from the signal); exit "
                "now, the next start resumes from it",
                senders,
                step,
                since,
                result.path if result is not None else "(already committed)",
                took,
                watch.deadline_s,
            )
        return True

    def _check(self, watch: Preemption, schedule: _Schedule) -> bool:
        """Read the agreement issued at the previous check (the first check makes one and
        waits for it), then issue the next one unless the ranks agreed to stop."""
        self.checks += 1
        pending, self._pending = self._pending, None
        first = pending is None
        if first:
            # Two agreements, waited for: the first lines the ranks up (its wait holds how far
            # apart they reached their first step: a compile, a data loader's start), the
            # second, timed, is the agreement's own latency.
            work, box = self._issue(watch, schedule, late=False)
            if work is not None:
                work.wait()
            stopping = bool(box[0].item())  # then already agreed: no second agreement
            pending = (None, box) if stopping else self._issue(watch, schedule, late=False)
        assert pending is not None
        work, box = pending
        late = not first and work is not None and not work.is_completed()
        t0 = time.perf_counter()
        if work is not None:
            work.wait()
        if first:
            schedule.latency_s = time.perf_counter() - t0
        stop, interval = bool(box[0].item()), max(1, int(box[1].item()))
        if stop:
            earliest = -int(box[2].item())
            self._first_signal = earliest / 1000 if earliest < _NO_SIGNAL_MS else None
            return True
        self._interval = interval
        schedule.next_check = schedule.calls + interval
        self._pending = self._issue(watch, schedule, late=late)
        return False

    def _issue(
        self, watch: Preemption, schedule: _Schedule, late: bool
    ) -> tuple[Any, torch.Tensor]:
        proposal = schedule.propose(self._interval, late) if self.rank == 0 else 0
        at = watch.received_at
        # the earliest signal's wall time, in ms, reduced by MAX as its negation
        when = -round(at * 1000) if watch.requested and at is not None else -_NO_SIGNAL_MS
        box = torch.tensor([int(watch.requested), proposal, when], dtype=torch.int64)
        if not self._ctl.distributed:
            return None, box
        work = dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._ctl.group, async_op=True)
        return work, box

    def _drain(self) -> None:
        """Wait for the agreement still in flight (every rank issued it at the same call)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is not None:
            try:
                pending[0].wait()
            except RuntimeError as exc:  # a rank that is gone: nothing more to agree on
                log.warning("dckpt: the last preemption check did not complete: %s", exc)

    def _final_save(
        self, step: int, deadline: float, save: Callable[[int], SaveHandle]
    ) -> SaveResult | None:
        # Every rank must take the same branches: a rank that makes an agreement the others
        # skip meets their next one (every rank raises DivergedError; before the agreements
        # had one size, gloo aborted the process: seen in CI when rank 0's save had ended
        # and rank 1's had not). So no branch reads this
        # rank's own view of the save in flight: the newest save started is the same save
        # everywhere (saves are collective), and whether it still runs on some rank, and
        # what a rank's clock or wait decides, is agreed before anything depends on it.
        latest = self._saver.latest
        if self._ctl.any(self._saver.current is not None):
            assert latest is not None  # running on some rank: started on every rank
            in_flight = SaveHandle(latest)
            if in_flight.step == step:
                return self._within(in_flight, deadline)
            # an older save: let it finish first, it may be the fallback
            stuck: SaveError | None = None
            try:
                self._within(in_flight, deadline)
            except SaveError as exc:
                if not in_flight.done():  # still writing at the deadline: no room for ours
                    stuck = exc
                else:
                    log.error("dckpt: the save in flight failed during preemption: %s", exc)
            failed = self._ctl.first_failure(stuck)
            if failed is not None:
                raise SaveError(
                    f"the save of step {in_flight.step} still in flight on rank {failed.rank} "
                    f"when the preemption deadline passed: no time left to save step {step} "
                    f"({failed.error})"
                )
            self._saver.clear_failed()
        if self._saver.last_committed_step == step:
            return None
        if self._ctl.any(deadline - time.perf_counter() <= 0):
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
