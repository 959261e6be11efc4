"""``Bucket``: what the parts of an s3:// root (its commit strategy, source and memory-tier
ledger) use of the root they belong to, as a protocol.

``ObjectRoot`` (dckpt.tiers.object_root) is the one implementation; it builds its parts and
hands itself to them. The parts name this protocol, not ``ObjectRoot``, so the import graph
has no circle: the root imports its parts (when a job first asks for them), a part imports
only this module. No torch, no boto3.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..root.fence import Fence
from ..root.manifest import Manifest
from ..root.protocol import Entry
from ..root.resume_record import ResumeRecords
from ..root.retention import Decision, RetentionPolicy
from ..root.verify import FileProblem
from .s3_store import S3Store
from .url import ObjectURL

__all__ = ["Bucket"]


class Bucket(Protocol):
    """The bucket-level members of an s3:// root that its parts call."""

    store: S3Store
    url: ObjectURL

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under the root's prefix."""
        ...

    def url_of(self, *parts: str) -> str:
        """``s3://bucket/prefix/parts...``, for messages."""
        ...

    def entries(self) -> list[Entry]: ...
    def committed_steps(self) -> list[int]: ...
    def manifest_raw(self, step: int) -> bytes: ...
    def read_manifest(self, step: int) -> Manifest: ...
    def run_of(self, step: int) -> str | None: ...
    def resume_records(self) -> ResumeRecords: ...
    def publish_latest(self, steps: list[int] | None = None) -> None: ...
    def uncommit(self, step: int) -> None: ...
    def quarantine(self, step: int, reason: str) -> str: ...

    def check_objects(
        self,
        step: int,
        progress: Callable[[int], None] | None = None,
        only: frozenset[str] | None = None,
    ) -> tuple[Manifest, list[FileProblem]]: ...

    def apply_retention(
        self, policy: RetentionPolicy, *, dry_run: bool = False, fence: Fence | None = None
    ) -> tuple[list[Decision], list[str]]: ...
