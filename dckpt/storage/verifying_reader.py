"""A DCP StorageReader that verifies every file against its manifest digest before use.

Role: the bottom of the load path. Each file the load plan needs whole is read once
(storage.one_pass): in order, several reads in flight, hashed as it arrives, large tensors
read straight into the state; its values are committed only once its digest matched the
manifest. A mismatch raises ``IntegrityError`` naming the file and both digests; the tensors
it filled on the way hold its bytes until the fallback loads over them (one_pass says why
that is safe).

Invariants:
- no file is opened unless the manifest lists it (a path in DCP metadata that the manifest does
  not list is an integrity failure), and no symlink is followed (``O_NOFOLLOW``);
- a file whose size differs from the manifest is rejected before anything is read;
- ``.metadata`` is read into memory and exactly those bytes are hashed and then unpickled,
  with an allow-list (storage.safe_unpickle), then checked against the manifest's files
  (``check_metadata``) before any tensor is allocated from it; given the manifest's
  ``versions``, metadata another torch release wrote that this one cannot read or that fails
  those checks is ``IncompatibleCheckpointError`` (storage.safe_unpickle), not damage;
- non-tensor values are loaded with ``torch.load(weights_only=True)`` (``SafeLoadPlanner``);
- a tensor item whose bytes are proven but do not load as the tensor the metadata records
  for its chunk (a weights-only refusal, a storage larger than the item, no tensor, another
  shape or dtype: nothing a save of a tensor writes) is ``UnloadableItemError`` naming the
  step, the file, the item and what failed: damage, quarantined by a resume on every rank
  alike (DCP hands every rank every rank's failure). Not damage, raised as they are: an
  allocation this host cannot make, a step another torch release wrote
  (``IncompatibleCheckpointError``), and a value that ``weights_only`` refuses (dckpt's own
  save can seal one: a numpy scalar in a ``state_dict``);
- an I/O error is a ``StorageError`` (retry), never an integrity failure.

Given ``owned`` (a resume: the files of this rank's share), a file it does not own that has
item digests (``item_digests``) is not hashed whole: each item this rank reads is, segment by
segment, before any of its bytes is used; the file's owner hashes it whole.

Cost: none beyond the read itself for a same-layout load (the hash runs beside the reads);
an item another rank owns is read with its segments, one extra pass over those bytes.
Committed directories are never written into, so an item read the ordinary way (through the
same descriptor, after its bytes streamed past the hash) is the bytes that were hashed.
"""

from __future__ import annotations

import bisect
import heapq
import io
import itertools
import math
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from ..errors import (
    CheckpointError,
    IntegrityError,
    ManifestError,
    StateMismatchError,
    UnloadableItemError,
    read_failed,
)
from ..faults import fault_point, process_rank
from ..phases import Phase
from .item_digests import ItemDigests, items_name, parse_items
from .one_pass import PARTLY_FILLED, LoadTimes, OnePassFile
from .records import METADATA_FILE, FileRecord
from .safe_unpickle import incompatible_torch, load_dcp_metadata, refusal_words, step_words
from .verified_files import (
    open_checked,
    open_verified,
    read_verified,
    read_verified_digest,
    unreadable,
    verify_span,
)

__all__ = ["READ_THREADS", "SafeLoadPlanner", "VerifyingReader", "open_verified", "read_verified"]

READ_THREADS = 4
"""Reads in flight per file at a load: a deep queue is what a disk's bandwidth needs (one
thread reached 0.9-1.5 GB/s on this project's box, four 1.9-2.2 GB/s)."""


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


