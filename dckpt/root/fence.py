"""The job's claim on its root, as its commits and deletes see it: fencing.

A run lock keeps a second job out at start; it cannot stop a job that was wrong about the
first one's staleness (its host stalled for a whole lease, or a second launch with the same
run id took it over at once). What keeps such a takeover from costing anything is here, on
rank 0, for every root kind:

- ``check`` runs right before every commit point (a directory's rename, a bucket's manifest
  PUT, a memory ledger's record) and every delete of a committed step or record (retention,
  a bucket's re-saved step uncommitted, a memory ledger's pruning): it reads the lock back
  and raises ``LockError`` unless it is still this job's, so the job that lost its lock
  commits and deletes nothing more;
- ``movable`` says which committed steps this job may move aside as superseded or delete by
  retention: those it found at its start (``start``, after recovery, under the lock), those
  it committed itself, and those its own run wrote (the manifest's run id). A step another
  job committed while this one held the root is left where it is, and said.

Without a lock (``lock=False``), ``check`` passes; the rest holds the same. No torch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable

from .retention import Decision

__all__ = ["Fence"]

log = logging.getLogger("dckpt")


class Fence:
    """See the module docstring."""

    def __init__(self, *, held: Callable[[], None] | None = None, run_id: str | None = None):
        self._held = held
        """Raises LockError unless this job still holds the run lock (None: no lock)."""
        self.run_id = run_id
        self.known: set[int] | None = None
        """The committed steps found at this job's start (None: not recorded: any)."""
        self._mine: set[int] = set()
        self._said: set[int] = set()

    def check(self) -> None:
        """Right before a commit point: LockError unless this job still holds the root."""
        if self._held is not None:
            self._held()

    def start(self, steps: Iterable[int]) -> None:
        """The committed steps this job found at its start, under its lock."""
        self.known = set(steps)

    def committed(self, step: int) -> None:
        self._mine.add(step)

    def movable(self, step: int, run_of: Callable[[], str | None]) -> bool:
        """Whether this job may move ``step`` aside or delete it; ``run_of`` reads the run id
        its manifest records (called only for a step this job neither found nor wrote)."""
        if self.known is None or step in self.known or step in self._mine:
            return True
        run = run_of()
        if run is not None and run == self.run_id:
            return True
        if step not in self._said:
            self._said.add(step)
            log.error(
                "dckpt: step %d was committed by another job (run %s) while this job (run %s) "
                "held the root: it is left where it is. Two jobs are writing this root; stop "
                "one of them.",
                step,
                run or "unknown",
                self.run_id,
            )
        return False

    def spare(
        self, decisions: list[Decision], run_of: Callable[[int], str | None]
    ) -> list[Decision]:
        """Retention's ``decisions`` with every victim this job may not delete kept instead
        (``movable``), with that reason. Raises LockError first, deleting nothing, when there
        is a victim and this job no longer holds the root (``check``): the lock may have been
        taken after this job's last commit, and the new owner may be reading those steps."""
        if any(not d.keep for d in decisions):
            self.check()
        return [
            d
            if d.keep or self.movable(d.step, functools.partial(run_of, d.step))
            else dataclasses.replace(d, keep=True, reasons=("another job's",))
            for d in decisions
        ]
