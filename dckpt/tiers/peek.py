"""``peek`` and ``read_config`` for any root: a directory or an ``s3://`` URL.

The root is opened by ``open_root`` and read through the ``Root`` protocol
(dckpt.root.peek.peek_root): only the step's ``manifest.json`` is read, validated exactly as
one on disk (for an s3:// root, one GET); nothing else is opened or downloaded.
``CheckpointInfo.path`` is the step's directory, or its URL. A root that is neither a path
nor a well-formed URL (``s3:/bucket``) raises ``ValueError`` saying how to write it.
"""

from __future__ import annotations

import os
from typing import Any

from ..root.peek import CheckpointInfo, peek_root
from .roots import open_root

__all__ = ["CheckpointInfo", "peek", "read_config"]


def peek(root: str | os.PathLike[str], step: int | None = None) -> CheckpointInfo:
    """What the newest committed checkpoint under ``root`` (or ``step``) records about
    itself; see dckpt.root.peek.peek. ``root`` may be ``s3://bucket/prefix``."""
    return peek_root(open_root(root), step)


def read_config(root: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The run config saved with the newest committed checkpoint under ``root`` (or
    ``step``); see dckpt.root.peek.read_config. ``root`` may be ``s3://bucket/prefix``."""
    return peek(root, step).config
