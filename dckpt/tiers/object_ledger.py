"""The memory tier's ledger in an object store: ``PREFIX/memory/step-N.json``.

The same ledger as a directory root's (dckpt.root.memory_ledger states it): a memory step is
committed iff its record exists, and the record is one small PUT, made by rank 0 on the save
thread after every rank reported its file hashed, and only while this job still holds the run
lock (the lock is read back first, as for a durable commit). Knows keys, never tensors.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

from ..errors import ManifestError
from ..root.layout import QUARANTINE_DIR, step_dir_name
from ..root.manifest import MAX_MANIFEST_BYTES
from ..root.memory_ledger import (
    IDENTITY,
    LEDGER_DIR,
    RECORD_RE,
    Pruning,
    parse_identity,
    record_name,
)
from .bucket import Bucket

__all__ = ["ObjectLedger"]


class ObjectLedger(Pruning):
    """The memory ledger under an s3:// root; see the module docstring."""

    def __init__(self, objects: Bucket, held: Callable[[], None] | None = None) -> None:
        self.objects = objects
        self.store = objects.store
        self.held = held
        """Raises unless this job still holds the run lock (rank 0, checked before a PUT)."""

    def __str__(self) -> str:
        return self.objects.url_of(LEDGER_DIR)

    def _key(self, *parts: str) -> str:
        return self.objects.key(LEDGER_DIR, *parts)

    def steps(self) -> list[int]:
        prefix = self._key() + "/"
        return sorted(
            int(m.group(1))
            for o in self.store.list(prefix)
            if (m := RECORD_RE.fullmatch(o.key[len(prefix) :]))
        )

    def read(self, step: int) -> bytes:
        got = self.store.get_small(self._key(record_name(step)), MAX_MANIFEST_BYTES)
        if got is None:
            raise ManifestError(
                f"{self.where(step)} does not exist: memory step {step} is not committed"
            )
        return got[0]

    def commit(self, step: int, manifest: Path) -> str:
        raw = manifest.read_bytes()
        if self.held is not None:  # a job that lost its lock must not write into the root
            self.held()
        self.store.put_small(self._key(record_name(step)), raw)  # the commit point
        manifest.unlink(missing_ok=True)
        return self.where(step)

    def _remove(self, steps: list[int]) -> list[int]:
        self.store.delete([self._key(record_name(s)) for s in steps])
        return steps

    def quarantine(self, step: int, reason: str) -> str:
        name = record_name(step)
        target = self._key(QUARANTINE_DIR, name)
        self.store.copy(self._key(name), target)
        reason_key = self._key(QUARANTINE_DIR, f"{step_dir_name(step)}.reason.txt")
        self.store.put_small(reason_key, (reason + "\n").encode())
        self._remove([step])
        return f"s3://{self.objects.url.bucket}/{target}"

    def quarantined(self) -> int:
        prefix = self._key(QUARANTINE_DIR) + "/"
        return sum(1 for o in self.store.list(prefix) if RECORD_RE.fullmatch(o.key[len(prefix) :]))

    def where(self, step: int) -> str:
        return self.objects.url_of(LEDGER_DIR, record_name(step))

    def identity(self, *, create: bool) -> str | None:
        key = self._key(IDENTITY)
        got = self.store.get_small(key, 64)
        found = parse_identity(got[0] if got is not None else None)
        if found is not None or not create:
            return found
        self.store.put_small(key, uuid.uuid4().hex.encode(), if_absent=True)  # first wins
        got = self.store.get_small(key, 64)
        return parse_identity(got[0] if got is not None else None)
