"""``async_save="auto"`` (``SaveMode``) driven with synthetic costs, the way ``Saver`` drives it.

A ``Run`` plays the saver's side of the protocol: at every save rank 0 plans, every rank
applies the plan, the save runs the way the plan says, and its cost is recorded when it
commits: a synchronous save inside ``save()``, a background one (with ``lag``) only after the
next save's plan, as when the next ``save()`` plans before it joins the save in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dckpt.save.mode import (
    DECISIVE,
    DRIFT,
    GIVE_UP_AFTER,
    PROBE_SAVES,
    ModePlan,
    SaveMode,
)
from dckpt.save.step_clock import LoopCost

Cost = Callable[[int], float | None]
"""The cost of save ``i`` (1-based) the way it ran; None: not measured."""


def background(slowed: float | None, speed: float = 0.5) -> LoopCost:
    return LoopCost(
        slowed_s=slowed,
        stall_s=0.08,
        background_s=1.5,
        step_s=1.0,
        speed=None if slowed is None else speed,
        steps=8 if slowed is not None else 0,
        why_not="" if slowed is not None else "(every step overlapped a write alike)",
    )


def synchronous(stall: float) -> LoopCost:
    return LoopCost(
        slowed_s=stall, stall_s=stall, background_s=0.0, step_s=1.0, speed=None, steps=0
    )


class Run:
    """One rank 0 and one other rank, each with its own ``SaveMode``, as in a 2-rank job."""

    def __init__(
        self,
        bg: Cost,
        sync: Cost | None,
        *,
        speed: float = 0.5,
        lag: bool = True,
        waited: float = 0.0,
    ) -> None:
        self.rank0, self.rank1 = SaveMode("auto"), SaveMode("auto")
        self.bg, self.sync, self.speed, self.lag = bg, sync, speed, lag
        self.waited = waited  # of each synchronous stall, the wait for the save in flight
        self.ways: list[bool] = []
        self.messages: list[str] = []
        self.plans: list[ModePlan] = []
        self._in_flight: LoopCost | None = None

    def save(self) -> ModePlan:
        i = len(self.ways) + 1
        assert self.rank0.deciding == self.rank1.deciding
        plan = self.rank0.plan()
        self.plans.append(plan)
        for mode in (self.rank0, self.rank1):  # what rode the broadcast, applied everywhere
            mode.apply(plan)
        if plan.message:
            self.messages.append(plan.message)
        if self._in_flight is not None:  # joined now, after the plan: its cost comes late
            self.rank0.record(True, self._in_flight)
            self._in_flight = None
        asynchronous = self.rank0.asynchronous
        assert asynchronous == self.rank1.asynchronous
        self.ways.append(asynchronous)
        if asynchronous:
            cost = background(self.bg(i), self.speed)
            if self.lag:
                self._in_flight = cost
            else:
                self.rank0.record(True, cost)
        elif self.sync is not None:
            stall = self.sync(i)
            if stall is not None:  # None: the save failed, nothing committed or recorded
                self.rank0.record(False, synchronous(stall), waited_s=self.waited)
        return plan

    def saves(self, n: int) -> Run:
        for _ in range(n):
            if not self.rank0.deciding:
                break
            self.save()
        return self

    def decisions(self) -> list[str]:
        return [m for m in self.messages if "from now on" in m or "rest of the run" in m]


def const(value: float | None) -> Cost:
    return lambda _i: value


def test_background_cheaper_keeps_the_background() -> None:
    run = Run(bg=const(0.30), sync=const(0.40)).saves(12)
    # the first saves run in the background; once one has a measured cost (save 2, known
    # after save 3's plan), the next is the one synchronous trial
    assert run.ways[:4] == [True, True, True, False]
    assert all(run.ways[4:]), run.ways
    (decided,) = run.decisions()
    assert "background saves cost training 0.300 s each (median of 3" in decided
    assert "a synchronous save 0.400 s (its stall)" in decided
    assert "saving in the background from now on" in decided
    assert "async_save=True or False" in decided
    assert run.rank0.deciding and run.rank1.deciding  # re-deciding stays possible
    assert not any(p.final for p in run.plans)


def test_synchronous_cheaper_saves_synchronously_even_when_steps_keep_their_pace() -> None:
    # steps at 80% of their pace beside the write used to end the decision there, untried
    run = Run(bg=const(0.40), sync=const(0.30), speed=0.8).saves(12)
    (decided,) = run.decisions()
    assert "background saves cost training 0.400 s each (median of 3" in decided
    assert "80% of their pace" in decided
    assert "a synchronous save 0.300 s" in decided and "saving synchronously from now on" in decided
    assert run.ways[-6:] == [False] * 6
    # the warm-up, the probes, and one more planned before the last probe's cost came in
    assert run.ways.count(True) == 1 + PROBE_SAVES + 1


def test_the_trial_is_announced_once_before_it_runs() -> None:
    run = Run(bg=const(0.30), sync=const(0.40)).saves(5)
    trial = run.plans[3]
    assert not trial.asynchronous
    assert "background saves cost training 0.300 s each so far (median of 1" in trial.message
    assert "timing this save synchronously to compare" in trial.message
    assert "async_save=True or False" in trial.message
    assert [p.message for p in run.plans[:3]] == ["", "", ""] and run.plans[4].message == ""


def test_a_decisive_gap_decides_without_waiting_for_more_probes() -> None:
    # the job: background 0.548 s, synchronous 0.291 s (1.88x)
    assert DECISIVE <= 0.548 / 0.291
    run = Run(bg=const(0.548), sync=const(0.291), lag=False).saves(10)
    # warm-up, one measured probe, the trial, decided
    assert run.ways[:4] == [True, True, False, False]
    (decided,) = run.decisions()
    assert "(median of 1;" in decided and "saving synchronously" in decided


def test_close_costs_wait_for_the_median_of_the_probes() -> None:
    costs = {2: 0.75, 4: 0.5, 5: 0.52}  # one noisy probe, 1.25x the trial, does not decide
    run = Run(bg=lambda i: costs.get(i, 0.5), sync=const(0.6), lag=False).saves(8)
    assert run.ways[:3] == [True, True, False]
    (decided,) = run.decisions()
    assert "background saves cost training 0.520 s each (median of 3" in decided
    assert "in the background from now on" in decided


def test_the_first_background_save_is_not_counted() -> None:
    costs = {1: 5.0}  # it allocated the staging buffers
    run = Run(bg=lambda i: costs.get(i, 0.3), sync=const(0.4), lag=False).saves(8)
    (decided,) = run.decisions()
    assert "0.300 s each (median of 3" in decided
    assert "5.000" not in " ".join(run.messages)


def test_a_drift_of_the_background_cost_runs_a_new_trial_and_a_new_decision() -> None:
    # background cheaper at first; then (another job, a change in data loading) it doubles
    def bg(i: int) -> float:
        return 0.30 if i <= 8 else 0.70

    run = Run(bg=bg, sync=const(0.45)).saves(24)
    first, second = run.decisions()
    assert "saving in the background from now on" in first
    assert second.startswith(
        "re-decided (the cost of background saves moved from 0.300 s to 0.700 s (2.33x; median"
    )
    assert "background saves cost training 0.700 s each" in second
    assert "a synchronous save 0.450 s (its stall)" in second
    assert "saving synchronously from now on" in second
    trials = [m for m in run.messages if "timing the next save synchronously" in m]
    assert len(trials) == 1 and "0.700 s" in trials[0]
    assert run.ways.count(False) >= 2 and run.ways[-3:] == [False] * 3
    assert run.rank0.deciding


def test_a_drift_of_the_synchronous_cost_times_background_saves_again() -> None:
    def sync(i: int) -> float:
        return 0.30 if i <= 10 else 0.90

    run = Run(bg=const(0.50), sync=sync).saves(30)
    first, second = run.decisions()
    assert "saving synchronously from now on" in first
    assert (
        "re-decided (the cost of synchronous saves moved from 0.300 s to 0.900 s (3.00x" in second
    )
    assert "a synchronous save 0.900 s (its recent median)" in second
    assert "background saves cost training 0.500 s each (median of 1" in second
    assert "saving in the background from now on" in second
    assert any("timing background saves again" in m for m in run.messages)
    assert run.ways[-3:] == [True] * 3


def test_a_drift_within_the_band_changes_nothing() -> None:
    def bg(i: int) -> float:
        return 0.30 if i <= 8 else 0.30 * DRIFT * 0.95

    run = Run(bg=bg, sync=const(0.60)).saves(30)
    assert len(run.decisions()) == 1
    assert run.ways.count(False) == 1  # the first trial only


def test_a_drop_in_the_cost_re_decides_too() -> None:
    def sync(i: int) -> float:
        return 0.30 if i <= 10 else 0.15  # faster storage: the synchronous save halves

    run = Run(bg=const(0.60), sync=sync).saves(30)
    first, second = run.decisions()
    assert "saving synchronously from now on" in first
    assert "synchronous saves moved from 0.300 s to 0.150 s (0.50x" in second
    assert "saving synchronously from now on" in second  # the background is still dearer
    assert run.ways[-3:] == [False] * 3


def test_unmeasurable_background_costs_give_up_on_the_background() -> None:
    run = Run(bg=const(None), sync=const(0.40)).saves(40)
    (decided,) = run.decisions()
    assert f"could not be measured in {GIVE_UP_AFTER} saves" in decided
    assert "cannot be compared with a synchronous save's" in decided
    assert "saving in the background for the rest of the run" in decided
    assert not run.rank0.deciding and not run.rank1.deciding
    assert run.plans[-1].final and all(run.ways)  # no synchronous save without a figure
    assert len(run.ways) <= GIVE_UP_AFTER + 3


def test_a_trial_that_is_never_measured_keeps_the_background() -> None:
    run = Run(bg=const(0.3), sync=const(None)).saves(40)  # every synchronous save fails
    (decided,) = run.decisions()
    assert "the synchronous save to compare with was not measured in 10 saves" in decided
    assert "saving in the background for the rest of the run, at 0.300 s per save" in decided
    assert not run.rank0.deciding and run.ways[-1]
    assert run.ways.count(False) == GIVE_UP_AFTER


def test_a_re_decision_whose_trial_is_not_measured_keeps_the_current_way() -> None:
    def sync(i: int) -> float | None:
        return 0.45 if i <= 5 else None  # the later trial fails

    run = Run(bg=lambda i: 0.30 if i <= 8 else 0.70, sync=sync).saves(40)
    decisions = run.decisions()
    assert "saving in the background from now on" in decisions[0]
    assert "was not measured" in decisions[1] and "saving in the background" in decisions[1]
    assert run.rank0.deciding and run.ways[-1]


def test_each_decision_has_both_figures() -> None:
    runs = [
        Run(bg=const(0.30), sync=const(0.45)),
        Run(bg=const(0.60), sync=const(0.30)),
        Run(bg=lambda i: 0.30 if i <= 8 else 0.70, sync=const(0.45)),
    ]
    for run in runs:
        run.saves(30)
        for decided in run.decisions():
            assert decided.count(" s ") + decided.count(" s)") >= 2, decided
            assert "background saves cost training" in decided
            assert "a synchronous save" in decided


@pytest.mark.parametrize("setting", [True, False])
def test_fixed_settings_never_change(setting: bool) -> None:
    mode = SaveMode(setting)
    assert not mode.deciding and mode.asynchronous is setting
    mode.record(True, background(0.3))
    mode.record(False, synchronous(0.1))
    assert not mode.deciding and mode.asynchronous is setting


def test_a_synchronous_trial_is_judged_without_its_wait_for_the_save_in_flight() -> None:
    # the trial's stall of 0.8 s began with 0.6 s waiting for the background save before it
    # to finish writing: that wait is the background save's doing, not synchronous saving's
    run = Run(bg=const(0.30), sync=const(0.80), waited=0.6).saves(12)
    (decided,) = run.decisions()
    assert "a synchronous save 0.200 s (its stall)" in decided, decided
    assert "saving synchronously from now on" in decided


def test_a_trial_whose_save_did_not_run_is_planned_again_silently() -> None:
    # save 4 was the trial, but it was skipped (when=False) or fell on the memory tier
    run = Run(bg=const(0.30), sync=lambda i: None if i == 4 else 0.60).saves(10)
    assert run.ways[3:5] == [False, False]
    assert run.plans[4].message == ""  # announced once, before the first try
    (decided,) = run.decisions()
    assert "a synchronous save 0.600 s (its stall)" in decided
    assert "saving in the background from now on" in decided


def test_a_re_decision_whose_background_cost_is_not_measured_keeps_synchronous_saves() -> None:
    def bg(i: int) -> float | None:
        return 0.60 if i <= 6 else None  # later, every step overlaps a write alike

    run = Run(bg=bg, sync=lambda i: 0.30 if i <= 10 else 0.90).saves(40)
    first, second = run.decisions()
    assert "saving synchronously from now on" in first
    assert "the cost of synchronous saves moved from 0.300 s to 0.900 s" in second
    assert "could not be measured in 10 saves" in second
    assert "saving synchronously from now on, at 0.900 s per save" in second
    assert run.rank0.deciding and not run.ways[-1]


def test_a_memory_save_makes_no_plan(tmp_path: Path) -> None:
    """A memory save cannot run synchronously (its copy in ``save()`` is the snapshot): rank 0
    plans only for saves that may block, so a run of memory saves between durable ones never
    spends the synchronous trial or counts toward giving up."""
    from test_memory_ledger import _manager

    mgr, _net = _manager(tmp_path / "ckpt", tmp_path / "mem")
    with mgr:
        mode = mgr._saver._mode
        assert mode.deciding  # async_save="auto" is the default
        mgr.save(1).result()
        plans = mode._plans
        for step in range(2, 6):
            mgr.save(step, tier="memory").result()
        assert mode._plans == plans
        mgr.save(6).result()
        assert mode._plans == plans + 1
