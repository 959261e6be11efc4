"""What a save costs the training loop: the step-time model, and a 2-rank run.

The clock is fed a simulated loop whose truth is known (a pace, a speed beside the write, saves
that block and then write), so the estimate can be checked to the percent (``SaveMode``, the
``async_save="auto"`` decision, is fed synthetic costs in test_save_mode.py); the 2-rank run
checks that every rank follows rank 0's decision, that the save line and the manifest carry
the measured cost, and that ``dckpt inspect`` and ``dckpt plan`` use it."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import dckpt_cli
from dist_harness import run_world

from dckpt.save.step_clock import LoopCost, StepClock, describe_cost


class Loop:
    """A simulated training loop: ``pace`` s of work per step, ``speed`` beside a write."""

    def __init__(self, pace: float, speed: float, noise: float = 0.0, seed: int = 0) -> None:
        self.clock = StepClock()
        self.now = 100.0
        self.pace, self.speed, self.noise = pace, speed, noise
        self.rng = random.Random(seed)
        self.write_until = 0.0
        self.truth: list[float] = []

    def work(self, seconds: float) -> None:
        """Do ``seconds`` of full-pace work, slower while a write runs."""
        left = seconds
        while left > 1e-12:
            if self.now < self.write_until:
                wall = min(self.write_until - self.now, left / self.speed)
                self.now += wall
                left -= wall * self.speed
            else:
                self.now += left
                left = 0.0

    def step(self) -> None:
        self.clock.tick(self.now)
        jitter = self.rng.uniform(-self.noise, self.noise) * self.pace
        self.work(self.pace + jitter)

    def save(self, stall: float, write: float) -> LoopCost:
        """Call save() right after a tick: block ``stall`` s, then write ``write`` s beside the
        loop; return the clock's estimate at the end of the write."""
        self.clock.tick(self.now)
        self.work(0.1 * self.pace)  # the optimizer step, before save() is called
        t0 = self.now
        self.clock.save_started(t0)
        self.now += stall
        self.clock.save_returned(t0, self.now)
        end = self.now + write
        self.write_until = end
        self.truth.append(stall + (1 - self.speed) * write)
        self.work(0.9 * self.pace)
        while self.now < end:  # steps until the write is over
            self.step()
        cost = self.clock.cost(t0, stall, end)
        self.clock.save_ended(t0, end)
        return cost


def test_background_cost_is_read_from_step_times() -> None:
    loop = Loop(pace=1.0, speed=0.5)
    for _ in range(5):
        loop.step()
    costs = []
    for _ in range(6):
        costs.append(loop.save(stall=0.08, write=1.5))
        loop.step()
    for cost, truth in zip(costs[1:], loop.truth[1:], strict=True):
        assert cost.slowed_s == pytest.approx(truth, rel=0.02)
        assert cost.speed == pytest.approx(0.5, abs=0.01)
        assert cost.step_s == pytest.approx(1.0, rel=0.02)
    assert "training slowed 0.83 s over the 1.58 s write (steps at 50% pace" in costs[-1].phrase(
        1.58
    )
    timings = {"stall_s": 0.08, **costs[-1].timings()}
    assert timings["training_slowed_s"] == pytest.approx(0.83, rel=0.02)
    assert describe_cost(timings, 1.58) == costs[-1].phrase(1.58)


def test_saves_every_other_step_are_measured_without_quiet_steps() -> None:
    # The job: a save every 2 steps and a write longer than a step, so no step runs
    # without a save in flight; the partly overlapped steps still fix the line.
    loop = Loop(pace=0.9, speed=0.6, noise=0.05, seed=3)
    loop.step()
    loop.step()
    costs = [loop.save(stall=0.08, write=1.6) for _ in range(8)]
    measured = [c for c in costs if c.slowed_s is not None]
    assert len(measured) >= 5
    total = sum(c.slowed_s or 0.0 for c in measured)
    truth = sum(t for c, t in zip(costs, loop.truth, strict=True) if c.slowed_s is not None)
    assert total == pytest.approx(truth, rel=0.15)


def test_a_noisy_step_does_not_move_the_estimate() -> None:
    loop = Loop(pace=1.0, speed=0.6)
    for _ in range(6):
        loop.step()
    loop.now += 2.0  # one step three times its length (another job on the box)
    loop.step()
    for _ in range(3):
        cost = loop.save(stall=0.05, write=1.0)
        loop.step()
        loop.step()
    assert cost.slowed_s == pytest.approx(0.05 + 0.4 * 1.0, rel=0.05)


def test_synchronous_cost_is_the_stall_and_unmeasured_says_why() -> None:
    clock = StepClock()
    cost = clock.cost(10.0, 1.5, 11.5)  # synchronous: nothing ran beside it
    assert cost.slowed_s == 1.5 and "training slowed 1.500 s" in cost.phrase(1.5)
    background = clock.cost(10.0, 0.1, 11.0)
    assert background.slowed_s is None and background.timings() == {}
    assert "training slowdown not measured (no optimizer step seen)" in background.phrase(1.0)
    for _ in range(3):
        clock.tick()
    assert "not measured yet (1 of 4 steps timed)" in clock.cost(10.0, 0.1, 11.0).phrase(1.0)


def _auto_run(rank: int, world: int, root: str) -> dict[str, Any]:
    import tiny_training

    import dckpt

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("dckpt").addHandler(Keep())
    net, opt = tiny_training.model(width=512)
    state = dckpt.TrainState(net, opt)
    modes = []
    with dckpt.CheckpointManager(dckpt.CheckpointConfig(root=Path(root)), state) as manager:
        for step in range(1, 25):
            time.sleep(0.05)  # the forward and backward of a real model
            tiny_training.step(net, opt, step, width=512)
            if step % 2 == 0:
                manager.save(step)
                modes.append(manager._saver.asynchronous)
    return {"modes": modes, "log": records}


def test_every_rank_follows_rank_0s_decision_and_the_cost_is_recorded(tmp_path: Path) -> None:
    results = run_world(_auto_run, 2, str(tmp_path), timeout=180)
    assert results[0]["modes"] == results[1]["modes"]
    log = results[0]["log"]
    decided = [m for m in log if "from now on" in m or "for the rest of the run" in m]
    assert decided, log  # a re-decision may follow the first, each with both figures
    for message in decided:
        assert "background saves" in message and "synchronous save" in message, message
    assert len(decided) == len(set(decided)), log  # each logged once
    measured = [m for m in log if m.startswith("dckpt: saved step") and "training slowed" in m]
    assert measured, log
    manifest = json.loads((tmp_path / "step-00000024" / "manifest.json").read_text())
    timings = manifest["timings"]
    assert timings["training_slowed_s"] >= timings["stall_s"] - 1e-9
    human = dckpt_cli("inspect", str(tmp_path))
    assert human.returncode == 0 and "training slowed" in human.stdout, human.stdout
    plan = json.loads(dckpt_cli("plan", str(tmp_path), "--json").stdout)
    assert plan["inputs"]["stall_s"] == pytest.approx(timings["training_slowed_s"])
