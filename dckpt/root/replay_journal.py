"""The replay journal: rank 0's (step, loss) for every ``observe()`` since the newest save,
kept beside the checkpoints, so that a resume can compare the steps it replays with the run
that stopped (dckpt.load.replay).

    ROOT/.dckpt-replay/step-00001200.log
      {"dckpt_replay": 1, "step": 1200, "save_id": "<hex>", "run_id": "<id>"}   the header
      1201 0x1.2a3b4c5d6e7f8p+1                                 one line per observe()

Invariants:

- Only rank 0 writes. A journal is started at each ``save()`` (a fresh file, its header
  written whole before it is renamed in), and each ``observe()`` appends one line with one
  ``write()`` to an ``O_APPEND`` descriptor, never fsynced: a SIGKILL keeps every line
  written (the page cache is the kernel's), a power loss may lose the tail, and a resume then
  compares fewer steps. Nothing here ever fails a training step: a write that fails (a full
  disk) stops the journal, and the resume that would read it compares less.
- Losses are written as ``float.hex()``, so a comparison is bit for bit.
- A journal holds at most ``MAX_ENTRIES`` lines and is read with a size bound. A line that
  does not parse ends it (a torn or planted tail compares nothing wrong); a header that does
  not parse, or names another step, makes it no journal.
- A journal is of one save: the header's ``save_id`` is compared with the manifest a resume
  loaded, so another save of the same step never supplies the expected losses. A line, once
  written, is never replaced: the first run after a save writes a step's loss, and a resumed
  run only appends the steps after the last one journaled (so a resume that is not exact
  keeps being reported, restart after restart).
- Pruned by rank 0 at each save: every journal of a step older than the newest committed
  step (a resume of that step would read its own journal, and nothing older is resumed from
  while a newer one verifies).

An s3:// root keeps its journals in rank 0's local mirror (``CheckpointConfig.directory``):
a PUT per step would cost more than the step. A restart whose rank 0 runs on another host
finds no journal there, and the resume says so. The memory tier's steps keep their journals
in the same place: a journal is of a step, whichever tier holds its checkpoint.

No torch, no collective.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..owned import create_new, make_dir
from .layout import read_small_file, step_dir_name

__all__ = ["MAX_ENTRIES", "REPLAY_DIR", "Journal", "JournalWriter", "read_journal"]

log = logging.getLogger("dckpt")

REPLAY_DIR = ".dckpt-replay"
MAX_ENTRIES = 65_536
"""Lines kept per journal: about 2 MiB, and more steps than a resume needs compared."""
MAX_JOURNAL_BYTES = 64 + MAX_ENTRIES * 48 + 4096
_NAME_RE = re.compile(r"\.?step-([0-9]{8,})\.log(\.tmp-[0-9]+)?")
"""A journal, or the temporary file of one whose start was cut short."""
_LINE_RE = re.compile(r"(-?[0-9]{1,19}) (-?0x[0-9a-f.]+p[-+][0-9]+|-?inf|nan)")


@dataclass(frozen=True)
class Journal:
    """One journal as read: the save it follows and the losses observed after it."""

    step: int
    save_id: str
    run_id: str
    entries: list[tuple[int, str]]
    """(step, ``float.hex()`` of the loss), in the order they were observed."""


def journal_path(root: Path, step: int) -> Path:
    return Path(root) / REPLAY_DIR / f"{step_dir_name(step)}.log"


def read_journal(root: Path, step: int) -> Journal | None:
    """The journal of ``step`` under ``root``, or None when there is none (or it is not one:
    a header that does not parse). Never raises, whatever the file holds."""
    raw = read_small_file(journal_path(root, step), MAX_JOURNAL_BYTES, own=True)
    if raw is None:
        return None
    try:
        return _parse(raw, step)
    except Exception:  # a planted file (a header nested past the recursion limit): no journal
        return None


def _parse(raw: bytes, step: int) -> Journal | None:
    lines = raw.split(b"\n")
    header = json.loads(lines[0][:4096])
    if (
        not isinstance(header, dict)
        or header.get("dckpt_replay") != 1
        or header.get("step") != step
        or not isinstance(header.get("save_id"), str)
    ):
        return None
    entries: list[tuple[int, str]] = []
    # The last piece has no newline: a line still being written, or cut by the size bound.
    for line in lines[1:-1][:MAX_ENTRIES]:
        m = _LINE_RE.fullmatch(line.decode("ascii", "replace"))
        if m is None:
            break
        try:  # a line that looks right but is no float (0x..p+1, 0x1p+99999) ends it too
            float.fromhex(m.group(2))
        except (ValueError, OverflowError):
            break
        entries.append((int(m.group(1)), m.group(2)))
    return Journal(step, header["save_id"], str(header.get("run_id", "")), entries)


class JournalWriter:
    """Rank 0's journal of the newest save; see the module docstring. Every method logs and
    stops journaling on an OSError instead of raising."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / REPLAY_DIR
        self._fd: int | None = None
        self._count = 0
        self.step: int | None = None
        """The step whose journal is open."""

    def start(
        self, step: int, save_id: str, run_id: str, entries: Sequence[tuple[int, str]] = ()
    ) -> None:
        """A fresh journal of ``step`` (replacing any), holding ``entries`` already."""
        self.close()
        head = {"dckpt_replay": 1, "step": step, "save_id": save_id, "run_id": run_id}
        body = json.dumps(head) + "\n" + "".join(f"{s} {h}\n" for s, h in entries)
        path = journal_path(self.dir.parent, step)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            make_dir(self.dir)
            with contextlib.suppress(FileNotFoundError):  # a crashed process of this pid's
                tmp.unlink()
            with os.fdopen(create_new(tmp), "w", encoding="ascii") as f:  # no link followed
                f.write(body)
            os.replace(tmp, path)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._stop(exc)
            return
        self.step, self._count = step, len(entries)

    def reopen(self, journal: Journal, *, after: int) -> None:
        """Go on with ``journal`` (the one a resume just read): its lines up to step
        ``after`` are kept as they are (a torn or planted tail after them is dropped, so a
        line appended next is never glued to it), and the next ``append`` follows them."""
        kept = [(s, h) for s, h in journal.entries if s <= after]
        run_id = journal.run_id
        self.start(journal.step, journal.save_id, run_id, kept)

    def append(self, step: int, loss: float) -> None:
        """One line, one write(); nothing once the journal is full or stopped."""
        if self._fd is None or self._count >= MAX_ENTRIES:
            return
        try:
            os.write(self._fd, f"{step} {float(loss).hex()}\n".encode("ascii"))
        except OSError as exc:
            self._stop(exc)
            return
        self._count += 1

    def prune(self, below: int) -> None:
        """Remove every journal of a step older than ``below`` (the newest committed step)."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for name in names:
            m = _NAME_RE.fullmatch(name)
            if m and int(m.group(1)) < below and int(m.group(1)) != self.step:
                with contextlib.suppress(OSError):  # not durable on purpose: a hint, no record
                    os.unlink(self.dir / name)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd, self.step = None, None

    def _stop(self, exc: OSError) -> None:
        self.close()
        log.warning(
            "dckpt: the replay journal in %s stopped (%s): training goes on; a resume compares "
            "only the steps journaled before this",
            self.dir,
            exc,
        )
