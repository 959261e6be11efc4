"""The loss watch: the last losses before a save go into its manifest; after a resume, the
first losses are compared with where those were heading. No torch, no collective.

What is saved (``summary``, rank 0's losses: the manifest records the rank that builds it):
the last ``TAIL`` finite losses with their median and MAD, and the mean and std of the last
64 (the window).

The verdict, after ``steps`` losses (``observe`` on every rank, every step), in robust
statistics so one noisy batch decides nothing:

- the saved tail gives a level (median of its last quarter) and a trend (Theil-Sen slope);
  the expected median of the first losses after the resume lies between the level and the
  trend carried forward, so neither a loss that flattens nor one that keeps falling trips it;
- the margin above that is ``max(4 * noise, 5 % of |expected|)``, and twice that below
  (dckpt.robust): ``noise`` is the MAD of the tail around its trend, scaled to a standard
  deviation; the relative margin works for negative losses too;
- the median of the first losses must lie inside; a non-finite loss fails at once. Above is a
  resume that lost state (a re-initialised model, a wrong optimizer state, or data from
  another part of a stream whose difficulty changes); below is one that may be replaying data
  it already learned from, or a changed objective. A wrong data position over stationary data
  (shuffled pretraining text) looks like the right one: no loss can tell them apart.

A checkpoint that records no usable losses still gets a verdict (``guard``): a non-finite
loss among the first ``steps`` fails at once, and ``steps`` finite ones pass, compared with
nothing.

The verdict is one line in the resume report's format, logged by rank 0 (each rank compares
its own losses with rank 0's record); with ``raise`` the ranks agree first
(dckpt.load.watch), and ``LossDeviationError`` is raised on every rank or on none. Rank 0 also
records it in the root (dckpt.root.resume_record), so a checkpoint that fails on every
resume is not picked again and again.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import TYPE_CHECKING, Any

from ..errors import LossDeviationError
from ..robust import LOSS_REL, LOSS_SIGMA, expected_band, mad

if TYPE_CHECKING:
    from ..config import LossWatchAction

__all__ = ["LossVerdict", "LossWatch", "expected_band"]

TAIL = 16
"""Losses saved in the manifest, and the most the trend is fitted over."""


class LossVerdict:
    """The outcome of one loss watch: a line in the report's format, and whether it passed."""

    def __init__(self, ok: bool, detail: str) -> None:
        self.ok = ok
        self.detail = detail

    def line(self) -> str:
        # "warn", never "FAIL": a judgement on a trend, not a failure of the checkpoint
        return f"dckpt resume: [{'ok  ' if self.ok else 'warn'}] loss watch: {self.detail}"


