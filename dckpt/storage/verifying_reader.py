"""A DCP StorageReader that verifies every file against its manifest digest before use.

Role: the bottom of the load path. Each file the load plan needs is read once, front to back:
the byte ranges DCP asked for are kept, the rest is only hashed, and the digest is computed from
the very bytes that are then handed to DCP; a mismatch raises ``IntegrityError`` naming the file
and both digests before any tensor is filled from it.

Invariants:
- no file is opened unless the manifest lists it (a path in DCP metadata that the manifest does
  not list is an integrity failure), and no symlink is followed (``O_NOFOLLOW``);
- a file whose size differs from the manifest is rejected before its bytes are allocated;
- ``.metadata`` is verified, then unpickled with an allow-list (storage.safe_unpickle);
- non-tensor values are loaded with ``torch.load(weights_only=True)`` (``SafeLoadPlanner``).

Memory: the ranges this rank needs from one file are held while they are loaded, then
released; peak extra memory is what this rank reads from its largest file. Copies: one read
into a bytes object (hashed in place), then DCP's own deserialisation and copy into the target,
the same count as DCP's unverified reader.
"""

from __future__ import annotations

import errno
import io
import itertools
import os
import stat
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..errors import IntegrityError, ManifestError, StateMismatchError, StorageError
from .digest import READ_CHUNK, format_digest, new_hasher, parse_digest
from .records import FileRecord
from .safe_unpickle import load_dcp_metadata

__all__ = ["SafeLoadPlanner", "VerifyingReader", "read_spans_verified", "read_verified"]

METADATA_FILE = ".metadata"


