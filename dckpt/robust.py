"""Robust statistics for noisy series (step times, losses): one slow step or one odd batch
must not decide anything. Pure Python, no torch; used by every layer that reads a series.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = [
    "LOSS_REL",
    "LOSS_SIGMA",
    "MAD_TO_STD",
    "expected_band",
    "intercept",
    "mad",
    "same_level_margin",
    "theil_sen_slope",
]

MAD_TO_STD = 1.4826
"""Scales a median absolute deviation to a standard deviation for normal noise."""
LOSS_SIGMA = 4.0
"""How many noise-standard-deviations a loss level may move before it counts as different."""
ABS_FLOOR = 1e-6
"""The smallest margin at all: a loss that sat at exactly 0 may move by this much."""
LOSS_REL = 0.05
"""The smallest margin, relative to the expected loss (5 %); ``|loss|``, so negative losses
work too."""


def theil_sen_slope(xs: Sequence[float], ys: Sequence[float], min_dx: float = 0.0) -> float | None:
    """The median of the pairwise slopes of points whose x differ by at least ``min_dx`` (and
    by more than 0); None when no pair qualifies."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if abs(xs[j] - xs[i]) >= min_dx and xs[j] != xs[i]
    ]
    return statistics.median(slopes) if slopes else None


def intercept(xs: Sequence[float], ys: Sequence[float], slope: float) -> float:
    """The robust intercept for a given slope: the median of ``y - slope * x``."""
    return statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))


def mad(values: Sequence[float]) -> float:
    """The median absolute deviation from the median."""
    center = statistics.median(values)
    return statistics.median(abs(v - center) for v in values)


def expected_band(
    tail: Sequence[float], steps: int, sigma: float = LOSS_SIGMA, rel: float = LOSS_REL
) -> tuple[float, float, float, float]:
    """(low, high, slope, noise): where the median of the next ``steps`` values of a series
    whose last values are ``tail`` should lie.

    The expected median lies between the level (median of the tail's last quarter) and the
    robust trend (Theil-Sen) carried forward, so neither a series that flattens nor one that
    keeps its slope leaves it; above that, ``max(sigma * noise, rel * |expected|)``, and twice
    that below, where ``noise`` is the MAD of the tail around its trend, scaled to a standard
    deviation.

    Then the band must hold for the series itself (a backtest): the band its first values
    give for its own last ``k`` (``min(steps, n - 3)``, with at least 5 values) is checked
    against their median, and whatever that median lies outside it is added on that side,
    scaled by ``(steps / k) ** 2`` (a curve bends away from a line with the square of the
    distance). A curve no line follows (a loss
    that falls faster than linearly, an LR schedule's turn) widens its own band, so the
    run's own losses never fail it.
    """
    low, high, slope, noise = _band(tail, steps, sigma, rel)
    n, k = len(tail), min(steps, len(tail) - 3)
    if n >= 5 and k >= 1:
        lo_k, hi_k, _, _ = _band(tail[:-k], k, sigma, rel)
        held = statistics.median(tail[-k:])
        reach = (steps / k) ** 2  # a curve's miss grows with the square of the distance
        high += max(0.0, held - hi_k) * reach
        low -= max(0.0, lo_k - held) * reach
    return low, high, slope, noise


def _band(
    tail: Sequence[float], steps: int, sigma: float, rel: float
) -> tuple[float, float, float, float]:
    """``expected_band`` without the backtest."""
    n = len(tail)
    xs = [float(i) for i in range(n)]
    slope = (theil_sen_slope(xs, tail) if n >= 3 else None) or 0.0
    base = intercept(xs, tail, slope)
    level = statistics.median(tail[-max(1, n // 4) :])
    carried = base + slope * (n + (steps - 1) / 2)
    noise = (
        MAD_TO_STD
        * statistics.median(abs(y - (base + slope * x)) for x, y in zip(xs, tail, strict=True))
        if n >= 3
        else 0.0
    )
    lo_mid, hi_mid = min(level, carried), max(level, carried)
    margin = max(sigma * noise, rel * max(abs(lo_mid), abs(hi_mid)), ABS_FLOOR)
    # Twice the margin below: a loss that falls faster than its trend (the LR warmup ending,
    # say) is common and benign; replayed data sits far lower than that.
    return lo_mid - 2 * margin, hi_mid + margin, slope, noise


def same_level_margin(
    values: Sequence[float], sigma: float = LOSS_SIGMA, rel: float = LOSS_REL
) -> float:
    """How far another series' median may lie from the median of ``values`` and still count
    as the same level: ``max(sigma * noise, rel * |median|)``, ``noise`` being the MAD of
    ``values`` scaled to a standard deviation (a trend widens it: the tails are compared
    median to median, over the same steps)."""
    return max(sigma * MAD_TO_STD * mad(values), rel * abs(statistics.median(values)), ABS_FLOOR)
