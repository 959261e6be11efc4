"""After a resume: ``ResumeWatch``, the checks that follow the training it resumed.

The resume (dckpt.load.resumer, step 8 of its protocol) hands the watch the step it loaded;
from then on the manager calls the watch, not the resumer:

- ``observe()`` each step's loss: rank 0 journals it (dckpt.load.replay), compares the steps
  the resumed run replays with the run that stopped, and the loss watch (dckpt.load.loss_watch)
  compares the first losses with the one recorded at save time; a replay that matched
  outranks the loss watch (the resumed run is that run);
- ``touched()`` at each optimizer step: the config changes the restored state overrides
  (dckpt.load.overrides), checked at the first step and again at the second;
- ``saved()`` when a save starts: its journal begins, a replay still running ends;
- ``finish()`` at close: the verdicts on fewer steps than their windows.

Rank 0 records every verdict in the root's resume records (dckpt.root.resume_record) before
it is logged or raised; a record that cannot be written is logged, never raised. Those
records are what the resumer's restart-loop rule reads at the next start.

**One verdict for all ranks** (``loss_watch="raise"``). Each rank judges its own losses, and
only rank 0 holds the replay, whose proof outranks the loss watch: left alone, rank 0 would
pass a resume its replay proved while rank 1, without that proof, raised on the same losses,
and the job died in the next collective at every start. So with ``raise`` the verdicts are
held and agreed on dckpt's control group before anything is raised or recorded: at the
1st, 2nd, 4th, 8th ... ``observe()`` after the resume (and at the loss watch's last), while
any rank still has something to judge. A replay that differs raises its line on every rank;
a loss watch that fails on some rank raises that rank's line on every rank, unless rank 0's
replay vouched for the steps (then no rank raises). A failure is raised at most twice as many
steps after it was seen; an agreement costs two all-reduces of a few ints (plus two
broadcasts on failure), at O(log window) steps per resume, whatever the world's size. With
``raise``, every rank must call ``observe()`` at every step (a rank that does not is named,
after ``timeout_s``); ``warn`` and ``off`` use no collective, so a script that calls
``observe()`` on rank 0 alone never hangs.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

from ..collective.comm import Comm
from ..config import CheckpointConfig
from ..errors import CheckpointError, LossDeviationError, WorldError
from ..root.resume_record import (
    LOSS_WATCH,
    REPLAY,
    ResumeRecord,
    ResumeRecords,
    failed_in_a_row,
    this_start,
)
from ..train.state import TrainState
from .config_check import HORIZON_KEYS, OPERATIONAL_KEYS, is_allowed
from .loss_watch import LossVerdict, LossWatch
from .overrides import Override, find_overrides
from .replay import Replay, ReplayVerdict
from .report import LoadResult, ResumeReport

__all__ = ["ResumeWatch"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True)
class _Watched:
    """The resume the verdicts are about (for their records)."""

    step: int
    tier: str
    save_id: str


class _Agreement:
    """When the ranks agree on the held verdicts (``loss_watch="raise"``): at the 1st, 2nd,
    4th ... ``observe()`` since the resume and at the loss watch's last, the same counts on
    every rank; at every one in a single process, where agreeing is free. Ends once no rank
    had anything left to judge."""

    def __init__(self, ctl: Comm, window: int) -> None:
        self.ctl = ctl
        self.window = window
        self.seen = 0
        self._next = 1

    def due(self) -> bool:
        self.seen += 1
        if not self.ctl.distributed or self.seen in (self._next, self.window):
            while self._next <= self.seen:
                self._next *= 2
            return True
        return False


class ResumeWatch:
    """The replay, the loss watch and the overrides after a resume; see the module
    docstring."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        config: CheckpointConfig,
        loss_watch: LossWatch,
        replay: Replay,
        state: TrainState,
        records: ResumeRecords | None,
        run_id: str | None = None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._config = config
        self._loss_watch = loss_watch
        self.replay = replay
        self._state = state
        self.records = records
        self._run_id = (
            run_id or os.environ.get("DCKPT_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""
        )
        self._watched: _Watched | None = None
        self._overrides: list[Override] = []
        self._recheck: list[Override] = []
        self._agreement: _Agreement | None = None
        """Set after a resume with ``loss_watch="raise"``: the verdicts are agreed on first."""
        self._held_loss: LossVerdict | None = None
        self._held_replay: ReplayVerdict | None = None

    # --- from the resumer -------------------------------------------------------------------

    def forget(self) -> None:
        """A resume begins: nothing is watched until it loads a candidate."""
        self._watched = None
        self._agreement = None
        self._held_loss = self._held_replay = None

    def loaded(self, step: int, tier: str, save_id: str) -> None:
        """A resume loaded ``step`` from ``tier`` (its name): the verdicts are about it."""
        self._watched = _Watched(step, tier, save_id)

    def reset(self) -> None:
        """``load()`` (no resume): no replay of the steps after it."""
        self.replay.reset()

    def overrides(self, report: ResumeReport) -> None:
        """The config changes that passed but that the restored state overrides, named in
        the report and checked at the first optimizer steps (``touched``)."""
        self._overrides = find_overrides(report.config_changes, self._state)
        report.warnings.extend(o.describe() for o in self._overrides)

    def arm(self, result: LoadResult, report: ResumeReport, ctl: Comm) -> None:
        """Step 8: the replay and the loss watch, armed for the steps after ``result``; with
        ``loss_watch="raise"``, their verdicts agreed on ``ctl`` (dckpt's control group)."""
        report.replay = self._arm_replay(result, report)
        self._arm_loss_watch(result, report)
        self._held_loss = self._held_replay = None
        self._agreement = None
        if self._config.loss_watch == "raise":
            self._agreement = _Agreement(ctl, self._config.loss_watch_steps)

    # --- from the manager -------------------------------------------------------------------

    def saved(self, step: int, save_id: str, committed: int | None) -> None:
        """A save started: its journal begins (rank 0); a replay still running ends."""
        verdict = self.replay.saved(step, save_id, committed)
        if verdict is not None and self.rank == 0:
            log.info("%s", verdict.line())
            self._record(REPLAY, verdict.ok, verdict.detail)

    def touched(self) -> None:
        """A step of training (the optimizer's step pre-hook). The first after a resume
        checks the overrides the report named (rank 0 logs); the second checks again those it
        found applied (a schedule's first step after the resume could have put the saved
        value back)."""
        recheck, self._recheck = self._recheck, []
        for o in recheck:
            if self.rank == 0 and o.still_restored():
                c = o.change
                log.warning(
                    "dckpt: %s is back at %r (%s) after the first scheduler step: the schedule "
                    "restored the saved value. Apply it where the schedule steps from: %s",
                    c.key,
                    c.saved,
                    o.where,
                    "; ".join(o.fix),
                )
        overrides, self._overrides = self._overrides, []
        if self.rank != 0:
            return
        for o in overrides:
            c = o.change
            if o.still_restored():
                log.warning(
                    "dckpt: %s is still %r (%s) at the first optimizer step after the resume: "
                    "the change to %r does nothing. Apply it after resume(): %s",
                    c.key,
                    c.saved,
                    o.where,
                    c.current,
                    "; ".join(o.fix),
                )
            else:
                log.info("dckpt: %s %r is applied (%s)", c.key, c.current, o.where)
                self._recheck.append(o)

    def observe(self, loss: float, step: int | None = None) -> None:
        """Record this step's loss: kept for the manifest and the replay journal, and
        checked after a resume (the replay, then the loss watch). A replay that matched the
        run that stopped outranks the loss watch: the resumed run is that run, so the watch
        defers to it (and never fails it). With ``raise``, the verdicts are agreed across
        ranks first (``_agree``)."""
        value = float(loss)
        agreement = self._agreement
        replayed = self.replay.observe(value, step)  # rank 0's verdict, None on the others
        if replayed is not None:
            self._record(REPLAY, replayed.ok, replayed.detail)  # rank 0's proof, as it stands
            if replayed.ok or agreement is None:
                (log.info if replayed.ok else log.warning)("%s", replayed.line())
            else:
                self._held_replay = replayed  # raised on every rank once they agree
        verdict = self._loss_watch.judge(value, vouched=self.replay.vouched())
        if verdict is not None:
            if agreement is None:
                self._tell(verdict)
            else:
                self._held_loss = verdict
        if agreement is not None and agreement.due():
            self._agree(agreement)

    def _agree(self, agreement: _Agreement) -> None:
        """The ranks agree on the verdicts held so far: every rank raises the same
        LossDeviationError, or none does; rank 0 records the verdict agreed on before it is
        raised. See the module docstring."""
        replayed, verdict = self._held_replay, self._held_loss
        self._held_replay = self._held_loss = None
        mine: LossDeviationError | None = None
        if verdict is not None and not verdict.ok:  # first, as a single rank raises it
            mine = LossDeviationError(f"{verdict.line()} (the losses of rank {self.rank})")
            mine.kind = LOSS_WATCH
        elif replayed is not None:
            mine = LossDeviationError(replayed.line())
        ctl = agreement.ctl
        # begun as its own operation: a rank that never comes is named as one that never
        # began it, and a frozen one by its heartbeat (``Comm.late``)
        ctl.begin(f"agreement on the loss verdict at observe() {agreement.seen}")
        try:
            failed = ctl.first_failure(mine)
            vouched = None
            if failed is not None:  # does rank 0's replay outrank it? (None: it differed)
                vouched = ctl.broadcast(self.replay.vouched() if self.rank == 0 else None)
            judging = self._loss_watch.armed or self.replay.check.armed
            if not ctl.any(judging):
                self._agreement = None  # every verdict is in, on every rank
        except CheckpointError:  # dckpt's own words (ranks that diverged: a bug in dckpt)
            self._agreement = None
            raise
        except RuntimeError as exc:  # a rank did not come to the agreement
            self._agreement = None  # the group is broken: no collective on it again
            raise self._absent(ctl, exc) from exc
        finally:
            ctl.end()
        if failed is None:
            if verdict is not None:
                self._tell(verdict)  # passed everywhere: rank 0 logs and records its own
            return
        error = failed.error
        if vouched is not None:  # a loss watch's judgement; the replay proved these steps
            self._loss_watch.disarm()
            if self.rank == 0:
                log.info(
                    "dckpt resume: [ok  ] loss watch: %s; the replay found %s: nothing to judge",
                    str(error).split("] loss watch: ", 1)[-1],
                    vouched,
                )
                self._record(LOSS_WATCH, True, f"the replay found {vouched}: nothing to judge")
            return
        self._agreement = None
        self._loss_watch.disarm()
        if not isinstance(error, LossDeviationError):  # not ours: raise it as it is
            raise error
        if error.kind == LOSS_WATCH and self.rank == 0:
            # (a replay's failure was recorded when rank 0 saw it)
            self._record(LOSS_WATCH, False, str(error).split("] loss watch: ", 1)[-1])
        raise LossDeviationError(str(error))

    def _absent(self, ctl: Comm, exc: BaseException) -> WorldError:
        """The words every rank that came raises when one did not (gloo's timeout, after
        ``timeout_s``): who, and what it was doing when last heard of."""
        late = ctl.late()
        return WorldError(
            f"the agreement on the loss watch's verdict after the resume failed on rank "
            f"{self.rank} ({str(exc).splitlines()[0][:200]}): "
            f"{late + ' did not come' if late else 'a rank did not come'}. With "
            'loss_watch="raise" every rank calls observe() at every step, so that the ranks '
            "raise together or not at all; call it on every rank, or use "
            'loss_watch="warn" (no collective).'
        )

    def finish(self) -> None:
        """At close: the replay's and the loss watch's verdicts on fewer steps than their
        windows, if any. The replay's is recorded (every step it compared matched: proof
        for the checkpoint); the loss watch's is logged, not recorded: a run that ends a few
        steps after its resume (a preemption, a short job) judged too few losses (a
        non-finite loss gave its verdict, recorded, when it was seen)."""
        held, self._held_replay = self._held_replay, None
        if held is not None:  # recorded when seen; the run ends before the ranks agreed
            log.warning("%s", held.line())
        replayed = self.replay.finish()
        if replayed is not None:  # rank 0's
            log.info("%s", replayed.line())
            self._record(REPLAY, replayed.ok, replayed.detail)
        verdict, self._held_loss = self._held_loss, None
        if verdict is not None:  # reached, not yet agreed on: rank 0's own, as without raise
            self._tell(verdict)
        verdict = self._loss_watch.finish()
        if verdict is not None:
            self._tell(verdict, recorded=False)
        self._watched = None
        self._agreement = None

    def _tell(self, verdict: LossVerdict, *, logged: bool = True, recorded: bool = True) -> None:
        if self.rank != 0:  # one line, not one per rank (each rank judged its own losses)
            return
        if logged:
            (log.info if verdict.ok else log.warning)("%s", verdict.line())
        if recorded:
            self._record(LOSS_WATCH, verdict.ok, verdict.detail)

    def _record(self, kind: str, ok: bool, detail: str) -> None:
        """Rank 0: one verdict of this resume (``REPLAY`` or ``LOSS_WATCH``) into the root's
        resume records. Never raises: a lost record costs the restart-loop guard one start,
        a raise would cost the run."""
        watched = self._watched
        if watched is None or self.records is None or self.rank != 0:
            return
        attempt, job, start = this_start()
        record = ResumeRecord(
            step=watched.step,
            tier=watched.tier,
            save_id=watched.save_id,
            ok=ok,
            verdict=detail,
            run_id=self._run_id,
            attempt=attempt,
            job=job,
            start=start,
            time=time.time(),
            kind=kind,
        )
        where = self.records.where(watched.step)
        try:
            kept = self.records.add(record)
        except (OSError, ValueError, CheckpointError) as exc:
            log.warning(
                "dckpt: could not record the resume of step %d in %s (%s); training goes on, "
                "but a restart that fails the same way is not known to have failed before",
                watched.step,
                where,
                exc,
            )
            return
        if ok:
            return
        if kind == LOSS_WATCH:
            log.warning(
                "dckpt: the loss watch's verdict on the resume of step %d is recorded in %s: "
                "a warning, never a strike against the checkpoint (only a replay that differs "
                "from the run that stopped is)",
                watched.step,
                where,
            )
            return
        row = failed_in_a_row(
            [r for r in kept if (r.tier, r.save_id) == (record.tier, record.save_id)]
        )
        then = (
            "the next start quarantines it and resumes from the step before"
            if len(row) >= 2
            else "if the next start's replay of it differs too, the start after that "
            "quarantines it and resumes from the step before"
        )
        log.warning(
            "dckpt: the resume of step %d (%s, %s) did not reproduce the run that stopped "
            "(its replay differed), recorded in %s (%d in a row): %s",
            watched.step,
            watched.tier,
            record.label(),
            where,
            len(row),
            then,
        )

    def _arm_replay(self, result: LoadResult, report: ResumeReport) -> str:
        """Step 8: rank 0 reads the journal of the step resumed from and arms the replay."""
        changed = None
        neutral = OPERATIONAL_KEYS - HORIZON_KEYS  # where logs and saves go, not the math
        shaping = [c.key for c in report.config_changes if not is_allowed(c, neutral)]
        if report.world_size_saved not in (None, self.world_size):
            changed = f"the world size changed ({report.world_size_saved} -> {self.world_size})"
        elif shaping:
            changed = f"the config changed ({', '.join(shaping)})"
        return self.replay.resumed(result.step, result.manifest.save_id, changed)

    def _arm_loss_watch(self, result: LoadResult, report: ResumeReport) -> None:
        if self._config.loss_watch == "off":
            return  # no verdict of its own (the replay's is still recorded)
        steps = self._config.loss_watch_steps
        if not result.manifest.loss:  # nothing to compare with: a non-finite loss still fails
            self._loss_watch.guard(steps, result.path.name)
            return
        self._loss_watch.arm(result.manifest.loss, steps, result.path.name)
        low, high = self._loss_watch.band()
        if not (math.isfinite(low) and math.isfinite(high)):  # a NaN band would pass nothing
            report.warnings.append(f"loss watch {self._loss_watch.describe_armed()}")
            self._loss_watch.guard(steps, result.path.name)
            return
        report.check(
            "loss watch armed",
            True,
            self._loss_watch.describe_armed() + "; the verdict follows as its own line",
        )
