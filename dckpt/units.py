"""Human-readable figures for log lines and tables: sizes (decimal units, as disks are sold)
and the staging figures a manifest records. No torch here: the CLI uses it."""

from __future__ import annotations

__all__ = ["describe_staging", "human_bytes", "plural"]


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 file``, ``2 files``, ``0 files``: a count and its noun, the noun agreeing."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def human_bytes(n: float, digits: int = 2) -> str:
    """``1860000`` → ``"1.86 MB"``; whole bytes below 1 KB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1000
    return f"{n:.{digits}f} TB"


def describe_staging(timings: dict[str, float]) -> str:
    """One phrase for the save line: which path the bytes took (all ranks together)."""
    if "staged_host_bytes" not in timings:
        return "not recorded (saved by an older dckpt)"
    parts = []
    for key, what in (
        ("staged_device_bytes", "device→device→host"),
        ("staged_pinned_bytes", "device→host"),
        ("staged_host_bytes", "host copy"),
        ("staged_deferred_bytes", "copied after save() returned"),
    ):
        n = timings.get(key, 0.0)
        if n:
            parts.append(f"{human_bytes(n)} {what}")
    text = "staged " + (", ".join(parts) if parts else "nothing (live state written)")
    if timings.get("device_copy_s", 0.0) > 0:
        text += f", {timings['device_copy_s'] * 1e3:.1f} ms GPU copy"
    if timings.get("drain_s", 0.0) > 0:
        text += f", drained in {timings['drain_s']:.3f} s"
    if timings.get("staging_alloc_bytes", 0.0) > 0:
        text += (
            f"; allocated {human_bytes(timings['staging_alloc_bytes'])} of buffers in "
            f"{timings.get('staging_alloc_s', 0.0):.3f} s (reused by later saves)"
        )
    return text
