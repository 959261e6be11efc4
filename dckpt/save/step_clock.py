"""What a save costs the training loop, read from the loop's own step times.

The time ``save()`` blocks (the *stall*) is not what a save costs: while the write runs in the
background it takes CPU, memory bandwidth and the GIL from the training steps. On a box whose
cores the training already fills (a CPU job, or a GPU job whose data loading eats the cores) a
background save with a 0.08 s stall slowed the loop by almost a second. This module measures
that loss from step times, so the save line, the manifest, ``dckpt inspect`` and ``dckpt plan``
report what training really paid.

How (``StepClock``): an optimizer step pre-hook calls ``tick()`` at every step. For each step
interval (tick to tick) it records its length ``dt``, the part of it the loop was blocked in
``save()`` (``s``) and the part a background write ran beside it (``q``). A step needs ``b``
seconds of work at the loop's own pace and progresses at speed ``r`` beside a write, so::

    dt - s = b + (1 - r) * q

A robust line fit (Theil-Sen: the median of pairwise slopes) over the recent intervals gives
the slope ``1 - r`` and the pace ``b``; steps with no save in flight (``q = 0``) and steps that a
write overlapped only in part pin it down. A save that blocked for ``stall`` and ran ``W``
seconds in the background then cost the loop::

    cost = stall + (1 - r) * W            ("training slowed": what the loop lost in all)

The slope is kept within [0, 1]: a write never speeds the loop up, and a cost above
``stall + W`` (effects that outlast the write) is not attributed to it. A synchronous save has
``W = 0``: its cost is its stall. Saves so close together that every
step overlaps a write about equally leave the slope undetermined; then the last measured slope
is used, and before there is one the save line says the cost was not measured, and why.

Invariants:
- ``tick`` and ``save_returned`` run on the training thread, ``save_ended`` and ``cost`` on the
  save thread; a save's window is a small list whose slots are each written by one thread,
  and the deques are appended whole, so no lock is needed and ``tick`` stays cheap (it runs
  every step);
- nothing here blocks, raises into the loop, or touches a tensor.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

from ..robust import intercept, theil_sen_slope

__all__ = ["LoopCost", "StepClock", "describe_cost"]

MIN_STEPS = 4
"""Step intervals needed for a fit."""
WINDOW = 32
"""The fit uses this many most recent step intervals."""
MIN_SPREAD = 0.25
"""The write overlaps must differ by this fraction of a step for the slope to be determined."""


@dataclass(frozen=True, kw_only=True)
class LoopCost:
    """What one save cost the training loop (rank 0's loop; DDP/FSDP ranks move in step)."""

    slowed_s: float | None
    """Extra wall time of the loop, the stall included; None when it could not be measured."""
    stall_s: float
    background_s: float
    """How long the loop ran beside the background write (``W``)."""
    step_s: float | None
    """The loop's own pace ``b``: seconds per step with no save in flight."""
    speed: float | None
    """Training speed beside a background write, 1.0 = full pace (``r``)."""
    steps: int
    """Step intervals the fit used (0 for a synchronous save: its stall is its cost)."""
    why_not: str = ""

    def timings(self) -> dict[str, float]:
        """The manifest's timings for this cost (nothing when it was not measured)."""
        if self.slowed_s is None:
            return {}
        out = {"training_slowed_s": self.slowed_s, "background_s": self.background_s}
        if self.step_s is not None and self.speed is not None:
            out |= {"step_s": self.step_s, "speed_during_write": self.speed}
            out["steps_fitted"] = float(self.steps)
        return out

    def phrase(self, write_s: float) -> str:
        """The save line's part: ``stall 0.080 s, training slowed 0.41 s over the 1.2 s write``."""
        head = f"stall {self.stall_s:.3f} s"
        if self.slowed_s is None:
            return f"{head}, training slowdown not measured {self.why_not}"
        if self.background_s <= 0 or self.speed is None:
            return f"{head}, training slowed {self.slowed_s:.3f} s"
        return (
            f"{head}, training slowed {self.slowed_s:.2f} s over the {write_s:.2f} s write "
            f"(steps at {100 * self.speed:.0f}% pace beside it)"
        )


def describe_cost(timings: dict[str, float], write_s: float) -> str:
    """The cost phrase from a manifest's timings (``dckpt inspect``); '' when not recorded."""
    if "training_slowed_s" not in timings:
        return ""
    return LoopCost(
        slowed_s=timings["training_slowed_s"],
        stall_s=timings.get("stall_s", 0.0),
        background_s=timings.get("background_s", 0.0),
        step_s=timings.get("step_s"),
        speed=timings.get("speed_during_write"),
        steps=int(timings.get("steps_fitted", 0)),
    ).phrase(write_s)


@dataclass(frozen=True)
class _Fit:
    slope: float
    pace: float
    steps: int


class StepClock:
    """Step times of the training loop and the saves beside them; see the module docstring."""

    def __init__(self) -> None:
        self._last_tick: float | None = None
        self._seen = 0
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        """(dt, write overlap q, stall overlap s) of recent step intervals."""
        self._windows: deque[list[float | None]] = deque(maxlen=4)
        """[start, returned, ended] of recent saves; None until known."""
        self._last_fit: _Fit | None = None

    def tick(self, now: float | None = None) -> None:
        """One optimizer step began (called by the step pre-hook, every step)."""
        now = time.perf_counter() if now is None else now
        last, self._last_tick = self._last_tick, now
        self._seen += 1
        if last is None or self._seen <= 2:  # the first step pays for lazy allocations
            return
        q, s = self._overlaps(last, now)
        self._steps.append((now - last, q, s))

    @property
    def steps_seen(self) -> int:
        """Optimizer steps ticked so far."""
        return self._seen

    def save_started(self, now: float) -> None:
        self._windows.append([now, None, None])

    def save_returned(self, start: float, now: float) -> None:
        """``save()`` gave the loop back (training thread)."""
        for window in list(self._windows):
            if window[0] == start:
                window[1] = now

    def save_ended(self, start: float, now: float | None = None) -> None:
        """The save's write is over, committed or not (save thread)."""
        now = time.perf_counter() if now is None else now
        for window in list(self._windows):
            if window[0] == start:
                window[2] = now

    def _overlaps(self, a: float, b: float) -> tuple[float, float]:
        """(write, stall) seconds of saves inside the interval [a, b]."""
        write = stall = 0.0
        for start, returned, ended in list(self._windows):
            assert start is not None
            unblocked = b if returned is None else returned
            end = b if ended is None else ended
            stall += max(0.0, min(b, unblocked) - max(a, start))
            write += max(0.0, min(b, end) - max(a, unblocked))
        return write, stall

    def _fit(self) -> _Fit | None:
        steps = list(self._steps)
        if len(steps) < MIN_STEPS:
            return None
        qs = [q for _, q, _ in steps]
        spread = max(qs) - min(qs)
        if spread < MIN_SPREAD * statistics.median(dt for dt, _, _ in steps):
            return None
        ys = [dt - s for dt, _, s in steps]
        raw = theil_sen_slope(qs, ys, MIN_SPREAD * spread)
        if raw is None:
            return None
        slope = min(1.0, max(0.0, raw))
        return _Fit(slope=slope, pace=intercept(qs, ys, slope), steps=len(steps))

    def cost(self, t0: float, stall_s: float, t_end: float) -> LoopCost:
        """What the save that started at ``t0`` and blocked for ``stall_s`` cost the loop, as
        known at ``t_end`` (when the write ended)."""
        background = max(0.0, t_end - t0 - stall_s)
        fit = self._fit() or self._last_fit
        if fit is not None:
            self._last_fit = fit
        if background <= 0:  # synchronous: the loop waited and did nothing else
            return LoopCost(
                slowed_s=stall_s,
                stall_s=stall_s,
                background_s=0.0,
                step_s=fit.pace if fit else None,
                speed=None,
                steps=0,
            )
        if fit is None:
            if self._seen == 0:
                why = "(no optimizer step seen)"
            elif len(self._steps) < MIN_STEPS:
                why = f"yet ({len(self._steps)} of {MIN_STEPS} steps timed)"
            else:
                why = "(every step overlapped a write alike: saves closer together than a write)"
            return LoopCost(
                slowed_s=None,
                stall_s=stall_s,
                background_s=background,
                step_s=None,
                speed=None,
                steps=0,
                why_not=why,
            )
        return LoopCost(
            slowed_s=stall_s + fit.slope * background,
            stall_s=stall_s,
            background_s=background,
            step_s=fit.pace,
            speed=1.0 - fit.slope,
            steps=fit.steps,
        )
