"""The replay check: after a resume from step N, the steps the resumed run replays (N+1, N+2,
... as far as the run that stopped got) are compared, loss for loss, with that run's journal
(dckpt.root.replay_journal).

A resume is exact when those losses are the same bits. The loss watch (dckpt.load.loss_watch)
cannot tell: it is statistical, and a dropout stream shifted by an RNG draw between ``save()``
and the point where the loop re-enters (an eval after the save) looks like noise to it. This
check names the first step that differs, with both values.

- ``exact`` compares bits (``float.hex``); ``close`` passes a relative difference up to
  ``rtol`` (GPU kernels that are not deterministic: atomics in a backward, autotuning).
  ``CheckpointConfig(replay_check="auto")`` is exact when every parameter is on the CPU or
  ``torch.use_deterministic_algorithms`` is on, close otherwise (decided by the manager).
- Steps are named by ``observe(loss, step=...)`` when given, else counted from the save (the
  first ``observe()`` after ``save(N)`` is step N+1), the same way in both runs.
- Rank 0 judges: it journaled its own losses, so it compares its own (the loss a script
  gives ``observe()`` may be all-reduced or rank 0's own). It logs the verdict, one line in
  the resume report's format; with ``loss_watch="raise"`` a difference raises
  ``LossDeviationError`` on every rank, once the ranks agreed (dckpt.load.watch: its proof
  also outranks a loss watch that failed on another rank). No collective here: with ``warn``
  a script that calls ``observe()`` on rank 0 only never hangs.
- Not compared (and said so in the report): no journal (none was written, it was pruned
  when a newer step committed, or an s3:// root's rank 0 runs on another host than the run
  that stopped), a journal of another save of that step, a world size or a config that
  changed (the losses are not expected to be the same bits).
- The journal keeps what the run after the save wrote: a resumed run appends only the steps
  after the last one journaled, also when it differs, so the next restart from that step is
  compared with the run that first trained from it, and a resume that is not exact is
  reported again. Any other start (a fresh journal: not compared, or ``load()``, which
  starts none) leaves the old lines alone until the next save.

No torch, no collective, no file read but rank 0's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..root.replay_journal import JournalWriter, read_journal

__all__ = ["Replay", "ReplayCheck", "ReplayMode", "ReplayVerdict"]

ReplayMode = Literal["exact", "close"]

CAUSES = (
    "Likely causes: RNG drawn between save() and the point where the loop re-enters (an eval "
    "or a sample after save(): move it before save()), a different data order (a prefetched "
    "batch, a loader whose position is not in the TrainState), state changed after resume() "
    "(weights re-initialised or edited), gradients carried across save() (.grad is in no "
    "checkpoint: a script that accumulates micro-steps across a save, or never zeroes "
    "them, resumes with zeros where the run that stopped had sums), or kernels that are not "
    'deterministic (replay_check="close" for GPU runs). See the README, "Where save() goes"'
)


@dataclass(frozen=True)
class ReplayVerdict:
    ok: bool
    detail: str

    def line(self) -> str:
        return f"dckpt resume: [{'ok  ' if self.ok else 'FAIL'}] replay: {self.detail}"


def _span(steps: list[int]) -> str:
    if not steps:
        return "no step"
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {steps[0]}..{steps[-1]}"


class ReplayCheck:
    """The comparison after one resume; see the module docstring."""

    def __init__(self, mode: ReplayMode, rtol: float) -> None:
        self.mode = mode
        self.rtol = rtol
        self._expected: dict[int, str] = {}
        self._last = -1
        self._same: list[int] = []
        self._worst = 0.0
        self._differed = False

    @property
    def armed(self) -> bool:
        return bool(self._expected)

    def arm(self, resumed: int, entries: list[tuple[int, str]]) -> list[int]:
        """Compare the steps after ``resumed`` with ``entries``; returns those steps."""
        self._expected = {s: h for s, h in entries if s > resumed}
        steps = sorted(self._expected)
        self._last = steps[-1] if steps else -1
        self._same, self._worst, self._differed = [], 0.0, False
        return steps

    def vouched(self) -> str | None:
        """What this resume's replay proved so far, while it found no difference: the steps
        it compared and found the run that stopped's own (None: none yet, or one differed)."""
        return None if self._differed or not self._same else self._agrees()

    def observe(self, step: int, loss: float) -> ReplayVerdict | None:
        """The verdict once the last journaled step was replayed, or at the first difference."""
        if not self.armed:
            return None
        then = self._expected.get(step)
        if then is not None:
            if not self._matches(float.fromhex(then), loss):
                verdict = ReplayVerdict(False, self._differs(step, float.fromhex(then), loss))
                self._expected, self._differed = {}, True
                return verdict
            self._same.append(step)
        if step >= self._last:
            verdict = ReplayVerdict(True, self._agrees())
            self._expected = {}
            return verdict
        return None

    def finish(self) -> ReplayVerdict | None:
        """The verdict on the steps replayed so far, when the run ends first (None if none)."""
        if not self.armed or not self._same:
            self._expected = {}
            return None
        verdict = ReplayVerdict(True, f"{self._agrees()} (the run ended before step {self._last})")
        self._expected = {}
        return verdict

    def _matches(self, then: float, now: float) -> bool:
        if math.isnan(then) or math.isnan(now):
            return math.isnan(then) and math.isnan(now)
        if self.mode == "exact":
            return then.hex() == now.hex()
        if then == now:
            return True
        scale = max(abs(then), abs(now))
        diff = abs(then - now) / scale if math.isfinite(scale) and scale > 0 else math.inf
        self._worst = max(self._worst, diff)
        return diff <= self.rtol

    def _agrees(self) -> str:
        if self.mode == "exact":
            return f"{_span(self._same)} identical to the run that stopped"
        return (
            f"{_span(self._same)} within {self.rtol:g} of the run that stopped (largest "
            f"relative difference {self._worst:.3g})"
        )

    def _differs(self, step: int, then: float, now: float) -> str:
        before = f" ({self._agrees()})" if self._same else ""
        how = "differs from" if self.mode == "exact" else f"differs by more than {self.rtol:g} from"
        return (
            f"step {step} {how} the run that stopped: {now!r} now, {then!r} then{before}. {CAUSES}"
        )


