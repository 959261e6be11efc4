"""Offline verification of committed checkpoints: re-hash every file against its manifest.

Used by ``dckpt verify`` and by anything that wants a yes/no on a checkpoint without loading it.
Files are hashed in parallel threads (hashing and reads release the GIL); a progress callback
receives byte counts so a caller can draw a bar.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import IntegrityError, ManifestError, StorageError
from ..owned import make_dir, write_atomic
from ..storage.records import FileRecord
from ..storage.verified_files import open_verified
from .layout import read_small_file
from .manifest import Manifest, check_layout, read_manifest

__all__ = [
    "FileProblem",
    "VerifyResult",
    "read_verification",
    "record_verification",
    "verify_checkpoint",
]

VERIFIED_DIR = ".dckpt-verified"
MAX_RECORD_BYTES = 4096


@dataclass(frozen=True, kw_only=True)
class FileProblem:
    path: str
    error: str
    expected: str = ""
    actual: str = ""
    unreadable: bool = False
    """The storage failed to serve the file (EIO, ESTALE, EACCES): no word on its bytes,
    where every other problem is evidence of damage."""


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    step_dir: Path
    step: int | None
    files_checked: int = 0
    bytes_checked: int = 0
    problems: list[FileProblem] = field(default_factory=list)
    where: str = ""
    """Where the checkpoint lives when not at ``step_dir`` (an object store's URL)."""
    incompatible: str | None = None
    """``deep``: why this torch cannot read the checkpoint's DCP metadata, which another
    torch wrote (not damage: every byte hashed right), else None."""
    files_digest: str | None = None
    """The manifest's digest of its file list, which a recorded outcome is bound to."""
    captured: tuple[int | None, int] = (None, 0)
    """How many tensors the save compared with their state at ``save()`` before it committed,
    and how many it could not (the manifest's ``capture``); None: not recorded (a save made
    without the capture check)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged(self) -> bool:
        """Some problem is evidence of damage (not only files the storage could not serve)."""
        return any(not p.unreadable for p in self.problems)


def _check_file(
    path: Path, record: FileRecord, progress: Callable[[int], None]
) -> FileProblem | None:
    # The same check a load makes: no symlink followed, no FIFO waited on, every byte hashed.
    try:
        open_verified(str(path), record, progress).close()
    except IntegrityError as exc:
        return FileProblem(
            path=str(path), error=exc.detail, expected=exc.expected, actual=exc.actual
        )
    except StorageError as exc:
        return FileProblem(path=str(path), error=str(exc), unreadable=True)
    return None


def verify_checkpoint(
    step_dir: Path,
    *,
    threads: int = 4,
    progress: Callable[[int], None] = lambda _n: None,
    deep: bool = False,
) -> VerifyResult:
    """Validate the manifest and layout of ``step_dir``, then re-hash every listed file.

    ``deep``: once the bytes hash right, also read DCP's metadata the way a load does (the
    allow-list unpickler and the span checks), for checkpoints re-sealed on purpose."""
    try:
        manifest = read_manifest(step_dir)
    except (ManifestError, IntegrityError) as exc:
        path = getattr(exc, "path", str(step_dir / "manifest.json"))
        return VerifyResult(
            step_dir=step_dir, step=None, problems=[FileProblem(path=path, error=str(exc))]
        )
    except StorageError as exc:
        unread = FileProblem(path=str(step_dir / "manifest.json"), error=str(exc), unreadable=True)
        return VerifyResult(step_dir=step_dir, step=None, problems=[unread])
    try:
        check_layout(step_dir, manifest)
    except StorageError as exc:
        unread = FileProblem(path=str(step_dir), error=str(exc), unreadable=True)
        return VerifyResult(step_dir=step_dir, step=manifest.step, problems=[unread])
    except IntegrityError as exc:
        return VerifyResult(
            step_dir=step_dir,
            step=manifest.step,
            problems=[
                FileProblem(
                    path=exc.path, error=exc.detail, expected=exc.expected, actual=exc.actual
                )
            ],
        )
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        found = list(
            pool.map(lambda rec: _check_file(step_dir / rec.path, rec, progress), manifest.files)
        )
    problems = [p for p in found if p is not None]
    incompatible = None
    if deep and not problems:
        more, incompatible = _check_metadata(step_dir, manifest)
        problems.extend(more)
    return VerifyResult(
        step_dir=step_dir,
        step=manifest.step,
        files_checked=len(manifest.files),
        bytes_checked=manifest.total_bytes,
        problems=problems,
        incompatible=incompatible,
        files_digest=manifest.files_digest,
        captured=(manifest.capture.get("items"), manifest.capture.get("uncompared", 0)),
    )


def _check_metadata(step_dir: Path, manifest: Manifest) -> tuple[list[FileProblem], str | None]:
    """Problems of the DCP metadata (damage), or why this torch cannot read it (not damage)."""
    from ..errors import CheckpointError, IncompatibleCheckpointError
    from ..storage.verifying_reader import VerifyingReader  # imports torch: only when asked

    try:
        VerifyingReader(step_dir, manifest.file_map(), versions=manifest.versions).load_metadata()
    except IncompatibleCheckpointError as exc:
        return [], str(exc)
    except CheckpointError as exc:
        path = str(getattr(exc, "path", step_dir / ".metadata"))
        return [FileProblem(path=path, error=str(exc))], None
    return [], None


def _record_path(step_dir: Path) -> Path:
    return step_dir.parent / VERIFIED_DIR / f"{step_dir.name}.json"


def record_verification(result: VerifyResult) -> None:
    """Remember a verification outcome beside the root (``ls`` shows it); best effort.

    Written through a descriptor of ``.dckpt-verified`` opened without following a symlink,
    so a root whose record directory was replaced by a link never gets a file written
    elsewhere."""
    try:
        manifest = read_manifest(result.step_dir)
    except (ManifestError, IntegrityError):
        return
    path = _record_path(result.step_dir)
    record = {"ok": result.ok, "time": time.time(), "files_digest": manifest.files_digest}
    # A fresh name, created exclusively through a descriptor of the record directory: nothing
    # already there (a link, a FIFO, a hard link to a file elsewhere) is ever opened for writing.
    with contextlib.suppress(OSError):
        make_dir(path.parent)
        write_atomic(path.parent, path.name, json.dumps(record).encode(), sync=False)


def read_verification(step_dir: Path, files_digest: str) -> dict[str, object] | None:
    """The last recorded verification of this very checkpoint (same files digest), if any."""
    path = _record_path(step_dir)
    try:  # neither the record directory nor the record is followed if it is a symlink
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        raw = read_small_file(path.name, MAX_RECORD_BYTES, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        record = json.loads(raw) if raw is not None else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("files_digest") != files_digest:
        return None
    return record
