"""Reading a checkpoint file once: every byte from the storage a single time, in parallel,
hashed in file order as it arrives, the large tensors' bytes landing straight in the tensors
they restore.

Role: the whole-file path of ``VerifyingReader.read_data`` (a file of this rank's share, or
any file it reads without item digests). The earlier path hashed the file front to back and
only then let DCP read its items through the same descriptor: a cold read, then a second pass
over the page cache, one after the other, on one thread. Here one ``OnePassFile`` walks the
file in order: the bytes between items (and any item it cannot place) go through a ring of
``READ_CHUNK`` buffers, a small item is read into memory and deserialized from there, and the
storage record of a large tensor item is read by ``threads`` threads directly into the
memory of the tensor it restores (CPU, contiguous, the same dtype and shape: what a resume of
the same layout meets), while the calling thread hashes each finished chunk in order.

Invariants:
- every byte of the file is hashed exactly once, in order: a tensor's bytes from its own
  memory after the read filled it, a small item's from the buffer it is deserialized from;
  one read past the recorded size must find nothing. What places an item (its archive's
  directory and pickle) and a large item read the ordinary way are read again through the
  same descriptor: committed files are never written, so those are the bytes hashed;
- the load is complete only when the file's digest matched: ``read`` raises IntegrityError
  (naming the file and both digests) otherwise. Tensors are filled *before* that verdict, so
  on a mismatch the state the caller passed holds bytes of the failed file: the load fails
  on every rank (the resumer agrees on the first failure), and a resume's fallback loads the
  next candidate over the whole state; when none is left the resume raises, saying the state
  is partly overwritten (as it did already when a second file failed after a first was
  used). ``planner.commit_tensor`` and every non-tensor value (``load_bytes``) wait for the
  verdict;
- what the placing of an item reads before its bytes are hashed is the torch.save archive's
  directory and pickle, through ``torch.load(map_location="meta", weights_only=True)``: it
  allocates no storage, and the record it names must lie inside the item's span and match
  the target's size, or the item is read the ordinary way;
- no thread writes into a tensor after ``read`` returns or raises: every read submitted is
  waited for;
- peak memory beyond the state: ``threads`` chunk buffers, the small items held until the
  verdict (``HELD_BUDGET``), the file's non-tensor values (held too: they are applied only
  once proven; an optimizer's step counts, RNG and sampler states), and a large item that
  cannot go straight into its tensor (a resharded load, a GPU tensor): that one is read the
  way DCP reads it, through a view of the same descriptor;
- an error after a tensor was filled (``filled``) says that the state holds some of the
  file's bytes (``PARTLY_FILLED``).
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, cast

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view

from ..errors import IntegrityError
from .digest import READ_CHUNK, format_digest, new_hasher, parse_digest
from .records import FileRecord

__all__ = ["DIRECT_MIN", "HELD_BUDGET", "PARTLY_FILLED", "LoadTimes", "OnePassFile"]

DIRECT_MIN = 1 << 20
"""Items smaller than this are read into memory and deserialized from there; larger tensor
items are read into their tensor when it can take the bytes as stored."""


PARTLY_FILLED = (
    "Tensors of the state this load filled hold some of this file's bytes: load a checkpoint "
    "into it again before training (resume() does, falling back to an older one)."
)

HELD_BUDGET = 64 << 20
"""Bytes of small items per file kept in memory and deserialized once the file is proven;
past it, a small item is deserialized as it comes (its allocation bounded first)."""


@dataclass
class LoadTimes:
    """Where a verified load's time went on this rank (seconds, summed over files)."""

    read_wait_s: float = 0.0
    """Waiting for reads the hasher needed next (the storage)."""
    hash_s: float = 0.0
    """Hashing, on the calling thread, beside the reads in flight."""
    fill_s: float = 0.0
    """Deserializing items and copying them into the state."""
    bytes_read: int = 0
    direct_bytes: int = 0
    """Bytes read straight into the tensors they restore."""

    def add(self, other: LoadTimes) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _bounded(view: Any, offset: int, length: int, where: str) -> torch.Tensor:
    """The stored tensor of the item at ``offset`` (``view``: its bytes) as a meta tensor
    (its archive's directory and pickle read, no storage allocated), refused unless its
    storage fits the item's span: bytes not yet proven never make a reader allocate more
    than the file holds."""
    meta = torch.load(view, map_location="meta", weights_only=True)
    if not isinstance(meta, torch.Tensor) or meta.untyped_storage().nbytes() > length:
        raise ValueError(f"{where}: the item at byte {offset} does not hold a tensor that fits it")
    return meta


class _ShortReadError(Exception):
    """The file ended before ``at``: it shrank after the size check."""

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise _ShortReadError(offset + done)
        done += got


