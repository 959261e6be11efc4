"""A DCP StorageWriter that hashes every byte it writes, as it writes it.

Role: the bottom of the save path. DCP's file-system writer decides what goes in which file;
this layer wraps each output stream so the digest (xxh3-128 by default) is computed from the
same buffers that go to the file: no second read, no window in which the file could change
between writing and hashing.

Invariants:
- every file this writer creates under its directory has exactly one FileRecord, keyed by its
  final name (DCP's ``.metadata.tmp`` → ``.metadata`` rename moves the record with it);
- each data file's items are hashed in the same pass, one segment between two of DCP's
  ``tell()`` calls, and written beside it as ``<file>.items`` (``item_digests``), a file with
  its own record: a reader of a few items of the file checks those alone;
- a record exists only for a stream that was closed without error;
- it never overwrites a DCP checkpoint (``overwrite=False``): dckpt writes into a fresh tmp dir;
- with a ``tee`` (an object store's upload), every byte also goes to that file's sink in the
  same order, hashed once for both; the sink is completed when the file closes cleanly and
  aborted otherwise;
- files are written with ``O_DIRECT`` where the file system allows it (``direct_file``): no
  page-cache copy, which was most of a background save's CPU;
- ``torch.save``'s zip CRC-32 is off while it writes: the digest covers every byte the CRC would,
  and ``torch.load`` never checks the CRC, so computing it was half of the writer's CPU (see
  ``write_data``).

Call order (DCP drives it): ``set_up_storage_writer`` → ``prepare_local_plan`` →
``prepare_global_plan`` (coordinator) → ``write_data`` (every rank) → ``finish`` (coordinator,
writes ``.metadata``; with ``slim_return``, then empties the copy DCP broadcasts to every
rank). After ``dcp.save`` returns, ``records()`` on each rank holds the files that rank wrote;
the coordinator (dckpt.save.coordinator) gathers them.
"""

from __future__ import annotations

import io
import os
import queue
import threading
import time
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.utils.serialization import config as serialization_config

from ..phases import Phase, Trace
from .digest import Hasher, format_digest, new_hasher
from .direct_file import DirectFile, open_for_write
from .item_digests import SUFFIX, ItemHasher, items_name
from .item_writes import ItemWrites
from .records import METADATA_FILE, FileRecord
from .sink import Sink, Tee
from .stable_file import StableBase, StableFile, item_key, link_base, prehash, stable_name

__all__ = ["HashingFileSystem", "HashingWriter", "Sink", "Tee"]

_SPLIT = getattr(_dcp_fs, "_split_by_size_and_type", None)
"""DCP's own split of a rank's items into its files (private: a torch without it saves
every item to DCP's files, ``HashingWriter._write_split``)."""


class _HashingStream(io.RawIOBase):
    """A write-only file whose every written byte also feeds a hasher (and a sink, if any),
    and the segment hasher of its items (cut at each ``tell()``: DCP asks where it is before
    and after each item it writes)."""

    def __init__(
        self,
        raw: BinaryIO,
        hasher: Hasher,
        sink: Sink | None = None,
        items: ItemHasher | None = None,
        writes: ItemWrites | None = None,
    ) -> None:
        super().__init__()
        self._raw = raw
        self._sink = sink
        self._hasher: Hasher | None = hasher
        self._direct = isinstance(raw, DirectFile)
        if isinstance(raw, DirectFile):  # it hashes each piece as it copies it
            raw.hasher, self._hasher = hasher, None
        self.items = items
        self._writes = writes
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        item = self._writes.match(view) if self._writes is not None else None
        if item is None:
            return self._write(view)
        assert self._writes is not None
        also = item.start()  # a tensor item's storage: its own digest, as the bytes go out
        if self._direct:  # piece by piece, from the bounce buffer (None: a ``g`` digest)
            self._raw.also = also  # type: ignore[attr-defined]
        elif also is not None:
            also.update(view)
        try:
            written = self._write(view)
        finally:
            if self._direct:
                self._raw.also = None  # type: ignore[attr-defined]
        self._writes.finished(item)
        return written

    def _write(self, view: memoryview) -> int:
        if self._hasher is not None:
            self._hasher.update(view)
        if self.items is not None:
            self.items.update(view)
        written = self._raw.write(view)
        # BufferedWriter writes everything or raises; a short write here would desync the digest.
        if written != len(view):
            raise OSError(f"short write: {written} of {len(view)} bytes")
        if self._sink is not None:
            self._sink.write(view)
        self.nbytes += written
        return written

    def tell(self) -> int:
        if self.items is not None:
            self.items.cut()
        return self._raw.tell()

    def fileno(self) -> int:
        # DCP fsyncs fileno() before close: the buffered tail must be in the kernel first.
        self._raw.flush()
        return self._raw.fileno()

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            try:
                self._raw.close()
            finally:
                super().close()


