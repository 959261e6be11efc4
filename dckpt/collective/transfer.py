"""Files moved between the job's ranks over dckpt's own gloo group: the memory tier's replicas.

No socket of dckpt's own: the bytes go over the gloo group dckpt made at start from the job's
own process group, which only the job's ranks can join (torchrun's rendezvous). ``move`` runs
one exchange on every rank that takes part (both ends know the plan: who sends which file to
whom, its size and the writer's digest):

0. every rank meets the peers of its exchange through the job's store within ``timeout_s``
   (``Comm.meet``): the group connects a pair lazily, on its first message, and a message to
   a silent peer can block in gloo's connect past any deadline; a late peer is named instead;
1. each receiver maps a part file next to its target (a spare of the same name is reused, so
   no page is allocated on a steady run) and posts one receive per chunk straight into the
   mapping, each chunk's pages allocated just before (so a fresh file's allocation overlaps
   the chunks already arriving); each sender posts one send per chunk straight from its
   file's mapping (gloo moves them in C++, off the GIL, no copy in between);
2. each receiver waits for its chunks in order and hashes each as it lands, while the later
   ones are still arriving; a file is renamed to its target only once every byte hashed to
   the digest its writer recorded, and is deleted otherwise;
3. every wait has a deadline: ``timeout_s`` for each chunk (a peer that stops answering), and
   ``timeout_s`` plus one second per chunk for the whole exchange (a peer that trickles,
   slower than 16 MiB/s); past it the exchange fails with ``TransferError`` instead of
   hanging. After that gloo has closed the pair: the group is unusable, as after any failed
   collective.

A file can instead arrive into a ``Taker`` (``Incoming.taker``; dckpt.storage.memory_file.
StreamFill puts its bytes straight into the live state): no part file is made. Its first
chunk lands in a staging buffer (it holds the header the taker routes by); the rest comes in
segments both ends cut alike from that chunk's bytes (``Split``: the sender cuts by a copy of
the first chunk, which is what it sends), each segment straight into the tensor the taker
``place``s it in, or else into one of ``RING`` reused 16 MiB staging buffers (so the
receive's memory is bounded and no page is allocated) and handed to ``take``, the next
segment's receive posted into the buffer just freed. Every segment is hashed where it landed,
in the file's order. The taker learns the verdict from the result: nothing is named, and the
caller decides what a mismatch undoes.

Both ends always post every chunk of the plan, whatever goes wrong on their side, so no peer
waits on a chunk that was never sent: a receiver that cannot hold a file takes its bytes into
one reused chunk and drops them (``Received.refused``); a sender that cannot read its file
sends zeros (``Outgoing.data`` None), which the receiver's digest refuses.

Chunks (16 MiB) keep hashing beside the transfer and bound what one wait covers; measured
here, chunked sends into a mapped file ran at the speed of one send of the whole buffer.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..phases import Phase, Trace
from ..storage.digest import format_digest, new_hasher
from .comm import Comm

__all__ = [
    "CHUNK",
    "RING",
    "Incoming",
    "Outgoing",
    "Split",
    "Taker",
    "Targets",
    "TransferError",
    "move",
]

CHUNK = 16 << 20
RING = 4
"""Staging buffers of ``CHUNK`` bytes for the files that arrive into a ``Taker``: the receive's
whole memory (64 MiB), however large the files; while one is hashed and handed on, the next
three are arriving."""
_CHUNKS_PER_FILE = 1 << 20  # tags: (file of this pair) << 20 | chunk; 16 TiB per file


class Claim(Protocol):
    buffer: Any
    """A writable mapping of the file."""
    key: tuple[int, int]
    """The file's (device, inode)."""

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

    def rename(self, src: Path, dst: Path, *, key: tuple[int, int] | None = None) -> None:
        """Give the file ``key`` at ``src`` the name ``dst`` (checked to be that file)."""
        ...


Split = Callable[[memoryview, int], list[tuple[int, int]]]
"""How a file is cut after its first chunk: ``(its first chunk's bytes, its size)`` -> the
segments ``[a, b)`` that cover the rest, in order, each at most ``CHUNK`` bytes. Both ends
compute it from the same bytes (the sender from a copy of the first chunk it then sends), so
they post the same messages; a receiver can then take a segment that lies inside one tensor
straight into it (``Taker.place``)."""


