"""Retention carried out: read the facts from a root, decide (dckpt.retention), delete.

Used after every committed save (by rank 0, on the writer thread) and by ``dckpt gc``. Only
committed checkpoints are candidates; a manifest that cannot be read makes its checkpoint a
keeper (never delete what cannot be judged).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import IntegrityError, ManifestError
from .commit import delete_checkpoints
from .layout import committed_steps, pinned_steps, step_dir_name
from .manifest import read_manifest
from .retention import Candidate, Decision, RetentionPolicy, decide

__all__ = ["apply_retention", "plan_retention"]

log = logging.getLogger("dckpt")


def plan_retention(root: str | os.PathLike[str], policy: RetentionPolicy) -> list[Decision]:
    """The decisions the policy makes for every committed checkpoint under ``root``."""
    base = Path(root)
    pins = pinned_steps(base)
    candidates: list[Candidate] = []
    unreadable: set[int] = set()
    for step in committed_steps(base):
        try:
            manifest = read_manifest(base / step_dir_name(step))
        except (ManifestError, IntegrityError):
            unreadable.add(step)
            continue
        value = manifest.metric.get("value")
        candidates.append(
            Candidate(
                step=step,
                milestone=manifest.milestone,
                pinned=step in pins,
                metric=float(value) if isinstance(value, (int, float)) else None,
            )
        )
    decisions = decide(candidates, policy)
    decisions += [Decision(step=s, keep=True, reasons=("unreadable manifest",)) for s in unreadable]
    return sorted(decisions, key=lambda d: d.step)


def apply_retention(
    root: str | os.PathLike[str], policy: RetentionPolicy, *, dry_run: bool = False
) -> tuple[list[Decision], list[str]]:
    """Decide and (unless ``dry_run``) delete; logs one line; returns decisions and deleted."""
    decisions = plan_retention(root, policy)
    victims = [d.step for d in decisions if not d.keep]
    deleted = [] if dry_run or not victims else delete_checkpoints(root, victims)
    if victims:
        kept = ", ".join(f"{d.step} ({'+'.join(d.reasons)})" for d in decisions if d.keep)
        verb = "would delete" if dry_run else "deleted"
        log.info(
            "dckpt retention: %s step(s) %s; kept %s",
            verb,
            ", ".join(map(str, victims)),
            kept,
        )
    return decisions, deleted
