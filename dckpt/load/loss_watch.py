"""The loss watch: recent losses for the manifest, and the check of the first losses after a
resume against them. No torch.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from ..errors import LossDeviationError

if TYPE_CHECKING:
    from ..config import LossWatchAction

__all__ = ["LossWatch"]


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

    def observe(self, loss: float, action: LossWatchAction) -> str | None:
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
