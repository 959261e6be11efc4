"""One rank's state as one flat file for the memory tier: written by a memcpy, read by one.

A memory checkpoint is restored in place, by the same ranks, on the same sharding (a torchrun
restart, or a requeue of the same job): so unlike a DCP save it needs no plan, no collective
and no resharding, and its file is simply every tensor of this rank's state dict (a DTensor's
local shard) laid end to end, plus the non-tensor values:

```
b"DCKPTMEM" | u64 little-endian header length | header (JSON) | zero padding to 4 KiB
tensor bytes, each at a 64-byte aligned offset the header records
non-tensor values: torch.save of {flat key: value}, read back with weights_only=True
zero padding to a multiple of 64 KiB (a file keeps its size, and its mapped pages, across saves)
```

The header is ``{"version": 1, "tensors": [[key, dtype, shape, offset, nbytes], ...],
"objects": [offset, length], "size": total}``. Keys are DCP's flattened names, so a restore
matches tensors by name, shape and dtype against the live state dict and fails (naming the
first difference) rather than loading into the wrong tensor.

A file can also be read as it arrives from another node (``StreamFill``, a transfer's taker):
its header, parsed from the first bytes, routes each tensor's bytes straight into the live
tensor of that name (checked first to have its dtype and shape; a tensor of 1 MiB or more is
received in place, ``cut_at_tensors`` and ``StreamFill.place``), and keeps every other byte
(the header, the non-tensor values, the padding, tensors this rank does not hold) in memory;
so a lost node's file costs no page of its own, and no copy after it arrived.

Invariants: ``write_into`` copies every tensor before it returns (the snapshot is the state at
``save()`` time); the reader trusts nothing in the file before its digest matched the
manifest, and even then checks every offset against the buffer's length. A ``StreamFill``
writes bytes into live tensors *before* the digest is known: nothing reads them until the
whole file hashed right, and a file that did not leaves the candidate failed (the caller's
rule: dckpt.load.memory). Files and their mappings are dckpt.tiers.memory_layout's; this
module only lays bytes out and reads them.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.tensor import DTensor

from .tamper import tampered_copy
from .tensor_digest import copy_hashed, host_digest

__all__ = [
    "FlatFile",
    "MemoryFileError",
    "StateFill",
    "StreamFill",
    "cut_at_tensors",
    "plan_flat",
    "row_fits",
    "share_out",
    "signature",
    "write_into",
]

MAGIC = b"DCKPTMEM"
_HEAD = struct.Struct("<8sQ")
_DATA_ALIGN = 4096
_ALIGN = 64
_SIZE_STEP = 64 << 10
"""A file's size is rounded up to this (zero padding at its end): the pickled non-tensor
values change by a few bytes between saves (a step count's digits), and a file that keeps its
size reuses its predecessor's mapped pages instead of being mapped and allocated again."""
_MAX_HEADER = 64 << 20


class MemoryFileError(ValueError):
    """A memory file that is not what its header says, or does not fit the live state."""


@dataclass(frozen=True)
class FlatPlan:
    """Where each tensor of one state dict goes in its file (built in ``save()``)."""

    tensors: list[tuple[str, torch.Tensor, int, int]]  # key, local tensor, offset, nbytes
    objects: bytes
    objects_offset: int
    header: bytes
    size: int


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def signature(state_dict: dict[str, Any]) -> tuple[str, dict[str, int]]:
    """This rank's replicated-looking tensors (plain tensors: DCP's rule for what is the
    same on every rank; not a DTensor shard, not a per-rank RNG state) by key and size, and
    a digest of their names, dtypes and shapes: ranks with equal digests hold the same ones."""
    flat, _ = flatten_state_dict(state_dict)
    sizes: dict[str, int] = {}
    hasher = hashlib.sha256()
    for key in sorted(flat):
        value = flat[key]
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if key.startswith("rng."):
                continue
            sizes[key] = value.numel() * value.element_size()
            hasher.update(f"{key}|{value.dtype}|{list(value.shape)}\n".encode())
    return hasher.hexdigest(), sizes


def share_out(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Each replicated tensor's owner: the biggest first, each to the least loaded rank (ties
    to the lowest), so every rank copies about 1/world of them. Deterministic: every rank
    computes the same owners from the same sizes."""
    load = [0] * world_size
    owners: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[key] = rank
        load[rank] += sizes[key]
    return owners


def plan_flat(state_dict: dict[str, Any], skip: frozenset[str] = frozenset()) -> FlatPlan:
    """Lay out ``state_dict``: tensor offsets, the pickled non-tensor values, the header.
    Tensors named in ``skip`` (another rank's file holds them) are left out."""
    flat, _ = flatten_state_dict(state_dict)
    rows: list[list[Any]] = []
    tensors: list[tuple[str, torch.Tensor, int, int]] = []
    objects: dict[str, Any] = {}
    pending: list[tuple[str, torch.Tensor, int]] = []
    for key, value in flat.items():
        if key in skip:
            continue
        if isinstance(value, torch.Tensor):
            local = _local(value).detach()
            pending.append((key, local, local.numel() * local.element_size()))
        else:
            objects[key] = value
    buf = io.BytesIO()
    torch.save(objects, buf)
    blob = buf.getvalue()
    # The header's length depends on the offsets, which depend on the header's length: size
    # the header with placeholder offsets of the final width, then fill them in.
    offset = 0
    for key, local, nbytes in pending:
        rows.append([key, str(local.dtype).removeprefix("torch."), list(local.shape), 0, nbytes])
    guess = len(json.dumps({"version": 1, "tensors": rows, "objects": [0, 0], "size": 0}))
    offset = _round(_HEAD.size + guess + 64 * (len(rows) + 2), _DATA_ALIGN)
    for row, (key, local, nbytes) in zip(rows, pending, strict=True):
        row[3] = offset
        tensors.append((key, local, offset, nbytes))
        offset = _round(offset + nbytes, _ALIGN)
    objects_offset = offset
    size = _round(offset + len(blob), _SIZE_STEP)
    header = json.dumps(
        {"version": 1, "tensors": rows, "objects": [objects_offset, len(blob)], "size": size}
    ).encode()
    if len(header) > _MAX_HEADER:
        raise MemoryFileError(
            f"this state has {len(rows)} tensors, whose index ({len(header)} bytes) is over "
            f"the memory file's limit of {_MAX_HEADER} bytes"
        )
    return FlatPlan(tensors, blob, objects_offset, header, size)


def write_into(
    buf: Any,
    plan: FlatPlan,
    *,
    capture: bool = False,
    tamper: tuple[str, str] | None = None,
) -> dict[str, str]:
    """Write the planned file into ``buf`` (a writable mapping of exactly ``plan.size``
    bytes, every page allocated: dckpt.tiers.memory_layout.Slots.open), copying every tensor
    now (the snapshot). With ``capture``, returns each host tensor's digest, taken from the
    source in the copy's pass (dckpt.storage.tensor_digest.copy_hashed); one whose
    bytes cannot be read so is copied and left out (the caller saves it unchecked).
    ``tamper``: (action, key), the fault hook's copy to get wrong (dckpt.storage.tamper)."""
    view = memoryview(buf)
    if len(view) != plan.size:
        raise ValueError(f"the mapping holds {len(view)} bytes, the plan {plan.size}")
    view[: _HEAD.size] = _HEAD.pack(MAGIC, len(plan.header))
    view[_HEAD.size : _HEAD.size + len(plan.header)] = plan.header
    digests: dict[str, str] = {}
    for key, local, offset, nbytes in plan.tensors:
        wanted = capture and not local.is_cuda
        if not nbytes:
            if wanted:
                digests[key] = host_digest(local)
            continue
        dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
        into = dst.view(local.dtype).view(local.shape)
        if tamper is not None and tamper[1] == key:
            if wanted:
                digests[key] = host_digest(local)
            tampered_copy(into, local, tamper[0])
        elif wanted:
            try:
                digests[key] = copy_hashed(into, local)
            except Exception:  # bytes it cannot read so (a conjugate view): copied, no digest
                into.copy_(local)
        else:
            into.copy_(local)
        del dst, into  # the mapping cannot close while a tensor views it
    end = plan.objects_offset + len(plan.objects)
    view[plan.objects_offset : end] = plan.objects
    view[end:] = bytes(plan.size - end)  # the padding: no stale bytes of an earlier file
    del view
    return digests


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def header_length(view: Any, size: int, source: str) -> int:
    """Where the header of a file of ``size`` bytes ends, from its first 16 bytes (``view``):
    MemoryFileError unless they are a memory file's."""
    if size < _HEAD.size or len(view) < _HEAD.size:
        raise MemoryFileError(f"{source}: {size} bytes, too short for a memory file")
    magic, hlen = _HEAD.unpack_from(view, 0)
    if magic != MAGIC or hlen > _MAX_HEADER or _HEAD.size + hlen > size:
        raise MemoryFileError(f"{source}: not a dckpt memory file (bad magic or header)")
    return int(_HEAD.size + hlen)


Row = tuple[str, torch.dtype, list[int], int, int]
"""A tensor in a memory file: its key, dtype, shape, offset and length in bytes."""


def parse_header(view: Any, size: int, source: str) -> tuple[list[Row], tuple[int, int]]:
    """The rows and the non-tensor values' span of a memory file of ``size`` bytes whose first
    bytes (at least the header) are ``view``; each span checked to lie inside the file."""
    end = header_length(view, size, source)
    if len(view) < end:
        raise MemoryFileError(f"{source}: its header is cut short")
    try:
        header = json.loads(bytes(view[_HEAD.size : end]))
        rows = [
            (str(k), _DTYPES[str(d)], [int(x) for x in shape], int(off), int(n))
            for k, d, shape, off, n in header["tensors"]
        ]
        objects_at = (int(header["objects"][0]), int(header["objects"][1]))
    except (ValueError, KeyError, TypeError) as exc:
        raise MemoryFileError(f"{source}: unreadable header ({exc!r})") from None
    for key, _d, _s, off, n in [*rows, ("objects", None, None, *objects_at)]:
        if off < 0 or n < 0 or off + n > size:
            raise MemoryFileError(f"{source}: {key} lies outside the file")
    return rows, objects_at


_WHOLE_TENSOR = 1 << 20
"""A tensor this large is its own segments when a file moves (``cut_at_tensors``): received
straight into the live tensor, where a smaller one comes through a staging buffer."""


def cut_at_tensors(first: memoryview, size: int, most: int) -> list[tuple[int, int]]:
    """How a memory file moves after its first ``len(first)`` bytes: segments of at most
    ``most`` bytes, cut at both ends of every tensor of at least 1 MiB, so that each such
    tensor arrives in segments of its own (and can be received straight into the live one).
    From the header in ``first`` (unproven: both ends of a transfer compute this from the
    same bytes, and a header that does not parse, or lies past ``first``, gives plain cuts)."""
    start = len(first)
    try:
        rows, _ = parse_header(first, size, "the file")
    except MemoryFileError:
        rows = []
    cuts = {start, size}
    for _key, _dtype, _shape, offset, nbytes in rows:
        if nbytes >= _WHOLE_TENSOR:
            cuts.update(x for x in (offset, offset + nbytes) if start < x < size)
    edges = sorted(cuts)
    return [
        (a, min(a + most, b)) for lo, b in itertools.pairwise(edges) for a in range(lo, b, most)
    ]


class FlatFile:
    """A verified memory file's contents, read from ``buf`` (an mmap or bytes) by name."""

    def __init__(self, buf: Any, source: str) -> None:
        self.buf, self.source = buf, source
        view = memoryview(buf)
        self.rows, self.objects_at = parse_header(view, len(view), source)

    def objects(self) -> dict[str, Any]:
        off, n = self.objects_at
        return _objects(bytes(memoryview(self.buf)[off : off + n]), self.source)

    def tensor(
        self, dtype: torch.dtype, shape: list[int], offset: int, nbytes: int
    ) -> torch.Tensor:
        # A read-only mapping (only ever read): torch warns once per process that its tensor
        # is not writable, and that is left alone (see dckpt.collective.transfer._view).
        return _tensor_at(self.buf, dtype, shape, offset, nbytes)


class StreamFill:
    """One memory file arriving chunk by chunk from another node (a transfer's ``Taker``), its
    tensors written straight into the live state as their bytes arrive.

    ``live``: this rank's flat state (DCP's flattened keys, a DTensor as its local shard).
    ``taken``: shared by the files this rank receives: which one wrote each key (its own file
    first, else the first to arrive). The header, once its bytes are in, is parsed and each
    row matched: a row of a live key with its dtype, shape and length, contiguous, is routed
    into that tensor; a row of a key this rank does not hold (another rank's RNG) is kept.
    A row of a live key that does not fit it, a key the own file has and the state has not,
    or a header that does not parse stops the routing before any of its bytes is written
    (``problem``): only the bytes are hashed from then on. Every byte not routed is kept, in
    order (``kept``): the header, the non-tensor values, the padding, the rows kept.

    After the digest matched, it serves ``StateFill`` as a ``FlatFile`` does (``rows``,
    ``objects``, ``tensor`` of a kept row); ``placed`` are the keys already in place."""

    def __init__(
        self,
        size: int,
        source: str,
        live: dict[str, torch.Tensor],
        taken: dict[str, StreamFill],
        *,
        own: bool,
    ) -> None:
        self.size, self.source, self.own = size, source, own
        self._live, self._taken = live, taken
        self.rows: list[Row] = []
        self.objects_at = (0, 0)
        self.problem: str | None = None
        """Why nothing more is routed: the header did not parse (damage, once the digest
        matched) or does not fit the live state (a changed state)."""
        self.damaged = False
        """``problem`` is the header's own fault (it does not describe its file)."""
        self.placed: set[str] = set()
        self.kept: list[tuple[int, bytearray]] = []
        self._route: list[tuple[int, int, torch.Tensor, str]] = []  # offset, end, bytes, key
        self._next = 0  # the first route not yet passed (the bytes come in order)
        self._parsed = False

    @property
    def wrote(self) -> bool:
        """Whether any byte went into a live tensor."""
        return bool(self.placed)

    def place(self, offset: int, end: int) -> torch.Tensor | None:
        """The live tensor's bytes ``[offset, end)`` of the file lands in, when one routed
        tensor holds them all (its key is then placed): received straight there."""
        if not self._parsed or self.problem is not None:
            return None
        for row_at, row_end, dest, key in self._route:
            if row_at <= offset and end <= row_end:
                self.placed.add(key)
                return dest[offset - row_at : end - row_at]
            if row_at >= end:
                break
        return None

    @property
    def complete(self) -> bool:
        """Whether its header arrived whole (and was parsed, or found wrong)."""
        return self._parsed

    def take(self, offset: int, chunk: torch.Tensor) -> None:
        if self.problem is not None:
            return  # only hashed from here on (by the transfer)
        if self._parsed:
            self._walk(offset, offset + chunk.numel(), chunk)
            return
        self._keep(offset, chunk)  # until the header is whole, every byte is kept
        if self._parse():
            # The bytes kept so far (from offset 0, in one piece) that belong to a routed row
            # go into it now, the rest stay kept.
            start, head = self.kept.pop()
            self._walk(start, start + len(head), torch.frombuffer(head, dtype=torch.uint8))

    def _parse(self) -> bool:
        """Parse the header once its bytes are in, and plan the routes: whether it did, and
        routes may be taken."""
        head = self.kept[0][1]
        try:
            end = header_length(memoryview(head), self.size, self.source)
        except MemoryFileError as exc:
            if len(head) >= _HEAD.size:
                self._stop(str(exc), damaged=True)
            return False
        if len(head) < end:
            return False  # more of the header is still to come
        self._parsed = True
        try:
            self.rows, self.objects_at = parse_header(memoryview(head), self.size, self.source)
        except MemoryFileError as exc:
            self._stop(str(exc), damaged=True)
            return False
        route = []
        for key, dtype, shape, offset, nbytes in self.rows:
            if offset < end or not row_fits(dtype, shape, nbytes):
                self._stop(
                    f"{self.source}: {key} is recorded as {nbytes} bytes of {dtype}{shape} at "
                    f"offset {offset}: its header does not describe its bytes",
                    damaged=True,
                )
                return False
            live = self._live.get(key)
            if live is None:
                if self.own:
                    self._stop(f"{self.source} holds {key}, which this state does not have")
                    return False
                continue  # another rank's (its RNG): kept
            if live.dtype != dtype or list(live.shape) != shape:
                self._stop(
                    f"{self.source}: {key} is {dtype}{shape} there, {live.dtype}"
                    f"{list(live.shape)} here"
                )
                return False
            holder = self._taken.get(key)
            if not live.is_contiguous() or (holder is not None and (holder.own or not self.own)):
                continue  # kept: StateFill copies it from here if this file is its source
            route.append((offset, offset + nbytes, _bytes_of(live), key))
        for *_, key in route:
            self._taken[key] = self
        self._route = sorted(route, key=lambda r: r[0])
        return True

    def _stop(self, why: str, *, damaged: bool = False) -> None:
        """Route nothing more (nothing was routed yet: the header comes first)."""
        self.problem, self.damaged, self._parsed = why, damaged, True
        self._route = []
        self.kept = []  # nothing of this file will be read

    def _walk(self, offset: int, end: int, chunk: torch.Tensor) -> None:
        """Route the rows that lie in ``[offset, end)``; keep every other byte."""
        pos = offset
        routes = self._route
        while self._next < len(routes) and routes[self._next][1] <= pos:
            self._next += 1
        i = self._next
        while pos < end and i < len(routes) and routes[i][0] < end:
            row_at, row_end, dest, key = routes[i]
            if row_at > pos:
                self._keep(pos, chunk[pos - offset : row_at - offset])
                pos = row_at
            hi = min(row_end, end)
            dest[pos - row_at : hi - row_at].copy_(chunk[pos - offset : hi - offset])
            self.placed.add(key)
            pos = hi
            if hi == row_end:
                i += 1
        self._next = i
        if pos < end:
            self._keep(pos, chunk[pos - offset :])

    def _keep(self, offset: int, data: torch.Tensor) -> None:
        raw = data.numpy().data.cast("B")
        if self.kept and self.kept[-1][0] + len(self.kept[-1][1]) == offset:
            self.kept[-1][1].extend(raw)
        else:
            self.kept.append((offset, bytearray(raw)))

    def _kept_span(self, offset: int, nbytes: int) -> memoryview:
        for at, data in self.kept:
            if at <= offset and offset + nbytes <= at + len(data):
                return memoryview(data)[offset - at : offset - at + nbytes]
        raise MemoryFileError(f"{self.source}: bytes {offset}-{offset + nbytes} were not kept")

    def objects(self) -> dict[str, Any]:
        off, n = self.objects_at
        return _objects(bytes(self._kept_span(off, n)), self.source)

    def tensor(
        self, dtype: torch.dtype, shape: list[int], offset: int, nbytes: int
    ) -> torch.Tensor:
        span = self._kept_span(offset, nbytes) if nbytes else memoryview(b"")
        return _tensor_at(span, dtype, shape, 0, nbytes)

    def image(self) -> list[tuple[int, Any]]:
        """The whole file as (offset, bytes) pieces, in order: the kept bytes and each routed
        row's live tensor (what it holds now: a changed tensor gives other bytes, which the
        caller's digest refuses)."""
        pieces: list[tuple[int, Any]] = [(at, data) for at, data in self.kept]
        pieces += [(at, dest) for at, _end, dest, key in self._route if key in self.placed]
        return sorted(pieces, key=lambda p: p[0])


def _objects(raw: bytes, source: str) -> dict[str, Any]:
    """A file's non-tensor values: tensors and plain values only (``weights_only``)."""
    value = torch.load(io.BytesIO(raw), weights_only=True)
    if not isinstance(value, dict):
        raise MemoryFileError(f"{source}: its non-tensor values are not a dict")
    return value


def _tensor_at(
    buf: Any, dtype: torch.dtype, shape: list[int], offset: int, nbytes: int
) -> torch.Tensor:
    """``nbytes`` of ``buf`` at ``offset`` as a tensor of ``dtype`` and ``shape`` (a view)."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)


def row_fits(dtype: torch.dtype, shape: list[int], nbytes: int) -> bool:
    """Whether a row's length is its shape's in its dtype (a header that says otherwise does
    not describe its bytes: damage, once its digest matched)."""
    return min(shape, default=0) >= 0 and nbytes == math.prod(shape) * dtype.itemsize


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view of its storage (on its device)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class StateFill:
    """A restore matched and checked, not yet applied: ``prepare`` finds every live tensor in
    the files (this rank's own first) and checks names, shapes and dtypes, writing nothing;
    ``apply`` then copies. The ranks agree between the two, so a mismatch on any rank leaves
    every rank's state untouched."""

    def __init__(
        self,
        state_dict: dict[str, Any],
        flat_file: FlatFile | StreamFill,
        shared: list[FlatFile | StreamFill],
    ) -> None:
        self.state_dict = state_dict
        self.flat, self.mapping = flatten_state_dict(state_dict)
        rows: dict[str, tuple[FlatFile | StreamFill, Row]] = {
            row[0]: (flat_file, row) for row in flat_file.rows
        }
        for other in shared:
            for row in other.rows:
                rows.setdefault(row[0], (other, row))  # this rank's own copy first
        self.rows = rows
        self.objects = flat_file.objects()
        flat = self.flat
        self.live = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor))
        live, mine = set(self.live), {row[0] for row in flat_file.rows}
        if not live <= set(rows) or not mine <= live or set(flat) - live != set(self.objects):
            missing = sorted((live - set(rows)) | (set(flat) - live - set(self.objects)))
            extra = sorted((mine - live) | (set(self.objects) - (set(flat) - live)))
            raise MemoryFileError(
                f"{flat_file.source} does not match this state: missing {missing[:3]}, "
                f"unexpected {extra[:3]}"
            )
        for key in self.live:
            local = _local(flat[key])
            source, (_, dtype, shape, _, _) = rows[key]
            if local.dtype != dtype or list(local.shape) != shape:
                raise MemoryFileError(
                    f"{source.source}: {key} is {dtype}{shape} there, {local.dtype}"
                    f"{list(local.shape)} here"
                )

    def apply(self) -> dict[str, Any]:
        """Copy every tensor into the live one (a DTensor's local shard); the saved non-tensor
        values replace the live ones, in place, in the state dict given (so its empty
        containers, which a flat view drops, such as an optimizer's state before its first
        step, stay as they are). Returns that state dict, to load."""
        with torch.no_grad():  # the live tensors may be parameters that require grad
            for key in self.live:
                source, (_, dtype, shape, offset, nbytes) = self.rows[key]
                if isinstance(source, StreamFill) and key in source.placed:
                    continue  # its bytes went into this very tensor as they arrived
                _local(self.flat[key]).copy_(source.tensor(dtype, shape, offset, nbytes))
        for key, value in self.objects.items():
            set_element(self.state_dict, self.mapping[key], value)
        return self.state_dict
