"""The pieces of a verified resume: config comparison, the report, and the loss watch.

The flow itself is ``CheckpointManager.resume`` (manager.py); it follows the resume checklist:

1. rank 0 lists the committed checkpoints, newest first, and all ranks take the same list;
2. for a candidate: the manifest is validated; the saved config is compared with the current
   one (``config_changes``: a readable diff; keys in ``SAFE_CONFIG_KEYS`` or allowed by the
   user only warn, anything else raises ``ConfigMismatchError``); the precision policy is
   compared; the layout is checked and ``.metadata`` verified;
3. DCP loads model, optimizer, scheduler, scaler, data position and counters through the
   verifying reader; files no rank read are then hashed too, so every file is verified; the
   digests each rank saw are all-gathered and compared;
4. RNG is restored last (or reseeded from seed, step and rank if the world size changed);
5. a warmup all-reduce on the training group checks the world;
6. a candidate that fails 2 or 3 because of its bytes is moved to ``quarantine/`` and the next
   older one is tried (``fallback=False`` raises instead);
7. the ``ResumeReport`` is logged as one block; ``LossWatch`` then compares the first few losses
   with the loss recorded at save time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigMismatchError, LossDeviationError

__all__ = [
    "SAFE_CONFIG_KEYS",
    "Check",
    "ConfigChange",
    "LossWatch",
    "ResumeReport",
    "check_config",
    "config_changes",
    "is_allowed",
]

SAFE_CONFIG_KEYS = frozenset(
    {
        "ckpt_dir",
        "loss_log",
        "log_every",
        "print_every",
        "eval_every",
        "save_every",
        "keep_last",
        "milestone_every",
        "crash_at_step",
        "async_save",
        "num_workers",
        "profile",
        "wandb_project",
        "run_name",
    }
)
"""Config keys whose change does not change the training math: a resume only warns."""

_MISSING = "<absent>"


@dataclass(frozen=True)
class ConfigChange:
    key: str
    saved: Any
    current: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.current!r}"


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[ConfigChange]:
    """Every key (dotted, for nested configs) whose value differs, was added or was removed."""
    a, b = _flatten(saved), _flatten(current)
    return [
        ConfigChange(k, a.get(k, _MISSING), b.get(k, _MISSING))
        for k in sorted(a.keys() | b.keys())
        if a.get(k, _MISSING) != b.get(k, _MISSING)
    ]


def is_allowed(change: ConfigChange, allowed: frozenset[str]) -> bool:
    """Whether a changed key may differ on resume (by its full dotted name or its last part)."""
    return change.key in allowed or change.key.split(".")[-1] in allowed


def check_config(
    saved: dict[str, Any], current: dict[str, Any], allowed: frozenset[str], checkpoint: str
) -> list[ConfigChange]:
    """Raise ConfigMismatchError on an unsafe change; return the safe ones (to warn about)."""
    changes = config_changes(saved, current)
    unsafe = [c for c in changes if not is_allowed(c, allowed)]
    if unsafe:
        diff = "\n".join(f"    {c}" for c in changes)
        raise ConfigMismatchError(
            f"the config differs from the one {checkpoint} was saved with:\n{diff}\n"
            f"Unsafe changes: {', '.join(c.key for c in unsafe)}. Resuming would silently train "
            "a different run. Restore those values, start a new run in a new directory, or "
            "allow the keys (CheckpointManager(..., allow_config_changes=[...]))."
        )
    return changes


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class ResumeReport:
    """What a resume did: the step, every check and its result, what was skipped and why."""

    step: int | None = None
    path: Path | None = None
    world_size_saved: int | None = None
    world_size_now: int = 1
    checks: list[Check] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rng: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def resumed(self) -> bool:
        return self.step is not None

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(name, ok, detail))

    def format(self) -> str:
        if not self.resumed and not self.skipped:
            return "dckpt resume: no committed checkpoint; starting from scratch"
        lines = [
            f"dckpt resume: step {self.step} from {self.path}"
            if self.resumed
            else "dckpt resume: no checkpoint could be loaded"
        ]
        if self.world_size_saved is not None:
            lines.append(
                f"  world size    saved {self.world_size_saved}, now {self.world_size_now}"
            )
        for c in self.checks:
            mark = "ok  " if c.ok else "FAIL"
            lines.append(f"  [{mark}] {c.name}" + (f": {c.detail}" if c.detail else ""))
        if self.rng:
            lines.append(f"  rng           {self.rng}")
        for step, why in self.skipped:
            lines.append(f"  skipped step {step} (quarantined): {why}")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        if self.timings:
            parts = ", ".join(f"{k} {v:.3f} s" for k, v in self.timings.items())
            lines.append(f"  timings       {parts}")
        return "\n".join(lines)


class LossWatch:
    """Recent losses (for the manifest) and the post-resume comparison with them.

    After ``arm``, each of the next ``steps`` losses is compared with the mean and spread saved
    in the checkpoint: a loss that is not finite, or above ``mean + max(sigma * std,
    rel * |mean|)``, is a deviation. Lower losses are fine: training goes on improving.
    """

    def __init__(self, window: int = 32) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self._saved: dict[str, float] = {}
        self._left = 0
        self._checkpoint = ""
        self._seen = 0
        self.sigma = 4.0
        self.rel = 0.2

    def summary(self) -> dict[str, float]:
        values = [v for v in self._recent if math.isfinite(v)]
        if not values:
            return {}
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        return {"mean": mean, "std": std, "n": float(len(values)), "last": values[-1]}

    def arm(self, saved: dict[str, float], steps: int, checkpoint: str) -> None:
        self._saved, self._left, self._checkpoint, self._seen = dict(saved), steps, checkpoint, 0

    @property
    def armed(self) -> bool:
        return self._left > 0 and bool(self._saved)

    def bound(self) -> float:
        mean, std = self._saved["mean"], self._saved.get("std", 0.0)
        return mean + max(self.sigma * std, self.rel * abs(mean))

    def observe(self, loss: float, action: str) -> str | None:
        """Record ``loss``; while armed, return a message if it deviates (raise if asked)."""
        self._recent.append(loss)
        if not self.armed:
            return None
        self._left -= 1
        self._seen += 1
        if math.isfinite(loss) and loss <= self.bound():
            if self._left == 0:
                return (
                    f"dckpt loss watch: {self._seen} steps after resuming from "
                    f"{self._checkpoint} within bound (<= {self.bound():.4f}; saved mean "
                    f"{self._saved['mean']:.4f})"
                )
            return None
        message = (
            f"loss {loss:.4f} at step {self._seen} after resuming from {self._checkpoint} is above "
            f"the bound {self.bound():.4f} (saved mean {self._saved['mean']:.4f}, std "
            f"{self._saved.get('std', 0.0):.4f}): the resume may have lost optimizer, data or RNG "
            "state, or the data changed"
        )
        if action == "raise":
            self._left = 0
            raise LossDeviationError(message)
        return "dckpt loss watch: WARNING " + message