class Taker(Protocol):
    """Where a file's bytes go when it is not made in memory (``Incoming.taker``)."""

    def place(self, offset: int, end: int) -> torch.Tensor | None:
        """A host tensor of exactly ``end - offset`` bytes that these bytes may be received
        straight into (they are then hashed there, and not handed to ``take``); None: they
        come through the staging buffers to ``take``."""
        ...

    def take(self, offset: int, chunk: torch.Tensor) -> None:
        """Bytes ``[offset, offset + len(chunk))`` of the file, in order, already hashed into
        the running digest (not yet proven: the verdict comes after the last chunk). The
        chunk's buffer is reused once this returns. An exception stops the taker (the rest of
        the file is still received, and the file is reported refused)."""
        ...


class TransferError(RuntimeError):
    """A peer did not send or take its bytes within the deadline, or its connection closed:
    the exchange failed and dckpt's group cannot be used again."""


@dataclass(frozen=True)
class Outgoing:
    """A file this rank sends: its bytes (a mapping of the file), to ``to`` (a rank)."""

    data: Any
    """An mmap (or any buffer) of at least the file's bytes; None: this rank could not read
    the file, and sends zeros in its place (the receiver's digest refuses them)."""
    to: int
    size: int
    tag: int = 0
    """This file's number among the files going from this rank to ``to`` (both ends agree)."""
    split: Split | None = None
    """Cut after its first chunk as the receiver cuts it (``Incoming.split``); None: chunks."""


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
    taker: Taker | None = None
    """Not made in memory: its chunks go through the staging buffers (or, where ``place``
    says, straight into a tensor) to this taker, and nothing is named (``into`` only names
    the file in messages)."""
    split: Split | None = None
    """How the sender cuts it after its first chunk (a taker's file only; None: chunks)."""


@dataclass(frozen=True)
class Received:
    """What became of one incoming file: ``error`` is None once it is renamed into place."""

    into: Path
    seconds: float
    error: str | None = None
    refused: bool = False
    """The error is this rank's (it could not hold or name the file), not the bytes'."""


def _chunks(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + CHUNK, size)) for a in range(0, size, CHUNK)] or [(0, 0)]


def _view(data: Any, size: int) -> torch.Tensor:
    # A sender's file is mapped read-only (gloo only reads it): torch warns once per process
    # that its tensor is not writable. That warning is left as it is: silencing it would take
    # a change to the process's warning filters, which resets every once-only warning.
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
    chunks_total = sum(len(_chunks(i.size)) for i in incoming) + sum(
        len(_chunks(o.size)) for o in outgoing
    )
    deadline = _Deadline(timeout_s, time.monotonic() + timeout_s + chunks_total)
    posted: list[_Posted] = []
    sends: list[tuple[Outgoing, torch.Tensor | None, list[Any]]] = []
    results: list[Received] = []
    zeros: torch.Tensor | None = None
    scratch: torch.Tensor | None = None
    t0 = time.perf_counter()
    try:
        late = comm.meet({o.to for o in outgoing} | {i.src for i in incoming}, timeout_s)
        if late:
            raise TransferError(
                f"rank(s) {', '.join(map(str, late))} did not reach the exchange within "
                f"{timeout_s:.0f} s (timeout_s) of this rank, or gave up on it; no byte moved"
            )
        buffers: list[torch.Tensor] = []  # the staging buffers, made at the first taker's file
        for item in incoming:
            part = item.into.with_name(f".{item.into.name}.part{part_suffix}")
            got = _Posted(item, part)
            posted.append(got)  # before a chunk is posted: a failure below still drops it
            if item.taker is not None:  # its segments are posted as it is taken (below)
                continue
            try:
                claim = item.claim or slots.claim(part, item.size, spare_of=item.spare_of)
                got.mm, got.key = claim.buffer, claim.key
                chunks = _view(got.mm, item.size)
            except OSError as exc:
                got.refused = f"this node's memory cannot hold {item.into.name} ({exc})"
            for i, (a, b) in enumerate(_chunks(item.size)):
                if got.refused is None:
                    try:  # each chunk's pages, while the chunks before it arrive
                        claim.allocate(a, b)
                        target = chunks[a:b]
                    except OSError as exc:
                        got.refused = f"this node's memory cannot hold {item.into.name} ({exc})"
                if got.refused is not None:
                    # The sender sends all the same: take its bytes into one reused chunk,
                    # and drop them, so a full memory here never hangs the sender.
                    if scratch is None:
                        scratch = torch.empty(CHUNK, dtype=torch.uint8)
                    target = scratch[: b - a]
                got.works.append(_post(dist.irecv, target, item.src, comm, item.tag, i))
        for out in outgoing:
            buf = _view(out.data, out.size) if out.data is not None else None
            works = []
            segments = _chunks(out.size)
            first: torch.Tensor | None = None
            if out.split is not None and out.size:
                # The first chunk goes from a copy: the cut is computed from the very bytes
                # the receiver gets, whatever the file does meanwhile.
                a, b = segments[0]
                first = (
                    buf[a:b].clone() if buf is not None else torch.zeros(b - a, dtype=torch.uint8)
                )
                segments = [(a, b), *_cut(out.split, first, out.size)]
            for i, (a, b) in enumerate(segments):
                if buf is None and zeros is None:
                    zeros = torch.zeros(CHUNK, dtype=torch.uint8)
                if i == 0 and first is not None:
                    src = first
                else:
                    src = buf[a:b] if buf is not None else zeros[: b - a]  # type: ignore[index]
                works.append(_post(dist.isend, src, out.to, comm, out.tag, i))
            sends.append((out, first if first is not None else buf, works))
        fired = False
        for got in posted:
            item = got.item
            algorithm = item.digest.split(":", 1)[0]
            hasher = new_hasher(algorithm)
            if item.taker is not None:
                if not buffers:
                    buffers = [torch.empty(CHUNK, dtype=torch.uint8) for _ in range(RING)]
                _take(got, comm, deadline, hasher, buffers)
                if not fired and trace is not None:
                    fired = True
                    trace.at(Phase.REPLICATE)
                results.append(_settle(got, algorithm, hasher, slots, time.perf_counter() - t0))
                continue
            view = memoryview(got.mm) if got.mm is not None and got.refused is None else None
            for (a, b), work in zip(_chunks(item.size), got.works, strict=True):
                deadline.wait(work, f"the bytes {a}-{b} of {item.into.name} from rank {item.src}")
                if view is not None:
                    hasher.update(view[a:b])
                if not fired and trace is not None:
                    fired = True
                    trace.at(Phase.REPLICATE)
            del view
            results.append(_settle(got, algorithm, hasher, slots, time.perf_counter() - t0))
        if not fired and trace is not None:
            trace.at(Phase.REPLICATE)
        for out, _buf, works in sends:
            for work in works:
                deadline.wait(work, f"a file's bytes to rank {out.to}")
    except BaseException:
        for got in posted[len(results) :]:
            with contextlib.suppress(Exception):
                slots.drop(got.part)
        raise
    return results


