"""Shared pieces of the ``dckpt`` commands: consoles, exit codes, progress bars, and the
root and step lookup every command makes through the ``Root`` protocol (dckpt.root.protocol),
never asking which kind of root it reads.

Exit codes: 0 ok; 2 bad usage, or a root/step that does not exist or is not dckpt's; 3 an
integrity failure (a digest or size mismatch, a damaged or hostile manifest).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from ..errors import CheckpointNotFoundError
from ..root.layout import step_dir_name
from ..root.protocol import Root
from ..tiers.roots import open_root
from ..units import human_bytes, plural

__all__ = [
    "EXIT_INCOMPATIBLE",
    "EXIT_INTEGRITY",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_UNSIGNED",
    "EXIT_USAGE",
    "CliError",
    "bar",
    "cli_root",
    "committed_step",
    "err",
    "fail",
    "human",
    "out",
    "plural",
    "step_dirs",
]

EXIT_OK, EXIT_USAGE, EXIT_INTEGRITY, EXIT_INCOMPATIBLE, EXIT_STORAGE = 0, 2, 3, 4, 5
EXIT_UNSIGNED = 6
"""``verify --key-file``: every byte hashed right, but some step is not signed by the key."""

# Piped output (logs, CI, `make demo`) gets a wide table instead of rich's 80 columns.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class CliError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def fail(code: int, message: str) -> NoReturn:
    raise CliError(code, message)


def cli_root(text: str) -> Root:
    """The root a command names, opened through ``open_root`` (the one place that tells a
    directory from an s3:// URL); exit 2 for one that is not a root dckpt wrote."""
    try:
        root = open_root(text)
        root.expect_checkpoints()
    except ValueError as exc:  # a URL dckpt cannot use, or a path that reads as a mangled one
        fail(EXIT_USAGE, str(exc))
    except CheckpointNotFoundError as exc:
        fail(EXIT_USAGE, str(exc))
    return root


def committed_step(root: Root, step: int | None) -> int:
    """``step`` (None: the newest), if it is committed under ``root``; exit 2 saying what is
    there otherwise."""
    committed = root.committed_steps()
    if step is None:
        if not committed:
            fail(EXIT_USAGE, f"no committed checkpoint under {root} (see `dckpt ls {root}`)")
        return committed[-1]
    if step not in committed:
        have = ", ".join(map(str, committed)) or "none"
        fail(EXIT_USAGE, f"no committed checkpoint for step {step} under {root} "
             f"(committed: {have})")  # fmt: skip
    return step


@contextlib.contextmanager
def bar(what: str, total: int, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar of bytes on stderr (none when ``quiet`` or not a terminal)."""
    with Progress(
        TextColumn(what),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        disable=quiet or not err.is_terminal,
        transient=True,
    ) as shown:
        task = shown.add_task(what, total=total)
        yield lambda n: shown.advance(task, n)


@contextlib.contextmanager
def step_dirs(
    args: argparse.Namespace, steps: Sequence[int | None]
) -> Iterator[tuple[list[Path], str]]:
    """The committed ``steps`` (None: the newest) under ``args.root`` as local step
    directories, verified (an object store's fetched for as long as the context lasts), and
    the root as the output names it."""
    root = cli_root(args.root)
    chosen = [committed_step(root, s) for s in steps]
    total = sum(root.read_manifest(s).total_bytes for s in chosen)
    with contextlib.ExitStack() as stack:
        with bar("fetching", total, bool(getattr(args, "json", False))) as advance:
            # The bar lasts while the steps are fetched, not while the command reads them.
            note = lambda line: err.print(f"dckpt {args.command}: {line}")  # noqa: E731
            local = stack.enter_context(root.local_steps(chosen, advance, note))
        yield [local / step_dir_name(s) for s in chosen], str(root)


def human(n: float) -> str:
    return human_bytes(n, digits=1)
