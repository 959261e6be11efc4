"""Durability on a POSIX file system: fsync of files and directories, and the ``latest`` pointer.

``publish_latest`` replaces ``latest`` atomically (tmp file, fsync, rename, fsync the root) and
only ever with the name of a committed step, so ``latest`` never points ahead of a commit. Used
by the rename commit and by upkeep (quarantine, deletes, recovery). No torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..owned import write_atomic
from .layout import LATEST_FILE, committed_steps, read_latest, step_dir_name

__all__ = ["fsync_dir", "fsync_file", "publish_latest"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    write_atomic(root, LATEST_FILE, (name + "\n").encode())  # tmp, fsync, rename, fsync root
