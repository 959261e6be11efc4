"""Background or synchronous: the ``async_save="auto"`` decision, made from measured costs.

A background save is meant to cost the loop less than a synchronous one. On a box whose cores
the training already fills, it may not: the write takes its CPU from the steps. ``SaveMode``
compares what the two ways really cost the loop (``step_clock.LoopCost``: a background save's
``slowed_s`` read from step times, a synchronous save's stall) and keeps the cheaper, always:
how well the steps kept their pace is reported, never a reason to skip the comparison.

The comparison, on rank 0:

1. the first saves run in the background. The very first one's cost is not counted (it
   allocates the staging buffers, and the step clock has too few steps to measure it);
2. once one background save has a measured cost, the next save is the *synchronous trial*:
   its cost is its stall, known when ``save()`` returns (the first saves stay in the
   background, as they always were, so a job's early saves behave the same);
3. then background saves until ``PROBE_SAVES`` of them have a measured cost (the ones before
   the trial included); their median is set against the trial, and the cheaper way is kept.
   When the measured ones already differ from the trial by ``DECISIVE`` times or more, the
   decision comes at once (each extra save the dearer way is paid for in full);
4. after it, the chosen way's costs are watched: when the median of its last ``DRIFT_SAVES``
   costs moves by more than ``DRIFT`` times (either way) from the figure the decision was made
   on, the other way is tried again (one synchronous save, or background saves as in 3) and
   set against the chosen way's recent median; the new decision is logged with why.

Protocol with the ``Saver``: while ``deciding``, rank 0 calls ``plan()`` at every ``save()``
(before it joins the save still in flight, so that save's cost may come one save late) and the
``ModePlan`` rides the broadcast each save already makes (rank 0's ``when=``), so a plan costs
no collective; every rank calls ``apply(plan)``. ``record`` gets each committed save's cost, on
rank 0, from the save thread (only for routes that may block). Rank 0 logs ``plan.message``.

Invariants:

- ``async_save=True`` or ``False`` never changes and never plans; for ``"auto"``, ``deciding``
  stays true (re-deciding stays possible) unless a cost cannot be measured at all, and it
  changes only through ``apply``, so it is the same on every rank;
- only rank 0's measurements count (its loop moves in step with the others'); a plan whose
  save is skipped, fails or runs on a route that cannot block is simply planned again;
- each decision is logged once, with both figures, what was chosen and how to fix the choice
  (``async_save=True``/``False``); each trial is announced once, before it runs;
- a trial that is never measured (``GIVE_UP_AFTER`` plans of it: it failed, was skipped, or
  fell on a memory-tier save), or background costs that cannot be measured
  (``GIVE_UP_AFTER`` committed background saves without one), end in a logged choice, never
  in a loop of trials: in the first comparison, the background for the rest of the run
  (``deciding`` turns false); when re-deciding, the way that ran before, still watched;
- ``record`` (save thread) only appends; ``plan`` (training thread) only reads what is appended.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .step_clock import LoopCost

__all__ = [
    "DECISIVE",
    "DRIFT",
    "DRIFT_SAVES",
    "GIVE_UP_AFTER",
    "PROBE_SAVES",
    "ModePlan",
    "SaveMode",
]

PROBE_SAVES = 3
"""Background saves with a measured cost whose median is set against the synchronous trial."""
DECISIVE = 1.5
"""A first background cost this many times the trial's, or the trial's this many times it,
decides before ``PROBE_SAVES`` are measured."""
GIVE_UP_AFTER = 10
"""Plans of a synchronous trial, or committed background saves, after which a cost still not
measured is given up on."""
DRIFT = 1.5
"""The chosen way's recent median, this many times its decision figure or less than 1/DRIFT of
it, makes the comparison run again."""
DRIFT_SAVES = 3
"""Costs of the chosen way in that recent median."""

_CHOOSE = "set async_save=True or False to fix the choice"


@dataclass(frozen=True)
class ModePlan:
    """How the next save runs, as rank 0 decided it (broadcast to every rank)."""

    asynchronous: bool
    final: bool
    """True: this way for the rest of the run; no more plans (``deciding`` turns false)."""
    message: str = ""
    """For rank 0 to log (a decision or a trial); empty for most saves."""


@dataclass
class _Comparison:
    """One comparison in progress: the figure already known, and what is still measured."""

    bg_from: int
    """Index into the measured background costs where this comparison's probes start."""
    bg_seen_from: int
    """The committed background saves counted when it started."""
    sync_from: int
    """Index into the synchronous costs where this comparison's trial lands."""
    background: float | None = None
    """Known at the start when re-deciding from the background (its recent median)."""
    background_pace: float | None = None
    synchronous: float | None = None
    """Known at the start when re-deciding from synchronous saves (their recent median)."""
    why: str = ""
    """Why a re-decision runs ('' for the first)."""
    tries: int = 0
    """Plans of the synchronous trial so far."""
    trial_announced: bool = False
    probe_announced: bool = False