def check_metadata(metadata: Metadata, expected: Mapping[str, FileRecord], source: str) -> None:
    """Raise ManifestError unless DCP's metadata fits the files the manifest lists.

    Run before anything is allocated from it: its digest only proves that these are the bytes
    that were committed, and whoever can write the directory can re-seal a manifest. Every
    storage entry lies inside a listed file and uses no stream transform (dckpt writes none);
    every tensor's chunks lie inside the tensor, fit the stored bytes they point to, do not
    overlap and add up to the whole tensor (so no part of it is left unfilled); all chunks
    together claim no more bytes than the checkpoint's files hold, so no reader allocates more
    than the checkpoint's size.

    An entry in a file the manifest does not list is left to ``VerifyingReader.listed``, which
    refuses it naming the file (``IntegrityError``): in ``load_metadata`` before anything is
    allocated, and in ``read_data`` before anything is opened.
    """

    def bad(why: str) -> ManifestError:
        return ManifestError(
            f"{source}: {why}; the DCP metadata does not fit the checkpoint's files, which "
            "happens only if it was crafted or written by a broken writer. It was not loaded."
        )

    try:
        storage = metadata.storage_data
        tensors = metadata.state_dict_metadata
        if not isinstance(storage, dict) or not isinstance(tensors, dict):
            raise bad("storage_data or state_dict_metadata is not a mapping")
        for index, info in storage.items():
            if not isinstance(info, _StorageInfo):
                raise bad(f"{index} has no storage record")
            record = expected.get(info.relative_path)
            if record is None:  # never opened: read_data refuses it, naming it, if needed
                continue
            offset, length = info.offset, info.length
            if not (_is_size(offset) and _is_size(length) and offset + length <= record.bytes):
                raise bad(
                    f"{index} spans bytes [{offset}, +{length}) of {info.relative_path}, which "
                    f"holds {record.bytes}"
                )
            if info.transform_descriptors:
                raise bad(f"{index} uses stream transforms {info.transform_descriptors!r}")
        claimed = 0
        for fqn, meta in tensors.items():
            if not isinstance(meta, TensorStorageMetadata):
                continue
            dtype, size = meta.properties.dtype, meta.size
            if not isinstance(dtype, torch.dtype) or not all(_is_size(d) for d in size):
                raise bad(f"tensor {fqn} has an unusable dtype or shape ({dtype!r}, {size!r})")
            numel, covered = math.prod(size), 0
            boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
            for chunk in meta.chunks:
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                if not (
                    len(offsets) == len(sizes) == len(size)
                    and all(
                        _is_size(o) and _is_size(n) for o, n in zip(offsets, sizes, strict=True)
                    )
                    and all(o + n <= d for o, n, d in zip(offsets, sizes, size, strict=True))
                ):
                    raise bad(f"tensor {fqn} of shape {tuple(size)} has a chunk {chunk} outside it")
                boxes.append((offsets, sizes))
                info = storage.get(MetadataIndex(fqn, offsets))
                if info is None:
                    raise bad(f"tensor {fqn}: its chunk at {offsets} has no storage record")
                covered += math.prod(sizes)
                if info.relative_path not in expected:
                    continue  # see above; VerifyingReader.listed refuses it by name
                chunk_bytes = math.prod(sizes) * dtype.itemsize
                if chunk_bytes > info.length:
                    raise bad(
                        f"tensor {fqn}: its chunk at {offsets} needs {chunk_bytes} bytes, "
                        f"stored in {info.length} bytes"
                    )
                claimed += chunk_bytes
            pair = _overlapping(boxes)  # disjoint boxes that add up to the tensor cover it
            if pair is not None:
                raise bad(f"tensor {fqn} has overlapping chunks at {pair[0]} and {pair[1]}")
            if covered != numel:
                raise bad(
                    f"tensor {fqn} of shape {tuple(size)} has {numel} elements, its chunks "
                    f"hold {covered}"
                )
        total = sum(r.bytes for r in expected.values())
        if claimed > total:
            raise bad(f"its tensors claim {claimed} bytes, the checkpoint's files hold {total}")
    except ManifestError:
        raise
    except Exception as exc:  # a field of the wrong type, from a crafted pickle
        raise bad(f"malformed ({type(exc).__name__}: {exc})") from None


