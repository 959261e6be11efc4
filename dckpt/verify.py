"""Offline verification of committed checkpoints: re-hash every file against its manifest.

Used by ``dckpt verify`` and by anything that wants a yes/no on a checkpoint without loading it.
Files are hashed in parallel threads (hashing and reads release the GIL); a progress callback
receives byte counts so a caller can draw a bar.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .errors import IntegrityError, ManifestError, StorageError
from .manifest import check_layout, read_manifest
from .storage.records import FileRecord
from .storage.verified_files import open_verified

__all__ = [
    "FileProblem",
    "VerifyResult",
    "read_verification",
    "record_verification",
    "verify_checkpoint",
]

VERIFIED_DIR = ".dckpt-verified"


@dataclass(frozen=True, kw_only=True)
class FileProblem:
    path: str
    error: str
    expected: str = ""
    actual: str = ""


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    step_dir: Path
    step: int | None
    files_checked: int = 0
    bytes_checked: int = 0
    problems: list[FileProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


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
        return FileProblem(path=str(path), error=f"cannot read: {exc}")
    return None


def verify_checkpoint(
    step_dir: Path, *, threads: int = 4, progress: Callable[[int], None] = lambda _n: None
) -> VerifyResult:
    """Validate the manifest and layout of ``step_dir``, then re-hash every listed file."""
    try:
        manifest = read_manifest(step_dir)
    except (ManifestError, IntegrityError) as exc:
        path = getattr(exc, "path", str(step_dir / "manifest.json"))
        return VerifyResult(
            step_dir=step_dir, step=None, problems=[FileProblem(path=path, error=str(exc))]
        )
    try:
        check_layout(step_dir, manifest)
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
    return VerifyResult(
        step_dir=step_dir,
        step=manifest.step,
        files_checked=len(manifest.files),
        bytes_checked=manifest.total_bytes,
        problems=[p for p in found if p is not None],
    )


def _record_path(step_dir: Path) -> Path:
    return step_dir.parent / VERIFIED_DIR / f"{step_dir.name}.json"


def record_verification(result: VerifyResult) -> None:
    """Remember a verification outcome beside the root (``ls`` shows it); best effort."""
    try:
        manifest = read_manifest(result.step_dir)
    except (ManifestError, IntegrityError):
        return
    path = _record_path(result.step_dir)
    try:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        record = {"ok": result.ok, "time": time.time(), "files_digest": manifest.files_digest}
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return


def read_verification(step_dir: Path, files_digest: str) -> dict[str, object] | None:
    """The last recorded verification of this very checkpoint (same files digest), if any."""
    try:
        record = json.loads(_record_path(step_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("files_digest") != files_digest:
        return None
    return record
