"""A fault hook that tests use to break a save or a resume on purpose, at one of its named
phases (dckpt.phases).

``DCKPT_FAULT="phase=write_manifest,rank=0,action=sigkill[,step=8][,seconds=5]"`` makes the
process of that rank fire the action when it reaches that phase (of that step, if given):

- ``sigkill``: the process kills itself with SIGKILL, no cleanup (a crash, a lost node);
- ``raise``: raises ``InjectedFaultError`` (an ordinary error on one rank);
- ``enospc``: raises ``OSError(ENOSPC)`` (a full disk);
- ``sleep``: sleeps ``seconds`` (a stuck write);
- ``wait``: waits until the file ``path`` exists (at most ``seconds``): a test holds the phase
  while it changes the world, then lets it go, with no race against the machine's speed;
- ``sigstop``: the process stops itself (SIGSTOP: every thread frozen, its sockets open, as a
  host that hangs);
- ``eio``: raises ``OSError(EIO)`` (a storage that fails a read or a write);
- ``corrupt``: ``fault_point`` returns True, and the caller falsifies what this rank computed
  there (a broken collective backend at ``warmup``, a rank that read different bytes at
  ``verify``), so the checks that compare ranks are tested against a rank that is wrong.
- ``stale``, ``torn``, ``skip``: a save's staging copy goes wrong at that phase, on that rank
  (``tampering``; nothing fires at the point itself): ``stale``, the copy is not made, so its
  buffer keeps what an earlier save left there (a cached or reused buffer); ``torn``, the copy
  is made and then changed (one bit); ``skip``, only the first half of the tensor is copied.
  It hits the tensor named ``item=<name>`` (DCP's flattened name), else the largest one this
  rank copies. Phases: ``prepare`` (the copies a durable save takes in ``save()``; in a
  synchronous save, the tensor handed to the writer), ``stage`` (a deferred copy of
  ``overlap_staging``, or a GPU buffer's copy to host memory) and ``memory_copy`` (the copy
  into the memory tier's file). The capture check (dckpt.save.capture) must refuse that save.

Two more fields narrow where a spec fires: ``file=<text>``, only at a point that names a file
(the reads of a resume) whose path contains the text (``file=step-00000002``: that step's
files only); ``times=N``, only the first N times it matches in this process (``times=1``: a
transient fault; without it, a fault that persists).

Several specs separated by ``;`` each fire at their own point (a test that holds a run twice).
Unset, it costs one cached lookup per phase. Phases (dckpt.phases.Phase), in save order:

- on every rank: ``prepare`` (state dict taken, in ``save()``), ``make_tmp`` (background, before
  the tmp dir is made), ``stage`` (before the deferred copies are taken), ``write_shards`` (this
  rank's shard files written and fsynced, before DCP's metadata), ``dcp_finish`` (DCP returned
  on this rank); for an s3:// root also ``upload`` (a shard's first part sent);
- on rank 0, the coordinator: ``write_manifest``, ``fsync_shards`` (manifest written, before
  the files and the tmp dir are fsynced), ``rename`` (before the commit rename),
  ``rename_reply`` (inside the commit rename, right after the storage performed it: an
  ``eio`` there is a reply lost after the rename landed), ``fsync_parent`` (renamed, before
  the root is fsynced), ``publish_latest`` (before
  ``latest`` is replaced), ``retention`` (victims renamed to trash, not yet removed);
- in a resume, on every rank: ``list_steps`` (rank 0, before it lists the committed steps),
  ``read_manifest``, ``read_metadata``, ``read_shard`` (inside the read of a manifest, of
  ``.metadata``, of each shard file: an ``eio`` there is what the storage's EIO would be),
  ``verify`` (this rank's digests of the files it read, before the ranks compare them),
  ``warmup`` (before this rank joins the warmup collective); after a memory resume, on a rank
  whose files arrived from another node straight into its state, ``memory_refill`` (in the
  thread that puts them back into its node's memory, before it copies a byte);
- in a memory save (``save(step, tier="memory")``): on every rank ``memory_copy`` (in
  ``save()``, its state copied into the node's memory, before the file is complete),
  ``memory_hash`` (background, its file hashed, before the ranks gather their reports) and
  ``replicate`` (its replica's first chunk sent or received, the rest not); on rank 0
  ``memory_commit`` (before the manifest goes into the root's ledger: the commit point).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import threading
import time
from dataclasses import dataclass

from .phases import Phase

__all__ = [
    "COORDINATOR_PHASES",
    "MEMORY_PHASES",
    "OBJECT_PHASES",
    "PHASES",
    "RANK_PHASES",
    "RESUME_PHASES",
    "TAMPERS",
    "InjectedFaultError",
    "Tamper",
    "fault_point",
    "tampering",
]

RANK_PHASES = tuple(p.value for p in Phase if p.side == "rank")
"""Phases every rank passes in a save."""
COORDINATOR_PHASES = tuple(p.value for p in Phase if p.side == "coordinator")
"""Phases of a save that run on rank 0 only, after every rank's."""
RESUME_PHASES = tuple(p.value for p in Phase if p.side == "resume")
"""Phases of a resume, on every rank."""
OBJECT_PHASES = tuple(p.value for p in Phase if p.side == "object")
"""Phases of a save to an object store only (s3:// roots), on every rank."""
MEMORY_PHASES = tuple(p.value for p in Phase if p.side == "memory")
"""Phases of a memory save: every rank's, but ``memory_commit``, which is rank 0's."""
PHASES = tuple(p.value for p in Phase)
TAMPERS = ("stale", "torn", "skip")
"""Actions that falsify a save's staging copy (``tampering``) instead of firing at a point."""
ACTIONS = ("sigkill", "raise", "enospc", "sleep", "corrupt", "sigstop", "eio", "wait", *TAMPERS)