def _overlapping(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The offsets of two of ``boxes`` (offsets, sizes) that overlap, or None.

    Two boxes overlap when in every dimension each starts before the other ends (strictly:
    chunks that meet at an edge, as every sharded tensor's do, fit). Comparing every pair
    is quadratic: minutes at the thousands of chunks per tensor that thousands of ranks
    write. Instead one dimension (``axis``) is swept: the boxes sorted by where they start
    in it, each is compared only with the *open* ones, those met before it that have not
    ended where it starts (a heap by end); a pair that overlaps overlaps in ``axis``, so it
    is met. ``axis`` is the dimension with the most distinct starts: a tensor sharded along
    it (FSDP's rows, a column split) has one box open at a time.

    In two dimensions the open boxes (each pair overlapping in ``axis``, none flagged)
    cannot overlap in the other dimension, so sorted by where they start there they also
    end in order: only the last that starts before the new box ends can overlap it (a
    bisection), and a grid of chunks costs O(k log k) too. In more dimensions the open
    boxes are compared one by one (a grid of a x b x ... chunks: its largest cross-section).
    """
    if len(boxes) < 2:
        return None
    dims = len(boxes[0][0])
    if dims == 0:  # scalars: every box is the whole (empty-shaped) tensor
        return boxes[1][0], boxes[0][0]

    def meet(i: int, j: int) -> bool:
        (o1, n1), (o2, n2) = boxes[i], boxes[j]
        return all(a < b + m and b < a + n for a, n, b, m in zip(o1, n1, o2, n2, strict=True))

    axis = max(range(dims), key=lambda d: len({o[d] for o, _ in boxes}))
    other = 1 - axis if dims == 2 else -1
    ends: list[tuple[int, int]] = []  # (end in ``axis``, box): a heap of the open boxes
    open_: set[int] = set()
    across: list[tuple[int, int, int]] = []  # 2-D: (start, end in ``other``, box), sorted
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i][0][axis]):
        offsets, sizes = boxes[i]
        start = offsets[axis]
        while ends and ends[0][0] <= start:  # ended where this one starts: no overlap
            j = heapq.heappop(ends)[1]
            open_.discard(j)
            if other >= 0:
                o, n = boxes[j][0][other], boxes[j][1][other]
                del across[bisect.bisect_left(across, (o, o + n, j))]
        if other >= 0 and sizes[axis] > 0:
            # The open boxes starting before this one ends in ``other``: the last of them
            # ends last, so it is the only one that can reach into this box.
            before = bisect.bisect_left(across, (offsets[other] + sizes[other],))
            if before and meet(i, across[before - 1][2]):
                return offsets, boxes[across[before - 1][2]][0]
        else:  # more dimensions, or a box empty in ``axis``: every open box
            for j in open_:
                if meet(i, j):
                    return offsets, boxes[j][0]
        heapq.heappush(ends, (start + sizes[axis], i))
        open_.add(i)
        if other >= 0:
            o, n = offsets[other], sizes[other]
            bisect.insort(across, (o, o + n, i))
    return None


def _is_size(value: object) -> bool:
    return type(value) is int and value >= 0


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed (this host's memory, not the bytes'
    fault: never proof of damage). torch's CPU allocator raises a plain RuntimeError."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("allocate" in text or "out of memory" in text)


def _undigested(digests: ItemDigests, spans: list[tuple[int, int]]) -> bool:
    """Whether one of ``spans`` lies in a segment without a digest (too large to have one)."""
    for offset, length in spans:
        try:
            if digests.covering(offset, length) is None:
                return True
        except ValueError:  # past the file: verify_span names it
            return False
    return False


class VerifyingReader(FileSystemReader):
    """FileSystemReader that reads only manifest-listed files, each verified; see module doc."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        expected: Mapping[str, FileRecord],
        *,
        versions: Mapping[str, object] | None = None,
        owned: frozenset[str] | None = None,
        read_threads: int = READ_THREADS,
    ) -> None:
        super().__init__(path)
        self.expected = dict(expected)
        self.versions = dict(versions or {})
        """The manifest's ``versions`` (who wrote the checkpoint): a metadata failure under
        another torch release is ``IncompatibleCheckpointError``."""
        self.owned = owned
        """The files this rank proves whole (its share); of any other file with item digests,
        only the items it reads are hashed. None: every file it reads is hashed whole."""
        self.verified: dict[str, str] = {}
        """Files this reader verified whole, relative path → the digest their bytes hashed to
        (each rank then checks its digests against the manifest the ranks agreed on)."""
        self.hashed_bytes = 0
        """Bytes this reader hashed: whole files, and the segments of items read elsewhere."""
        self.items_checked = 0
        """Items read from files this rank does not own, each proven by its item digests."""
        self.read_threads = read_threads
        """Reads in flight per file (storage.one_pass)."""
        self.times = LoadTimes()
        """Where the whole-file reads' time went (read, hash, fill)."""
        self.read_done: Callable[[], None] | None = None
        """Told when this rank's share is read and proven, before DCP's collective waits for
        the other ranks': a rank still reading is then behind in its marks, and named."""
        self._metadata: Metadata | None = None
        self._items: dict[str, ItemDigests | None] = {}
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]]
        self._chunks = {}  # filled from the metadata when first asked (``_recorded``)

    def load_metadata(self) -> Metadata:
        """Verify, parse and check ``.metadata`` now, so its errors surface before DCP runs.

        DCP turns exceptions from ``read_metadata`` into text; calling this first (as loads,
        resumes and ``offline.load_flat`` do) keeps a failure dckpt's own error naming the
        file. It also requires every file the metadata refers to to be listed in the manifest
        (IntegrityError naming the first that is not), before anything is allocated from the
        metadata; through DCP's ``read_metadata`` that is left to ``read_data``, which refuses
        to open such a file.
        """
        metadata = self._checked_metadata()
        for info in metadata.storage_data.values():
            self.listed(info.relative_path)
        return metadata

    def files_for(self, state_dict: dict[str, Any]) -> set[str]:
        """The files a load of ``state_dict`` will read: DCP's own local plan for it (what
        ``read_data`` will be asked for), made from the verified metadata without reading a
        byte of any shard. A fetch from an object store brings only these to a node."""
        metadata = self.load_metadata()
        planner = SafeLoadPlanner()
        planner.set_up_planner(state_dict, metadata, False)
        plan = planner.create_local_plan()
        return {metadata.storage_data[item.storage_index].relative_path for item in plan.items}

    def _checked_metadata(self) -> Metadata:
        if self._metadata is None:
            data = self._read(METADATA_FILE)
            source = os.path.join(str(self.path), METADATA_FILE)
            metadata = load_dcp_metadata(bytes(data), source, self.versions)
            try:
                if not isinstance(metadata, Metadata):
                    raise ManifestError(f"{source} does not hold DCP metadata")
                check_metadata(metadata, self.expected, source)
            except ManifestError as exc:
                raise incompatible_torch(self.versions, source, exc) or exc from None
            self._metadata = metadata
        return self._metadata

    def listed(self, relative_path: str) -> FileRecord:
        """The manifest's record of a file DCP's metadata refers to; IntegrityError naming it
        if the manifest does not list it (nothing else is ever opened)."""
        record = self.expected.get(relative_path) if isinstance(relative_path, str) else None
        # DCP writes a flat directory: a separator or dot-name could only lead elsewhere.
        if record is None or "/" in relative_path or relative_path in ("", ".", ".."):
            raise IntegrityError(
                os.path.join(str(self.path), str(relative_path)),
                "a file listed in manifest.json",
                "a file the manifest does not list",
                detail="unlisted file referenced by DCP metadata",
            )
        return record

    def _read(self, relative_path: str) -> bytes:
        record = self.listed(relative_path)
        where = os.path.join(str(self.path), relative_path)
        if relative_path == METADATA_FILE:
            try:
                fault_point(Phase.READ_METADATA, process_rank(), path=where)
            except OSError as exc:  # what the storage's own error would be here
                raise unreadable(where, exc) from exc
        data, digest = read_verified_digest(where, record)
        self.verified[relative_path] = digest
        self.hashed_bytes += record.bytes
        return data

    def item_digests(self, relative_path: str) -> ItemDigests | None:
        """The item digests of a file this rank does not own, from its sidecar (verified
        whole against the manifest); None when the file is this rank's to prove whole, or has
        no sidecar (written before they existed)."""
        if self.owned is None or relative_path in self.owned:
            return None
        if relative_path not in self._items:
            sidecar = items_name(relative_path)
            got: ItemDigests | None = None
            if sidecar in self.expected:
                raw = self._read(sidecar)
                source = os.path.join(str(self.path), sidecar)
                try:
                    got = parse_items(raw, relative_path, self.listed(relative_path).bytes, source)
                except ValueError as exc:
                    raise IntegrityError(
                        source, "the item digests of its file", str(exc), "unusable item digests"
                    ) from None
            self._items[relative_path] = got
        return self._items[relative_path]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._checked_metadata()
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
            record = self.listed(relative_path)
            where = os.path.join(str(self.path), relative_path)
            ordered = sorted(items, key=lambda i: self._span(i)[0])
            digests = self.item_digests(relative_path)
            if digests is not None and _undigested(digests, [self._span(i) for i in ordered]):
                digests = None  # an item too large to have a digest: the whole file, then
            try:
                if digests is not None:  # another rank's file: the items read, each proven
                    with open_checked(where, record) as f:
                        for item in ordered:
                            offset, length = self._span(item)
                            self.hashed_bytes += verify_span(f, where, digests, offset, length)
                            self.items_checked += 1
                            self._load_item(f, item, planner)
                    continue
                # The whole file, read once (storage.one_pass): hashed in order as it arrives,
                # its values committed only once it matched.
                self.verified[relative_path] = self._read_once(where, record, ordered, planner)
                self.hashed_bytes += record.bytes
            except OSError as exc:  # a read DCP's loading made through the proven descriptor
                raise unreadable(where, exc) from exc
        if self.read_done is not None:
            self.read_done()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_once(
        self, where: str, record: FileRecord, ordered: list[ReadItem], planner: LoadPlanner
    ) -> str:
        spans = [self._span(i) for i in ordered]
        if any(a[0] + a[1] > b[0] for a, b in itertools.pairwise(spans)):
            # items that share bytes are not what DCP writes: hash whole first, then read
            with open_verified(where, record) as f:
                for item in ordered:
                    self._load_item(f, item, planner)
                return f.digest
        with open_checked(where, record) as f:
            fault_point(Phase.READ_SHARD, process_rank(), path=where)  # as the EIO would be
            with ThreadPoolExecutor(self.read_threads, thread_name_prefix="dckpt-read") as pool:
                once = OnePassFile(
                    f, where, record, pool, threads=self.read_threads, span=self._span,
                    load_item=self._load_item,
                )  # fmt: skip
                try:
                    return once.read(ordered, planner)
                except OSError as exc:  # a read failed part way: say what the state holds
                    failed = unreadable(where, exc)
                    if once.filled:
                        failed = read_failed(f"{failed} {PARTLY_FILLED}", where, exc)
                    raise failed from exc
                except Exception as exc:
                    if isinstance(exc, CheckpointError) or _out_of_memory(exc):
                        raise
                    named = self._unplaced(f, ordered, exc)
                    if named is exc:
                        raise
                    raise named from exc
                finally:
                    self.times.add(once.times)

    def _span(self, item: ReadItem) -> tuple[int, int]:
        info = self.storage_data[item.storage_index]
        return (info.offset, info.length)

    def _unplaced(self, f: io.FileIO, ordered: list[ReadItem], exc: Exception) -> Exception:
        """The failure to raise for ``exc``, which came out of a file read whole whose digest
        matched (``OnePassFile.read`` raises what broke an item only then): the first tensor
        item whose bytes do not hold the tensor its metadata records (what placing an item
        reads: its archive's directory and pickle, through the same descriptor, allocating no
        storage), as ``UnloadableItemError``; ``exc`` itself when every one holds it (then
        ``exc`` is no proof: a value, ``SafeLoadPlanner.load_bytes``, or not the bytes)."""
        for item in ordered:
            if item.type == LoadItemType.BYTE_IO:
                continue
            offset, length = self._span(item)
            view: Any = _create_file_view(f, offset, length)
            try:
                meta = torch.load(view, map_location="meta", weights_only=True)
            except Exception as failure:
                if isinstance(failure, OSError) or _out_of_memory(failure):
                    return exc
                return self._unloadable(item, refusal_words(failure), failure)
            wrong = self._unlike_record(meta, item)
            if wrong:
                return self._unloadable(item, wrong)
        return exc

    def _recorded(self, item: ReadItem) -> tuple[tuple[int, ...], torch.dtype] | None:
        """The shape and dtype DCP's metadata records for the chunk a tensor item stores."""
        if not self._chunks:
            for fqn, meta in self._checked_metadata().state_dict_metadata.items():
                if isinstance(meta, TensorStorageMetadata):
                    for chunk in meta.chunks:
                        key = (fqn, tuple(chunk.offsets))
                        self._chunks[key] = (tuple(chunk.sizes), meta.properties.dtype)
        index = item.storage_index
        return self._chunks.get((index.fqn, tuple(index.offset or ())))

    def _unlike_record(self, stored: object, item: ReadItem) -> str:
        """How the value an item's bytes hold differs from the tensor its metadata records
        ("" when it is that tensor): DCP stores each chunk as its own tensor, whole, so a
        save writes exactly the chunk, and its storage lies within the item's bytes."""
        if not isinstance(stored, torch.Tensor):
            return f"it holds a {type(stored).__name__}, not a tensor"
        recorded = self._recorded(item)
        if recorded is not None and (tuple(stored.shape), stored.dtype) != recorded:
            return f"it holds a {tuple(stored.shape)} {stored.dtype} tensor"
        if stored.layout != torch.strided:  # no save of DCP's writes another layout
            return f"it holds a {stored.layout} tensor"
        nbytes, length = stored.untyped_storage().nbytes(), self._span(item)[1]
        if nbytes > length:
            return f"its tensor's storage claims {nbytes} bytes, in an item of {length} bytes"
        return ""

    def _unloadable(
        self, item: ReadItem, failure: str, exc: BaseException | None = None
    ) -> CheckpointError:
        """The error for a tensor item whose proven bytes do not load as its metadata's
        tensor: ``UnloadableItemError`` (damage), or, when another torch release wrote the
        checkpoint, ``IncompatibleCheckpointError`` (not damage: this torch may not read it)."""
        info = self.storage_data[item.storage_index]
        where = os.path.join(str(self.path), info.relative_path)
        incompatible = incompatible_torch(self.versions, where, exc or ValueError(failure))
        if incompatible is not None:
            return incompatible
        recorded = self._recorded(item)
        expected = f"a {recorded[0]} {recorded[1]} tensor" if recorded is not None else "a tensor"
        step = step_words(str(self.path), "the checkpoint")
        return UnloadableItemError(
            where,
            expected,
            failure,
            f"{step}: tensor item {item.dest_index.fqn} (bytes {info.offset}-"
            f"{info.offset + info.length})",
        )

    def _load_item(self, f: io.FileIO, item: ReadItem, planner: LoadPlanner) -> torch.Tensor | None:
        """Deserialize one item from ``f`` into the state; the tensor it filled (None for a
        value). Called once the item's bytes are proven, or, in a file read whole, before its
        verdict (``OnePassFile`` raises the failure only once the file's digest matched): a
        tensor item that does not load as its metadata's tensor is ``UnloadableItemError``."""
        info = self.storage_data[item.storage_index]
        view = _create_file_view(f, info.offset, info.length)
        source = self.transforms.transform_load_stream(
            item, info.transform_descriptors or (), cast(Any, view)
        )
        if item.type == LoadItemType.BYTE_IO:
            # A value weights_only refuses is no proof of damage: dckpt seals one that a
            # state_dict holds (a numpy scalar, say), so its refusal is raised as it is.
            planner.load_bytes(item, io.BytesIO(source.read(-1)))
            return None
        seekable: Any = source if source.seekable() else io.BytesIO(source.read(-1))
        try:
            stored = torch.load(seekable, map_location="cpu", weights_only=True)
        except Exception as exc:
            if isinstance(exc, OSError) or _out_of_memory(exc):
                raise
            raise self._unloadable(item, refusal_words(exc), exc) from exc
        wrong = self._unlike_record(stored, item)
        if wrong:
            raise self._unloadable(item, wrong)
        tensor = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
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
        return target