class HashingFileSystem(FileSystem):
    """DCP's local FileSystem, with a FileRecord for each file written below ``base``."""

    def __init__(
        self,
        base: str | os.PathLike[str],
        algorithm: str,
        rank: int,
        *,
        direct: bool = True,
        tee: Tee | None = None,
        writes: ItemWrites | None = None,
    ) -> None:
        super().__init__()
        self.base = Path(base)
        self.tee = tee
        self.writes = writes
        """Where each tensor item's written bytes are digested (None: not digested)."""
        self.algorithm = algorithm
        self.rank = rank
        self.direct = direct
        self._lock = threading.Lock()
        self._records: dict[str, FileRecord] = {}
        new_hasher(algorithm)  # fail at construction, not mid-save, on a bad name

    def _key(self, path: str | os.PathLike[str]) -> str:
        return Path(path).relative_to(self.base).as_posix()

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        hasher = new_hasher(self.algorithm)
        # DCP writes ``.metadata`` as ``.metadata.tmp`` and renames it: the tee gets the
        # final name (nothing is committed before the manifest, so no rename is needed there).
        name = self._key(path).removesuffix(".tmp")
        sink = self.tee(name) if self.tee else None
        # every rank reads ``.metadata`` (and a sidecar) whole: only data files get item digests
        data_file = name != METADATA_FILE and not name.endswith(SUFFIX)
        items = ItemHasher(self.algorithm) if data_file else None
        raw = open_for_write(path, direct=self.direct)
        writes = self.writes if data_file else None
        stream = _HashingStream(raw, hasher, sink, items, writes)
        try:
            try:
                yield stream
            finally:
                stream.close()
        except BaseException:
            if sink is not None:  # the write or the local close failed: no object either
                sink.abort()
            raise
        if sink is not None:
            sink.close()  # the object is complete (raises, failing the write, if not)
        record = FileRecord(
            path=self._key(path),
            bytes=stream.nbytes,
            digest=format_digest(self.algorithm, hasher),
            rank=self.rank,
        )
        with self._lock:
            self._records[record.path] = record
        if items is not None:
            self._write_sidecar(Path(path), items.encode(record.path))

    def _write_sidecar(self, data_path: Path, data: bytes) -> None:
        """``<file>.items`` beside a data file: written, hashed, teed and recorded as any file
        this writer makes (it gets no sidecar of its own), and fsynced."""
        with self.create_stream(data_path.with_name(items_name(data_path.name)), "wb") as stream:
            stream.write(data)
            os.fsync(stream.fileno())

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            record = self._records.pop(self._key(path), None)
            if record is not None:
                self._records[self._key(new_path)] = FileRecord(
                    path=self._key(new_path),
                    bytes=record.bytes,
                    digest=record.digest,
                    rank=record.rank,
                )

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        super().rm_file(path)
        with self._lock:
            self._records.pop(self._key(path), None)

    def adopt(self, records: tuple[FileRecord, ...]) -> None:
        """Files put in place by a link, not written: their records are their writer's."""
        with self._lock:
            for rec in records:
                self._records[rec.path] = rec

    def records(self) -> list[FileRecord]:
        with self._lock:
            return sorted(self._records.values())

    def clear(self) -> None:
        with self._lock:
            self._records.clear()


