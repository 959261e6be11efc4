"""manifest.json: the record that makes a directory a checkpoint, and its validation.

The manifest is JSON (never pickle), versioned by ``schema_version``, and carries its own digest
(``self_digest``, over the canonical JSON of every other field), and a reader accepts only the
exact bytes ``write_manifest`` produces for those values, so one flipped bit anywhere in it is
caught (even one that parses to the same values). Records are frozen dataclasses, changed with
``dataclasses.replace``.

Validation is strict and happens before any checkpoint byte is read:
- the file is at most ``MAX_MANIFEST_BYTES`` and parses as a JSON object of this schema;
- every file path is a plain file name (DCP writes a flat directory): no ``/``, ``..``, NUL or
  backslash, unique, and not the manifest itself;
- sizes and counts are bounded, so a hostile manifest cannot make a reader allocate absurdly;
- ``check_layout`` then requires every listed file to be a regular file (no symlink, FIFO or
  directory) of exactly the recorded size (all of them, or one ``Manifest.share`` of them:
  the split is the manifest's alone, so every process that holds it splits it alike).

No collective here: this layer knows files, not process groups.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import (
    IncompatibleCheckpointError,
    IntegrityError,
    ManifestError,
    StorageError,
    read_failed,
)
from ..faults import fault_point, process_rank
from ..owned import write_atomic
from ..phases import Phase
from ..storage.digest import ALGORITHMS, digest_of_digests, new_hasher, parse_digest
from ..storage.records import FileRecord

__all__ = [
    "MANIFEST_FILE",
    "SCHEMA_VERSION",
    "Manifest",
    "canonical",
    "check_layout",
    "fingerprint",
    "manifest_bytes",
    "parse_manifest",
    "read_manifest",
    "write_manifest",
]

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILES = 1_000_000
MAX_FILE_BYTES = 1 << 44  # 16 TiB: far above any real shard, far below what would overflow
MAX_WORLD_SIZE = 1 << 20
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(FileRecord))


def fingerprint(obj: Any) -> str:
    """A stable digest of a JSON-able value (used for configs and the manifest itself)."""
    hasher = new_hasher("xxh3_128")
    hasher.update(canonical(obj))
    return f"xxh3_128:{hasher.hexdigest()}"


def canonical(obj: Any) -> bytes:
    """The canonical JSON bytes of a value: what ``fingerprint`` hashes (and a key signs)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything recorded about one committed checkpoint. See docs/ARCHITECTURE.md."""

    step: int
    world_size: int
    files: tuple[FileRecord, ...]
    run_id: str
    save_id: str
    created_at: float
    digest_algorithm: str = "xxh3_128"
    files_digest: str = ""
    epoch: int = 0
    state: tuple[str, ...] = ()
    versions: dict[str, str] = field(default_factory=dict)
    mesh: dict[str, Any] = field(default_factory=dict)
    precision: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    config_fingerprint: str = ""
    loss: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    bytes_per_rank: tuple[int, ...] = ()
    milestone: bool = False
    metric: dict[str, Any] = field(default_factory=dict)
    integrity: dict[str, Any] = field(default_factory=dict)
    """What the save's value checks let through (``nonfinite``, ``replicas_differ``); empty,
    and then absent from the file (older manifests stay byte-identical), for a clean save."""
    data: dict[str, Any] = field(default_factory=dict)
    """Where the data position stood at the save (``epoch``, ``batches`` into it), when the
    state's ``data`` records them (a DataLoader's position, ``GlobalBatchSampler``): the
    loader's epoch, which a script that never passes ``save(epoch=)`` leaves out of ``epoch``.
    Empty, and then absent from the file (older manifests stay byte-identical), without one."""
    incremental: dict[str, Any] = field(default_factory=dict)
    """A save with ``incremental`` on records ``trainable`` (the names of the parameters that
    required grad, as rank 0 holds them) and, when it linked files, ``reused`` (file → the step
    whose save wrote its bytes); empty, and then absent from the file, with ``incremental``
    off. Every listed file is in the step's own directory either way: a dckpt that does not
    know the field reads such a step as any other."""
    capture: dict[str, Any] = field(default_factory=dict)
    """The capture check of this save (dckpt.save.capture): ``items``, the tensors whose
    bytes written were compared with their digest taken from the live state at ``save()``
    (every rank's), and ``uncompared`` when some could not be. Empty, and then absent from
    the file, for a save made without it (an older dckpt's: older manifests stay valid)."""
    signature: dict[str, Any] = field(default_factory=dict)
    """With a job key (``CheckpointConfig.key_file``): ``algorithm``, ``key`` (the key's id)
    and ``mac``, an HMAC of every other field (dckpt.root.provenance). Empty, and then absent
    from the file, without a key; covered by the self-digest like any field, so an older
    dckpt reads a signed manifest as any other."""
    schema_version: int = SCHEMA_VERSION

    @property
    def finite(self) -> bool:
        """False when the step was saved with NaN or Inf in a tensor (``allow_nonfinite``)."""
        return not self.integrity.get("nonfinite")

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def file_map(self) -> dict[str, FileRecord]:
        return {f.path: f for f in self.files}

    def share(self, part: int, parts: int) -> tuple[FileRecord, ...]:
        """The files of ``part`` when the checkpoint's files are split into ``parts``: those
        whose writer's rank is ``part`` modulo ``parts``. The split depends on the manifest
        alone, so processes holding the same manifest split it alike, each file in one part,
        and a process that reads back the files it wrote (the same world) finds its part
        among them. What a part is for (a resume's rank checking it) is the caller's."""
        if not 0 <= part < parts:
            raise ValueError(f"part {part} of {parts}")
        return tuple(f for f in self.files if f.rank % parts == part)

    def sealed(self) -> Manifest:
        """This manifest with ``files_digest`` and ``config_fingerprint`` filled in."""
        return dataclasses.replace(
            self,
            files_digest=digest_of_digests((f.path, f.bytes, f.digest) for f in self.files),
            config_fingerprint=fingerprint(self.config),
        )

    def to_json_obj(self) -> dict[str, Any]:
        # ``dataclasses.asdict`` of every field but the files, which it would walk record by
        # record, recursively: two thirds of rank 0's manifest time at 16k ranks. A record's
        # fields are scalars, read directly.
        obj = dataclasses.asdict(dataclasses.replace(self, files=()))
        obj["files"] = [{k: getattr(f, k) for k in _RECORD_FIELDS} for f in self.files]
        obj["state"] = list(self.state)
        obj["bytes_per_rank"] = list(self.bytes_per_rank)
        if not self.integrity:
            del obj["integrity"]
        if not self.incremental:
            del obj["incremental"]
        if not self.data:
            del obj["data"]
        if not self.capture:
            del obj["capture"]
        if not self.signature:
            del obj["signature"]
        obj["self_digest"] = fingerprint(obj)
        return obj

    @classmethod
    def from_json_obj(cls, obj: Any, source: str = "manifest") -> Manifest:
        return _parse(obj, source)


def _encode(obj: Any) -> bytes:
    """The exact bytes of a manifest file holding ``obj`` (what ``read_manifest`` insists on)."""
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def manifest_bytes(manifest: Manifest) -> bytes:
    """The exact bytes ``write_manifest`` writes for ``manifest`` (sealed)."""
    return _encode(manifest.sealed().to_json_obj())


def write_manifest(directory: str | os.PathLike[str], manifest: Manifest) -> FileRecord:
    """Write ``manifest.json`` (sealed) into ``directory``, fsynced; returns what was written."""
    data = _encode(manifest.sealed().to_json_obj())
    write_atomic(directory, MANIFEST_FILE, data)  # never through a link; fsynced
    return FileRecord(path=MANIFEST_FILE, bytes=len(data), digest="", rank=0)


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``directory/manifest.json``; ManifestError says what is wrong."""
    path = Path(directory) / MANIFEST_FILE
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ManifestError(
            f"{path} does not exist: {directory} is not a committed checkpoint"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ManifestError(f"{path} is a symlink; a manifest is never followed") from exc
        raise StorageError(f"cannot open {path}: {exc}; the storage failed, retry") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{path} is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path} is {st.st_size} bytes, over {MAX_MANIFEST_BYTES}")
        with os.fdopen(os.dup(fd), "rb") as f:
            fault_point(Phase.READ_MANIFEST, process_rank(), path=str(path))
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:  # the storage failed (EIO, ESTALE): no word on the bytes
        raise read_failed(
            f"cannot read {path}: {os.strerror(exc.errno) if exc.errno else exc}: the storage "
            "failed to serve it (not damage: nothing was quarantined); retry once the storage "
            "is healthy",
            str(path),
            exc,
        ) from exc
    finally:
        os.close(fd)
    return parse_manifest(raw, str(path))


def parse_manifest(raw: bytes, source: str) -> Manifest:
    """Validate the bytes of a ``manifest.json`` read from ``source`` (a file, an object)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{source} is {len(raw)} bytes or more, over {MAX_MANIFEST_BYTES}")
    path = source
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ManifestError(f"{path} is not valid JSON ({exc}); the manifest is damaged") from exc
    manifest = _parse(obj, str(path))
    # The self-digest covers the parsed values, and some byte changes parse to the same values
    # (the 17th digit of a float, "e" for "E", a hex escape's case). dckpt writes one exact
    # form, so any other bytes are damage too.
    if raw != _encode(obj):
        raise IntegrityError(
            str(path),
            "the bytes dckpt wrote",
            "other bytes that parse to the same values",
            "manifest bytes changed",
        )
    return manifest


def check_layout(
    directory: str | os.PathLike[str],
    manifest: Manifest,
    only: Collection[str] | None = None,
    *,
    part: tuple[int, int] | None = None,
    owned: Callable[[Path, os.stat_result], None] | None = None,
) -> int:
    """Every listed file (of ``only``, when given; of ``manifest.share(*part)``, when
    ``part`` is) is a regular file of the recorded size; raises on the first that is not.
    Returns the number of files checked.

    ``part`` lets each of many processes stat its share alone (a file is a ``stat`` each,
    and thousands of ranks each stat'ing every file is thousands of times the work); that
    every part passed is for the caller to establish. ``owned``: called with each file's
    path and ``lstat``, to raise for one that is not the job's (dckpt.root.provenance)."""
    base = Path(directory)
    checked = 0
    for rec in manifest.files if part is None else manifest.share(*part):
        if only is not None and rec.path not in only:
            continue
        path = base / rec.path
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise IntegrityError(str(path), rec.digest, "missing file", "file missing") from None
        except OSError as exc:
            raise StorageError(f"cannot stat {path}: {exc}; the storage failed, retry") from exc
        if owned is not None:  # another user's file is foreign, whatever it holds: not damage
            owned(path, st)
        if not stat.S_ISREG(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise IntegrityError(str(path), "a regular file", kind, "wrong file type")
        if st.st_size != rec.bytes:
            raise IntegrityError(
                str(path), f"{rec.bytes} bytes", f"{st.st_size} bytes", "size mismatch"
            )
        checked += 1
    return checked


# --- parsing -------------------------------------------------------------------------------


def _fingerprint_or_none(obj: Any) -> str | None:
    try:
        return fingerprint(obj)
    except ValueError:  # a non-finite number: no digest to compare
        return None


def _fail(source: str, why: str) -> ManifestError:
    return ManifestError(f"{source}: {why}; the checkpoint cannot be trusted and is not loaded")


def _int(obj: dict[str, Any], key: str, source: str, lo: int, hi: int) -> int:
    value = obj.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(source, f"{key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _str(obj: dict[str, Any], key: str, source: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise _fail(source, f"{key!r} must be a string, got {type(value).__name__}")
    return value


def _capture(obj: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``capture`` record, each count checked (absent: an older save's, empty)."""
    if "capture" not in obj:
        return {}
    record = _dict(obj, "capture", source)
    for key in ("items", "uncompared"):
        value = record.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _fail(source, f"'capture.{key}' must be a count, got {value!r}")
    return record


def _dict(obj: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = obj.get(key, {})
    if not isinstance(value, dict):
        raise _fail(source, f"{key!r} must be an object")
    return value


def _safe_path(path: Any, source: str) -> str:
    if not isinstance(path, str) or not path:
        raise _fail(source, f"file path {path!r} is not a non-empty string")
    pure = PurePosixPath(path)
    if (
        pure.is_absolute()
        or "/" in path
        or "\\" in path
        or "\0" in path
        or any(part in ("..", ".", "") for part in path.split("/"))
        or path == MANIFEST_FILE
    ):
        raise _fail(source, f"file path {path!r} escapes or aliases the checkpoint directory")
    return path


def _incremental(obj: dict[str, Any], source: str, files: set[str]) -> dict[str, Any]:
    """The ``incremental`` record, checked: a trainable name is a string, a reused file is
    listed, and its step of origin is not after this step."""
    if "incremental" not in obj:
        return {}
    record = _dict(obj, "incremental", source)
    trainable, reused = record.get("trainable", []), record.get("reused", {})
    if not isinstance(trainable, list) or not all(isinstance(t, str) for t in trainable):
        raise _fail(source, "'incremental.trainable' must be a list of strings")
    if not isinstance(reused, dict):
        raise _fail(source, "'incremental.reused' must be an object")
    step = obj.get("step")
    for path, origin in reused.items():
        if path not in files:
            raise _fail(source, f"'incremental.reused' names {path[:80]!r}, not a listed file")
        if type(origin) is not int or type(step) is not int or not 0 <= origin <= step:
            raise _fail(source, f"'incremental.reused' gives {path!r} the step {origin!r}")
    return record


def _parse(obj: Any, source: str) -> Manifest:
    if not isinstance(obj, dict):
        raise _fail(source, "top level is not a JSON object")
    version = obj.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:
        # A flipped bit can turn 1 into 3, 5 or 9: when the self-digest holds for this schema,
        # the manifest is this schema's and damaged, not a newer dckpt's (which would refuse
        # the fallback a damaged checkpoint gets).
        if obj.get("self_digest") == _fingerprint_or_none(
            {
                **{k: v for k, v in obj.items() if k != "self_digest"},
                "schema_version": SCHEMA_VERSION,
            }
        ):
            raise IntegrityError(
                source, f"schema_version {SCHEMA_VERSION}", f"{version}", "schema_version damaged"
            )
        raise IncompatibleCheckpointError(
            f"{source}: schema_version {version} is newer than this dckpt supports "
            f"({SCHEMA_VERSION}); upgrade dckpt to read it"
        )
    if type(version) is not int or version != SCHEMA_VERSION:
        raise _fail(
            source,
            f"schema_version {version!r} is not supported by this dckpt (supports "
            f"{SCHEMA_VERSION}); if it was written by a newer dckpt, upgrade dckpt to read it",
        )
    claimed = obj.get("self_digest")
    body = {k: v for k, v in obj.items() if k != "self_digest"}
    try:
        actual = fingerprint(body)
    except ValueError as exc:
        raise _fail(source, f"holds a non-finite number ({exc})") from exc
    if claimed != actual:
        raise IntegrityError(source, str(claimed), actual, "manifest self-digest mismatch")
    world_size = _int(obj, "world_size", source, 1, MAX_WORLD_SIZE)
    raw_files = obj.get("files")
    if not isinstance(raw_files, list) or len(raw_files) > MAX_FILES:
        raise _fail(source, f"'files' must be a list of at most {MAX_FILES} entries")
    files: list[FileRecord] = []
    seen: set[str] = set()
    for entry in raw_files:
        if not isinstance(entry, dict):
            raise _fail(source, "a 'files' entry is not an object")
        path = _safe_path(entry.get("path"), source)
        if path in seen:
            raise _fail(source, f"file {path!r} is listed twice")
        seen.add(path)
        digest = _str(entry, "digest", source)
        try:
            parse_digest(digest)
        except ValueError as exc:
            raise _fail(source, str(exc)) from exc
        files.append(
            FileRecord(
                path=path,
                bytes=_int(entry, "bytes", source, 0, MAX_FILE_BYTES),
                digest=digest,
                rank=_int(entry, "rank", source, 0, world_size - 1),
            )
        )
    algorithm = _str(obj, "digest_algorithm", source)
    if algorithm not in ALGORITHMS:
        raise _fail(source, f"digest_algorithm {algorithm!r} is not one of {sorted(ALGORITHMS)}")
    odd = [f.path for f in files if not f.digest.startswith(algorithm + ":")]
    if odd:
        raise _fail(source, f"files {odd[:3]} are not hashed with {algorithm}")
    state = obj.get("state", [])
    bytes_per_rank = obj.get("bytes_per_rank", [])
    if not isinstance(state, list) or not all(isinstance(s, str) for s in state):
        raise _fail(source, "'state' must be a list of strings")
    if not isinstance(bytes_per_rank, list) or not all(type(b) is int for b in bytes_per_rank):
        raise _fail(source, "'bytes_per_rank' must be a list of integers")
    created_at = obj.get("created_at")
    if not isinstance(created_at, (int, float)):
        raise _fail(source, "'created_at' must be a number")
    milestone = obj.get("milestone", False)
    if not isinstance(milestone, bool):
        raise _fail(source, "'milestone' must be true or false")
    manifest = Manifest(
        schema_version=version,
        step=_int(obj, "step", source, 0, 1 << 62),
        epoch=_int(obj, "epoch", source, 0, 1 << 62),
        world_size=world_size,
        files=tuple(files),
        run_id=_str(obj, "run_id", source),
        save_id=_str(obj, "save_id", source),
        created_at=float(created_at),
        digest_algorithm=algorithm,
        files_digest=_str(obj, "files_digest", source),
        state=tuple(state),
        versions=_dict(obj, "versions", source),
        mesh=_dict(obj, "mesh", source),
        precision=_dict(obj, "precision", source),
        config=_dict(obj, "config", source),
        config_fingerprint=_str(obj, "config_fingerprint", source),
        loss=_dict(obj, "loss", source),
        timings=_dict(obj, "timings", source),
        bytes_per_rank=tuple(bytes_per_rank),
        milestone=milestone,
        metric=_dict(obj, "metric", source),
        integrity=_dict(obj, "integrity", source) if "integrity" in obj else {},
        incremental=_incremental(obj, source, seen),
        data=_dict(obj, "data", source) if "data" in obj else {},
        capture=_capture(obj, source),
        signature=_dict(obj, "signature", source) if "signature" in obj else {},
    )
    sealed = manifest.sealed()
    if sealed.files_digest != manifest.files_digest:
        raise _fail(source, "'files_digest' does not match the listed files")
    if sealed.config_fingerprint != manifest.config_fingerprint:
        raise _fail(source, "'config_fingerprint' does not match the config")
    return manifest
