"""Where a load finds its candidates: ``CheckpointSource``, and the local directory's.

A load reads a step from a local directory (``source.local``). For a directory root that is
the root itself, read in place (``fetcher`` None); for an object store
(dckpt.tiers.object_source) it is the root's local mirror, filled and verified by its
``Fetcher`` before anything reads it: for a resume, with only the files each rank's load plan
reads, so a node downloads what its ranks read, not the whole step. The durable reader
(dckpt.load.durable) talks to these two protocols only, so every check after the fetch is
the same for both; the memory tier's source (dckpt.load.memory) is read by its own reader.

Resumes are recorded in the root, those of every tier (``Root.resume_records``:
dckpt.root.resume_record), not by a source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..errors import CheckpointError
from .layout import committed_steps, list_checkpoints, step_dir_name
from .manifest import read_manifest
from .upkeep import quarantine

__all__ = ["CheckpointSource", "Fetched", "Fetcher", "LocalSource"]


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

    @property
    def fetcher(self) -> Fetcher | None:
        """What brings a step into ``local`` before it is read (an object store's mirror);
        None: ``local`` is where the steps live, read in place."""
        ...

    def quarantine(self, step: int, reason: str, damage: CheckpointError | None = None) -> None:
        """Rank 0: move a step that failed verification aside, with the reason. ``damage``:
        the failure that condemns it; a source whose copy is a local one first checks it
        where the step lives, and raises StorageError if that copy is intact (a local fault:
        nothing is quarantined)."""
        ...

    def quarantined_count(self) -> int: ...

    def save_id(self, step: int) -> str:
        """Rank 0: the save id in ``step``'s manifest where it lives (which checkpoint of that
        step it is), before anything is fetched. Raises (OSError, CheckpointError) when the
        manifest cannot be read."""
        ...


class Fetcher(Protocol):
    """Brings a committed step from where it lives into the source's ``local`` directory,
    verified, only the files a rank reads (the others hashed where they live)."""

    def fetch(self, step: int, files: frozenset[str] | None = None) -> Fetched | None:
        """Every rank: make ``local/step-N`` hold this rank's share of ``step`` (with
        ``files``: those files, for this rank), verified."""
        ...

    def complete(self, step: int, files: frozenset[str] | None = None) -> Fetched | None:
        """Every rank, after every rank's ``fetch``: whatever ``local/step-N`` still lacks
        (of ``files``, when given)."""
        ...

    def forget(self, step: int, path: str) -> None:
        """Every rank, after a read of ``path`` (a file of ``step`` in ``local``) failed:
        drop this node's copy of it, so the next fetch brings it afresh."""
        ...

    def digest_remote(self, step: int, name: str) -> str:
        """The digest of ``step``'s file ``name`` where it lives, nothing written locally
        (for the files no rank brought)."""
        ...


class LocalSource:
    """A directory root: its step directories are read in place."""

    fetcher = None

    def __init__(self, root: Path) -> None:
        self.local = Path(root)

    def __str__(self) -> str:
        return str(self.local)

    def steps(self) -> list[int]:
        return committed_steps(self.local) if self.local.is_dir() else []

    def origin(self, step: int) -> str:
        return ""

    def quarantine(self, step: int, reason: str, damage: CheckpointError | None = None) -> None:
        """Read in place: what failed is the checkpoint itself (no copy to confirm)."""
        quarantine(self.local, self.local / step_dir_name(step), reason)

    def quarantined_count(self) -> int:
        if not self.local.is_dir():
            return 0
        return sum(1 for e in list_checkpoints(self.local) if e.status == "quarantined")

    def save_id(self, step: int) -> str:
        return read_manifest(self.local / step_dir_name(step)).save_id
