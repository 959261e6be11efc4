"""The memory tier's ledger: the manifest of every memory checkpoint, kept in the durable root.

A memory checkpoint's bytes live in the nodes' memory (dckpt.tiers.memory_layout), where any
process of the node's user could write; its manifest lives here, where only the job writes
(``ROOT/memory/``, or ``PREFIX/memory/`` in an object store):

```
ROOT/memory/
  root-id                        the root's memory identity (32 hex), made at first use
  step-00000008.json             the manifest of memory step 8: its commit point
  step-00000010.tmp-<32 hex>/    a memory save in flight (rank 0 writes its manifest there)
  quarantine/step-00000006.json  a memory step every copy of which failed its digests
  quarantine/step-00000006.reason.txt
```

Invariants:
- a memory step is committed iff ``memory/step-N.json`` exists: rank 0 writes it (fsynced,
  renamed in, the directory fsynced) only after every rank reported its file hashed, so the
  record is the commit point, and a resume restores a memory step only if its manifest came
  from here; files found in memory without a record are never read;
- a memory file is read only after it hashed to the digest this manifest records;
- a record above a newly committed step belongs to a branch the run rolled back from and is
  removed (``drop_above``), so a resume never returns to that branch.

Knows files and manifests, never tensors (no torch).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ..errors import ManifestError
from ..owned import create_new, make_dir, write_atomic
from .durable import fsync_dir, fsync_file
from .layout import QUARANTINE_DIR, read_small_file, step_dir_name
from .manifest import MAX_MANIFEST_BYTES

__all__ = [
    "IDENTITY",
    "LEDGER_DIR",
    "DirectoryLedger",
    "MemoryLedger",
    "Pruning",
    "parse_identity",
    "record_name",
]

LEDGER_DIR = "memory"
RECORD_RE = re.compile(r"step-([0-9]{8,})\.json")
IDENTITY = "root-id"
"""Beside the records: the root's memory identity (``MemoryLedger.identity``)."""
_ID_RE = re.compile(r"[0-9a-f]{32}")


def parse_identity(raw: bytes | None) -> str | None:
    """A ``root-id``'s id, or None when it does not hold one."""
    text = (raw or b"").decode("ascii", "replace").strip()
    return text if _ID_RE.fullmatch(text) else None


def record_name(step: int) -> str:
    return f"{step_dir_name(step)}.json"


class MemoryLedger(Protocol):
    """Where a root keeps its memory checkpoints' manifests; see the module docstring."""

    def steps(self) -> list[int]:
        """Committed memory steps, oldest first."""
        ...

    def read(self, step: int) -> bytes:
        """The raw manifest of memory step ``step`` (ManifestError if it has none)."""
        ...

    def commit(self, step: int, manifest: Path) -> str:
        """Make the fsynced manifest file ``manifest`` memory step ``step``'s record: the commit
        point of a memory save. Returns where the record is."""
        ...

    def drop_above(self, step: int) -> list[int]:
        """Remove the records above ``step`` (a rolled-back branch); returns their steps."""
        ...

    def keep_newest(self, count: int) -> list[int]:
        """Remove all but the ``count`` newest records; returns the steps removed."""
        ...

    def quarantine(self, step: int, reason: str) -> str:
        """Move ``step``'s record aside with the reason (every copy of it was damaged)."""
        ...

    def quarantined(self) -> int:
        """How many records were moved aside."""
        ...

    def where(self, step: int) -> str:
        """Where ``step``'s record is (for logs)."""
        ...

    def identity(self, *, create: bool) -> str | None:
        """The root's memory identity: a random id kept beside the records (``root-id``),
        made at the first memory start (``create``; the first writer wins a race), which a
        memory directory records as the root it serves. It travels with the root (a copy
        or a move keeps it), and two roots never share one. None: none yet (and not made)."""
        ...


