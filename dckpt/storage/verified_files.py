"""Opening checkpoint files safely and proving their bytes match the manifest (no torch).

``open_regular`` is the one way a checkpoint file is opened for reading, by every reader (a
load, ``dckpt verify``, the coverage pass of a resume, the memory tier's mappings): no
symlink is followed (``O_NOFOLLOW``), no FIFO is waited on (``O_NONBLOCK``, then a
regular-file check on the descriptor), and the size must match before anything is read or
mapped. ``open_verified`` adds the digest: every byte hashed through one reused buffer.
``read_verified`` is for small files whose every byte is then used (``.metadata``): it
hashes exactly the bytes it returns.
An I/O failure is a ``StorageError`` (retry), never an integrity failure.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Callable

from ..errors import IntegrityError, StorageError, read_failed
from ..faults import fault_point, process_rank
from ..phases import Phase
from .digest import READ_CHUNK, format_digest, hash_stream, new_hasher, parse_digest
from .item_digests import ItemDigests
from .records import FileRecord

__all__ = [
    "NotRegularFileError",
    "VerifiedFile",
    "open_checked",
    "open_regular",
    "open_verified",
    "read_verified",
    "read_verified_digest",
    "unreadable",
    "verify_span",
]


def unreadable(path: str, exc: OSError, doing: str = "read") -> StorageError:
    """The storage failed to serve ``path`` (EIO, ESTALE, EACCES ...): a StorageError that
    names the file and what failed, never damage (nothing says the bytes are bad)."""
    return read_failed(
        f"cannot {doing} {path}: {os.strerror(exc.errno) if exc.errno else exc}: the storage "
        "failed to serve it (not damage: nothing was quarantined); retry once the storage is "
        "healthy",
        path,
        exc,
    )


class NotRegularFileError(ValueError):
    """The path opened is not a regular file of the recorded size; ``actual`` says what it is
    (``"N bytes"``, or ``"not a regular file"``)."""

    def __init__(self, st: os.stat_result, size: int) -> None:
        self.regular = stat.S_ISREG(st.st_mode)
        self.actual = f"{st.st_size} bytes" if self.regular else "not a regular file"
        super().__init__(f"{self.actual} where {size} bytes were recorded")


def open_regular(path: str, size: int) -> tuple[int, os.stat_result]:
    """``path`` opened read-only, never through a symlink (``OSError`` ELOOP) nor waiting on a
    FIFO; its ``fstat`` must be a regular file of ``size`` bytes (``NotRegularFileError``
    otherwise, the descriptor closed). Returns the descriptor (the caller's to close) and the
    ``fstat``. Other ``OSError`` (missing file, the storage failing) as raised."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise NotRegularFileError(st, size)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class VerifiedFile(io.FileIO):
    """A checkpoint file opened by ``open_verified``; ``digest`` is what its bytes hashed to
    (equal to the manifest's record, or it would not have been returned)."""

    digest: str = ""


def _open_checked(path: str, record: FileRecord) -> tuple[VerifiedFile, str]:
    """Open ``path`` for reading without following a symlink; require a regular file of the
    recorded size (checked before anything is allocated). Returns the file and the algorithm."""
    try:
        algorithm, _ = parse_digest(record.digest)
    except ValueError as exc:
        raise IntegrityError(path, record.digest, "unusable digest", str(exc)) from None
    try:
        fd, _ = open_regular(path, record.bytes)
    except FileNotFoundError:
        raise IntegrityError(path, record.digest, "missing file", detail="file missing") from None
    except NotRegularFileError as exc:
        if not exc.regular:
            raise IntegrityError(
                path, "a regular file", "not a regular file", "wrong file type"
            ) from None
        raise IntegrityError(
            path, f"{record.bytes} bytes", exc.actual, detail="size mismatch"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink: the layout was tampered with
            raise IntegrityError(path, "a regular file", "a symlink", "wrong file type") from exc
        raise unreadable(path, exc, "open") from exc
    return VerifiedFile(fd, "rb", closefd=True), algorithm


def open_checked(path: str, record: FileRecord) -> VerifiedFile:
    """``path`` opened as ``open_verified`` opens it (no symlink, a regular file of the
    recorded size), nothing hashed yet: for a reader that proves the spans it reads
    (``verify_span``)."""
    return _open_checked(path, record)[0]


def verify_span(f: io.FileIO, path: str, digests: ItemDigests, offset: int, length: int) -> int:
    """Hash the segments of ``digests`` that hold bytes ``[offset, offset + length)`` of the
    open file ``f``; IntegrityError naming the file and the bytes when one does not match (or
    the range is past the segments, or a segment has no digest: the caller hashes the whole
    file for those, ``ItemDigests.covering``). Returns the bytes hashed."""
    try:
        spans = digests.covering(offset, length)
    except ValueError as exc:
        past = IntegrityError(path, "an item inside its file", str(exc), "item past its file")
        raise past from None
    if spans is None:
        raise IntegrityError(path, "an item digest", "none", "item without a digest")
    hashed = 0
    buf = bytearray(min(READ_CHUNK, max((n for _, n, _ in spans), default=0)))
    for start, size, expected in spans:
        algorithm = expected.split(":", 1)[0]
        hasher = new_hasher(algorithm)
        done = 0
        while done < size:
            want = min(len(buf), size - done)
            try:
                fault_point(Phase.READ_SHARD, process_rank(), path=path)  # as the EIO would be
                got = os.preadv(f.fileno(), [memoryview(buf)[:want]], start + done)
            except OSError as exc:
                raise unreadable(path, exc) from exc
            if got <= 0:
                raise IntegrityError(
                    path, f"bytes {start}-{start + size}", f"{start + done} bytes", "size mismatch"
                )
            hasher.update(memoryview(buf)[:got])
            done += got
        actual = format_digest(algorithm, hasher)
        if actual != expected:
            raise IntegrityError(
                path,
                expected,
                actual,
                detail=f"digest mismatch in bytes {start}-{start + size} (an item this rank read)",
            )
        hashed += size
    return hashed


def open_verified(
    path: str, record: FileRecord, progress: Callable[[int], None] | None = None
) -> VerifiedFile:
    """Open ``path`` (no symlink, a regular file of the recorded size), hash all of it, and
    return it open and rewound, only if it matches: callers read the verified file through
    this same descriptor, mostly from the page cache the hashing pass just filled."""
    f, algorithm = _open_checked(path, record)
    try:
        try:
            fault_point(Phase.READ_SHARD, process_rank(), path=path)  # as the EIO would be
            actual, size = hash_stream(f, algorithm, progress)
        except OSError as exc:
            raise unreadable(path, exc) from exc
        if size != record.bytes:  # it changed size since the fstat check
            raise IntegrityError(
                path, f"{record.bytes} bytes", f"{size} bytes", detail="size mismatch"
            )
        if actual != record.digest:
            raise IntegrityError(path, record.digest, actual)
        f.digest = actual
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f


def read_verified(path: str, record: FileRecord) -> bytes:
    """Read ``path`` whole into memory and hash exactly those bytes (for small files, such as
    ``.metadata``, whose every byte is then used: nothing can change between check and use)."""
    return read_verified_digest(path, record)[0]


def read_verified_digest(path: str, record: FileRecord) -> tuple[bytes, str]:
    """``read_verified``, and the digest the bytes hashed to."""
    f, algorithm = _open_checked(path, record)
    with f:
        parts: list[bytes] = []
        got = 0
        while got <= record.bytes:  # one read past the end proves there is no more
            try:
                chunk = f.read(READ_CHUNK)
            except OSError as exc:
                raise unreadable(path, exc) from exc
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
    data = b"".join(parts)
    if len(data) != record.bytes:
        raise IntegrityError(path, f"{record.bytes} bytes", f"{len(data)} bytes", "size mismatch")
    hasher = new_hasher(algorithm)
    hasher.update(data)
    actual = format_digest(algorithm, hasher)
    if actual != record.digest:
        raise IntegrityError(path, record.digest, actual)
    return data, actual
