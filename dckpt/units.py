"""Human-readable sizes for log lines and tables (decimal units, as disks are sold)."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float, digits: int = 2) -> str:
    """``1860000`` → ``"1.86 MB"``; whole bytes below 1 KB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1000
    return f"{n:.{digits}f} TB"