class Pruning(ABC):
    """The ledger's upkeep, the same for every store: what a ledger removes is found from its
    listing (``steps``), and removed by its ``_remove`` (each store's own), only while this
    job still holds the run lock (``held``, read back first, as before a commit: a job that
    lost its lock removes no record the new owner may resume from)."""

    held: Callable[[], None] | None = None
    """Raises unless this job still holds the run lock (None: no lock to check)."""

    @abstractmethod
    def steps(self) -> list[int]:
        """The steps that have a record, oldest first."""

    @abstractmethod
    def _remove(self, steps: list[int]) -> list[int]:
        """Remove the records of ``steps``; returns those removed."""

    def drop_above(self, step: int) -> list[int]:
        return self._prune([s for s in self.steps() if s > step])

    def keep_newest(self, count: int) -> list[int]:
        steps = self.steps()
        return self._prune(steps[: max(0, len(steps) - count)])

    def _prune(self, steps: list[int]) -> list[int]:
        if steps and self.held is not None:
            self.held()
        return self._remove(steps) if steps else []


class DirectoryLedger(Pruning):
    """The ledger of a directory root: ``ROOT/memory/``."""

    def __init__(
        self, root: str | os.PathLike[str], held: Callable[[], None] | None = None
    ) -> None:
        self.dir = Path(root) / LEDGER_DIR
        self.held = held
        """Raises unless this job still holds the run lock (rank 0, checked before a commit)."""

    def __str__(self) -> str:
        return str(self.dir)

    def steps(self) -> list[int]:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := RECORD_RE.fullmatch(n)))

    def read(self, step: int) -> bytes:
        path = self.dir / record_name(step)
        raw = read_small_file(path, MAX_MANIFEST_BYTES + 1)  # no symlink, FIFO or device
        if raw is None:
            raise ManifestError(f"{path} does not exist: memory step {step} is not committed")
        return raw

    def commit(self, step: int, manifest: Path) -> str:
        fresh = not self.dir.is_dir()
        make_dir(self.dir)
        if fresh:
            fsync_dir(self.dir.parent)
        fsync_file(manifest)
        final = self.dir / record_name(step)
        if self.held is not None:  # a job that lost its lock must not write into the root
            self.held()
        os.replace(manifest, final)  # the commit point (a re-save replaces the record)
        fsync_dir(self.dir)
        return str(final)

    def _remove(self, steps: list[int]) -> list[int]:
        for step in steps:
            (self.dir / record_name(step)).unlink(missing_ok=True)
        if steps:
            fsync_dir(self.dir)
        return steps

    def quarantine(self, step: int, reason: str) -> str:
        aside = make_dir(self.dir / QUARANTINE_DIR)
        target = aside / record_name(step)
        write_atomic(aside, f"{step_dir_name(step)}.reason.txt", (reason + "\n").encode())
        os.replace(self.dir / record_name(step), target)
        fsync_dir(self.dir)
        return str(target)

    def quarantined(self) -> int:
        try:
            return sum(1 for n in os.listdir(self.dir / QUARANTINE_DIR) if RECORD_RE.fullmatch(n))
        except OSError:
            return 0

    def where(self, step: int) -> str:
        return str(self.dir / record_name(step))

    def identity(self, *, create: bool) -> str | None:
        found = parse_identity(read_small_file(self.dir / IDENTITY, 64))
        if found is not None or not create:
            return found
        make_dir(self.dir)
        tmp = self.dir / f"{IDENTITY}.tmp-{uuid.uuid4().hex}"
        with os.fdopen(create_new(tmp), "wb") as f:
            f.write(uuid.uuid4().hex.encode())
            f.flush()
            os.fsync(f.fileno())
        try:  # written whole, then linked: the first writer's id wins, none is seen half made
            with contextlib.suppress(FileExistsError):
                os.link(tmp, self.dir / IDENTITY, follow_symlinks=False)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.dir)
        return parse_identity(read_small_file(self.dir / IDENTITY, 64))
