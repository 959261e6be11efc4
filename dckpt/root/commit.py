"""The commit: how a save's files become a checkpoint, atomically and durably, as a strategy.

A ``CommitStrategy`` says where a save in flight lives (``tmp_location``, ``make_tmp``) and
how it becomes a checkpoint (``finalize``, ``retain``). The save pipeline only talks to this
protocol, so a second root kind (an object store, committed by a manifest written last) is a
second strategy, not a fork of the pipeline. A ``FileCommit`` is a strategy for DCP's files
(the durable route's): it also says where a committed file is found to link into a later save
(``committed_file``), and where the bytes go besides the tmp dir (``uploads``: one
``Upload`` opened per save on each rank, which holds that save's state; None for a
directory, whose tmp dir is where the commit needs the files). What *is* committed is the
root's to say (its listing, dckpt.root.protocol.Root; for a directory
``layout.is_committed_dir``), once per kind. Upkeep (recovery, quarantine, deletes, pins)
lives in dckpt.root.upkeep.

``RenameCommit.finalize``, run by the coordinator (rank 0) once every rank's files and the
manifest are written into ``step-XXXXXXXX.tmp-<hex>/``:

1. fsync every file in the tmp dir, then the tmp dir itself;
2. the run lock is read back (``Fence.check``): a job that lost it commits nothing;
   rename tmp -> ``step-XXXXXXXX/`` and fsync the root: this rename is the commit point. If
   the final name is taken (the same step saved again), the two are swapped in one atomic
   ``renameat2(RENAME_EXCHANGE)`` instead, so the step is never missing; where the file system
   cannot swap, the old copy is first renamed aside to ``step-XXXXXXXX.replaced-<hex>`` (a
   committed directory is never written into);
3. after a rollback (a step below the newest), the newer branch moves to ``quarantine/``:
   the steps of it this job may move (dckpt.root.fence: found at its start, or its own);
4. replace ``latest`` atomically, only ever with a committed name (dckpt.root.durable);
5. delete the replaced copy (after a swap it has the tmp dir's name).

Knows directories and files only, never tensors.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from ..errors import CheckpointError
from ..faults import fault_point
from ..owned import make_dir
from ..phases import Phase, Trace
from ..storage.records import FileRecord
from ..storage.sink import Tee
from .durable import fsync_dir, fsync_file, publish_latest
from .fence import Fence
from .layout import TMP_RE, committed_steps, step_dir_name
from .manifest import MANIFEST_FILE, read_manifest
from .retention import RetentionPolicy
from .upkeep import apply_retention, quarantine

__all__ = ["CommitStrategy", "FileCommit", "Flag", "RenameCommit", "Upload", "exchange"]

log = logging.getLogger("dckpt")


class Flag(Protocol):
    """A flag another thread may raise (``threading.Event`` is one)."""

    def is_set(self) -> bool: ...


class CommitStrategy(Protocol):
    """How a root turns a save in flight into a checkpoint; see the module docstring."""

    def tmp_location(self, root: Path, step: int, save_id: str) -> Path:
        """Where one save of ``step`` writes before its commit (not created here)."""
        ...

    def make_tmp(self, root: Path, tmp: Path, step: int, *, coordinator: bool) -> None:
        """Every rank, before any rank writes a byte of ``step``: make ``tmp``; the
        coordinator (rank 0) also makes room for the step (an object store uncommits a step
        saved again). Raises a CheckpointError in its own words, or an OSError."""
        ...

    def finalize(self, root: Path, tmp: Path, step: int, *, cancelled: Flag | None = None) -> Path:
        """Make ``tmp`` (holding every file and the manifest) the committed ``step``; returns
        its final location. Raises, committing nothing, if ``cancelled`` is set before the
        commit point."""
        ...

    def where(self, root: Path, step: int) -> str:
        """Where a user finds the committed ``step`` (for logs)."""
        ...

    def retain(self, root: Path, policy: RetentionPolicy) -> None:
        """Carry out the retention policy (rank 0, after a commit)."""
        ...


class Upload(Protocol):
    """One save's uploads on one rank, from its first byte to ``publish``."""

    tee: Tee
    """Where else the bytes of this rank's files go as they are written."""

    def publish(
        self, records: Sequence[FileRecord], *, reused: Mapping[str, int] | None = None
    ) -> float:
        """After this rank's files are written: make sure each is where the commit needs
        it; returns the seconds it took. ``reused``: the files linked from a committed step
        (``committed_file``) rather than written, each with that step."""
        ...


class FileCommit(CommitStrategy, Protocol):
    """A commit strategy for DCP's files (the durable route's); see the module docstring."""

    @property
    def shares_reused(self) -> bool:
        """Whether a file a save reuses (``committed_file``) is the same bytes on the storage
        as the step it came from (a hard link), not a copy of its own (an object store's
        copy): then one bad sector in it fails both steps."""
        ...

    def committed_file(self, root: Path, step: int, name: str) -> Path:
        """Where any rank finds the file ``name`` of the committed ``step``, to link into a
        later save (dckpt.storage.stable_file)."""
        ...

    @property
    def uploads(self) -> Callable[[Path, int, Trace], Upload] | None:
        """Opens one save's ``Upload`` on this rank (its tmp dir, its step, its trace); None:
        the tmp dir is where the commit needs the files."""
        ...


def exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux renameat2 RENAME_EXCHANGE); False where
    the platform or file system cannot, so the caller falls back to rename-aside."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _replace(base: Path, tmp_dir: Path, final: Path) -> Path:
    """Commit ``tmp_dir`` over an existing ``final``; returns where the old copy now is."""
    if exchange(tmp_dir, final):  # the commit point: the old copy now has the tmp name
        return tmp_dir
    replaced = base / f"{final.name}.replaced-{uuid.uuid4().hex}"
    os.rename(final, replaced)
    try:
        os.rename(tmp_dir, final)  # the commit point
    except BaseException:
        os.rename(replaced, final)  # put the old copy back: nothing changed
        raise
    return replaced


class RenameCommit:
    """Commit by atomic rename, for POSIX file systems where rename(2) is atomic."""

    shares_reused = True  # a reused file is a hard link
    uploads = None  # the tmp dir, renamed, is the checkpoint

    def __init__(self, fence: Fence | None = None) -> None:
        self.fence = fence or Fence()
        """Rank 0's claim on the root: checked before the rename, consulted before any step
        is moved aside or deleted."""

    def tmp_location(self, root: Path, step: int, save_id: str) -> Path:
        return Path(root) / f"{step_dir_name(step)}.tmp-{save_id}"

    def make_tmp(self, root: Path, tmp: Path, step: int, *, coordinator: bool) -> None:
        """A re-saved step is swapped in at the commit point: no room to make."""
        make_dir(tmp, parents=True)

    def where(self, root: Path, step: int) -> str:
        return str(Path(root) / step_dir_name(step))

    def committed_file(self, root: Path, step: int, name: str) -> Path:
        return Path(root) / step_dir_name(step) / name

    def retain(self, root: Path, policy: RetentionPolicy) -> None:
        if policy.enabled:
            apply_retention(root, policy, fence=self.fence)

    def finalize(self, root: Path, tmp: Path, step: int, *, cancelled: Flag | None = None) -> Path:
        """See the module docstring. ``cancelled`` is read right before the commit point: a
        save its owner gave up on (declared stuck) must not land in a root that may belong to
        the next job by then."""
        base = Path(root)
        if TMP_RE.fullmatch(tmp.name) is None or tmp.parent != base:
            raise ValueError(f"{tmp} is not a dckpt tmp dir under {base}")
        if not (tmp / MANIFEST_FILE).is_file():
            raise ValueError(f"{tmp} has no {MANIFEST_FILE}: refusing to commit it")
        fault_point(Phase.FSYNC_SHARDS, 0, step)
        for child in tmp.iterdir():
            if child.is_file() and not child.is_symlink():
                fsync_file(child)
        fsync_dir(tmp)

        final = base / step_dir_name(step)
        fault_point(Phase.RENAME, 0, step)
        if cancelled is not None and cancelled.is_set():
            raise RuntimeError(f"the save of step {step} was cancelled before its commit")
        self.fence.check()  # a job whose run lock was taken commits nothing more
        replaced: Path | None = None
        if final.is_symlink():  # not a checkpoint (never followed): a planted name, dropped
            final.unlink()
        mine = (tmp / MANIFEST_FILE).read_bytes()
        try:
            if final.exists():
                replaced = _replace(base, tmp, final)
            else:
                os.rename(tmp, final)  # the commit point
            fault_point(Phase.RENAME_REPLY, 0, step)
        except Exception as exc:
            # The storage may have performed the rename and lost its answer (EIO, a network
            # file system's reply): look before saying anything.
            if not _landed(final, mine):
                raise
            log.warning(
                "dckpt: the commit rename of step %d failed (%s) but it landed: %s holds this "
                "save's manifest; the step is committed",
                step,
                exc,
                final,
            )
        # Committed. What follows only tidies up: a failure here is logged, not raised, so a
        # committed save is never reported as lost; `recover` finishes the job at next start.
        self.fence.committed(step)
        try:
            fault_point(Phase.FSYNC_PARENT, 0, step)
            fsync_dir(base)
            _supersede(base, step, self.fence)
            fault_point(Phase.PUBLISH_LATEST, 0, step)
            publish_latest(base)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
        except Exception as exc:
            log.warning("dckpt: step %d is committed, but tidying up failed: %r", step, exc)
        return final


def _supersede(root: Path, step: int, fence: Fence) -> None:
    """After a rollback (a save below the newest step), move the abandoned newer branch to
    quarantine/, so that resume and retention follow the run as it goes on: the steps this
    job may move (``Fence.movable``); another job's are left, and said."""
    for newer in [s for s in committed_steps(root) if s > step]:
        if not fence.movable(newer, functools.partial(_run_of, root, newer)):
            continue
        quarantine(
            root,
            root / step_dir_name(newer),
            f"superseded: the run was rolled back and saved step {step} after step {newer}",
        )


def _run_of(root: Path, step: int) -> str | None:
    try:
        return read_manifest(root / step_dir_name(step)).run_id
    except CheckpointError:
        return None


def _landed(final: Path, manifest: bytes) -> bool:
    """Whether ``final`` is the committed step whose manifest is exactly ``manifest`` (a
    rename whose answer was lost may have been performed)."""
    try:
        return (final / MANIFEST_FILE).read_bytes() == manifest
    except OSError:
        return False
