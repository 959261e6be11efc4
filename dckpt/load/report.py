"""The resume report: the step resumed from, every check and its result, what was skipped.

A ``CandidateReport`` is built for each checkpoint a resume tries, so checks and warnings of a
skipped candidate never leak into the one finally loaded; ``ResumeReport`` is what the user
gets: the chosen candidate's findings plus the list of skipped steps (and of steps set
aside as restart loops: resumed and failed by the loss watch on two starts in a row, each on
its own line). Logged as one block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..root.manifest import Manifest
from .config_check import ConfigChange

__all__ = ["CandidateReport", "Check", "LoadResult", "ResumeReport"]


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """A verified load: which step, from where, how much was checked and how long it took."""

    step: int
    path: Path
    bytes: int
    files_verified: int
    seconds: float
    manifest: Manifest
    times: dict[str, float] = field(default_factory=dict)
    """Where this rank's reading went (``read`` waiting on the storage, ``hash``, ``fill``
    deserializing and copying), when the reader measured it."""
    behind: Callable[[float], None] | None = None
    """Work the load left running (the memory tier's copy of what arrived into the state),
    and the wait (its deadline in seconds) that must end before the state changes."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class CandidateReport:
    """What the checks found in one checkpoint a resume tried; thrown away if it is skipped."""

    step: int
    path: Path
    origin: str = ""
    """Where the checkpoint lives, when not at ``path`` (an object store's URL)."""
    world_size_saved: int | None = None
    checks: list[Check] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rng: str = ""
    config_changes: list[ConfigChange] = field(default_factory=list)
    hashed_bytes: int = 0
    """Bytes this rank hashed to prove the checkpoint: its share of the files, and the items
    its load read of other ranks' files."""

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(name, ok, detail))

    def warn(self, text: str) -> None:
        self.warnings.append(text)


@dataclass
class ResumeReport:
    """What a resume did: the step, every check and its result, what was skipped and why."""

    step: int | None = None
    path: Path | None = None
    origin: str = ""
    world_size_saved: int | None = None
    world_size_now: int = 1
    checks: list[Check] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    rng: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    config_changes: list[ConfigChange] = field(default_factory=list)
    """Every run-config key that differs from the checkpoint's (all of them passed)."""
    restart_loops: list[tuple[int, str]] = field(default_factory=list)
    """Steps quarantined before they were loaded: their last two resumes failed the loss
    watch (dckpt.root.resume_record), with the reason."""
    replay: str = ""
    """What the replay check compares (dckpt.load.replay), or why it compares nothing."""
    foreign: list[str] = field(default_factory=list)
    """A fresh start: what the root holds that is not dckpt's (rank 0's report)."""
    hashed_bytes: int = 0
    """Bytes this rank hashed to prove the checkpoint it loaded (``CandidateReport``)."""

    @classmethod
    def of(
        cls,
        chosen: CandidateReport | None,
        skipped: list[tuple[int, str]],
        world_size_now: int,
        restart_loops: list[tuple[int, str]] | None = None,
    ) -> ResumeReport:
        """The report of a resume that loaded ``chosen`` (None: nothing) after ``skipped``
        (and ``restart_loops``)."""
        loops = list(restart_loops or [])
        if chosen is None:
            return cls(world_size_now=world_size_now, skipped=list(skipped), restart_loops=loops)
        return cls(
            step=chosen.step,
            path=chosen.path,
            origin=chosen.origin,
            world_size_saved=chosen.world_size_saved,
            world_size_now=world_size_now,
            checks=list(chosen.checks),
            skipped=list(skipped),
            warnings=list(chosen.warnings),
            rng=chosen.rng,
            config_changes=list(chosen.config_changes),
            restart_loops=loops,
            hashed_bytes=chosen.hashed_bytes,
        )

    @property
    def resumed(self) -> bool:
        return self.step is not None

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(name, ok, detail))

    def format(self) -> str:
        if not self.resumed and not self.skipped and not self.restart_loops:
            head = "dckpt resume: no committed checkpoint; starting from scratch"
            if self.foreign:
                head = (
                    "dckpt resume: no dckpt checkpoint; files that are not dckpt checkpoints: "
                    f"{'; '.join(self.foreign)}; starting from scratch (dckpt resumes only "
                    "from the step-N directories it wrote: load another checkpointer's files "
                    "into the model yourself, before the first save)"
                )
            return "\n".join([head, *(f"  warning: {w}" for w in self.warnings)])
        lines = [
            f"dckpt resume: step {self.step} from {self.origin or self.path}"
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
        if self.replay:
            lines.append(f"  replay        {self.replay}")
        for step, why in self.restart_loops:
            instead = f"; resumed from step {self.step} instead" if self.resumed else ""
            lines.append(f"  restart loop: step {step} quarantined, {why}{instead}")
        for step, why in self.skipped:
            lines.append(f"  skipped step {step} (quarantined): {why}")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        if self.timings:
            parts = ", ".join(f"{k} {v:.3f} s" for k, v in self.timings.items())
            lines.append(f"  timings       {parts}")
        return "\n".join(lines)
