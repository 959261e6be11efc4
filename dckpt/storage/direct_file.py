"""A write-only file that bypasses the page cache (``O_DIRECT``) through a reused aligned buffer.

Why: a buffered write of a checkpoint costs the CPU far more than its bytes suggest. The kernel
allocates a page-cache page for every 4 KiB, copies into it, and later writes it back and
reclaims it; on a VM that hands freed memory back to its host, each new page is also a host
page fault. Measured on the 2-core dev VM for 344 MiB (``bench/README.md`` has the figures):
0.08-0.56 s of CPU buffered (warm or cold pages) against 0.07 s through ``O_DIRECT`` with one
copy into a warm aligned buffer. A background save takes that CPU from the training steps, so
it is most of what a save costs a CPU-bound loop. The page cache also stops filling with
checkpoint pages that push the training's memory out.

How: bytes are copied into a page-aligned bounce buffer; each full buffer is written with
``pwrite`` at an aligned offset. ``sync_tail`` (before an fsync, and on close) writes the
partial last block padded to the alignment and truncates the file to its true length; later
writes continue from the same block, so it may be called at any point.

Invariants:
- the file's bytes are exactly the bytes given to ``write``, in order; ``tell`` counts them;
- a file system that refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some network file systems,
  FUSE) gets a buffered
  file instead (``open_for_write``); one that accepts the flag but refuses an aligned write
  drops the flag on that descriptor and continues buffered;
- bounce buffers are pooled per process and reused across files and saves (warm pages), at
  most one per concurrently open file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import threading
from typing import Any, BinaryIO

from ..owned import create_new
from .digest import Hasher

__all__ = ["ALIGN", "BOUNCE_BYTES", "DirectFile", "open_for_write"]

ALIGN = 4096
"""File offset, length and memory alignment of every direct write (covers 512 B sectors)."""
BOUNCE_BYTES = 4 << 20
COPY_PIECE = 1 << 20
"""A memoryview copy holds the GIL: copy in pieces so the training thread gets it in between."""

_pool: list[mmap.mmap] = []
_pool_lock = threading.Lock()


def _take_buffer() -> mmap.mmap:
    with _pool_lock:
        if _pool:
            return _pool.pop()
    return mmap.mmap(-1, BOUNCE_BYTES)  # anonymous mappings are page-aligned


def _give_back(buffer: mmap.mmap) -> None:
    with _pool_lock:
        _pool.append(buffer)


class DirectFile(io.RawIOBase):
    """See the module docstring. Create with ``open_for_write``."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self._buffer: mmap.mmap | None = _take_buffer()
        self._view = memoryview(self._buffer)
        self._filled = 0  # bytes of the current block run held in the buffer
        self._base = 0  # aligned file offset where the buffer's first byte goes
        self._tail_synced = True
        self.direct = True
        self.hasher: Hasher | None = None
        """Fed each piece from the bounce buffer right after the copy, while it is in cache:
        one pass over memory fewer than hashing the source."""
        self.also: Any = None
        """A second hasher the pieces go through while set (an item's own digest,
        dckpt.storage.item_writes): the bytes in the bounce buffer, as they go to disk."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        done = 0
        while done < len(data):
            room = BOUNCE_BYTES - self._filled
            n = min(room, COPY_PIECE, len(data) - done)
            piece = self._view[self._filled : self._filled + n]
            piece[:] = data[done : done + n]
            if self.hasher is not None:
                self.hasher.update(piece)
            if self.also is not None:
                self.also.update(piece)
            self._filled += n
            done += n
            if self._filled == BOUNCE_BYTES:
                self._pwrite(self._view, self._base)
                self._base += BOUNCE_BYTES
                self._filled = 0
        if done:
            self._tail_synced = False
        return done

    def tell(self) -> int:
        return self._base + self._filled

    def sync_tail(self) -> None:
        """Put the partial last block on the file and cut the file to its true length."""
        if self._tail_synced:
            return
        if self._filled:
            padded = -(-self._filled // ALIGN) * ALIGN
            self._pwrite(self._view[:padded], self._base)
        os.ftruncate(self._fd, self._base + self._filled)
        self._tail_synced = True

    def fileno(self) -> int:
        self.sync_tail()  # whoever fsyncs the descriptor must find every byte in the file
        return self._fd

    def flush(self) -> None:
        pass  # torch.save flushes after every tensor; the tail is written by sync_tail

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.sync_tail()
        finally:
            os.close(self._fd)
            self._view.release()
            if self._buffer is not None:
                _give_back(self._buffer)
                self._buffer = None
            super().close()

    def _pwrite(self, data: memoryview, offset: int) -> None:
        try:
            written = os.pwrite(self._fd, data, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            # The file system took O_DIRECT at open but not this write: go on buffered.
            flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            self.direct = False
            written = os.pwrite(self._fd, data, offset)
        if written != len(data):
            raise OSError(
                errno.ENOSPC, f"short write: {written} of {len(data)} bytes at offset {offset}"
            )


def open_for_write(path: str | os.PathLike[str], *, direct: bool) -> BinaryIO:
    """A new file for writing: direct where the file system allows it, else buffered in 1 MiB
    batches (each small torch.save chunk would be a syscall). FileExistsError if the name is
    taken: a name may be a link to a committed step's file (dckpt.storage.stable_file), and
    truncating it would change that step's bytes."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            fd = create_new(path, flags=os.O_WRONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # Some file systems (ramfs, FUSE, tmpfs before Linux 6.6) create the file, then
            # refuse O_DIRECT: O_EXCL proves that file is the one just made, so it goes
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            return DirectFile(fd)  # type: ignore[return-value]
    return os.fdopen(create_new(path), "wb", buffering=1 << 20)
