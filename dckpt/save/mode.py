"""Background or synchronous: the ``async_save="auto"`` decision, made from measured costs.

A background save is meant to cost the loop less than a synchronous one. On a box whose cores
the training already fills, it may not: the write takes its CPU from the steps. ``SaveMode``
decides from what the saves really cost (``step_clock.LoopCost``), on rank 0, and the manager
broadcasts rank 0's plan so every rank saves the same way:

1. saves run in the background until ``PROBE_SAVES`` of them have a measured cost;
2. if the loop kept at least ``SLOW_PACE`` of its pace during those writes (median), the
   background wins and the decision is final: no synchronous save is ever tried (a GPU job
   whose steps do not wait on the CPU ends here);
3. otherwise the next save is synchronous, and its cost (its stall: the loop does nothing else)
   is set against the median background cost; the cheaper way is kept for the rest of the run.

Invariants: the decision is logged once, with both figures (a synchronous trial is announced
before it runs); ``async_save=True`` or ``False``
never changes; only rank 0's measurements count (its loop moves in step with the others); the
plan is broadcast only while undecided (the first few saves), so later saves run no collective.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .step_clock import LoopCost

__all__ = ["PROBE_SAVES", "SLOW_PACE", "ModePlan", "SaveMode"]

PROBE_SAVES = 3
"""Background saves with a measured cost before the decision."""
GIVE_UP_AFTER = 10
"""Saves after which, still without ``PROBE_SAVES`` measured costs, the background is kept."""
SLOW_PACE = 0.7
"""Below this pace during the write (median), one synchronous save is timed to compare."""


@dataclass(frozen=True)
class ModePlan:
    """How the next save runs, as rank 0 decided it (broadcast to every rank)."""

    asynchronous: bool
    final: bool
    message: str = ""


class SaveMode:
    """The ``async_save`` setting and, for ``"auto"``, the decision; see the module docstring."""

    def __init__(self, setting: bool | str) -> None:
        self.asynchronous = setting is not False
        self.deciding = setting == "auto"
        self._background: list[LoopCost] = []
        self._trial: LoopCost | None = None
        self._trying = False
        self._plans = 0

    def record(self, asynchronous: bool, cost: LoopCost) -> None:
        """A committed save's cost (rank 0, from the save thread)."""
        if not self.deciding or cost.slowed_s is None:
            return
        if asynchronous and cost.background_s > 0:
            self._background.append(cost)
        elif not asynchronous and self._trying:
            self._trial = cost

    def plan(self) -> ModePlan:
        """Rank 0: how the next save runs (call only while ``deciding``)."""
        self._plans += 1
        if len(self._background) < PROBE_SAVES:
            if self._plans <= GIVE_UP_AFTER:
                return ModePlan(True, final=False)
            return ModePlan(
                True,
                final=True,
                message=(
                    f"the cost of background saves could not be measured in {GIVE_UP_AFTER} "
                    "saves (it needs optimizer steps that a write overlaps by different amounts): "
                    "saving in the background (async_save='auto')"
                ),
            )
        bg = statistics.median(c.slowed_s or 0.0 for c in self._background)
        pace = statistics.median(c.speed or 0.0 for c in self._background)
        if pace >= SLOW_PACE:
            return ModePlan(
                True,
                final=True,
                message=(
                    f"background saves cost training {bg:.3f} s each (median of "
                    f"{len(self._background)}; steps kept {100 * pace:.0f}% of their pace during "
                    "the write): saving in the background (async_save='auto')"
                ),
            )
        if self._trial is None:
            if self._trying:  # the trial save failed or was not measured: stay in the background
                return ModePlan(True, final=True, message=self._no_trial(bg, pace))
            self._trying = True
            return ModePlan(
                False,
                final=False,
                message=(
                    f"background saves hold training at {100 * pace:.0f}% of its pace while they "
                    f"write ({bg:.3f} s per save): timing the next save synchronously to compare "
                    "(async_save='auto')"
                ),
            )
        sync = self._trial.slowed_s or 0.0
        background_wins = bg <= sync
        return ModePlan(
            background_wins,
            final=True,
            message=(
                f"background saves cost training {bg:.3f} s each (median of "
                f"{len(self._background)}), a synchronous save {sync:.3f} s: saving "
                + ("in the background" if background_wins else "synchronously")
                + " from now on (async_save='auto'; set async_save=True or False to choose)"
            ),
        )

    @staticmethod
    def _no_trial(bg: float, pace: float) -> str:
        return (
            f"background saves hold training at {100 * pace:.0f}% of its pace ({bg:.3f} s per "
            "save) but the synchronous save to compare with was not measured: saving in the "
            "background (async_save='auto')"
        )

    def apply(self, plan: ModePlan) -> None:
        """Every rank: follow rank 0's plan."""
        self.asynchronous = plan.asynchronous
        if plan.final:
            self.deciding = False