@dataclass
class _Choice:
    asynchronous: bool
    figure: float
    """The chosen way's cost the decision was made on."""
    watch_from: int
    """Index into the chosen way's costs where the watch for drift starts."""


class SaveMode:
    """The ``async_save`` setting and, for ``"auto"``, the decision; see the module docstring."""

    def __init__(self, setting: bool | str) -> None:
        self.asynchronous = setting is not False
        self.deciding = setting == "auto"
        self._background: list[LoopCost] = []
        """Measured background costs (the first background save's left out)."""
        self._background_seen = 0
        """Committed background saves, measured or not (the first left out)."""
        self._warmed = False
        self._synchronous: list[float] = []
        self._plans = 0
        self._comparison: _Comparison | None = _Comparison(0, 0, 0)
        self._choice: _Choice | None = None

    # --- rank 0, save thread ----------------------------------------------------------------

    def record(self, asynchronous: bool, cost: LoopCost, *, waited_s: float = 0.0) -> None:
        """A committed save's cost (rank 0, from the save thread). ``waited_s``: how long the
        save first waited for one still writing; a synchronous save is judged without it (the
        background save before it caused that wait, and the trial would otherwise be charged
        for it)."""
        if not self.deciding:
            return
        if asynchronous:
            if not self._warmed:  # it allocated the staging buffers: not a steady cost
                self._warmed = True
                return
            if cost.slowed_s is not None and cost.background_s > 0:
                self._background.append(cost)
            self._background_seen += 1
        elif cost.slowed_s is not None:
            self._synchronous.append(max(0.0, cost.slowed_s - waited_s))

    # --- rank 0, training thread -------------------------------------------------------------

    def plan(self) -> ModePlan:
        """Rank 0: how the next save runs (call only while ``deciding``)."""
        self._plans += 1
        if self._plans == 1:  # the warm-up: buffers allocated, too few steps to measure
            return ModePlan(True, final=False)
        if self._comparison is None:
            return self._watch()
        return self._compare(self._comparison)

    def _compare(self, c: _Comparison) -> ModePlan:
        probes = self._background[c.bg_from :] if c.background is None else []
        seen = self._background_seen - c.bg_seen_from
        if c.background is None and not probes:  # first, a measured background cost
            if seen >= GIVE_UP_AFTER:
                return self._background_not_measured(c)
            return self._probe(c)
        if c.synchronous is None:  # then the synchronous trial
            if len(self._synchronous) > c.sync_from:
                c.synchronous = self._synchronous[c.sync_from]
            elif c.tries >= GIVE_UP_AFTER:
                return self._trial_not_measured(c)
            else:
                c.tries += 1
                first, c.trial_announced = not c.trial_announced, True
                message = self._announce_sync(c, probes) if first else ""
                return ModePlan(False, final=False, message=message)
        if c.background is None:  # then the median of the probes, unless the gap is decisive
            bg = statistics.median(p.slowed_s or 0.0 for p in probes)
            ratio = max(bg, c.synchronous) / max(min(bg, c.synchronous), 1e-9)
            if len(probes) >= PROBE_SAVES or ratio >= DECISIVE or seen >= GIVE_UP_AFTER:
                c.background = bg
                c.background_pace = _pace(probes)
                return self._decide(c, len(probes))
            return self._probe(c)
        return self._decide(c, 0)

    def _probe(self, c: _Comparison) -> ModePlan:
        first, c.probe_announced = not c.probe_announced, True
        if c.why and first:
            message = f"{c.why}: timing background saves again to compare (async_save='auto')"
            return ModePlan(True, final=False, message=message)
        return ModePlan(True, final=False)

    def _decide(self, c: _Comparison, probes: int) -> ModePlan:
        assert c.background is not None and c.synchronous is not None
        bg, sync = c.background, c.synchronous
        background_wins = bg <= sync
        bg_how = f"median of {probes}" if probes else "its recent median"
        if c.background_pace is not None:
            bg_how += f"; steps at {100 * c.background_pace:.0f}% of their pace beside the write"
        # re-deciding from synchronous saves, their figure is their recent median
        sync_how = "its recent median" if c.why and probes else "its stall"
        chosen = "in the background" if background_wins else "synchronously"
        head = f"re-decided ({c.why}): " if c.why else ""
        message = (
            f"{head}background saves cost training {bg:.3f} s each ({bg_how}), a synchronous "
            f"save {sync:.3f} s ({sync_how}): saving {chosen} from now on (async_save='auto' "
            f"compares again if the cost drifts by more than {DRIFT:g}x; {_CHOOSE})"
        )
        self._settle(background_wins, bg if background_wins else sync)
        return ModePlan(background_wins, final=False, message=message)

    def _settle(self, asynchronous: bool, figure: float) -> None:
        costs = self._background if asynchronous else self._synchronous
        self._choice = _Choice(asynchronous, figure, watch_from=len(costs))
        self._comparison = None

    def _watch(self) -> ModePlan:
        choice = self._choice
        assert choice is not None
        if choice.asynchronous:
            since = self._background[choice.watch_from :]
            recent = [c.slowed_s or 0.0 for c in since[-DRIFT_SAVES:]]
        else:
            recent = self._synchronous[choice.watch_from :][-DRIFT_SAVES:]
        if len(recent) < DRIFT_SAVES:
            return ModePlan(choice.asynchronous, final=False)
        now = statistics.median(recent)
        if choice.figure / DRIFT <= now <= choice.figure * DRIFT:
            return ModePlan(choice.asynchronous, final=False)
        way = "background" if choice.asynchronous else "synchronous"
        why = (
            f"the cost of {way} saves moved from {choice.figure:.3f} s to {now:.3f} s "
            f"({now / max(choice.figure, 1e-9):.2f}x; median of the last {DRIFT_SAVES})"
        )
        c = _Comparison(
            bg_from=len(self._background),
            bg_seen_from=self._background_seen,
            sync_from=len(self._synchronous),
            why=why,
        )
        if choice.asynchronous:
            c.background = now
            c.background_pace = _pace(self._background[choice.watch_from :][-DRIFT_SAVES:])
        else:
            c.synchronous = now
        self._comparison = c
        return self._compare(c)

    # --- messages and give-ups --------------------------------------------------------------

    @staticmethod
    def _announce_sync(c: _Comparison, probes: list[LoopCost]) -> str:
        if c.why:
            return (
                f"{c.why}: timing the next save synchronously to compare again (async_save='auto')"
            )
        bg = statistics.median(p.slowed_s or 0.0 for p in probes)
        pace = _pace(probes)
        seen = (
            "" if pace is None else f"; steps at {100 * pace:.0f}% of their pace beside the write"
        )
        return (
            f"background saves cost training {bg:.3f} s each so far (median of {len(probes)}"
            f"{seen}): timing this save synchronously to compare (async_save='auto' keeps the "
            f"cheaper way; {_CHOOSE})"
        )

    def _trial_not_measured(self, c: _Comparison) -> ModePlan:
        not_measured = (
            f"the synchronous save to compare with was not measured in {GIVE_UP_AFTER} saves "
            "(it failed, was skipped, or fell on a memory-tier save)"
        )
        if c.background is None:  # the first comparison: its probes so far, for good
            bg = statistics.median(p.slowed_s or 0.0 for p in self._background[c.bg_from :])
            return ModePlan(
                True,
                final=True,
                message=(
                    f"{not_measured}: saving in the background for the rest of the run, at "
                    f"{bg:.3f} s per save as measured (async_save='auto'; {_CHOOSE})"
                ),
            )
        self._settle(True, c.background)  # a re-decision: the background, still watched
        return ModePlan(
            True,
            final=False,
            message=(
                f"{c.why}, but {not_measured}: saving in the background from now on, at "
                f"{c.background:.3f} s per save (async_save='auto'; {_CHOOSE})"
            ),
        )

    def _background_not_measured(self, c: _Comparison) -> ModePlan:
        why = (
            f"the cost of background saves could not be measured in {GIVE_UP_AFTER} saves (it "
            "needs optimizer steps that a write overlaps by different amounts)"
        )
        if c.synchronous is None:  # the first comparison: the background, as it ran so far
            return ModePlan(
                True,
                final=True,
                message=(
                    f"{why}, so it cannot be compared with a synchronous save's: saving in the "
                    f"background for the rest of the run (async_save='auto'; {_CHOOSE})"
                ),
            )
        self._settle(False, c.synchronous)
        return ModePlan(
            False,
            final=False,
            message=(
                f"{c.why}, but {why}: saving synchronously from now on, at "
                f"{c.synchronous:.3f} s per save (async_save='auto'; {_CHOOSE})"
            ),
        )

    # --- every rank --------------------------------------------------------------------------

    def apply(self, plan: ModePlan) -> None:
        """Every rank: follow rank 0's plan."""
        self.asynchronous = plan.asynchronous
        if plan.final:
            self.deciding = False


def _pace(costs: list[LoopCost]) -> float | None:
    speeds = [c.speed for c in costs if c.speed is not None]
    return statistics.median(speeds) if speeds else None
