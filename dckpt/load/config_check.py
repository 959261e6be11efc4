"""The config check of a resume: what changed since the checkpoint was saved, and whether
that may pass.

``config_changes`` is a readable diff of two JSON-able configs (dotted keys for nested ones);
``check_config`` raises ``ConfigMismatchError`` on any change outside the allowed keys and
returns the allowed ones, for the report's warning. No torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigMismatchError

__all__ = ["SAFE_CONFIG_KEYS", "ConfigChange", "check_config", "config_changes", "is_allowed"]

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
