"""FileRecord: what the storage layer knows of one file it wrote (name, size, digest, rank).

Records are plain frozen values so they can cross process boundaries (gathered to rank 0 as
objects) and land in the manifest unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["METADATA_FILE", "FileRecord"]

METADATA_FILE = ".metadata"
"""DCP's metadata file: written once by the coordinator, read whole by every rank."""


@dataclass(frozen=True, kw_only=True, order=True)
class FileRecord:
    """One file of a checkpoint, by its path relative to the checkpoint directory."""

    path: str
    bytes: int
    digest: str
    rank: int
