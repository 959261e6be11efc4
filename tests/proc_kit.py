"""Small process helpers shared by the tests that start detached processes (keepers)."""

from __future__ import annotations

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Running (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
