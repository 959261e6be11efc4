"""The commit protocol: how a tmp directory becomes a checkpoint, atomically and durably.

Protocol (``RenameCommit.commit``), run by the coordinator (rank 0) after every rank's files and
the manifest are written into ``step-XXXXXXXX.tmp-<hex>/``:

1. fsync every file in the tmp dir, then the tmp dir itself;
2. rename tmp → ``step-XXXXXXXX/`` and fsync the root: this rename is the commit point. If
   the final name is taken (the same step saved again), the two are swapped in one atomic
   ``renameat2(RENAME_EXCHANGE)`` instead, so the step is never missing; where the file system
   cannot swap, the old copy is first renamed aside to ``step-XXXXXXXX.replaced-<hex>`` (a
   committed directory is never written into);
3. replace ``latest`` atomically (write tmp file, fsync, rename, fsync root), only ever to a
   committed name, so ``latest`` never points ahead of a commit;
4. delete the replaced copy (after a swap it has the tmp dir's name).

``recover`` undoes what a crash can leave: abandoned tmp dirs are removed, a replaced copy whose
successor never landed is renamed back, and a dangling ``latest`` is repointed. This layer
knows directories and files only, never tensors.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from ..faults import fault_point
from .layout import (
    LATEST_FILE,
    PINS_DIR,
    QUARANTINE_DIR,
    REPLACED_RE,
    STEP_RE,
    TMP_RE,
    TRASH_RE,
    committed_steps,
    read_latest,
    step_dir_name,
)
from .manifest import MANIFEST_FILE

__all__ = [
    "RenameCommit",
    "delete_checkpoints",
    "fsync_dir",
    "new_tmp_dir",
    "pin",
    "quarantine",
    "recover",
    "unpin",
]

log = logging.getLogger("dckpt")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def new_tmp_dir(root: str | os.PathLike[str], step: int, save_id: str) -> Path:
    """The path (not yet created) of the tmp dir for one save of ``step``."""
    return Path(root) / f"{step_dir_name(step)}.tmp-{save_id}"


class RenameCommit:
    """Commit by atomic rename, for POSIX file systems where rename(2) is atomic."""

    name = "rename"

    def commit(
        self,
        root: str | os.PathLike[str],
        tmp_dir: Path,
        step: int,
        *,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> Path:
        """Commit ``tmp_dir`` as ``step``; see the module docstring. ``abandoned`` is asked
        right before the commit point: a save its owner gave up on (declared stuck) must not
        land in a root that may belong to the next job by then."""
        base = Path(root)
        if not TMP_RE.fullmatch(tmp_dir.name) or tmp_dir.parent != base:
            raise ValueError(f"{tmp_dir} is not a dckpt tmp dir under {base}")
        if not (tmp_dir / MANIFEST_FILE).is_file():
            raise ValueError(f"{tmp_dir} has no {MANIFEST_FILE}: refusing to commit it")
        fault_point("fsync_shards", 0, step)
        for child in tmp_dir.iterdir():
            if child.is_file() and not child.is_symlink():
                _fsync_file(child)
        fsync_dir(tmp_dir)

        final = base / step_dir_name(step)
        fault_point("rename", 0, step)
        if abandoned():
            raise RuntimeError(f"the save of step {step} was abandoned before its commit")
        replaced: Path | None = None
        if final.is_symlink():  # not a checkpoint (never followed): a planted name, dropped
            final.unlink()
        if final.exists():
            replaced = _replace(base, tmp_dir, final)
        else:
            os.rename(tmp_dir, final)  # the commit point
        # Committed. What follows only tidies up: a failure here is logged, not raised, so a
        # committed save is never reported as lost; `recover` finishes the job at next start.
        try:
            fault_point("fsync_parent", 0, step)
            fsync_dir(base)
            self._supersede(base, step)
            fault_point("publish_latest", 0, step)
            self.publish_latest(base)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
        except Exception as exc:
            log.warning("dckpt: step %d is committed, but tidying up failed: %r", step, exc)
        return final

    @staticmethod
    def _supersede(root: Path, step: int) -> None:
        """After a rollback (a save below the newest step), move the abandoned newer branch to
        quarantine/, so that resume and retention follow the run as it goes on."""
        for newer in [s for s in committed_steps(root) if s > step]:
            quarantine(
                root,
                root / step_dir_name(newer),
                f"superseded: the run was rolled back and saved step {step} after step {newer}",
            )

    @staticmethod
    def publish_latest(root: Path) -> None:
        """Point ``latest`` at the newest committed step (or remove it when there is none)."""
        steps = committed_steps(root)
        latest = root / LATEST_FILE
        if not steps:
            latest.unlink(missing_ok=True)
            fsync_dir(root)
            return
        name = step_dir_name(steps[-1])
        if read_latest(root) == name:
            return
        tmp = root / f"{LATEST_FILE}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, latest)
        fsync_dir(root)


def recover(root: str | os.PathLike[str]) -> list[str]:
    """Clean up after crashed saves; returns one line per action taken (also logged)."""
    base = Path(root)
    actions: list[str] = []
    for child in sorted(base.iterdir()):
        ours = any(r.fullmatch(child.name) for r in (TMP_RE, TRASH_RE, REPLACED_RE))
        if child.is_symlink() and ours:  # dckpt never makes these links: drop, never follow
            child.unlink()
            actions.append(f"removed the symlink {child.name}")
            continue
        if child.is_symlink() or not child.is_dir():
            continue
        if TMP_RE.fullmatch(child.name):
            shutil.rmtree(child, ignore_errors=True)
            actions.append(f"removed abandoned save {child.name}")
        elif TRASH_RE.fullmatch(child.name):
            shutil.rmtree(child, ignore_errors=True)
            actions.append(f"finished deleting {child.name}")
        elif m := REPLACED_RE.fullmatch(child.name):
            final = base / f"step-{m.group(1)}"
            if not final.exists() and (child / MANIFEST_FILE).is_file():
                os.rename(child, final)
                actions.append(f"restored {final.name}: its re-save never committed")
            else:
                shutil.rmtree(child, ignore_errors=True)
                actions.append(f"removed superseded copy {child.name}")
    for child in base.glob(f"{LATEST_FILE}.tmp-*"):
        if child.is_file() and not child.is_symlink():
            child.unlink(missing_ok=True)
    if actions:
        fsync_dir(base)
    # A crash between the commit rename and `latest` leaves `latest` behind: bring it forward.
    RenameCommit.publish_latest(base)
    for line in actions:
        log.info("dckpt recover: %s", line)
    return actions


def quarantine(root: str | os.PathLike[str], step_dir: Path, reason: str) -> Path:
    """Move a committed checkpoint that failed verification to ``quarantine/``, with the reason."""
    base = Path(root)
    if not STEP_RE.fullmatch(step_dir.name) or step_dir.parent != base:
        raise ValueError(f"{step_dir} is not a committed step dir under {base}")
    qdir = base / QUARANTINE_DIR
    qdir.mkdir(exist_ok=True)
    target = qdir / step_dir.name
    if target.exists():
        target = qdir / f"{step_dir.name}-{uuid.uuid4().hex[:8]}"
    os.rename(step_dir, target)
    (target.parent / f"{target.name}.reason.txt").write_text(reason + "\n", encoding="utf-8")
    fsync_dir(qdir)
    fsync_dir(base)
    RenameCommit.publish_latest(base)
    log.warning(
        "dckpt: moved %s to %s: %s", step_dir.name, target, reason.split(". ", maxsplit=1)[0]
    )
    return target


def delete_checkpoints(root: str | os.PathLike[str], steps: list[int]) -> list[str]:
    """Delete committed checkpoints: rename each to a trash name (fsynced), then remove it.

    After the rename the directory no longer looks committed, so a crash mid-delete leaves
    only a trash dir, which ``recover`` removes. ``latest`` is never left pointing at one.
    """
    base = Path(root)
    trashed: list[Path] = []
    for step in steps:
        src = base / step_dir_name(step)
        if not (src / MANIFEST_FILE).is_file():
            continue
        dst = base / f"{src.name}.trash-{uuid.uuid4().hex}"
        os.rename(src, dst)
        trashed.append(dst)
    if trashed:
        fsync_dir(base)
        RenameCommit.publish_latest(base)
        fault_point("retention", 0)
    for path in trashed:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name.split(".trash-")[0] for p in trashed]


def pin(root: str | os.PathLike[str], step: int) -> Path:
    """Mark a committed step as pinned: retention never deletes it."""
    base = Path(root)
    if not (base / step_dir_name(step) / MANIFEST_FILE).is_file():
        raise FileNotFoundError(f"no committed checkpoint for step {step} under {base}")
    pins = base / PINS_DIR
    pins.mkdir(exist_ok=True)
    marker = pins / step_dir_name(step)
    marker.touch()
    fsync_dir(pins)
    return marker


def unpin(root: str | os.PathLike[str], step: int) -> bool:
    """Remove a pin; returns whether there was one."""
    marker = Path(root) / PINS_DIR / step_dir_name(step)
    if not marker.exists():
        return False
    marker.unlink()
    fsync_dir(marker.parent)
    return True
