"""A rank's stable file: the items a caller names as rarely changing (frozen parameters),
written to a file of their own so that a later save whose items all hash the same links that
file instead of writing it again.

Role: the storage half of incremental saves. The policy (which items are stable, which
committed file is the base, how often a fresh copy is forced) is the save layer's
(dckpt.save.durable); this module knows files and DCP write items only.

How a reuse is decided, keyed by content:
- before the stable file is written, each of its items is hashed as the writer writes it
  (``prehash``: ``torch.save`` of the tensor as DCP's loader hands it over, ``as_written``,
  into a hashing stream with the writer's CRC setting; the bytes are deterministic and do
  not depend on where in the file they go, see tests);
- the file is reused only when every item's key (name, chunk offsets and sizes, dtype) and
  digest equal those of the base (a stable file of an earlier committed save, which the save
  layer picks), in order;
- the base is linked (``link(2)``) into the new step's directory, with its sidecar; the
  linked name must be the inode that was remembered at the commit, of the remembered size and
  modification time, or the links are removed and the file is written.

Invariants:
- a reused file's bytes are the ones the base's writer hashed: its records (digests) and
  DCP write results are carried over unchanged, so the new step's manifest and ``.metadata``
  describe it exactly, and the step stays self-contained (a plain ``dcp.load`` reads it);
- nothing here writes into a committed file: a link adds a name, and the writer opens every
  file it writes with ``O_EXCL`` (dckpt.storage.direct_file), so a shared inode is never
  truncated;
- any failure to link (the base deleted by retention or ``gc``, moved to quarantine, a file
  system without hard links) falls back to writing: reuse saves bytes, never a save.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from .digest import format_digest, new_hasher
from .item_digests import items_name
from .records import FileRecord

__all__ = [
    "StableBase", "StableFile", "as_written", "item_key", "link_base", "prehash", "stable_name",
]  # fmt: skip

ItemKey = tuple[Any, ...]


def stable_name(prefix: str) -> str:
    """The stable file of the rank whose DCP file prefix is ``prefix`` (``__3_``)."""
    return f"{prefix}stable.distcp"


def item_key(item: WriteItem) -> ItemKey:
    """What must be equal, besides the bytes, for an item's stored bytes to serve again: its
    name, its chunk (offsets and sizes) and its tensor's dtype and global size."""
    data = item.tensor_data
    chunk = data.chunk if data is not None else None
    props = data.properties if data is not None else None
    return (
        item.index.fqn,
        tuple(item.index.offset or ()),
        item.type.name,
        tuple(chunk.offsets) if chunk is not None else (),
        tuple(chunk.sizes) if chunk is not None else (),
        str(props.dtype) if props is not None else "",
        tuple(data.size) if data is not None else (),
    )


class _HashSink:
    """A write-only stream that only hashes (torch.save's target for ``prehash``)."""

    def __init__(self, algorithm: str) -> None:
        self.hasher = new_hasher(algorithm)
        self.n = 0

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.hasher.update(view)
        self.n += len(view)
        return len(view)

    def flush(self) -> None:
        pass


def as_written(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as DCP's writer serialises it (its ``_SerialCpuLoader``): detached, on the
    CPU, and cloned when its storage holds more than its own bytes (a view), so ``torch.save``
    writes only its bytes and records the CPU as its device."""
    out = tensor.detach().cpu()
    if out.untyped_storage().size() != out.nbytes:
        out = out.clone()
    return out


def prehash(tensor: Any, algorithm: str) -> str:
    """The digest (and length) of the bytes DCP's writer writes for ``tensor``: call it where
    the writer's CRC setting is in force (inside ``HashingWriter.write_data``)."""
    sink = _HashSink(algorithm)
    torch.save(as_written(tensor), sink)  # type: ignore[arg-type]
    return f"{format_digest(algorithm, sink.hasher)}/{sink.n}"


@dataclass(frozen=True)
class StableFile:
    """One save's stable file: as written, or as reused from its base."""

    name: str
    """Its name in the step's directory (``stable_name``)."""
    records: tuple[FileRecord, ...]
    """The data file's record and its sidecar's."""
    results: tuple[WriteResult, ...]
    """DCP's write results for its items (where each item's bytes are in the file)."""
    items: tuple[tuple[ItemKey, str], ...]
    """Each item's key and pre-hash, in the order written."""
    reused: bool = False
    written: tuple[tuple[str, str], ...] = ()
    """Each tensor's name and the digest of the bytes written for it when the file was
    written (dckpt.storage.item_writes): what a save that links the file compares its
    capture with. Empty without the capture check."""

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.records)


@dataclass(frozen=True)
class StableBase:
    """A stable file of an earlier committed save, where it now lives, and the inode, size
    and modification time it had when its step was committed (a linked name must still be
    that file)."""

    file: StableFile
    path: Path
    """The committed data file (its sidecar lies beside it)."""
    inode: tuple[int, int]
    """``(st_dev, st_ino)`` of ``path`` at the commit."""
    size: int
    mtime_ns: int
    """Its ``st_mtime_ns`` then (a link does not change it; a freed inode number handed to a
    file of the same size written later does)."""


def link_base(base: StableBase, directory: Path) -> bool:
    """Link ``base`` and its sidecar into ``directory`` under the same names; True when both
    are there and are the remembered file. False (nothing left behind) on any failure: the
    base was deleted or moved, the file system has no hard links, the name now holds another
    file."""
    made: list[Path] = []
    data = directory / base.file.name
    sidecar_src = base.path.with_name(items_name(base.path.name))
    pairs = [(base.path, data), (sidecar_src, data.with_name(items_name(data.name)))]
    try:
        for src, dst in pairs:
            os.link(src, dst, follow_symlinks=False)
            made.append(dst)
        st = os.lstat(made[0])
        sidecar = next((r for r in base.file.records if r.path == items_name(base.file.name)), None)
        if (
            (st.st_dev, st.st_ino) != base.inode
            or st.st_size != base.size
            or st.st_mtime_ns != base.mtime_ns
            or (sidecar is not None and os.lstat(made[1]).st_size != sidecar.bytes)
        ):
            raise OSError(errno.ESTALE, "the base now holds another file")
        return True
    except OSError:
        for path in made:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return False
