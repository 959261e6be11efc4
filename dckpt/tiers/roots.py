"""``open_root``: what a user wrote as a root, opened as the ``Root`` of its kind.

The one place that builds a root from a path or a URL (``url.parse_root`` tells them apart):
a directory becomes a ``DirectoryRoot`` (dckpt.root.directory), ``s3://bucket/prefix`` an
``ObjectRoot`` (dckpt.tiers.object_root) over an ``S3Store``. The manager, the CLI and
``peek`` open roots here and talk to the ``Root`` protocol only (dckpt.root.protocol).

boto3 is imported only when an s3:// root is opened.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..root.directory import DirectoryRoot
from ..root.protocol import Root
from .url import parse_root

__all__ = ["open_root"]


def open_root(root: str | os.PathLike[str], *, mirror: Path | None = None) -> Root:
    """The root ``root`` names. ``mirror``: the job's local directory for an object store
    root (a directory root is its own: None or the directory itself). ValueError for a root
    that cannot be parsed; CheckpointError when its store cannot be used (boto3 missing, a
    bad ``DCKPT_S3_*`` setting)."""
    where = parse_root(root)
    if isinstance(where, Path):
        if mirror is not None and Path(mirror) != where:
            raise ValueError(f"a mirror is for s3:// roots; {where} is its own copy")
        return DirectoryRoot(where)
    from .object_root import ObjectRoot
    from .s3_store import S3Store

    return ObjectRoot(S3Store(where), mirror=mirror)