class InjectedFaultError(RuntimeError):
    """The error a ``raise`` fault throws."""


@dataclass(frozen=True)
class _Spec:
    phase: str
    rank: int | None
    action: str
    step: int | None
    seconds: float
    path: str
    item: str = ""
    file: str = ""
    times: int | None = None


@dataclass(frozen=True)
class Tamper:
    """A staging copy to falsify (``tampering``): how, and which tensor ("" for the largest
    one copied)."""

    action: str
    item: str = ""


@functools.lru_cache(maxsize=1)
def _specs(raw: str | None) -> tuple[_Spec, ...]:
    """The faults of ``DCKPT_FAULT``: one spec, or several separated by ``;`` (a test that
    holds a run at two points)."""
    return tuple(_spec(part, raw) for part in (raw or "").split(";") if part.strip())


def _spec(part: str, raw: str | None) -> _Spec:
    fields = dict(p.split("=", 1) for p in part.strip().split(",") if "=" in p)
    phase, action = fields.get("phase", ""), fields.get("action", "raise")
    if phase not in PHASES or action not in ACTIONS:
        raise ValueError(
            f"DCKPT_FAULT={raw!r}: phase must be one of {PHASES}, action one of {ACTIONS}"
        )
    if action == "wait" and not fields.get("path"):
        raise ValueError(f"DCKPT_FAULT={raw!r}: action=wait needs path=<file to wait for>")
    return _Spec(
        phase=phase,
        rank=int(fields["rank"]) if "rank" in fields else None,
        action=action,
        step=int(fields["step"]) if "step" in fields else None,
        seconds=float(fields.get("seconds", "3600")),
        path=fields.get("path", ""),
        item=fields.get("item", ""),
        file=fields.get("file", ""),
        times=int(fields["times"]) if "times" in fields else None,
    )


def process_rank() -> int:
    """This process's rank, for a fault point in a layer that knows no rank (torchrun's
    ``RANK``; 0 outside it)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


_FIRED: dict[_Spec, int] = {}
"""How often each spec with ``times`` fired in this process."""
_FIRED_LOCK = threading.Lock()  # a load's read threads pass the same point at once


def fault_point(phase: Phase | str, rank: int, step: int | None = None, path: str = "") -> bool:
    """Fire the configured fault if this is its phase, rank and step (and file: ``path``,
    the file this point reads); otherwise nothing. Returns True only for ``corrupt``: the
    caller then falsifies its own result."""
    name = phase.value if isinstance(phase, Phase) else phase
    for spec in _specs(os.environ.get("DCKPT_FAULT")):
        if (
            spec.phase == name
            and (spec.rank is None or spec.rank == rank)
            and (spec.step is None or spec.step == step)
            and (not spec.file or spec.file in path)
        ):
            if spec.times is not None:
                with _FIRED_LOCK:
                    fired = _FIRED.get(spec, 0)
                    _FIRED[spec] = fired + 1
                if fired >= spec.times:
                    continue
            return _fire(spec, phase, rank)
    return False


def tampering(phase: Phase | str, rank: int, step: int | None = None) -> Tamper | None:
    """The staging copy to falsify at this phase, rank and step (a ``stale``, ``torn`` or
    ``skip`` spec), or None."""
    name = phase.value if isinstance(phase, Phase) else phase
    for spec in _specs(os.environ.get("DCKPT_FAULT")):
        if (
            spec.action in TAMPERS
            and spec.phase == name
            and (spec.rank is None or spec.rank == rank)
            and (spec.step is None or spec.step == step)
        ):
            return Tamper(spec.action, spec.item)
    return None


def _fire(spec: _Spec, phase: Phase | str, rank: int) -> bool:
    if spec.action in TAMPERS:  # the copy at this point does it (``tampering``)
        return False
    if spec.action == "corrupt":
        return True
    where = f"injected fault at phase {phase} on rank {rank}"
    if spec.action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec.action == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif spec.action == "sleep":
        time.sleep(spec.seconds)
    elif spec.action == "wait":
        deadline = time.monotonic() + spec.seconds
        while not os.path.exists(spec.path) and time.monotonic() < deadline:
            time.sleep(0.01)
    elif spec.action == "eio":
        raise OSError(errno.EIO, f"Input/output error ({where})")
    elif spec.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device ({where})")
    else:
        raise InjectedFaultError(where)
    return False