@dataclass
class _Posted:
    """One incoming file while it arrives."""

    item: Incoming
    part: Path
    mm: Any = None
    key: tuple[int, int] | None = None
    refused: str | None = None
    works: list[Any] = field(default_factory=list)

    def place(self, offset: int, end: int) -> torch.Tensor | None:
        """Where the taker takes ``[offset, end)`` straight in (None: staging)."""
        taker = self.item.taker
        if taker is None or self.refused is not None:
            return None
        try:
            target = taker.place(offset, end)
        except Exception as exc:  # the rest still arrives (the sender is never hung)
            self.refused = f"{self.item.into.name} could not be taken in: {exc}"
            return None
        if target is not None and (
            target.device.type != "cpu"
            or target.dtype != torch.uint8
            or target.numel() != end - offset
            or not target.is_contiguous()
        ):
            return None  # gloo receives into host memory only, and exactly there
        return target

    def feed(self, offset: int, chunk: torch.Tensor) -> None:
        """Hand a hashed chunk to the taker; a taker that fails is stopped, and said."""
        taker = self.item.taker
        if taker is None or self.refused is not None:
            return
        try:
            taker.take(offset, chunk)
        except Exception as exc:  # the rest still arrives (the sender is never hung)
            self.refused = f"{self.item.into.name} could not be taken in: {exc}"


def _cut(split: Split | None, first: torch.Tensor, size: int) -> list[tuple[int, int]]:
    """The segments after ``first`` (``split``'s, checked: in order, covering the rest, each
    at most ``CHUNK``; else, or with no ``split``, plain chunks). Both ends run this on the
    same bytes."""
    start = first.numel()
    try:
        cut = split(first.numpy().data, size) if split is not None else []
    except Exception:  # a cut that fails is no cut: plain chunks, on both ends alike
        cut = []
    at = start
    for a, b in cut:
        if a != at or not a < b <= size or b - a > CHUNK:
            cut = []
            break
        at = b
    if not cut or at != size:
        cut = [(a, min(a + CHUNK, size)) for a in range(start, size, CHUNK)]
    return cut


