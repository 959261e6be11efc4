"""Per-save progress markers in the job's key-value store, to name a late rank; and the
``SaveTrace`` one save reports its phases to.

Each rank marks the phases of a save it got past (``Phase``, the same names as the fault hook).
When a wait fails (a timeout, or a peer that closed its connection), ``lagging`` tells which
ranks had not completed which phase, so the error names them on every rank without another
collective (after a gloo timeout the group is unusable anyway). Store errors are swallowed:
markers only improve messages, they never decide anything.

``StopFlag`` is a save's one shared word in the store: set by a rank whose upload failed for
good (the save can no longer commit), read now and then by the ranks still sending bytes, so
they stop sending instead of finishing a shard nobody will commit and only then learning of
the failure at the save's next collective. It is only ever set by a failure that fails the
save anyway, so it never changes an outcome, only how soon every rank knows it.

Both are sealed (``dckpt.collective.sealed``): the job's store takes writes from any client
that reaches its port, and a stop flag planted there failed a save that nothing else had
failed. A marker or a flag whose seal fails reads as not set (named once in a warning): a
planted one can neither stop a save nor make a late rank look done. Reading a flag costs the
same store call as before (``check``), and one ``get`` only once the key exists.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from ..faults import Tamper, fault_point, tampering
from ..phases import Phase
from . import sealed
from .comm import Comm
from .store import call, default_store

__all__ = ["MARKED", "Progress", "SaveTrace", "StopFlag"]

MARKED = (Phase.PREPARE, Phase.MAKE_TMP, Phase.WRITE_SHARDS, Phase.DCP_FINISH)
"""The phases every rank marks in a save, in order. ``DCP_FINISH`` is marked once this rank's
files are written (the durable tier: DCP's save returned cleanly; the memory tier, which runs
no DCP save: its memory file copied and hashed); nothing can fail between that and its report
to the coordinator."""
MARK = "1"
"""A marker's value (sealed), and a set stop flag's."""
DECIDED = Phase.RENAME
"""Marked by rank 0 alone once it decided, before telling the others: past the commit point
(``rename``), or the save refused."""


class Progress:
    """The markers of every save of this job; see the module docstring."""

    def __init__(self, comm: Comm) -> None:
        self._world = comm.world_size
        self._rank = comm.rank
        self._comm = comm  # its key prefix (the job's random token) is read at each use
        self._store: Any = default_store() if comm.distributed else None

    @property
    def comm(self) -> Comm:
        return self._comm

    def _key(self, save_id: str, phase: Phase, rank: int) -> str:
        return f"{self._comm.keys}/{save_id}/{phase.value}/{rank}"

    def mark(self, save_id: str, phase: Phase) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):  # a marker is a hint, never a failure
                sealed.put(self._store, self._key(save_id, phase, self._rank), MARK)

    def _has(self, save_id: str, phase: Phase, rank: int) -> bool:
        return sealed.get(self._store, self._key(save_id, phase, rank)) == MARK

    def _all_have(self, save_id: str, phase: Phase) -> bool:
        """Whether every rank marked ``phase``: two store calls for all of them (the store's
        ``check`` and ``multi_get`` of many keys), so a look costs two calls per phase, not
        per rank, until the phase some rank lacks. A mark whose seal fails is not one."""
        keys = [self._key(save_id, phase, r) for r in range(self._world)]
        return all(v == MARK for v in sealed.get_many(self._store, keys))

    def lagging(self, save_id: str) -> str:
        """'rank(s) 1 did not complete writing shards', or '' when nobody is known to lag.
        A call per phase every rank passed, then one per rank for the first phase some rank
        did not: on a failure only."""
        if self._store is None:
            return ""
        try:
            for phase in MARKED:
                if self._all_have(save_id, phase):
                    continue
                late = [r for r in range(self._world) if not self._has(save_id, phase, r)]
                if late:
                    who = ", ".join(str(r) for r in late)
                    return (
                        f"rank(s) {who} did not complete {phase.what} (seen from rank {self._rank})"
                    )
            if not self._has(save_id, DECIDED, 0):
                return f"rank 0 did not complete the commit (seen from rank {self._rank})"
        except Exception:
            return ""
        return ""

    def all_reported(self, save_id: str) -> bool:
        """Whether every rank finished its DCP save cleanly, so every report was clean and
        rank 0 may have gone on to commit."""
        if self._store is None:
            return False
        try:
            return self._all_have(save_id, Phase.DCP_FINISH)
        except Exception:
            return False

    def clear(self, save_id: str) -> None:
        if self._store is not None:
            for phase in (*MARKED, DECIDED):
                with contextlib.suppress(Exception):
                    call(self._store.delete_key, self._key(save_id, phase, self._rank))

    def trace(self, save_id: str, step: int) -> SaveTrace:
        return SaveTrace(self, self._rank, save_id, step)

    def stop_flag(self, name: str) -> StopFlag:
        """The stop flag of the save whose tmp location is ``name`` (the same on every
        rank, and new for every save). Each rank looks every second, up to 1000 ranks;
        beyond, less often (at most every 5 s), so the store serves about 1000 looks a
        second whatever the world's size."""
        every_s = min(5.0, max(1.0, self._world / 1000))
        return StopFlag(self._store, f"{self._comm.keys}/stop/{name}", every_s)


class StopFlag:
    """A flag every rank of a save can set and read, through the job's store; see the module
    docstring. ``is_set`` asks the store at most every ``every_s`` seconds (the ranks still
    sending call it for every piece they send; a rank whose upload ends sooner never asks),
    and once it saw the flag set it stays set. Without a store (one process) it is a plain
    flag."""

    def __init__(self, store: Any, key: str, every_s: float = 1.0) -> None:
        self._store = store
        self._key = key
        self._every_s = every_s
        self._seen = False
        self._asked = time.monotonic()  # the first write of a save does not wait on the store
        self._lock = threading.Lock()

    def set(self) -> None:
        self._seen = True
        if self._store is not None:
            with contextlib.suppress(Exception):  # then the others learn it at the agreement
                sealed.put(self._store, self._key, MARK)

    def is_set(self) -> bool:
        if self._seen or self._store is None:
            return self._seen
        now = time.monotonic()
        with self._lock:  # several writer threads: one of them asks
            if now - self._asked < self._every_s:
                return False
            self._asked = now
        with contextlib.suppress(Exception):
            # set only by this job's own flag: a planted one is named and stops nothing
            if sealed.get(self._store, self._key) == MARK:  # one check; a get once it is set
                self._seen = True  # never unset another thread's set()
        return self._seen


class SaveTrace:
    """One save's ``dckpt.phases.Trace``: the fault hook at a point, a marker past it."""

    def __init__(self, progress: Progress, rank: int, save_id: str, step: int) -> None:
        self._progress = progress
        self.rank = rank
        self.save_id = save_id
        self.step = step

    def at(self, phase: Phase) -> None:
        fault_point(phase, self.rank, self.step)

    def tamper(self, phase: Phase) -> Tamper | None:
        return tampering(phase, self.rank, self.step)

    def passed(self, phase: Phase) -> None:
        self._progress.mark(self.save_id, phase)
        self._progress.comm.mark(f"past {phase.what}")  # what it did last, for ``Comm.late``