class HashingWriter(FileSystemWriter):
    """FileSystemWriter whose files are hashed while written; see the module docstring."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        algorithm: str = "xxh3_128",
        rank: int = 0,
        thread_count: int = 1,
        sync_files: bool = True,
        direct: bool = True,
        trace: Trace | None = None,
        tee: Tee | None = None,
        slim_return: bool = False,
        stable_keys: frozenset[str] = frozenset(),
        base: StableBase | None = None,
        writes: ItemWrites | None = None,
    ) -> None:
        # per_thread_copy_ahead=0: DCP's serial loader. The overlapping one (chosen whenever
        # CUDA is available) synchronizes the writer thread's stream every 10 MB, which on the
        # default stream waits for the training kernels; dckpt hands DCP host tensors only.
        super().__init__(
            path,
            single_file_per_rank=True,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=0,
            overwrite=False,
        )
        self.fs: HashingFileSystem = HashingFileSystem(
            path, algorithm, rank, direct=direct, tee=tee, writes=writes
        )
        self._trace = trace
        self._slim_return = slim_return
        self._stable_keys = stable_keys
        self._base = base
        self.stable: StableFile | None = None
        """This save's stable file (None: no item was stable), once ``write_data`` returned."""
        self.prehash_s = 0.0

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        if self._slim_return:
            # DCP broadcasts the object ``finish`` was given to every rank, as dcp.save's
            # return value: under FSDP every rank's chunk of every tensor, a payload that
            # grows with the world. With ``slim_return`` the caller reads only the committed
            # ``.metadata`` and hands this writer a copy of its own: emptied once written.
            metadata.state_dict_metadata = {}
            metadata.storage_data = {}
            metadata.planner_data = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # DCP serialises each tensor with torch.save, which computes a zip CRC-32 of its bytes
        # (about 1.9 GB/s: 0.18 s of a 0.18 + 0.17 s write per 335 MB, measured on the dev box)
        # that torch.load never checks; our digest is the check. The setting is process-wide,
        # so a torch.save elsewhere in the process during the write skips its CRC too (the
        # file loads the same; only zip tools' CRC test would notice).
        # (the config module is installed at import time: mypy cannot see its patch())
        with serialization_config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
            stable = [
                wi for wi in plan.items
                if wi.index.fqn in self._stable_keys and wi.type != WriteItemType.BYTE_IO
            ]  # fmt: skip
            if stable and _SPLIT is not None and hasattr(self, "_write_data"):
                result = self._write_split(plan, planner, stable, _SPLIT)
            else:
                result = super().write_data(plan, planner)
        if self._trace is not None:  # this rank's shards are on disk; DCP's metadata is not yet
            self._trace.at(Phase.WRITE_SHARDS)
            self._trace.passed(Phase.WRITE_SHARDS)
        return result

    def _write_split(
        self, plan: SavePlan, planner: SavePlanner, stable: list[Any], split: Any
    ) -> Future[list[WriteResult]]:
        """DCP's ``write_data`` with the stable items in a file of their own
        (dckpt.storage.stable_file), linked from the base when every item hashes the same.
        The other items go to the files DCP would make of them, under the same names. It
        builds DCP's file queue itself, with two private DCP functions (``split``, its
        ``_split_by_size_and_type``, and ``_write_data``): on a torch without them, every
        item goes to DCP's own files and nothing is reused (``_SPLIT``)."""
        prefix: str = plan.storage_data.prefix
        name = stable_name(prefix)
        ids = {id(wi) for wi in stable}
        volatile = [wi for wi in plan.items if id(wi) not in ids]
        t0 = time.perf_counter()
        items = tuple(
            (item_key(wi), prehash(planner.resolve_data(wi), self.fs.algorithm)) for wi in stable
        )
        self.prehash_s = time.perf_counter() - t0
        files: queue.Queue[tuple[str, str, list[Any]]] = queue.Queue()
        for i, bucket in enumerate(split(self.thread_count, volatile)):
            file = f"{prefix}{i}.distcp"  # DCP's own name for its i-th file
            files.put((str(self.fs.concat_path(self.path, file)), file, bucket))
        base = self._base
        writes = self.fs.writes
        fqns = {wi.index.fqn for wi in stable}
        if (
            base is not None
            and base.file.name == name
            and base.file.items == items
            and (writes is None or writes.comparable(dict(base.file.written), fqns))
            and link_base(base, Path(self.path))
        ):
            self.fs.adopt(base.file.records)
            if writes is not None:  # the bytes linked are the ones that save wrote
                writes.adopt(dict(base.file.written))
            self.stable = StableFile(
                name, base.file.records, base.file.results, items, True, base.file.written
            )
            written = self._write_data(planner, files).wait()
            return _done([*written, *base.file.results])
        files.put((str(self.fs.concat_path(self.path, name)), name, stable))
        written = self._write_data(planner, files).wait()
        mine = {r.path: r for r in self.fs.records()}
        wrote = writes.written() if writes is not None else {}
        self.stable = StableFile(
            name,
            tuple(mine[p] for p in (name, items_name(name)) if p in mine),
            tuple(r for r in written if r.storage_data.relative_path == name),
            items,
            written=tuple(sorted((k, d) for k, d in wrote.items() if k in fqns)),
        )
        return _done(written)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self.fs = HashingFileSystem(
                checkpoint_id, self.fs.algorithm, self.fs.rank, direct=self.fs.direct,
                tee=self.fs.tee, writes=self.fs.writes,
            )  # fmt: skip
        self.fs.clear()

    def records(self) -> list[FileRecord]:
        """The files this rank wrote in the last save, with their digests."""
        return self.fs.records()


def _done(results: list[WriteResult]) -> Future[list[WriteResult]]:
    fut: Future[list[WriteResult]] = Future()
    fut.set_result(results)
    return fut
