"""Where a load finds its candidates: ``CheckpointSource``, and the local directory's.

A load reads a step from a local directory (``source.local``). For a directory root that is
the root itself; for an object store (dckpt.tiers.object_source) it is the root's local
mirror, filled and verified by ``fetch`` before anything reads it: for a resume, with only
the files each rank's load plan reads (``partial``), so a node downloads what its ranks
read, not the whole step. The resume protocol
(dckpt.load.resumer) talks to this protocol only, so every check after ``fetch`` is the same
for both.

Resumes are recorded in the root (``resume_records``: dckpt.root.resume_record), those of
every tier: the durable source's records are the resume's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..errors import CheckpointError
from .layout import committed_steps, list_checkpoints, step_dir_name
from .manifest import read_manifest
from .resume_record import DirectoryRecords, ResumeRecords
from .upkeep import quarantine

__all__ = ["CheckpointSource", "Fetched", "LocalSource"]


class Fetched(Protocol):
    """What ``fetch`` did on this rank (for the resume report)."""

    @property
    def reread(self) -> tuple[str, ...]:
        """Files whose first read was damaged on the way and a fresh read matched."""
        ...

    def line(self) -> str | None: ...


class CheckpointSource(Protocol):
    local: Path
    """The directory the step directories are read from."""

    def __str__(self) -> str: ...

    def steps(self) -> list[int]:
        """Committed steps, oldest first (rank 0 asks; it may list a remote store)."""
        ...

    def origin(self, step: int) -> str:
        """Where ``step`` lives, for the resume report ("" when it is read in place)."""
        ...

    partial: bool
    """Whether ``fetch`` can bring only the files a rank reads (``files``), the others left
    where they live and hashed there (``digest_remote``): an object store's mirror. False
    for a directory root, read in place."""

    def fetch(self, step: int, files: frozenset[str] | None = None) -> Fetched | None:
        """Every rank: make ``local/step-N`` hold this rank's share of ``step`` (with
        ``files``: those files, for this rank), verified."""
        ...

    def complete(self, step: int, files: frozenset[str] | None = None) -> Fetched | None:
        """Every rank, after every rank's ``fetch``: whatever ``local/step-N`` still lacks
        (of ``files``, when given)."""
        ...

    def digest_remote(self, step: int, name: str) -> str:
        """The digest of ``step``'s file ``name`` where it lives, nothing written locally (a
        ``partial`` source: for the files no rank brought)."""
        ...

    def confirm_damage(self, step: int, exc: CheckpointError) -> None:
        """Rank 0, before a quarantine: raise StorageError if the failure was local (the
        checkpoint where it lives is intact), so it is not quarantined."""
        ...

    def quarantine(self, step: int, reason: str) -> None:
        """Rank 0: move a step that failed verification aside, with the reason."""
        ...

    def quarantined_count(self) -> int: ...

    def save_id(self, step: int) -> str:
        """Rank 0: the save id in ``step``'s manifest where it lives (which checkpoint of that
        step it is), before anything is fetched. Raises (OSError, CheckpointError) when the
        manifest cannot be read."""
        ...

    def resume_records(self) -> ResumeRecords | None:
        """Where resumes of this source's steps are recorded; None: in the root's (a tier
        that is not the root)."""
        ...


class LocalSource:
    """A directory root: its step directories are read in place."""

    partial = False

    def __init__(self, root: Path) -> None:
        self.local = Path(root)

    def __str__(self) -> str:
        return str(self.local)

    def steps(self) -> list[int]:
        return committed_steps(self.local) if self.local.is_dir() else []

    def origin(self, step: int) -> str:
        return ""

    def fetch(self, step: int, files: frozenset[str] | None = None) -> Fetched | None:
        return None

    def complete(self, step: int, files: frozenset[str] | None = None) -> Fetched | None:
        return None

    def digest_remote(self, step: int, name: str) -> str:
        raise NotImplementedError("a directory root is read in place")

    def confirm_damage(self, step: int, exc: CheckpointError) -> None:
        pass  # read in place: what failed is the checkpoint itself

    def quarantine(self, step: int, reason: str) -> None:
        quarantine(self.local, self.local / step_dir_name(step), reason)

    def quarantined_count(self) -> int:
        if not self.local.is_dir():
            return 0
        return sum(1 for e in list_checkpoints(self.local) if e.status == "quarantined")

    def save_id(self, step: int) -> str:
        return read_manifest(self.local / step_dir_name(step)).save_id

    def resume_records(self) -> ResumeRecords:
        return DirectoryRecords(self.local)
