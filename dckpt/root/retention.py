"""Retention: which committed checkpoints to keep, as a pure decision over simple facts.

The policy sees steps with four facts each (milestone, pinned, metric, finite) and returns one
decision per step with its reasons. It knows no file format and touches no file; the commit
layer (``commit.delete_checkpoints``) carries the deletions out, rename-to-trash first.

A checkpoint is kept when any of these holds:
- it is the newest committed checkpoint (always, whatever the settings);
- it is the newest *finite* one, when a newer step was saved with NaN or Inf in a tensor
  (``allow_nonfinite``): the step a diverged run can go back to is never pushed out;
- it is among the ``keep_last`` newest;
- it is a milestone (``save(milestone=True)``, or its step is a multiple of ``milestone_every``);
- it is pinned (``dckpt pin``);
- it is among the ``best_k`` best by the configured metric (``min`` or ``max``).
Saves in flight and quarantined checkpoints are never candidates: only committed ones are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["BestMode", "Candidate", "Decision", "RetentionPolicy", "decide"]

BestMode = Literal["min", "max"]
"""Whether a lower (``min``) or higher (``max``) metric is better, for ``best_k``."""


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Validated at construction: a bad policy fails before any save, never mid-run."""

    keep_last: int | None = None
    best_k: int = 0
    best_mode: BestMode = "min"

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 2:
            raise ValueError(
                f"keep_last must be at least 2, got {self.keep_last}: the newest checkpoint may "
                "turn out damaged, and the one before it is what a resume falls back to"
            )
        if self.best_k < 0:
            raise ValueError(f"best_k must be >= 0, got {self.best_k}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")

    @property
    def enabled(self) -> bool:
        return self.keep_last is not None


@dataclass(frozen=True, kw_only=True)
class Candidate:
    step: int
    milestone: bool = False
    pinned: bool = False
    metric: float | None = None
    finite: bool = True


@dataclass(frozen=True, kw_only=True)
class Decision:
    step: int
    keep: bool
    reasons: tuple[str, ...]


def decide(candidates: Sequence[Candidate], policy: RetentionPolicy) -> list[Decision]:
    """One decision per committed checkpoint, oldest first; see the module docstring."""
    ordered = sorted(candidates, key=lambda c: c.step)
    if not policy.enabled:
        return [Decision(step=c.step, keep=True, reasons=("retention off",)) for c in ordered]
    assert policy.keep_last is not None
    newest = {c.step for c in ordered[-1:]}
    finite = [c.step for c in ordered if c.finite]
    newest_finite = set(finite[-1:]) - newest
    last = {c.step for c in ordered[-policy.keep_last :]}
    sign = 1.0 if policy.best_mode == "min" else -1.0
    scored = sorted((sign * c.metric, c.step) for c in ordered if c.metric is not None)
    best = {step for _score, step in scored[: policy.best_k]}
    decisions = []
    for c in ordered:
        reasons = [
            why
            for why, hit in (
                ("newest", c.step in newest),
                ("newest finite", c.step in newest_finite),
                (f"keep_last={policy.keep_last}", c.step in last),
                ("milestone", c.milestone),
                ("pinned", c.pinned),
                (f"best {policy.best_k} by metric", c.step in best),
            )
            if hit
        ]
        decisions.append(
            Decision(step=c.step, keep=bool(reasons), reasons=tuple(reasons) or ("superseded",))
        )
    return decisions
