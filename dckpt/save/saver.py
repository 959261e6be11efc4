"""The foreground of a save: ``Saver`` decides whether and how a save runs, and hands it off.

It owns the save thread, the busy policy (``if_busy``), the save mode (``async_save``, with
"auto" decided by rank 0 and broadcast on the control group with rank 0's ``when``), the step
clock's hooks, and the waits the caller makes (``wait``, ``before_optimizer_step``). The
ordered steps of a save are ``dckpt.save.pipeline.SavePipeline``, whose docstring states the
protocol (steps 1-3 run here).

Invariants: at most one save in flight; a save's error is raised once, by the next ``save()``,
``wait()`` or ``close()``; after a failed collective or a save the watchdog gave up on, every
later ``save()`` refuses with a request to restart (dckpt's group is unusable).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from ..collective.comm import Comm
from ..collective.progress import Progress
from ..config import CheckpointConfig
from ..errors import LockError, SaveError, WorldError
from .background import SaveThread
from .handle import SaveHandle, SaveResult, SaveTicket
from .mode import SaveMode
from .pipeline import SavePipeline
from .route import SaveTier
from .step_clock import StepClock

__all__ = ["Saver"]

log = logging.getLogger("dckpt")

BUSY_WAIT_NOTE_S = 0.5
"""A save that waits at least this long for the previous one says so (and why)."""


class Saver:
    """Runs ``save()`` for the manager; see the module docstring."""

    def __init__(
        self,
        *,
        ctl: Comm,
        pipeline: SavePipeline,
        tiers: Sequence[SaveTier],
        progress: Progress,
        config: CheckpointConfig,
        clock: StepClock,
        mode: SaveMode,
    ) -> None:
        self._ctl = ctl
        self._pipeline = pipeline
        self._tiers = {tier.name: tier for tier in tiers}
        """Every tier this start saves to, by its name (``save(tier=...)``)."""
        self._anchor = next((t.name for t in tiers if t.anchor), None)
        """The name of the tier the run's lineage rests on (the root's)."""
        self._progress = progress
        self._config = config
        self._clock = clock
        self._mode = mode
        self._thread = SaveThread(ctl.rank)
        self.rank = ctl.rank
        self._stuck_reason: str | None = None
        # The background save bounds each of its own waits by timeout_s and names a late rank
        # when one expires; joining it waits for that to happen, with a margin, never forever.
        self._join_timeout = config.watchdog_s

    @property
    def current(self) -> SaveTicket | None:
        return self._thread.current

    @property
    def latest(self) -> SaveTicket | None:
        return self._thread.latest

    @property
    def stuck(self) -> SaveTicket | None:
        return self._thread.stuck

    @property
    def last_committed_step(self) -> int | None:
        """The step of the last committed save to the tier the run's lineage rests on (the
        root's)."""
        return None if self._anchor is None else self._pipeline.last_committed.get(self._anchor)

    @property
    def asynchronous(self) -> bool:
        return self._mode.asynchronous

    def save(
        self,
        step: int,
        *,
        epoch: int | None,
        milestone: bool,
        metric: float | None,
        loss: dict[str, Any],
        tier: str,
        when: object = None,
        resumed_unchanged: bool = False,
    ) -> SaveHandle:
        """Steps 1-3 of the save protocol, then the hand-off to the save thread. A route that
        cannot block (the memory tier's: its copy in ``save()`` is the snapshot) always runs
        in the background.

        Before any of it, once this rank knows it may save at all (an unusable group is raised
        here first, with no collective; an earlier save's failure only after the broadcast and
        the wait for that save, on every rank: a rank whose save thread has ended knows of the
        failure before a rank whose thread is still tidying up): rank 0's ``when``, one
        broadcast made at every save whatever this rank's ``when`` (a rank that passed None
        must not leave the others waiting), which also carries rank 0's ``async_save="auto"``
        plan while it decides (so the decision costs no collective of its own, and lags the
        save still in flight by one save); then ``resumed_unchanged``, the same on every
        rank: the step just resumed from, with nothing trained since, is not written again."""
        chosen = self._tiers[tier]
        route = chosen.route
        self._refuse_if_unusable()
        t0 = time.perf_counter()
        mine = None
        if self.rank == 0:  # a plan only for a save that runs: a trial must not be skipped
            go = when is None or bool(when)
            # nor land on a route that cannot block (a memory save): it would spend the trial
            # (every rank passes the same tier, so every rank's route is rank 0's)
            planned = self._mode.deciding and go and not resumed_unchanged and route.can_block
            # rank 0's metric is the one recorded (best-k ranks by it): refused on every rank
            # together, never by rank 0 alone (the others would wait for it here)
            bad = metric is not None and not math.isfinite(metric)
            refused = f"metric must be a finite number (best-k ranks by it), got {metric}"
            mine = (go, self._mode.plan() if planned else None, refused if bad else None)
        told = self._ctl.broadcast(mine)
        assert told is not None  # rank 0 always sends one
        go, plan, refused_metric = told
        if refused_metric is not None:
            raise ValueError(f"{refused_metric} (rank 0's; the save of step {step} was not made)")
        if plan is not None:  # async_save="auto": rank 0 measured, every rank follows
            self._mode.apply(plan)
            if self.rank == 0 and plan.message:
                log.info("dckpt: %s", plan.message)
        if not go:
            return self.skipped(step, "rank 0's when= was false")
        if resumed_unchanged:
            why = "it is the step just resumed from, and nothing has trained since"
            if self.rank == 0:
                log.info("dckpt: save of step %d skipped: %s (no optimizer step)", step, why)
            return self.skipped(step, why)
        in_flight = self._thread.current
        asynchronous = self._mode.asynchronous or not route.can_block
        if self._config.if_busy == "skip" and asynchronous:
            busy = self._ctl.lowest(in_flight is not None)  # one all-reduce, not N flags
            if busy is not None:
                return self._skip(step, busy)
        # Every rank joins and raises here, whatever its own view of the save in flight (one
        # rank's thread may have ended while another's runs): the decision to go on with
        # this save must be the same on every rank.
        t_wait = time.perf_counter()
        self._thread.join(self._join_timeout)  # at once when this rank's thread has ended
        waited = time.perf_counter() - t_wait if in_flight is not None else 0.0
        if in_flight is not None and self.rank == 0 and waited >= BUSY_WAIT_NOTE_S:
            log.info(  # a blip is not worth a line
                "dckpt: save of step %d waited %.2f s for step %d to finish writing "
                "(saves come faster than the storage takes them; see if_busy='skip')",
                step,
                waited,
                in_flight.step,
            )
        self._thread.raise_if_failed()
        # The save just joined may have lost dckpt's group (a memory save's replicas whose
        # peer stopped answering): checked again now that it has ended, never before, so
        # this save does not run its collectives on a broken group (gloo aborts the process).
        self._refuse_if_unusable()

        job = self._pipeline.prepare(
            chosen,
            step,
            started=t0,
            waited_s=waited,
            epoch=epoch,
            milestone=milestone,
            metric=metric,
            loss=loss,
            asynchronous=asynchronous,
        )
        ticket = SaveTicket(step, t0)
        ticket.save_id = job.save_id
        handle = SaveHandle(ticket)
        self._clock.save_started(t0)
        self._thread.start(
            ticket,
            lambda: self._pipeline.run(job, ticket),
            deadline_s=self._config.watchdog_s,
            where=lambda: self._progress.lagging(job.save_id),
            soft=route.soft,
        )
        if not asynchronous:
            try:
                handle.result()
            except BaseException:
                self._thread.clear_failed()  # delivered here; the next save() starts clean
                raise
        now = time.perf_counter()
        ticket.stall_s = now - t0
        self._clock.save_returned(t0, now)
        return handle

    def _skip(self, step: int, busy: int) -> SaveHandle:
        # ``busy`` is the lowest rank still writing: naming one costs one all-reduce, not N flags
        why = f"the previous save is still writing on rank {busy} (if_busy='skip')"
        if self.rank == 0:
            log.warning("dckpt: skipped the save of step %d: %s", step, why)
        return self.skipped(step, why)

    def skipped(self, step: int, why: str) -> SaveHandle:
        """A save that does not run (``result()`` raises, saying ``why``); nothing logged."""
        ticket = SaveTicket(step, time.perf_counter())
        ticket.skip(why)
        return SaveHandle(ticket)

    def on_optimizer_step(self) -> None:
        self._clock.tick()
        if self._config.overlap_staging:
            self.before_optimizer_step()

    def before_optimizer_step(self) -> None:
        ticket = self._thread.current
        if ticket is not None:
            SaveHandle(ticket).wait_staged(self._join_timeout)

    def wait(self) -> SaveResult | None:
        """Block until the save in flight is committed; raise if any earlier save failed."""
        self._note_stuck()
        if self._unusable is not None:
            self._thread.raise_if_failed()
            raise SaveError(f"{self._unusable}; restart the job")
        ticket = self._thread.current
        self._thread.join(self._join_timeout)
        self._thread.raise_if_failed()  # an agreed failure: latched on every rank once joined
        if ticket is None:
            return None
        try:
            return SaveHandle(ticket).result()
        except SaveError:
            # What is left is a memory save's failure, agreed and logged, which fails only its
            # handle; raising it here only where the save was still running would send this
            # rank away while the others go on to the caller's next collective.
            return None

    def drain(self) -> None:
        """At close: wait for the save in flight, unless it is stuck (then say so)."""
        if self._thread.stuck is not None:
            log.error(
                "dckpt: closing with the save of step %d still stuck in the background; "
                "this process may not exit until its storage answers",
                self._thread.stuck.step,
            )
        else:
            self._thread.join(self._join_timeout)

    def raise_if_failed(self) -> None:
        self._thread.raise_if_failed()

    def clear_failed(self) -> None:
        self._thread.clear_failed()

    @property
    def _unusable(self) -> str | None:
        """Why dckpt's group can no longer be used: a collective of a save failed (the latest
        such failure), or the watchdog gave up on a save; None while it is fine."""
        return self._pipeline.group_lost or self._stuck_reason

    def _note_stuck(self) -> None:
        """After the watchdog gave up on a save: raise its error once, then refuse to save
        (the stuck thread may still hold dckpt's group and its files)."""
        stuck = self._thread.stuck
        if stuck is not None and self._unusable is None:
            self._stuck_reason = f"the save of step {stuck.step} got stuck and never finished"
            self._thread.raise_if_failed()

    def _refuse_if_unusable(self) -> None:
        fenced = self._pipeline.fenced
        if fenced is not None:
            raise LockError(
                f"this job commits nothing more: {fenced}. Stop it; restart it only once "
                "the other job is gone (it then resumes from the newest committed checkpoint)."
            )
        self._note_stuck()
        if self._unusable is not None:
            self._thread.raise_if_failed()  # the detailed error first, naming the late rank
            raise WorldError(
                f"an earlier save failed inside a collective ({self._unusable}); dckpt's process "
                "group cannot recover from that. Restart the job: it resumes from the last "
                "committed checkpoint."
            )
