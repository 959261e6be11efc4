"""``Sink`` and ``Tee``: a second place the bytes of a file go while it is written (no torch).

The hashing writer (dckpt.storage.hashing_writer) writes each shard file to the local disk
and, given a ``Tee``, also to that file's ``Sink`` (an object store's upload, made by
dckpt.tiers), byte for byte in the same order, hashed once for both. Defined apart so that
the commit layer, which knows no torch, can name the type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["Sink", "Tee"]


class Sink(Protocol):
    """A second place each written byte goes, in order (an object store's upload)."""

    def write(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def close(self) -> None:
        """All bytes were written: complete it (raises if it cannot)."""
        ...

    def abort(self) -> None:
        """The write failed: give it up."""
        ...


Tee = Callable[[str], Sink]
"""Given a file's final name (relative to the save's directory), where else its bytes go."""
