"""The ``Root`` protocol: one shape for every kind of checkpoint root.

A root is where one run's committed checkpoints live: a directory (``DirectoryRoot``,
dckpt.root.directory) or an object store prefix (``ObjectRoot``, dckpt.tiers.object_root).
``dckpt.tiers.roots.open_root`` is the one place that turns what a user wrote (a path, an
``s3://`` URL) into one; the manager, the CLI and ``peek`` talk to the protocol only, so
none of them asks which kind it holds.

What a root answers and does:

- **what it holds**: ``entries`` (every step-like entry: committed, incomplete, quarantined),
  ``committed_steps`` (the one rule of what is committed for that kind: a directory's
  ``manifest.json`` inside a real step directory; a bucket's ``step-N/manifest.json``
  object), manifests, pins, the records of verifications and resumes;
- **its upkeep**: ``quarantine`` and ``restore`` (back from it, verified first),
  ``delete_steps`` (the manifest's commit undone first, so a half-deleted step is never
  whole), ``pin``/``unpin``, retention, ``recover`` (a crash's debris removed, at a job's
  start under its lock);
- **a job's parts**: ``locks`` (the run lock, not yet taken), the ``FileCommit`` a save
  commits with, the ``CheckpointSource`` a resume reads, the memory tier's ledger;
- **a local copy** of committed steps for commands that read tensors (``local_steps``): the
  directory itself, or the steps fetched, each object hashed as it arrives.

Invariants every kind keeps (tests/tiers/ checks each against every kind):
- a step is listed as committed only once its manifest is durable: a save cut short is
  never listed, never loaded;
- retention never deletes the newest committed step or a pinned one;
- a second job is refused by the lock while the first holds it;
- ``recover`` removes what a crash left and nothing committed;
- ``restore`` commits a quarantined step only once it verified, never over a committed one
  (tests/test_set_aside.py, for every kind).

Knows names, manifests and files, never tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..owned import Access
from .commit import FileCommit
from .layout import Status
from .lock import OnWait
from .manifest import Manifest
from .memory_ledger import MemoryLedger
from .resume_record import ResumeRecords
from .retention import Decision, RetentionPolicy
from .source import CheckpointSource
from .verify import VerifyResult

__all__ = ["Entry", "Lock", "Root"]


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A step-like entry of a root (``dckpt ls``)."""

    step: int
    status: Status
    name: str
    """Relative to the root: ``step-N``, a save in flight's name, ``quarantine/step-N``."""
    where: str
    """Where a user finds it: a path, or an object store URL."""
    bytes: int | None = None
    """What it takes, where the listing told (an object store's); None: ``Root.measure``."""


class Lock(Protocol):
    """A run lock with a lease renewed while the job runs (dckpt.root.lock)."""

    def acquire(self, on_wait: OnWait | None = None) -> None:
        """Take it, or raise LockError naming the live owner. ``on_wait(seconds, why)`` is
        told before a wait for another host's lock (its lease), so the job's other ranks
        wait as long."""
        ...

    def release(self) -> None:
        """Give it back: removes only a record this lock wrote."""
        ...

    def abandon(self) -> None:
        """Stop renewing, leave the record: the lease runs out by itself (a job whose stuck
        write may still land keeps others out until then)."""
        ...


