"""The on-disk layout of a checkpoint root: names, patterns and discovery.

    ROOT/
      latest                        name of the newest committed step dir
      step-00001200/                committed: final name and a manifest.json inside
      step-00001300.tmp-<hex>/      a save in flight, or abandoned (never loaded)
      step-00001200.replaced-<hex>/ an older copy being replaced by a re-save of that step
      step-00000400.trash-<hex>/    being deleted by retention (renamed first: never loadable)
      quarantine/step-00001100/     failed verification, kept for forensics
      pins/step-00001000            an empty file: that step is pinned (retention keeps it)
      .dckpt-lock                   the run lock (dckpt.root.lock)
      .dckpt-resumes/ .dckpt-replay/ .dckpt-verified/   resume records, replay journals,
                                    verification records (each module's docstring)
      memory/                       the memory tier's records (dckpt.root.memory_ledger)

Only names that match these patterns are dckpt's; nothing else under ROOT is ever touched.
This module reads; dckpt.root.commit and dckpt.root.upkeep are the only writers of these names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..owned import owner_name
from .manifest import MANIFEST_FILE

log = logging.getLogger("dckpt")

__all__ = [
    "LATEST_FILE",
    "QUARANTINE_DIR",
    "CheckpointEntry",
    "committed_steps",
    "foreign_entries",
    "is_committed_dir",
    "is_ours",
    "list_checkpoints",
    "read_latest",
    "read_small_file",
    "step_dir_name",
]

LATEST_FILE = "latest"
QUARANTINE_DIR = "quarantine"
# Used with fullmatch only, and [0-9] not \d: a look-alike name (a trailing newline, other
# scripts' digits) is not dckpt's and must never be cleaned up or loaded.
STEP_RE = re.compile(r"step-([0-9]{8,})")
TMP_RE = re.compile(r"step-([0-9]{8,})\.tmp-([0-9a-f]{32})")
REPLACED_RE = re.compile(r"step-([0-9]{8,})\.replaced-([0-9a-f]{32})")
TRASH_RE = re.compile(r"step-([0-9]{8,})\.trash-([0-9a-f]{32})")
PINS_DIR = "pins"
LOCK_FILE = ".dckpt-lock"
QUARANTINED_RE = re.compile(r"step-([0-9]{8,})(-[0-9a-f]{8})?")

Status = Literal["committed", "incomplete", "quarantined"]


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


@dataclass(frozen=True, kw_only=True)
class CheckpointEntry:
    step: int
    status: Status
    path: Path


def _is_real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def is_committed_dir(path: Path) -> bool:
    """The one rule of what is committed in a directory root: a real ``step-N/`` directory
    (never a symlink) holding a ``manifest.json`` file, which the commit rename brought in,
    named exactly as dckpt names that step (``step-000000003`` is not step 3's directory:
    every reader rebuilds the path from the step number, and would read another one)."""
    m = STEP_RE.fullmatch(path.name)
    return (
        m is not None
        and path.name == step_dir_name(int(m.group(1)))
        and _is_real_dir(path)
        and (path / MANIFEST_FILE).is_file()
    )


def list_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointEntry]:
    """Every checkpoint-like directory under ``root``, sorted by step then status."""
    base = Path(root)
    entries: list[CheckpointEntry] = []
    for child in base.iterdir():
        if not _is_real_dir(child):
            continue
        if m := STEP_RE.fullmatch(child.name):
            status: Status = "committed" if is_committed_dir(child) else "incomplete"
            entries.append(CheckpointEntry(step=int(m.group(1)), status=status, path=child))
        elif m := TMP_RE.fullmatch(child.name):
            entries.append(CheckpointEntry(step=int(m.group(1)), status="incomplete", path=child))
    quarantine = base / QUARANTINE_DIR
    if _is_real_dir(quarantine):
        for child in quarantine.iterdir():
            m = QUARANTINED_RE.fullmatch(child.name)
            if m and _is_real_dir(child):
                entries.append(
                    CheckpointEntry(step=int(m.group(1)), status="quarantined", path=child)
                )
    return sorted(entries, key=lambda e: (e.step, e.status, e.path.name))


def committed_steps(root: str | os.PathLike[str]) -> list[int]:
    """Steps with a committed checkpoint, oldest first."""
    return [e.step for e in list_checkpoints(root) if e.status == "committed"]


def read_small_file(
    path: str | os.PathLike[str], limit: int, *, dir_fd: int | None = None, own: bool = False
) -> bytes | None:
    """The first ``limit`` bytes of ``path`` if it is a regular file, else None.

    For dckpt's own small records (``latest``, lock and verification records), which anyone
    with write access to the root could replace: a symlink is never followed (``O_NOFOLLOW``)
    and a FIFO or device is never waited on (``O_NONBLOCK``, then a regular-file check).
    ``dir_fd``: resolve ``path`` relative to that directory descriptor. ``own``: a record
    whose verdicts count (a replay journal, resume records): a file another user owns is
    not the job's evidence, read as absent and named once in a warning.
    """
    try:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if own and st.st_uid != os.geteuid():
            where = str(path)
            if dir_fd is not None:
                with contextlib.suppress(OSError):
                    where = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), where)
            _not_the_jobs(where, st.st_uid)
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


_named: set[str] = set()


def _not_the_jobs(path: str, uid: int) -> None:
    if path in _named:  # once a process: a record is read at every resume
        return
    _named.add(path)
    log.warning(
        "dckpt: ignored %s: it belongs to %s, not to this job's user %s (a record another user "
        "wrote is not this job's evidence); remove it if you know where it came from",
        path,
        owner_name(uid),
        owner_name(os.geteuid()),
    )


def read_latest(root: str | os.PathLike[str]) -> str | None:
    """The step dir name ``latest`` points to, or None when absent or not a step name."""
    raw = read_small_file(Path(root) / LATEST_FILE, 256)  # no more than a step name needs
    if raw is None:
        return None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    return name if STEP_RE.fullmatch(name) else None


def pinned_steps(root: str | os.PathLike[str]) -> set[int]:
    """Steps pinned with ``dckpt pin`` (marker files under ``pins/``)."""
    pins = Path(root) / PINS_DIR
    if not _is_real_dir(pins):
        return set()
    return {int(m.group(1)) for p in pins.iterdir() if (m := STEP_RE.fullmatch(p.name))}


def is_dckpt_root(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` holds anything of dckpt's (a step dir, ``latest`` or the lock)."""
    base = Path(root)
    if (base / LATEST_FILE).exists() or (base / LOCK_FILE).exists():
        return True
    return any(
        STEP_RE.fullmatch(c.name) or TMP_RE.fullmatch(c.name) or c.name == QUARANTINE_DIR
        for c in base.iterdir()
    )