def _take(
    got: _Posted, comm: Comm, deadline: _Deadline, hasher: Any, buffers: list[torch.Tensor]
) -> None:
    """Receive one file into its taker: the first chunk through a staging buffer (it holds
    the header the taker routes by), then each segment straight into the tensor the taker
    places it in, or through the next free staging buffer; hashed in order, as it lands."""
    item = got.item
    src, name = item.src, item.into.name
    first = _chunks(item.size)[0]
    head = buffers[0][: first[1]]
    work = _post(dist.irecv, head, src, comm, item.tag, 0)
    deadline.wait(work, f"the bytes {first[0]}-{first[1]} of {name} from rank {src}")
    hasher.update(head.numpy().data)
    got.feed(0, head)
    if item.size <= first[1]:
        return
    segments = _cut(item.split, head, item.size)
    direct = [got.place(a, b) for a, b in segments]
    works: list[Any] = [None] * len(segments)
    for i, target in enumerate(direct):
        if target is not None:
            works[i] = _post(dist.irecv, target, src, comm, item.tag, i + 1)
    staged = [i for i, target in enumerate(direct) if target is None]
    free = list(buffers)
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # segment -> its buffer, its bytes

    def post_next() -> None:
        if staged and free:
            i = staged.pop(0)
            a, b = segments[i]
            buffer = free.pop()
            held[i] = (buffer, buffer[: b - a])
            works[i] = _post(dist.irecv, held[i][1], src, comm, item.tag, i + 1)

    for _ in range(len(buffers)):
        post_next()
    for i, (a, b) in enumerate(segments):
        deadline.wait(works[i], f"the bytes {a}-{b} of {name} from rank {src}")
        target = direct[i]
        if target is not None:
            hasher.update(target.numpy().data)
            continue
        buffer, chunk = held.pop(i)
        hasher.update(chunk.numpy().data)
        got.feed(a, chunk)
        free.append(buffer)
        post_next()


def _settle(got: _Posted, algorithm: str, hasher: Any, slots: Targets, seconds: float) -> Received:
    """Every chunk of ``got`` arrived: name it if it hashed to its writer's digest."""
    item = got.item
    error, refused = got.refused, got.refused is not None
    if item.taker is not None:  # nothing was made in memory: the verdict is all there is
        if error is None and (actual := format_digest(algorithm, hasher)) != item.digest:
            error = _mismatch(item, actual)
        return Received(item.into, seconds, error, refused)
    if error is None:
        actual = format_digest(algorithm, hasher)
        if actual != item.digest:
            error = _mismatch(item, actual)
    if error is None:
        try:
            slots.drop(item.into)  # a damaged or older copy at the target goes
            slots.rename(got.part, item.into, key=got.key)  # the very file that was hashed
        except (OSError, CheckpointError) as exc:
            error, refused = f"cannot name {item.into}: {exc}", True
    if error is not None:
        slots.drop(got.part)
    return Received(item.into, seconds, error, refused)


def _mismatch(item: Incoming, actual: str) -> str:
    return (
        f"{item.into.name} from rank {item.src}: {item.size} bytes hashing to {actual}, the "
        f"writer recorded {item.digest} (digest mismatch)"
    )


@dataclass(frozen=True)
class _Deadline:
    """``timeout_s`` for each wait, and the whole exchange's end (a ``time.monotonic()``)."""

    timeout_s: float
    end: float

    def wait(self, work: Any, what: str) -> None:
        to_end = self.end - time.monotonic()
        left = min(self.timeout_s, to_end)
        try:
            work.wait(datetime.timedelta(seconds=max(left, 0.001)))
        except RuntimeError as exc:
            # which of the two deadlines this wait had: a peer that went silent, or one that
            # sends, too slowly for the whole exchange
            which = (
                "the whole exchange's deadline passed (timeout_s plus 1 s per 16 MiB chunk; "
                f"each chunk came within {self.timeout_s:.0f} s)"
                if to_end < self.timeout_s
                else f"nothing came within {self.timeout_s:.0f} s (timeout_s, for each chunk)"
            )
            raise TransferError(f"waiting for {what} failed: {which}: {str(exc)[:300]}") from exc


def _post(op: Any, chunk: torch.Tensor, peer: int, comm: Comm, tag: int, i: int) -> Any:
    assert comm.group is not None
    global_peer = dist.get_global_rank(comm.group, peer)
    try:
        return op(chunk, global_peer, group=comm.group, tag=tag * _CHUNKS_PER_FILE + i)
    except RuntimeError as exc:  # the pair to that peer closed already
        raise TransferError(f"cannot reach rank {peer}: {str(exc)[:300]}") from exc
