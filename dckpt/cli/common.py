"""Shared pieces of the ``dckpt`` commands: consoles, exit codes, root and step lookup.

Exit codes: 0 ok; 2 bad usage, or a root/step that does not exist or is not dckpt's; 3 an
integrity failure (a digest or size mismatch, a damaged or hostile manifest).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from rich.console import Console

from ..root.layout import is_dckpt_root, list_checkpoints
from ..units import human_bytes, plural

if TYPE_CHECKING:
    from ..tiers.object_root import ObjectRoot

__all__ = [
    "EXIT_INCOMPATIBLE",
    "EXIT_INTEGRITY",
    "EXIT_OK",
    "EXIT_USAGE",
    "CliError",
    "committed_dir",
    "dir_bytes",
    "err",
    "fail",
    "human",
    "open_root",
    "out",
    "plural",
    "root_arg",
]

EXIT_OK, EXIT_USAGE, EXIT_INTEGRITY, EXIT_INCOMPATIBLE = 0, 2, 3, 4

# Piped output (logs, CI, `make demo`) gets a wide table instead of rich's 80 columns.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class CliError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def fail(code: int, message: str) -> NoReturn:
    raise CliError(code, message)


def root_arg(path: str) -> Path:
    root = Path(path)
    if not root.exists():
        fail(EXIT_USAGE, f"{root} does not exist; pass the --ckpt-dir of a training run")
    if not root.is_dir():
        fail(EXIT_USAGE, f"{root} is not a directory; pass a checkpoint root, not a file in it")
    if not is_dckpt_root(root):
        fail(
            EXIT_USAGE,
            f"{root} is not a dckpt checkpoint root (no step-* directories, no latest, no "
            ".dckpt-lock); pass the --ckpt-dir a training run used",
        )
    return root


def human(n: float) -> str:
    return human_bytes(n, digits=1)


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def committed_dir(root: Path, step: int | None) -> Path:
    entries = [e for e in list_checkpoints(root) if e.status == "committed"]
    if step is None:
        if not entries:
            fail(EXIT_USAGE, f"no committed checkpoint under {root} (see `dckpt ls {root}`)")
        return entries[-1].path
    for e in entries:
        if e.step == step:
            return e.path
    have = ", ".join(str(e.step) for e in entries) or "none"
    fail(EXIT_USAGE, f"no committed checkpoint for step {step} under {root} (committed: {have})")


def open_root(url: str) -> ObjectRoot:
    """The s3:// root ``url`` names (boto3 is imported here, when one is used)."""
    from ..tiers.object_root import ObjectRoot
    from ..tiers.s3_store import S3Store
    from ..tiers.url import parse_url

    try:
        return ObjectRoot(S3Store(parse_url(url)))
    except ValueError as exc:
        fail(EXIT_USAGE, str(exc))
