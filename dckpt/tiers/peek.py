"""``peek`` and ``read_config`` for any root: a directory (dckpt.root.peek) or an s3:// URL.

For an s3:// root only the step's ``manifest.json`` is fetched (one GET, validated exactly as
one on disk); nothing else is downloaded. ``CheckpointInfo.path`` is then the step's URL.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointNotFoundError
from ..root import peek as local
from ..root.layout import step_dir_name
from ..root.peek import CheckpointInfo
from .url import is_url, parse_url

__all__ = ["CheckpointInfo", "peek", "read_config"]


def peek(root: str | os.PathLike[str], step: int | None = None) -> CheckpointInfo:
    """What the newest committed checkpoint under ``root`` (or ``step``) records about
    itself; see dckpt.root.peek.peek. ``root`` may be ``s3://bucket/prefix``."""
    if not is_url(root):
        return local.peek(root, step)
    from .object_root import ObjectRoot
    from .s3_store import S3Store

    objects = ObjectRoot(S3Store(parse_url(str(root))))
    committed = objects.committed_steps()
    if not committed or (step is not None and step not in committed):
        where = "any step" if step is None else f"step {step}"
        have = ", ".join(map(str, committed[-8:])) or "none"
        raise CheckpointNotFoundError(
            f"no committed checkpoint for {where} under {root} (committed: {have}); see "
            f"`dckpt ls {root}`"
        )
    chosen = committed[-1] if step is None else step
    info = local.info(step_dir_name(chosen), objects.read_manifest(chosen))
    return info.at(objects.where(step_dir_name(chosen)))


def read_config(root: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The run config saved with the newest committed checkpoint under ``root`` (or
    ``step``); see dckpt.root.peek.read_config. ``root`` may be ``s3://bucket/prefix``."""
    return peek(root, step).config
