"""``DirectoryRoot``: the ``Root`` (dckpt.root.protocol) of a local or shared directory.

It holds no state of its own beyond the path: each member is the directory layer's function
for it (``layout`` reads, ``commit`` commits by rename, ``upkeep`` changes, ``verify`` hashes,
``lock`` locks), so the rules of the on-disk format stay in those modules, once.

Committed, for a directory: a real ``step-N/`` directory (never a symlink) holding a
``manifest.json`` file (``layout.is_committed_dir``). Knows files, never tensors.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError, LockError
from ..owned import Access, prove_root
from .commit import FileCommit, RenameCommit
from .fence import Fence
from .layout import (
    LOCK_FILE,
    committed_steps,
    foreign_entries,
    is_dckpt_root,
    list_checkpoints,
    pinned_steps,
    read_small_file,
    step_dir_name,
)
from .lock import MAX_RECORD_BYTES, LockOwner, RunLock, apart, stale_reason
from .manifest import Manifest, read_manifest
from .memory_ledger import DirectoryLedger, MemoryLedger
from .protocol import Entry, Lock
from .resume_record import DirectoryRecords, ResumeRecords
from .retention import Decision, RetentionPolicy
from .source import CheckpointSource, LocalSource
from .upkeep import (
    apply_retention,
    delete_checkpoints,
    pin,
    plan_retention,
    quarantine,
    recover,
    restore,
    unpin,
)
from .verify import VerifyResult, read_verification, record_verification, verify_checkpoint

__all__ = ["DirectoryRoot", "dir_bytes"]


def _stats(path: Path) -> Iterator[os.stat_result]:
    """The ``lstat`` of every file under ``path`` (links not followed; one that vanished
    while listed is skipped)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                yield os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue


def dir_bytes(path: Path, *, shared: bool = False) -> int:
    """The bytes of every file under ``path``; what a step takes. With ``shared``, only of
    the files that have another name too (a hard link from a later or earlier step:
    dckpt.storage.stable_file)."""
    return sum(st.st_size for st in _stats(path) if not shared or st.st_nlink > 1)