class Replay:
    """The journal and the check, on rank 0, for one manager (other ranks only count)."""

    def __init__(
        self, *, rank: int, root: Path, mode: ReplayMode | None, rtol: float, run_id: str
    ) -> None:
        self.root = Path(root)
        self.check = ReplayCheck(mode or "exact", rtol)
        # Only rank 0 reads, writes and compares the journal (None: replay_check="off").
        self._writer = JournalWriter(root) if mode is not None and rank == 0 else None
        self._run_id = run_id
        self._base: int | None = None
        self._count = 0
        self._journaled = -1
        """The last step the open journal holds from the run it is of: never written again."""

    def saved(self, step: int, save_id: str, committed: int | None) -> ReplayVerdict | None:
        """After ``save(step)`` started: the observes from now on are this save's journal.
        A replay still running (steps the journal named that were not observed) ends here,
        with its verdict on what was compared."""
        self._base, self._count, self._journaled = step, 0, -1
        verdict = self.check.finish()
        if self._writer is not None:
            self._writer.start(step, save_id, self._run_id)
            if committed is not None:
                self._writer.prune(committed)
        return verdict

    def reset(self) -> None:
        """After ``load()``: no journal until the next save (the steps after a load are not
        those of any journaled run)."""
        self._base, self._count, self._journaled = None, 0, -1
        self.check.arm(0, [])
        if self._writer is not None:
            self._writer.close()

    def resumed(self, step: int, save_id: str, world_changed: str | None) -> str:
        """After a resume from ``step``: rank 0 reads the journal, arms the check and goes on
        journaling; returns the report's line ("" on other ranks)."""
        self._base, self._count, self._journaled = step, 0, -1
        self.check.arm(step, [])
        if self._writer is None:
            return ""
        journal = read_journal(self.root, step)
        ours = journal is not None and journal.save_id == save_id
        steps: list[int] = []
        if ours and world_changed is None:
            assert journal is not None
            steps = self.check.arm(step, journal.entries)
        if steps:
            assert journal is not None
            self._writer.reopen(journal, after=steps[-1])
            self._journaled = steps[-1]
        else:  # nothing of it is compared: this run's steps start the journal afresh
            self._writer.start(step, save_id, self._run_id)
        if journal is None:
            return (
                f"not compared: no journal of the run that stopped after step {step} (none "
                "was written, it was pruned when a newer step committed, or an s3:// root's "
                "rank 0 ran on another host)"
            )
        if not ours:
            return f"not compared: the journal of step {step} is of another save of that step"
        if world_changed is not None:
            return f"not compared: {world_changed}; the losses are not expected to be the same bits"
        if not steps:
            return f"nothing to compare: the run that stopped observed no step after step {step}"
        return (
            f"{_span(steps)} of the run that stopped to compare ({self.check.mode}); the verdict "
            "follows as its own line"
        )

    def observe(self, loss: float, step: int | None) -> ReplayVerdict | None:
        """Record one loss (rank 0's journal) and compare it while a resume is replayed."""
        self._count += 1
        if self._writer is None or self._base is None:
            return None  # not rank 0, or no save yet: nothing could ever replay this
        if step is None:
            step = self._base + self._count
        verdict = self.check.observe(step, loss) if self.check.armed else None
        if step > self._journaled:  # a step the journal has is never written again
            self._writer.append(step, loss)
        return verdict

    def finish(self) -> ReplayVerdict | None:
        verdict = self.check.finish()
        if self._writer is not None:
            self._writer.close()
        return verdict

    def vouched(self) -> str | None:
        """Rank 0: the steps this resume's replay found identical to (or within ``rtol`` of)
        the run that stopped, while none differed; the loss watch defers to it."""
        return self.check.vouched()