class Root(Protocol):
    """A checkpoint root of any kind; see the module docstring."""

    def __str__(self) -> str:
        """The root as the user wrote it (a path, an ``s3://`` URL): for messages."""
        ...

    def expect_checkpoints(self) -> None:
        """CheckpointNotFoundError, saying what to pass instead, unless this names a root
        dckpt wrote (a command that reads one asks first)."""
        ...

    # --- a job's parts ----------------------------------------------------------------------

    def prepare(self, *, coordinator: bool, access: Access = "private") -> None:
        """At a job's start, on every rank: make the local directory a save writes into (the
        coordinator: the root's; every node's first rank: an object store's mirror, tidied),
        proven the job's own (dckpt.owned.prove_root, ``access``: who else may write it).
        Raises CheckpointError (NotOwnedError) or OSError saying what is wrong with it."""
        ...

    def locks(self, run_id: str, lease_s: float) -> list[Lock]:
        """The run's locks, not yet taken, in the order to take them (coordinator only)."""
        ...

    def recover(self) -> list[str]:
        """At a job's start, under its lock: remove what crashed saves left (never a
        committed step) and repoint ``latest``; one line per action."""
        ...

    def commit_strategy(self) -> FileCommit:
        """How a save commits into this root (after ``locks`` were taken, on the
        coordinator: the strategy checks the lock is still the job's before each commit)."""
        ...

    def source(self) -> CheckpointSource:
        """Where a resume reads this root's committed steps from."""
        ...

    def memory_ledger(self) -> MemoryLedger:
        """Where the memory tier records its committed steps under this root."""
        ...

    # --- reading ----------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """Every step-like entry, sorted by step, then status, then name."""
        ...

    def committed_steps(self) -> list[int]:
        """Steps whose commit is complete, oldest first."""
        ...

    def read_manifest(self, step: int) -> Manifest:
        """The committed ``step``'s manifest, validated (ManifestError/IntegrityError)."""
        ...

    def manifest_of(self, entry: Entry) -> Manifest:
        """The manifest of any entry that has one (a quarantined step too)."""
        ...

    def measure(self, entry: Entry) -> int:
        """The bytes ``entry`` takes in the root."""
        ...

    def shared(self, entry: Entry) -> int:
        """The bytes of ``entry``'s files that other entries hold too (an incremental save's
        linked files): deleting ``entry`` frees ``measure - shared`` of them at most."""
        ...

    def where(self, step: int) -> Path | str:
        """Where a user finds the committed ``step``: its directory, or its URL."""
        ...

    def pinned_steps(self) -> set[int]: ...

    def foreign(self) -> list[str]:
        """What the root holds that dckpt did not write, each named (a fresh start's report
        lists it: the user may have pointed at another run's root)."""
        ...

    def resume_records(self) -> ResumeRecords:
        """How the resumes of this root's steps went (dckpt.root.resume_record)."""
        ...

    def verify(
        self, step: int, *, threads: int, deep: bool, progress: Callable[[int], None]
    ) -> VerifyResult:
        """Re-hash every file of the committed ``step`` against its manifest; a damaged
        manifest is a problem of the result, not an exception."""
        ...

    def record_verification(self, result: VerifyResult) -> None:
        """Remember ``result`` for ``dckpt ls``, bound to the step's files digest (a re-save
        makes it stale); best effort."""
        ...

    def verification(self, step: int, files_digest: str) -> dict[str, Any] | None:
        """The last recorded verification of that very checkpoint, or None."""
        ...

    def lock_holder(self) -> str | None:
        """Who holds the run lock now (a stale lock counts as free), or None."""
        ...

    def local_steps(
        self, steps: Sequence[int], progress: Callable[[int], None], note: Callable[[str], None]
    ) -> contextlib.AbstractContextManager[Path]:
        """A directory that holds the committed ``steps`` as step directories, verified,
        for as long as the context lasts; ``progress`` gets the bytes fetched, ``note`` a
        line per step fetched (a directory is read in place: neither is called)."""
        ...

    # --- changing ---------------------------------------------------------------------------

    def quarantine(self, step: int, reason: str) -> str:
        """Move the committed ``step`` to ``quarantine/`` with ``reason``; where it went."""
        ...

    def restore(
        self,
        step: int,
        name: str | None = None,
        *,
        progress: Callable[[int], None] = lambda _n: None,
    ) -> str:
        """Put the quarantined ``step`` back as committed; where it is now. ``name``: which
        quarantined copy (``quarantine/step-N-1a2b3c4d``), needed when there are several.
        Refused (dckpt.root.quarantined.RestoreError, CheckpointNotFoundError) while a step of that
        number is committed, and when the copy does not verify as ``verify`` would (it stays
        in quarantine; ``progress`` gets the bytes hashed). Its commit is the kind's own commit
        point, made last (a rename; the manifest), so a crash never leaves it looking committed
        but not whole; then ``latest`` is republished and the quarantined copy and its reason
        are gone."""
        ...

    def delete_steps(self, steps: list[int]) -> list[str]:
        """Delete committed steps (never half a checkpoint left that looks whole); the
        names deleted."""
        ...

    def pin(self, step: int) -> str:
        """Keep the committed ``step`` through retention (FileNotFoundError if there is
        none); where the pin is."""
        ...

    def unpin(self, step: int) -> bool:
        """Remove a pin; whether there was one."""
        ...

    def plan_retention(self, policy: RetentionPolicy) -> list[Decision]: ...

    def apply_retention(
        self, policy: RetentionPolicy, *, dry_run: bool = False
    ) -> tuple[list[Decision], list[str]]:
        """Decide and (unless ``dry_run``) delete; logs one line; decisions and deleted."""
        ...
