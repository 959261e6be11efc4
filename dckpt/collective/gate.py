"""A gate: one rank does work the others must wait for, for as long as that work may take.

Role: at a start, rank 0 opens the root alone (its run lock, the recovery of crashed saves)
while every other rank waits to hear how that went. That work may legitimately outlast
``timeout_s``: a lock held by a job on another host is watched for a whole lease (300 s by
default) before it is taken over. A collective would give the waiting ranks only their group's
timeout, so a relaunch after a job died on another host never started: rank 1 died in gloo
after ``timeout_s`` while rank 0 still watched the lock, and the next launch began the same
watch from zero.

So the waiting ranks wait on a key in the job's store instead, on a deadline of their own:
``timeout_s`` from the start of the wait, and, each time the opener announces a longer wait
(``extend``: how long, and why), at least that long from when they read it, plus
``timeout_s``. A waiter's deadline is therefore never shorter than the opener's own wait
(the rule that the guards' waits fit each other). Each waiter says once what it waits for and
until when; one that gives up names the opener and what it was doing.

Every store call has a deadline (dckpt.collective.store); a waiter reads the store once per
``SLICE_S`` at most (a wait that returns the moment the key is set), whatever the world's
size. A call that the store did not answer in time ends nothing while the waiter's deadline
has time left: it looks again (a store that stalls and answers again costs the wait the
stall); a store that still does not answer at the deadline is named as lost. Keys live under
the group's random token, one set per gate name and manager.

Both values are sealed (``dckpt.collective.sealed``): the job's store takes writes from any
client that reaches its port, and one once planted a "wait longer" that did not parse (the
waiting rank died of it) or could have opened the gate before rank 0 had. A value that fails
its seal is named and ignored: the waiter goes on waiting for rank 0's, on its own deadline.
An announcement counts only if it is newer than the last one read (``n``), so a genuine one
written again later (replayed by an outside writer) never moves a deadline twice.
"""

from __future__ import annotations

import json
import logging
import time

from ..errors import CheckpointError
from . import sealed
from .comm import Comm
from .store import StoreUnreachableError, default_store

__all__ = ["Gate"]

log = logging.getLogger("dckpt")

SLICE_S = 2.0
"""How long one store wait of a waiter lasts before it looks for a longer deadline."""
RETRY_S = 0.2
"""How soon a waiter looks again after the store did not answer (its calls fail at once
while the one that timed out still waits: dckpt.collective.store)."""
OPEN = "open"
"""The opener's value under the gate's ``open`` key (sealed)."""


class Gate:
    """One opener (``rank``), every other rank of ``comm`` a waiter; see the module docstring."""

    def __init__(self, comm: Comm, name: str, *, timeout_s: float, opener: int = 0) -> None:
        self.comm = comm
        self.timeout_s = timeout_s
        self.opener = opener
        self._open = f"{comm.keys}/gate/{name}/open"
        self._longer = f"{comm.keys}/gate/{name}/longer"
        self._announced = 0

    @property
    def used(self) -> bool:
        """Whether there is anyone to wait (a world of one rank has no store and no waiter)."""
        return self.comm.distributed and self.comm.world_size > 1

    def extend(self, seconds: float, why: str) -> None:
        """The opener: its work may take ``seconds`` more from now, because ``why`` (what the
        waiters log once). A store that does not answer is ignored: the waiters then give up
        on their own deadline, naming the opener."""
        if not self.used:
            return
        self._announced += 1
        value = json.dumps({"n": self._announced, "s": float(seconds), "why": why})
        try:
            sealed.put(default_store(), self._longer, value)
        except Exception as exc:  # a hint: the waiters still have a deadline of their own
            log.warning("dckpt: could not tell the other ranks to wait longer: %s", exc)

    def open(self) -> None:
        """The opener: its work is done (well or not); every waiter goes on. CheckpointError
        when the job's store does not take it (the waiters then give up on their deadline)."""
        if not self.used:
            return
        try:
            sealed.put(default_store(), self._open, OPEN)
        except (StoreUnreachableError, RuntimeError) as exc:
            raise CheckpointError(
                f"rank {self.opener} could not tell the other ranks it is done ({exc}); they "
                "stop waiting at their own deadline. Start the job again."
            ) from None

    def wait(self, what: str) -> None:
        """A waiter: return once the opener opened the gate; CheckpointError naming the opener
        and ``what`` it was doing once the deadline passed, or naming the store when it still
        did not answer at the deadline (a call it did not answer in time ends nothing before)."""
        if not self.used:
            return
        store = default_store()
        start = time.monotonic()
        deadline = start + self.timeout_s
        seen = 0
        lost: StoreUnreachableError | None = None  # the store at the last look, if it failed
        while True:
            left = deadline - time.monotonic()
            if left <= 0 and lost is not None:
                raise CheckpointError(
                    f"rank {self.comm.rank} lost the job's store while it waited for rank "
                    f"{self.opener} to finish {what}: it did not answer again within "
                    f"{time.monotonic() - start:.0f} s ({lost}). Start the job again."
                )
            if left <= 0:
                raise CheckpointError(
                    f"rank {self.comm.rank} waited {time.monotonic() - start:.0f} s for rank "
                    f"{self.opener} to finish {what}, and it did not: rank {self.opener} may "
                    "have died or hung there (its own log says where). Nothing was changed by "
                    "this rank; start the job again once rank "
                    f"{self.opener}'s node is healthy."
                )
            try:  # rank 0's own "open" only: a planted one is named and waited past
                if sealed.wait(store, self._open, min(SLICE_S, left)) == OPEN:
                    return
                lost = None
            except StoreUnreachableError as exc:  # a stall, or gone: the deadline tells
                lost = exc
                time.sleep(min(RETRY_S, max(deadline - time.monotonic(), 0.0)))
                continue
            try:
                raw = sealed.get(store, self._longer)
            except StoreUnreachableError:
                continue  # the next wait says so, or the deadline does
            if raw is None:  # none yet, or not rank 0's (named)
                continue
            told = json.loads(raw)  # sealed by rank 0: its own JSON
            if told["n"] <= seen:  # read before (or written again since, by someone else)
                continue
            seen = told["n"]
            deadline = max(deadline, time.monotonic() + told["s"] + self.timeout_s)
            more = deadline - time.monotonic()
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + more))
            log.warning(
                "dckpt: rank %d waits for rank %d: %s; waiting up to %.0f s more (until %s on "
                "this host's clock)",
                self.comm.rank,
                self.opener,
                told["why"],
                more,
                until,
            )