def disk_bytes(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """The disk blocks of the files under ``path``, each inode once, leaving out those in
    ``seen`` (which it extends): what a directory, or what was added to it since ``seen`` was
    filled, holds on the disk (a hard link adds a name, no block)."""
    seen = set() if seen is None else seen
    total = 0
    for st in _stats(path):
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


class DirectoryRoot:
    """The checkpoints under one directory; see the module docstring.

    ``name``: the root as a refusal names it, when it is another root's local copy (an
    object store's mirror takes this directory's lock too)."""

    def __init__(self, path: str | os.PathLike[str], *, name: str | None = None) -> None:
        self.path = Path(path)
        self._name = name
        self.fence = Fence()
        """Rank 0's claim on the root (dckpt.root.fence): the lock's check, once ``locks``
        made it, and the steps found at ``recover``."""

    def __str__(self) -> str:
        return str(self.path)

    def expect_checkpoints(self) -> None:
        if not self.path.exists():
            raise CheckpointNotFoundError(
                f"{self.path} does not exist; pass the --ckpt-dir a training run used"
            )
        if not self.path.is_dir():
            raise CheckpointNotFoundError(
                f"{self.path} is not a directory; pass a checkpoint root, not a file in it"
            )
        if not is_dckpt_root(self.path):
            raise CheckpointNotFoundError(
                f"{self.path} is not a dckpt checkpoint root (no step-* directories, no "
                "latest, no .dckpt-lock); pass the --ckpt-dir a training run used"
            )

    # --- a job's parts ----------------------------------------------------------------------

    def prepare(self, *, coordinator: bool, access: Access = "private") -> None:
        if not coordinator:
            return  # one directory, shared: the coordinator makes and proves it
        if self.path.exists() and not self.path.is_dir():
            raise CheckpointError(f"{self.path} exists and is not a directory")
        prove_root(self.path, access=access)

    def locks(self, run_id: str, lease_s: float) -> list[Lock]:
        lock = RunLock(self.path, run_id, lease_s, name=self._name)
        self.fence = Fence(held=lock.check_held, run_id=run_id)
        return [lock]

    def recover(self) -> list[str]:
        actions = recover(self.path)
        self.fence.start(committed_steps(self.path))  # what this job found: its to move
        return actions

    def commit_strategy(self) -> FileCommit:
        return RenameCommit(self.fence)

    def source(self) -> CheckpointSource:
        return LocalSource(self.path)

    def memory_ledger(self) -> MemoryLedger:
        return DirectoryLedger(self.path, held=self.fence.check)

    # --- reading ----------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        return [
            Entry(
                step=e.step,
                status=e.status,
                name=e.path.relative_to(self.path).as_posix(),
                where=str(e.path),
            )
            for e in list_checkpoints(self.path)
        ]

    def committed_steps(self) -> list[int]:
        return committed_steps(self.path)

    def read_manifest(self, step: int) -> Manifest:
        return read_manifest(self.path / step_dir_name(step))

    def manifest_of(self, entry: Entry) -> Manifest:
        return read_manifest(self.path / entry.name)

    def measure(self, entry: Entry) -> int:
        return dir_bytes(self.path / entry.name)

    def shared(self, entry: Entry) -> int:
        return dir_bytes(self.path / entry.name, shared=True)

    def where(self, step: int) -> Path:
        return self.path / step_dir_name(step)

    def pinned_steps(self) -> set[int]:
        return pinned_steps(self.path)

    def resume_records(self) -> ResumeRecords:
        return DirectoryRecords(self.path)

    def foreign(self) -> list[str]:
        return foreign_entries(self.path)

    def verify(
        self, step: int, *, threads: int, deep: bool, progress: Callable[[int], None]
    ) -> VerifyResult:
        step_dir = self.path / step_dir_name(step)
        return verify_checkpoint(step_dir, threads=threads, progress=progress, deep=deep)

    def record_verification(self, result: VerifyResult) -> None:
        record_verification(result)

    def verification(self, step: int, files_digest: str) -> dict[str, Any] | None:
        return read_verification(self.path / step_dir_name(step), files_digest)

    def lock_holder(self) -> str | None:
        """Who holds the run lock now, unless it is stale (the same rules as a job's
        takeover, dckpt.root.lock): an owner whose pid cannot be judged here (another host,
        boot or pid namespace) is a holder, said where. A record dckpt cannot read may be a
        live job's, so it is described, as a holder, not taken for free."""
        path = self.path / LOCK_FILE
        # Never follows a symlink or waits on a FIFO put in the lock's place.
        raw = read_small_file(path, MAX_RECORD_BYTES + 1)
        if raw is None or not raw.strip(b"\0"):  # none, or what a power cut left of one
            return None
        try:
            owner = LockOwner.parse(raw, str(path), f"rm {path}")
        except LockError as exc:
            return f"a lock dckpt cannot read ({exc})"
        if stale_reason(owner, run_id="") is not None:
            return None
        where = apart(owner)  # a container beside this one: its pid says nothing here
        return owner.describe() if where is None else f"{owner.describe()} {where}"

    @contextlib.contextmanager
    def local_steps(
        self, steps: Sequence[int], progress: Callable[[int], None], note: Callable[[str], None]
    ) -> Iterator[Path]:
        yield self.path  # read in place: every load and command hashes what it reads

    # --- changing ---------------------------------------------------------------------------

    def quarantine(self, step: int, reason: str) -> str:
        return str(quarantine(self.path, self.path / step_dir_name(step), reason))

    def restore(
        self,
        step: int,
        name: str | None = None,
        *,
        progress: Callable[[int], None] = lambda _n: None,
    ) -> str:
        return str(restore(self.path, step, name, progress=progress)[0])

    def delete_steps(self, steps: list[int]) -> list[str]:
        return delete_checkpoints(self.path, steps)

    def pin(self, step: int) -> str:
        return str(pin(self.path, step))

    def unpin(self, step: int) -> bool:
        return unpin(self.path, step)

    def plan_retention(self, policy: RetentionPolicy) -> list[Decision]:
        return plan_retention(self.path, policy)

    def apply_retention(
        self, policy: RetentionPolicy, *, dry_run: bool = False
    ) -> tuple[list[Decision], list[str]]:
        return apply_retention(self.path, policy, dry_run=dry_run)