@dataclass
class _Placed:
    """Where a large tensor item's storage record lies in the file and the tensor it fills."""

    record_start: int
    record_end: int
    target: torch.Tensor
    into: memoryview = field(repr=False)


class OnePassFile:
    """One file, opened and size-checked by the caller (``open_checked``), read once."""

    def __init__(
        self,
        f: io.FileIO,
        where: str,
        record: FileRecord,
        pool: ThreadPoolExecutor,
        *,
        threads: int,
        span: Callable[[ReadItem], tuple[int, int]],
        load_item: Callable[[io.FileIO, ReadItem, LoadPlanner], torch.Tensor | None],
    ) -> None:
        self.f, self.fd, self.where, self.record = f, f.fileno(), where, record
        self.pool, self.threads = pool, threads
        self.span, self.load_item = span, load_item
        self.algorithm, _ = parse_digest(record.digest)
        self.hasher = new_hasher(self.algorithm)
        self.pos = 0
        """Bytes hashed so far (the file's prefix [0, pos))."""
        self.times = LoadTimes()
        self._buffers: list[bytearray] = []
        self._held_bytes = 0
        self.filled = False
        """Whether a tensor of the state was written before the verdict (a failed read then
        leaves some of this file's bytes in it: the errors say so)."""

    # --- the walk ----------------------------------------------------------------------------

    def read(self, items: list[ReadItem], planner: LoadPlanner) -> str:
        """Fill every item of ``items`` (sorted by offset, not overlapping) from the file,
        hashing every byte of it once; the digest, once it matched the record.

        An item that fails to deserialize stops the filling but not the hashing: a file whose
        digest does not match is ``IntegrityError`` (the cause, whatever broke first); a file
        that matched and still fails is that error (a state that does not fit it)."""
        deferred: list[Callable[[], None]] = []
        broken: Exception | None = None
        try:
            for item in items:
                offset, length = self.span(item)
                self._through(offset)
                if broken is not None:
                    continue  # hashed as a gap by the next _through
                try:
                    deferred.append(self._item(item, offset, length, planner))
                except (OSError, _ShortReadError):
                    raise
                except Exception as exc:  # judged once the digest is known
                    broken = exc
            self._through(self.record.bytes)
            if os.pread(self.fd, 1, self.record.bytes):  # it grew after the size check
                size = f"{self.record.bytes} bytes"
                raise self._mismatch(size, "more bytes", "size mismatch")
        except _ShortReadError as short:
            size = f"{self.record.bytes} bytes"
            raise self._mismatch(size, f"{short.at} bytes", "size mismatch") from None
        actual = format_digest(self.algorithm, self.hasher)
        if actual != self.record.digest:
            raise self._mismatch(self.record.digest, actual)
        if broken is not None:
            raise broken
        t0 = time.perf_counter()
        for commit in deferred:  # only a proven file's values reach the state
            commit()
        self.times.fill_s += time.perf_counter() - t0
        return actual

    def _mismatch(self, expected: str, actual: str, detail: str = "") -> IntegrityError:
        note = PARTLY_FILLED if self.filled else ""
        return IntegrityError(self.where, expected, actual, detail, note=note)

    def _item(
        self, item: ReadItem, offset: int, length: int, planner: LoadPlanner
    ) -> Callable[[], None]:
        """Read one item (hashing it); fill its tensor now, or say how once proven."""
        if item.type == LoadItemType.BYTE_IO:  # a value: applied only once proven
            data = self._into_memory(offset, length)
            return lambda: planner.load_bytes(item, io.BytesIO(data))
        if length < DIRECT_MIN:
            data = self._into_memory(offset, length)
            if self._held_bytes + length <= HELD_BUDGET:  # deserialized once proven
                self._held_bytes += length

                def fill_proven() -> None:
                    self._fill(_MemoryFile(data, offset), item, planner, commit=True)

                return fill_proven
            held = _MemoryFile(data, offset)
            _bounded(_create_file_view(held, offset, length), offset, length, self.where)
            target = self._fill(held, item, planner, commit=False)
        else:
            placed = self._place(item, offset, length, planner)
            if placed is not None:
                self._through(placed.record_start)
                self.filled = True
                self._stream(placed.record_start, placed.record_end, placed.into)
                self.times.direct_bytes += placed.record_end - placed.record_start
                self._through(offset + length)
                return lambda: planner.commit_tensor(item, placed.target)
            self._through(offset + length)  # read the way DCP reads it, once hashed
            target = self._fill(self.f, item, planner, commit=False)
        assert target is not None  # a tensor item
        return lambda: planner.commit_tensor(item, target)

    def _fill(
        self, f: Any, item: ReadItem, planner: LoadPlanner, *, commit: bool
    ) -> torch.Tensor | None:
        """Deserialize ``item`` into the state; the tensor it filled (committed only when
        ``commit``: its file is proven)."""
        t0 = time.perf_counter()
        if not commit:
            self.filled = True
        try:
            return self.load_item(cast(io.FileIO, f), item, planner if commit else _held(planner))
        finally:
            self.times.fill_s += time.perf_counter() - t0

    def _place(
        self, item: ReadItem, offset: int, length: int, planner: LoadPlanner
    ) -> _Placed | None:
        """Where the item's tensor bytes lie, when they can be read straight into its target:
        a CPU tensor, contiguous, of the stored dtype and shape, the item the whole stored
        tensor (no resharding), the archive little-endian. None: read it the ordinary way
        (its allocation bounded by its span, ``_bounded``)."""
        view = _create_file_view(self.f, offset, length)
        meta = _bounded(view, offset, length, self.where)
        try:
            target = planner.resolve_tensor(item).detach()
            if (
                target.device.type != "cpu"
                or target.layout != torch.strided
                or not target.is_contiguous()
                or target.is_conj()
                or target.is_neg()
                or target.numel() == 0
                or meta.dtype != target.dtype
            ):
                return None
            into = memoryview(cast(Any, target.reshape(-1).view(torch.uint8).numpy()))
        except Exception:  # a target whose memory cannot take bytes: the ordinary way
            return None
        storage = meta.untyped_storage()
        start = getattr(storage, "_checkpoint_offset", None)
        nbytes = target.numel() * target.element_size()
        if (
            type(start) is not int
            or meta.shape != target.shape
            or not meta.is_contiguous()
            or meta.storage_offset() != 0
            or storage.nbytes() != nbytes
            or any(o != 0 for o in item.storage_offsets)
            or tuple(item.lengths) != tuple(target.shape)
            or not 0 <= start <= length - nbytes
            or not self._little_endian(view)
        ):
            return None
        return _Placed(offset + start, offset + start + nbytes, target, into)

    @staticmethod
    def _little_endian(view: Any) -> bool:
        view.seek(0)
        try:
            archive = torch._C.PyTorchFileReader(view)
            if "byteorder" not in archive.get_all_records():
                return False
            return bytes(archive.get_record("byteorder")) == sys.byteorder.encode() == b"little"
        except Exception:
            return False

    # --- reading and hashing -----------------------------------------------------------------

    def _through(self, end: int) -> None:
        """Read and hash the bytes up to ``end`` that no item used (through the ring)."""
        if end > self.pos:
            self._stream(self.pos, end, None)

    def _into_memory(self, offset: int, length: int) -> bytearray:
        data = bytearray(length)
        self._stream(offset, offset + length, memoryview(data))
        return data

    def _stream(self, start: int, end: int, into: memoryview | None) -> None:
        """Read [start, end) with up to ``threads`` reads in flight and hash it in order, into
        ``into`` (which holds exactly those bytes) or through the ring of chunk buffers."""
        assert start == self.pos, (start, self.pos)
        chunks = iter(range(start, end, READ_CHUNK))
        flight: collections.deque[tuple[memoryview, Future[None]]] = collections.deque()

        def submit() -> bool:
            at = next(chunks, None)
            if at is None:
                return False
            n = min(READ_CHUNK, end - at)
            if into is not None:
                view = into[at - start : at - start + n]
            else:
                view = memoryview(self._buffers.pop() if self._buffers else bytearray(READ_CHUNK))
                view = view[:n]
            flight.append((view, self.pool.submit(_pread_into, self.fd, view, at)))
            return True

        try:
            while len(flight) < self.threads and submit():
                pass
            while flight:
                view, done = flight.popleft()
                t0 = time.perf_counter()
                done.result()
                t1 = time.perf_counter()
                self.hasher.update(view)
                self.times.read_wait_s += t1 - t0
                self.times.hash_s += time.perf_counter() - t1
                self.times.bytes_read += len(view)
                self.pos += len(view)
                if into is None:
                    self._buffers.append(cast(bytearray, view.obj))
                submit()
        finally:
            for _, pending in flight:  # nothing writes into memory after this returns
                pending.cancel()
            for _, pending in flight:
                if not pending.cancelled():
                    with contextlib.suppress(OSError, _ShortReadError):
                        pending.result()


class _NoCommit:
    """The planner, with ``commit_tensor`` held back until the file is proven."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


def _held(planner: LoadPlanner) -> LoadPlanner:
    return cast(LoadPlanner, _NoCommit(planner))


class _MemoryFile(io.BytesIO):
    """A small item's bytes, served at the file offsets they came from (``load_item`` makes
    its view from the item's offset in the file)."""

    def __init__(self, data: bytearray, base: int) -> None:
        super().__init__(data)
        self._base = base

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            return super().seek(offset - self._base) + self._base
        return super().seek(offset, whence) + self._base

    def tell(self) -> int:
        return super().tell() + self._base
