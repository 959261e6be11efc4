"""CheckpointConfig: how dckpt saves and loads, validated once at construction.

Frozen and keyword-only: a config is a value that can be logged, compared and stored. Every bad
value is rejected in ``__post_init__`` with the reason, never later in the middle of a save.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .storage.digest import ALGORITHMS

__all__ = ["CheckpointConfig"]


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Settings of a CheckpointManager.

    Attributes:
        root: directory that holds the checkpoints of one run (created if missing).
        digest: ``xxh3_128`` (fast, default) or ``sha256`` (cryptographic) for every file.
        timeout_s: the longest any rank waits for the others in a save or load collective.
        io_threads: writer threads per rank (DCP's ``thread_count``); one file per thread.
        async_save: write in the background; ``save()`` returns once the state is staged.
        overlap_staging: let ``save()`` return before parameters and optimizer state are
            copied; the copy completes before the next ``optimizer.step()`` (a step pre-hook
            waits for it). Assumes those tensors change only inside ``optimizer.step()``.
        if_busy: what ``save()`` does while the previous save is still writing: ``wait`` for
            it, or ``skip`` this one (all ranks decide together; logged either way).
        fallback: on resume, quarantine a checkpoint that fails verification and try the next
            older one (``False``: raise instead).
        warmup: run the warmup all-reduce on the training group at the end of a resume.
        loss_watch: after a resume, compare the first ``loss_watch_steps`` losses given to
            ``observe()`` with the loss recorded at save time: ``warn``, ``raise`` or ``off``.
    """

    root: Path
    digest: str = "xxh3_128"
    timeout_s: float = 600.0
    io_threads: int = 1
    async_save: bool = True
    overlap_staging: bool = True
    if_busy: str = "wait"
    fallback: bool = True
    warmup: bool = True
    loss_watch: str = "warn"
    loss_watch_steps: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise ValueError(f"root must be a directory path, got {self.root!r}")
        object.__setattr__(self, "root", Path(self.root))
        if self.digest not in ALGORITHMS:
            raise ValueError(f"digest must be one of {sorted(ALGORITHMS)}, got {self.digest!r}")
        if not self.timeout_s > 0:
            raise ValueError(
                f"timeout_s must be > 0, got {self.timeout_s}: a wait without a bound turns a "
                "dead rank into a hang"
            )
        if self.loss_watch not in ("warn", "raise", "off"):
            raise ValueError(f"loss_watch must be warn, raise or off, got {self.loss_watch!r}")
        if self.loss_watch_steps < 1:
            raise ValueError(f"loss_watch_steps must be >= 1, got {self.loss_watch_steps}")
        if self.if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {self.if_busy!r}")
        if self.overlap_staging and not self.async_save:
            object.__setattr__(self, "overlap_staging", False)  # nothing to overlap with
        if not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be in [1, 64], got {self.io_threads}")