_OURS = frozenset({LATEST_FILE, QUARANTINE_DIR, PINS_DIR, "memory"})
_TORCH_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".ckpt", ".tar"})
FOREIGN_LISTED = 8


def is_ours(name: str) -> bool:
    """Whether a name at the top of a root is one dckpt writes (or a file system's own)."""
    return (
        name in _OURS
        or name == "lost+found"  # a mounted volume's, not another checkpointer's
        or name.startswith((".dckpt", f"{LATEST_FILE}.", ".nfs"))  # ours, or NFS's
        or any(r.fullmatch(name) for r in (STEP_RE, TMP_RE, REPLACED_RE, TRASH_RE))
    )


def _what(path: Path) -> str:
    """A foreign entry, named with what it looks like (another checkpointer's files)."""
    if _is_real_dir(path):
        if (path / ".metadata").is_file():
            return f"{path.name}/ (a DCP checkpoint: .metadata, no dckpt manifest)"
        return f"{path.name}/"
    if path.name == ".metadata":
        return ".metadata (the root itself is a DCP checkpoint, not dckpt's)"
    head = read_small_file(path, 4) or b""
    if path.suffix == ".safetensors":
        return f"{path.name} (safetensors)"
    if head.startswith(b"PK\x03\x04") or (head[:1] == b"\x80" and path.suffix in _TORCH_SUFFIXES):
        return f"{path.name} (a torch.save file)"
    return path.name


def foreign_entries(root: str | os.PathLike[str]) -> list[str]:
    """What ``root`` holds that dckpt did not write (at most ``FOREIGN_LISTED``, then a
    count), each named with what it looks like; for a fresh start's report."""
    try:
        names = sorted(c.name for c in Path(root).iterdir() if not is_ours(c.name))
    except OSError:
        return []
    shown = [_what(Path(root) / n) for n in names[:FOREIGN_LISTED]]
    if len(names) > FOREIGN_LISTED:
        shown.append(f"and {len(names) - FOREIGN_LISTED} more")
    return shown
