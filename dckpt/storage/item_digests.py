"""Digests of a data file's items: what a rank that reads a few items of a file another rank
owns checks, instead of hashing the whole file.

Role: DCP writes the items of a rank's file (a tensor's ``torch.save`` bytes, a pickled
value) one after another, asking the stream where it is (``tell()``) before and after each.
The hashing writer cuts a segment at every such ``tell()`` and hashes it in the same pass as
the whole file (``ItemHasher``), then writes the segments' lengths and digests beside the file
as ``<file>.items`` (``items_name``). The manifest lists that file like any other, with its
digest: the segments are the writer's word as much as the file's digest is.

At a resume, each rank hashes whole the files of its share (``Manifest.share``: the files it
wrote), and of every other file only the segments covering the items its load reads
(``ItemDigests.covering``), before any of their bytes is used. Every byte is still hashed by
some rank (each file by its owner), and a rank's hashing is its share plus what it reads,
where it was every file it touched: under FSDP, where DCP spreads the replicated values (an
optimizer's step counters) over every rank's file, that was most of the checkpoint per rank.

Invariants:
- the segments of a file tile it exactly: from 0 to its recorded size, each non-empty, in
  order (``parse_items`` refuses anything else, naming the file; a hostile sidecar cannot
  make a reader skip a byte it uses or allocate beyond the bounds below);
- a reader uses an item's bytes only once every segment covering them matched; a segment
  longer than ``LIMIT`` has no digest (its bytes are proven by hashing the whole file);
- a file without a sidecar (written before it existed, or not a data file) is hashed whole.

No torch here.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Any

from .digest import ALGORITHMS, new_hasher

__all__ = ["LIMIT", "SUFFIX", "ItemDigests", "ItemHasher", "items_name", "parse_items"]

SUFFIX = ".items"
LIMIT = 256 << 10
"""The largest segment that gets a digest (``ItemHasher``); a larger one's is ``""``."""
MAX_SIDECAR_BYTES = 256 << 20
MAX_SEGMENTS = 1 << 22


def items_name(file: str) -> str:
    """The sidecar that holds the item digests of ``file``."""
    return file + SUFFIX


class ItemHasher:
    """The segments of one file as it is written: ``update`` with every byte, ``cut`` where a
    segment ends (a ``tell()``); ``encode`` when the file is complete.

    Only segments of at most ``LIMIT`` bytes get a digest: hashing every byte twice (the file's
    digest and its items') cost a background save about 30 % more writer CPU, and what another
    rank reads of a file at a same-world resume is small (the replicated values DCP spreads
    over the files: step counters, scalars); a large item is read by its owner, or, read
    elsewhere (a resharded resume, DDP's one copy of each parameter), its file is hashed whole
    as before. A segment past the limit stops being hashed there: it costs at most ``LIMIT``."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self._hasher = new_hasher(algorithm)
        self._start = 0
        self._pos = 0
        self.lengths: list[int] = []
        self.digests: list[str] = []

    def update(self, data: Any) -> None:
        room = LIMIT - (self._pos - self._start)
        if room > 0:
            self._hasher.update(data if len(data) <= room else memoryview(data).cast("B")[:room])
        self._pos += len(data)

    def cut(self) -> None:
        """End the segment here (nothing when it would be empty)."""
        if self._pos == self._start:
            return
        size = self._pos - self._start
        self.lengths.append(size)
        self.digests.append(self._hasher.hexdigest() if size <= LIMIT else "")
        self._hasher = new_hasher(self.algorithm)
        self._start = self._pos

    def encode(self, file: str) -> bytes:
        """The sidecar's bytes for ``file`` (the bytes written so far, in segments)."""
        self.cut()
        obj = {
            "file": file,
            "algorithm": self.algorithm,
            "size": self._pos,
            "lengths": self.lengths,
            "digests": self.digests,
        }
        return json.dumps(obj, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ItemDigests:
    """A file's segments: ``starts[i]`` to ``starts[i + 1]`` hashes to ``digests[i]``."""

    file: str
    algorithm: str
    starts: tuple[int, ...]
    """Each segment's offset, then the file's size."""
    digests: tuple[str, ...]

    def covering(self, offset: int, length: int) -> list[tuple[int, int, str]] | None:
        """The segments (offset, length, digest) that hold the bytes ``[offset, offset +
        length)``: hashing them proves those bytes; None when one of them has no digest (a
        segment past ``LIMIT``: only the whole file proves it). ValueError for a range past
        the file."""
        end = offset + length
        if offset < 0 or length < 0 or end > self.starts[-1]:
            raise ValueError(f"bytes {offset}-{end} of a {self.starts[-1]}-byte file")
        if length == 0:
            return []
        first = bisect.bisect_right(self.starts, offset) - 1
        out = []
        i = first
        while i < len(self.digests) and self.starts[i] < end:
            a, b = self.starts[i], self.starts[i + 1]
            if not self.digests[i]:
                return None
            out.append((a, b - a, f"{self.algorithm}:{self.digests[i]}"))
            i += 1
        return out


def parse_items(raw: bytes, file: str, size: int, source: str) -> ItemDigests:
    """The sidecar ``raw`` of ``file`` (whose recorded size is ``size``), validated; ValueError
    saying what is wrong (the caller names ``source``) for anything but segments that tile the
    file exactly."""
    if len(raw) > MAX_SIDECAR_BYTES:
        raise ValueError(f"{source}: {len(raw)} bytes, over {MAX_SIDECAR_BYTES}")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{source}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{source}: not a JSON object")
    algorithm, lengths, digests = obj.get("algorithm"), obj.get("lengths"), obj.get("digests")
    if obj.get("file") != file or obj.get("size") != size:
        raise ValueError(f"{source}: describes {obj.get('file')!r} of {obj.get('size')!r} bytes")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{source}: unknown digest algorithm {algorithm!r}")
    if not isinstance(lengths, list) or not isinstance(digests, list):
        raise ValueError(f"{source}: lengths and digests must be lists")
    if len(lengths) != len(digests) or len(lengths) > MAX_SEGMENTS:
        raise ValueError(f"{source}: {len(lengths)} lengths, {len(digests)} digests")
    width = ALGORITHMS[algorithm]
    starts = [0]
    for n, d in zip(lengths, digests, strict=True):
        if type(n) is not int or n <= 0:
            raise ValueError(f"{source}: a segment length {n!r}")
        unhashed = d == "" and n > LIMIT  # a segment past the limit has none, no other
        if not unhashed and (
            not isinstance(d, str) or len(d) != width or d.strip("0123456789abcdef")
        ):
            raise ValueError(f"{source}: a segment digest {str(d)[:80]!r}")
        starts.append(starts[-1] + n)
    if starts[-1] != size:
        raise ValueError(f"{source}: segments end at byte {starts[-1]}, the file has {size}")
    return ItemDigests(file, algorithm, tuple(starts), tuple(digests))
