"""Files moved between the job's ranks over dckpt's own gloo group: the memory tier's replicas.

No socket of dckpt's own: the bytes go over the gloo group dckpt made at start from the job's
own process group, which only the job's ranks can join (torchrun's rendezvous). ``move`` runs
one exchange on every rank that takes part (both ends know the plan: who sends which file to
whom, its size and the writer's digest):

1. each receiver maps a part file next to its target (a spare of the same name is reused, so
   no page is allocated on a steady run) and posts one receive per chunk straight into the
   mapping, each chunk's pages allocated just before (so a fresh file's allocation overlaps
   the chunks already arriving); each sender posts one send per chunk straight from its
   file's mapping (gloo moves them in C++, off the GIL, no copy in between);
2. each receiver waits for its chunks in order and hashes each as it lands, while the later
   ones are still arriving; a file is renamed to its target only once every byte hashed to
   the digest its writer recorded, and is deleted otherwise;
3. the whole exchange has one deadline (``timeout_s``, as one collective has), and every
   wait gets what is left of it: a peer that stops answering, or trickles, fails the exchange
   with ``TransferError`` instead of hanging it. After that gloo has closed the pair: the
   group is unusable, as after any failed collective.

Chunks (16 MiB) keep hashing beside the transfer and bound what one wait covers; measured
here, chunked sends into a mapped file ran at the speed of one send of the whole buffer.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..phases import Phase, Trace
from ..storage.digest import format_digest, new_hasher
from .comm import Comm

__all__ = ["CHUNK", "Incoming", "Outgoing", "Targets", "TransferError", "move"]

CHUNK = 16 << 20
_CHUNKS_PER_FILE = 1 << 20  # tags: (file of this pair) << 20 | chunk; 16 TiB per file


class Claim(Protocol):
    buffer: Any
    """A writable mapping of the file."""

    def allocate(self, start: int, end: int) -> None:
        """Allocate the pages of ``[start, end)`` (OSError, ENOSPC, when it cannot)."""
        ...


class Targets(Protocol):
    """Where received files are made (dckpt.tiers.memory_layout.Slots is one)."""

    def claim(self, path: Path, size: int, *, spare_of: str | None = None) -> Claim:
        """A writable mapping of ``size`` bytes at ``path``, its pages allocated by range."""
        ...

    def drop(self, path: Path) -> None:
        """Delete ``path`` and let go of its mapping."""
        ...


class TransferError(RuntimeError):
    """A peer did not send or take its bytes within the deadline, or its connection closed:
    the exchange failed and dckpt's group cannot be used again."""


@dataclass(frozen=True)
class Outgoing:
    """A file this rank sends: its bytes (a mapping of the file), to ``to`` (a rank)."""

    data: Any
    """An mmap (or any buffer) of exactly the file's bytes."""
    to: int
    size: int
    tag: int = 0
    """This file's number among the files going from this rank to ``to`` (both ends agree)."""


@dataclass(frozen=True)
class Incoming:
    """A file this rank receives from ``src`` into ``into``, proven against ``digest``."""

    src: int
    into: Path
    size: int
    digest: str
    tag: int = 0
    spare_of: str | None = None
    """A spare of this name is reused for the part file (its pages already allocated)."""
    claim: Claim | None = None
    """The part file, claimed ahead by the caller (its pages perhaps being allocated by then)."""


@dataclass(frozen=True)
class Received:
    """What became of one incoming file: ``error`` is None once it is renamed into place."""

    into: Path
    seconds: float
    error: str | None = None


def _chunks(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + CHUNK, size)) for a in range(0, size, CHUNK)] or [(0, 0)]


def _view(data: Any, size: int) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping: gloo only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8, count=size) if size else torch.empty(0)