def _open_checked(path: str, record: FileRecord) -> tuple[io.FileIO, str]:
    """Open ``path`` for reading without following a symlink; require a regular file of the
    recorded size (checked before anything is allocated). Returns the file and the algorithm."""
    try:
        algorithm, _ = parse_digest(record.digest)
    except ValueError as exc:
        raise IntegrityError(path, record.digest, "unusable digest", str(exc)) from None
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise IntegrityError(path, record.digest, "missing file", detail="file missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink: the layout was tampered with
            raise IntegrityError(path, "a regular file", "a symlink", "wrong file type") from exc
        raise StorageError(f"cannot open {path}: {exc}; the storage failed, retry") from exc
    f = io.FileIO(fd, "rb", closefd=True)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        f.close()
        raise IntegrityError(path, "a regular file", "not a regular file", "wrong file type")
    if st.st_size != record.bytes:
        f.close()
        raise IntegrityError(
            path, f"{record.bytes} bytes", f"{st.st_size} bytes", detail="size mismatch"
        )
    return f, algorithm


def _read_exactly(f: io.FileIO, n: int, path: str, record: FileRecord) -> bytes:
    data = f.read(n) or b""
    if len(data) < n:  # a regular file returns short reads only at EOF or past ~2 GiB
        parts = [data]
        got = len(data)
        while got < n:
            more = f.read(n - got)
            if not more:
                raise IntegrityError(path, f"{record.bytes} bytes", "fewer bytes", "truncated")
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def read_spans_verified(
    path: str, record: FileRecord, spans: list[tuple[int, int]]
) -> dict[tuple[int, int], bytes]:
    """Read the byte ranges ``(offset, length)`` of ``path``, hashing the whole file as it streams.

    Bytes between and after the spans are read and hashed but not kept, so memory holds only
    what the caller asked for, and the digest covers every byte of the file. Raises
    IntegrityError (and returns nothing) unless the file matches its record.
    """
    wanted = sorted(set(spans))
    for off, n in wanted:
        if off < 0 or n < 0 or off + n > record.bytes:
            raise IntegrityError(
                path, f"{record.bytes} bytes", f"a range at {off}+{n}", "bad range"
            )
    if any(a[0] + a[1] > b[0] for a, b in itertools.pairwise(wanted)):
        whole = bytes(read_verified(path, record))  # overlapping ranges: keep the whole file
        return {(off, n): whole[off : off + n] for off, n in wanted}
    f, algorithm = _open_checked(path, record)
    hasher = new_hasher(algorithm)
    out: dict[tuple[int, int], bytes] = {}
    with f:
        pos = 0
        for off, n in [*wanted, (record.bytes, 0)]:
            while pos < off:  # a gap: hash it, keep nothing
                chunk = _read_exactly(f, min(READ_CHUNK, off - pos), path, record)
                hasher.update(chunk)
                pos += len(chunk)
            if n:
                data = _read_exactly(f, n, path, record)
                hasher.update(data)
                out[(off, n)] = data
                pos += n
    actual = format_digest(algorithm, hasher)
    if actual != record.digest:
        raise IntegrityError(path, record.digest, actual)
    return out


def read_verified(path: str, record: FileRecord) -> bytearray:
    """Read ``path`` whole, hashing as it streams in; raise IntegrityError unless it matches."""
    f, algorithm = _open_checked(path, record)
    with f:
        buf = bytearray(record.bytes)
        view = memoryview(buf)
        hasher = new_hasher(algorithm)
        pos = 0
        while pos < record.bytes:
            n = f.readinto(view[pos : pos + READ_CHUNK])
            if not n:
                raise IntegrityError(path, f"{record.bytes} bytes", f"{pos} bytes", "truncated")
            hasher.update(view[pos : pos + n])
            pos += n
    actual = format_digest(algorithm, hasher)
    if actual != record.digest:
        raise IntegrityError(path, record.digest, actual)
    return buf


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values never unpickle arbitrary objects."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DefaultLoadPlanner uses weights_only=False here, which would run any pickled code.
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class VerifyingReader(FileSystemReader):
    """FileSystemReader that reads only manifest-listed files, each verified; see module doc."""

    def __init__(self, path: str | os.PathLike[str], expected: Mapping[str, FileRecord]) -> None:
        super().__init__(path)
        self.expected = dict(expected)
        self.verified: dict[str, str] = {}
        """Files this reader verified, relative path → digest (for cross-rank checks)."""
        self._metadata: Metadata | None = None

    def load_metadata(self) -> Metadata:
        """Verify and parse ``.metadata`` now, so its errors surface before DCP runs.

        DCP catches exceptions from ``read_metadata`` and retries other file names; calling
        this first keeps an integrity failure an IntegrityError that names the file.
        """
        if self._metadata is None:
            data = self._read(METADATA_FILE)
            metadata = load_dcp_metadata(bytes(data), os.path.join(str(self.path), METADATA_FILE))
            if not isinstance(metadata, Metadata):
                raise ManifestError(f"{self.path}/{METADATA_FILE} does not hold DCP metadata")
            self._metadata = metadata
        return self._metadata

    def _record(self, relative_path: str) -> FileRecord:
        record = self.expected.get(relative_path)
        # DCP writes a flat directory: a separator or dot-name could only lead elsewhere.
        if record is None or "/" in relative_path or relative_path in ("", ".", ".."):
            raise IntegrityError(
                os.path.join(str(self.path), relative_path),
                "a file listed in manifest.json",
                "a file the manifest does not list",
                detail="unlisted file referenced by DCP metadata",
            )
        return record

    def _read(self, relative_path: str) -> bytearray:
        record = self._record(relative_path)
        data = read_verified(os.path.join(str(self.path), relative_path), record)
        self.verified[relative_path] = record.digest
        return data

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.load_metadata()
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative_path, items in per_file.items():
            record = self._record(relative_path)
            spans = [self._span(item) for item in items]
            data = read_spans_verified(os.path.join(str(self.path), relative_path), record, spans)
            self.verified[relative_path] = record.digest
            # Only now, with the whole file verified, is any tensor filled from it.
            for item, span in zip(items, spans, strict=True):
                self._load_item(data[span], item, planner)
            del data  # release this file's bytes before reading the next
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _span(self, item: ReadItem) -> tuple[int, int]:
        info = self.storage_data[item.storage_index]
        return (info.offset, info.length)

    def _load_item(self, data: bytes, item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        # BytesIO over a bytes object shares its buffer: no copy until someone writes to it.
        source = self.transforms.transform_load_stream(
            item, info.transform_descriptors or (), cast(Any, io.BytesIO(data))
        )
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(source.read(-1)))
            return
        seekable: Any = source if source.seekable() else io.BytesIO(source.read(-1))
        tensor = cast(torch.Tensor, torch.load(seekable, map_location="cpu", weights_only=True))
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size() or target.dtype != tensor.dtype:
            raise StateMismatchError(
                f"tensor {item.dest_index.fqn}: the checkpoint holds {tuple(tensor.size())} "
                f"{tensor.dtype}, the object being restored has {tuple(target.size())} "
                f"{target.dtype}. The model or optimizer was built differently from the run "
                "that saved this checkpoint (check the config); the checkpoint is not damaged."
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)