class LossWatch:
    """Recent losses (for the manifest) and the check after a resume; see the docstring."""

    def __init__(self, window: int = 64) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self._tail: list[float] = []
        self._after: list[float] = []
        self._steps = 0
        self._checkpoint = ""
        self._band: tuple[float, float, float, float] | None = None
        self._guard = False  # armed without a band: only a non-finite loss fails
        self._vouched: str | None = None

    def summary(self) -> dict[str, Any]:
        values = [v for v in self._recent if math.isfinite(v)]
        if not values:
            return {}
        mean = sum(values) / len(values)
        # (v - mean) * (v - mean), not ** 2: a huge finite loss gives inf, never OverflowError
        std = math.sqrt(sum((v - mean) * (v - mean) for v in values) / len(values))
        tail = values[-TAIL:]
        median = statistics.median(tail)
        return {
            "mean": mean,
            "std": std,
            "n": float(len(values)),
            "last": values[-1],
            "median": median,
            "mad": mad(tail),
            "tail": tail,
        }

    def arm(self, saved: dict[str, Any], steps: int, checkpoint: str) -> None:
        """Compare the next ``steps`` losses with ``saved`` (a manifest's ``loss``). A manifest
        written before the tail was saved gives only its mean: that is the level then."""
        tail = saved.get("tail")
        mean, std = saved.get("mean"), saved.get("std", 0.0)
        self._steps, self._checkpoint, self._after = steps, checkpoint, []
        self._guard = False
        if (
            isinstance(tail, list)
            and tail
            and all(isinstance(v, (int, float)) and math.isfinite(v) for v in tail)
        ):
            self._tail = [float(v) for v in tail[-TAIL:]]  # a longer list is not ours
            self._band = expected_band(self._tail, steps)
        elif isinstance(mean, (int, float)) and isinstance(std, (int, float)):
            self._tail = [float(mean)]
            bound = max(LOSS_SIGMA * float(std), LOSS_REL * abs(float(mean)), 1e-12)
            self._band = (float(mean) - bound, float(mean) + bound, 0.0, float(std))
        else:
            self._tail, self._band = [], None

    def guard(self, steps: int, checkpoint: str) -> None:
        """Watch the next ``steps`` losses after a resume from a checkpoint that records no
        usable losses: a non-finite one fails, ``steps`` finite ones pass."""
        self._steps, self._checkpoint, self._after = steps, checkpoint, []
        self._tail, self._band, self._guard = [], None, True

    def disarm(self) -> None:
        """No verdict of this watch for this resume (the ranks agreed on another one)."""
        self._band, self._guard, self._vouched = None, False, None

    @property
    def armed(self) -> bool:
        return (self._band is not None or self._guard) and len(self._after) < self._steps

    def band(self) -> tuple[float, float]:
        """The range the median of the first losses after the resume must lie in."""
        if self._band is None:
            return (math.nan, math.nan)
        return self._band[0], self._band[1]

    def describe_armed(self) -> str:
        if self._band is None:
            return (
                "not armed: the checkpoint records no usable losses (only a non-finite loss "
                "fails the resume)"
            )
        low, high = self.band()
        return (
            f"median of the next {self._steps} losses within [{low:.4g}, {high:.4g}] "
            f"(last {len(self._tail)} before the save: median {statistics.median(self._tail):.4g})"
        )

    def observe(self, loss: float, action: LossWatchAction) -> LossVerdict | None:
        """Record ``loss``; once armed and full (or at a non-finite loss), the verdict. With
        ``action="raise"`` a failed verdict raises LossDeviationError instead."""
        verdict = self.judge(loss)
        if verdict is not None and not verdict.ok and action == "raise":
            raise LossDeviationError(verdict.line())
        return verdict

    def judge(self, loss: float, *, vouched: str | None = None) -> LossVerdict | None:
        """``observe`` without raising: the caller records the verdict first. ``vouched``:
        what the replay check proved of this resume so far (steps identical to the run that
        stopped, none differing); it outranks the trend: the verdict then passes, saying so."""
        self._recent.append(loss)
        if not self.armed:
            return None
        self._after.append(loss)
        self._vouched = vouched
        if math.isfinite(loss) and len(self._after) < self._steps:
            return None
        verdict = self._verdict()
        self._band, self._guard = None, False  # one verdict per resume
        return verdict

    def finish(self) -> LossVerdict | None:
        """The verdict on the losses seen so far, when the run ends before the window is
        full (never raises: the run is over); None if nothing was seen since the resume."""
        if not self.armed or not self._after:
            return None
        verdict = self._verdict()
        self._band, self._guard = None, False
        verdict.detail += f" (the run ended after {len(self._after)} of {self._steps})"
        return verdict

    def _verdict(self) -> LossVerdict:
        where = f"after resuming from {self._checkpoint}"
        if self._vouched is not None:  # proof outranks a judgement
            vouched, self._vouched = self._vouched, None
            return LossVerdict(
                True,
                f"the first {len(self._after)} losses {where} are the run that stopped's own "
                f"(the replay found {vouched}): nothing to judge",
            )
        if self._band is None:  # guarded: nothing to compare with
            bad = [v for v in self._after if not math.isfinite(v)]
            if bad:
                return LossVerdict(
                    False,
                    f"loss {bad[0]} at step {len(self._after)} {where} is not finite (the "
                    "checkpoint records no losses to compare with)",
                )
            return LossVerdict(
                True,
                f"the first {len(self._after)} losses {where} are finite (not compared: the "
                "checkpoint records no usable losses)",
            )
        low, high, slope, noise = self._band
        before = (
            f"the last {len(self._tail)} before the save: median "
            f"{statistics.median(self._tail):.4g}, "
            f"trend {slope:+.3g}/step, noise {noise:.3g}"
        )
        bad = [v for v in self._after if not math.isfinite(v)]
        if bad:
            return LossVerdict(
                False,
                f"loss {bad[0]} at step {len(self._after)} {where} is not finite ({before})",
            )
        median = statistics.median(self._after)
        detail = (
            f"median {median:.4g} of the first {len(self._after)} losses {where}, expected "
            f"[{low:.4g}, {high:.4g}] ({before})"
        )
        if median > high:
            return LossVerdict(
                False,
                f"{detail}: ABOVE. The resume may have lost model, optimizer or RNG state "
                "(or the weights were changed after resume())",
            )
        if median < low:
            return LossVerdict(
                False,
                f"{detail}: BELOW. The run may be replaying data it saw before the save (a "
                "wrong data position) or optimising another objective",
            )
        return LossVerdict(True, detail)