def move(
    comm: Comm,
    outgoing: Sequence[Outgoing],
    incoming: Sequence[Incoming],
    slots: Targets,
    *,
    timeout_s: float,
    trace: Trace | None = None,
    part_suffix: str = "-in",
) -> list[Received]:
    """Send ``outgoing`` and receive ``incoming`` (see the module docstring); returns one
    ``Received`` per incoming file, in order. Raises TransferError when a peer fails."""
    if not outgoing and not incoming:
        return []
    if comm.group is None:
        raise ValueError("moving files between ranks needs a process group")
    deadline = (time.monotonic() + timeout_s, timeout_s)
    posted: list[tuple[Incoming, Path, Any, str | None, list[Any]]] = []
    sends: list[tuple[Outgoing, torch.Tensor, list[Any]]] = []
    results: list[Received] = []
    scratch: torch.Tensor | None = None
    t0 = time.perf_counter()
    try:
        for item in incoming:
            part = item.into.with_name(f".{item.into.name}.part{part_suffix}")
            refused: str | None = None
            works = []
            try:
                claim = item.claim or slots.claim(part, item.size, spare_of=item.spare_of)
                mm: Any = claim.buffer
                chunks = _view(mm, item.size)
            except OSError as exc:
                mm, refused = None, f"this node's memory cannot hold {item.into.name} ({exc})"
            for i, (a, b) in enumerate(_chunks(item.size)):
                if refused is None:
                    try:  # each chunk's pages, while the chunks before it arrive
                        claim.allocate(a, b)
                        target = chunks[a:b]
                    except OSError as exc:
                        refused = f"this node's memory cannot hold {item.into.name} ({exc})"
                if refused is not None:
                    # The sender sends all the same: take its bytes into one reused chunk,
                    # and drop them, so a full memory here never hangs the sender.
                    if scratch is None:
                        scratch = torch.empty(CHUNK, dtype=torch.uint8)
                    target = scratch[: b - a]
                works.append(_post(dist.irecv, target, item.src, comm, item.tag, i))
            posted.append((item, part, mm, refused, works))
        for out in outgoing:
            buf = _view(out.data, out.size)
            works = [
                _post(dist.isend, buf[a:b], out.to, comm, out.tag, i)
                for i, (a, b) in enumerate(_chunks(out.size))
            ]
            sends.append((out, buf, works))
        fired = False
        for item, part, mm, refused, works in posted:
            algorithm = item.digest.split(":", 1)[0]
            hasher = new_hasher(algorithm)
            view = memoryview(mm) if mm is not None and refused is None else None
            for (a, b), work in zip(_chunks(item.size), works, strict=True):
                _wait(work, deadline, f"the bytes {a}-{b} of {item.into.name} from rank {item.src}")
                if view is not None:
                    hasher.update(view[a:b])
                if not fired and trace is not None:
                    fired = True
                    trace.at(Phase.REPLICATE)
            del view
            error = refused
            if error is None:
                actual = format_digest(algorithm, hasher)
                if actual != item.digest:
                    error = (
                        f"{item.into.name} from rank {item.src}: {item.size} bytes hashing to "
                        f"{actual}, the writer recorded {item.digest} (digest mismatch)"
                    )
            if error is None:
                slots.drop(item.into)  # a damaged or older copy at the target goes
                os.replace(part, item.into)
            else:
                slots.drop(part)
            results.append(Received(item.into, time.perf_counter() - t0, error))
        if not fired and trace is not None:
            trace.at(Phase.REPLICATE)
        for out, _buf, works in sends:
            for work in works:
                _wait(work, deadline, f"a file's bytes to rank {out.to}")
    except BaseException:
        for _item, part, _mm, _refused, _works in posted[len(results) :]:
            with contextlib.suppress(Exception):
                slots.drop(part)
        raise
    return results


def _post(op: Any, chunk: torch.Tensor, peer: int, comm: Comm, tag: int, i: int) -> Any:
    assert comm.group is not None
    global_peer = dist.get_global_rank(comm.group, peer)
    try:
        return op(chunk, global_peer, group=comm.group, tag=tag * _CHUNKS_PER_FILE + i)
    except RuntimeError as exc:  # the pair to that peer closed already
        raise TransferError(f"cannot reach rank {peer}: {str(exc)[:300]}") from exc


def _wait(work: Any, deadline: tuple[float, float], what: str) -> None:
    """Wait for ``work`` until the exchange's deadline ``(time.monotonic() at which it ends,
    timeout_s)``, not a moment longer."""
    end, timeout_s = deadline
    try:
        work.wait(datetime.timedelta(seconds=max(end - time.monotonic(), 0.001)))
    except RuntimeError as exc:
        raise TransferError(
            f"waiting for {what} failed within the exchange's {timeout_s:.0f} s (timeout_s): "
            f"{str(exc)[:300]}"
        ) from exc
