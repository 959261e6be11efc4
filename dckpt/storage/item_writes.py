"""The digest of the bytes the writer wrote for each tensor item, as they went to the file.

Role: the written half of the capture check (dckpt.save.capture). A save digests each tensor
at ``save()``, from the live tensor; this digests the bytes that reached the file for the
same item, in the same form (``x:`` or ``g:``, dckpt.storage.tensor_digest), so the two can
be compared before the commit. A digest of the staging buffer would not do: a buffer that was
never refreshed, or was changed after its copy, is exactly what is being looked for, and
the file digest (computed over what is written) cannot see it either.

How an item's bytes are found in the stream: DCP serializes each tensor item with
``torch.save``, which writes the tensor's storage in one ``write`` call whose buffer *is* that
storage (measured on torch 2.13: same address, same length). The planner, right before DCP
serializes an item, hands ``expect`` the very tensor DCP will write (its storage exactly the
tensor's bytes, so DCP does not clone it); the hashing stream asks ``match`` about each large
write (by length, then by address) and digests the matching one as it goes out: an ``x``
digest through the ``O_DIRECT`` writer's bounce buffer, piece by piece beside the file
digest, so it is of the bytes handed to the disk (dckpt.storage.direct_file), or of the
write's buffer on a file system without ``O_DIRECT``; a ``g`` digest (the GPU fingerprint,
which needs the tensor whole) over the tensor whose storage is being written, right before
the write, from the same memory.

Invariant: an item is reported written only if its bytes passed through a stream of this
writer; one that never did (an error, a file linked instead of written) has no written
digest, and the capture check says so.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from .tensor_digest import fingerprint, fingerprint_digest, shape_prefix

__all__ = ["ItemWrites", "WrittenItem"]


@dataclass
class WrittenItem:
    """One tensor item DCP is about to write, and its digest once written."""

    key: str
    tensor: torch.Tensor
    kind: str
    """``x`` (xxh3-64 of the bytes) or ``g`` (the GPU fingerprint, computed here on the host)."""
    hasher: Any = None
    digest: str | None = None

    def start(self) -> Any:
        """The hasher the bytes go through (``x``), or None when the digest is taken whole
        (``g``: computed over the tensor whose storage is being written, right now)."""
        if self.kind == "g":
            self.digest = fingerprint_digest(shape_prefix(self.tensor), fingerprint(self.tensor))
            return None
        self.hasher = xxhash.xxh3_64(shape_prefix(self.tensor))
        return self.hasher

    def done(self) -> None:
        if self.hasher is not None:
            self.digest = f"x:{self.hasher.hexdigest()}"
            self.hasher = None


class ItemWrites:
    """One save's expected items on one rank, and their written digests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[tuple[int, int], list[WrittenItem]] = {}
        """By (address, length): the items whose bytes are that storage (tied weights: two
        names, one storage, each written), first expected first."""
        self._sizes: set[int] = set()
        self._written: dict[str, str] = {}
        self._kinds: dict[str, str] = {}

    def expect(self, key: str, tensor: torch.Tensor, kind: str) -> None:
        """DCP is about to serialize ``tensor`` (a host tensor whose storage is exactly its
        bytes) for item ``key``; ``kind`` says which digest the capture took."""
        nbytes = tensor.numel() * tensor.element_size()
        item = WrittenItem(key, tensor, kind)
        with self._lock:
            self._kinds[key] = kind
        if nbytes == 0:  # torch.save writes no storage record: nothing can differ but its shape
            item.start()
            item.done()
            self._record(item)
            return
        where = (int(tensor.untyped_storage().data_ptr()), nbytes)
        with self._lock:
            self._waiting.setdefault(where, []).append(item)
            self._sizes.add(nbytes)

    def match(self, view: memoryview) -> WrittenItem | None:
        """The expected item whose storage ``view`` is (a write of exactly its bytes, from its
        address), taken off the list; None for any other write."""
        if len(view) not in self._sizes:
            return None
        address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        with self._lock:
            waiting = self._waiting.get((address, len(view)))
            if not waiting:
                return None
            item = waiting.pop(0)
            if not waiting:
                del self._waiting[(address, len(view))]
            return item

    def finished(self, item: WrittenItem) -> None:
        """``item``'s bytes are all in the file."""
        item.done()
        self._record(item)

    def _record(self, item: WrittenItem) -> None:
        assert item.digest is not None
        with self._lock:
            self._written[item.key] = item.digest

    def expected_kind(self, key: str) -> str | None:
        """How ``key``'s written digest is made (as ``expect`` was told), or None."""
        with self._lock:
            return self._kinds.get(key)

    def comparable(self, digests: Mapping[str, str], keys: Collection[str]) -> bool:
        """Whether ``digests`` (an earlier write's, of a file a save would link) hold a digest
        of each of ``keys`` made the way this save's captures are (``x:`` or ``g:``)."""
        return all(
            (kind := self.expected_kind(k)) is not None
            and digests.get(k, "").startswith(f"{kind}:")
            for k in keys
        )

    def adopt(self, digests: Mapping[str, str]) -> None:
        """Items whose bytes are in the file by a link, not written now: their digests as
        the save that wrote them recorded."""
        with self._lock:
            self._written.update(digests)

    def written(self) -> dict[str, str]:
        """Item key → the digest of the bytes written for it, for every item written whole."""
        with self._lock:
            return dict(self._written)
