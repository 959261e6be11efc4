"""A checkpoint root in an object store: what is committed, and every change to it.

The layout is the directory layout, object for object::

    PREFIX/
      latest                       text: name of the newest committed step
      step-00001200/manifest.json  present: step 1200 is committed (written last)
      step-00001200/.metadata      DCP metadata
      step-00001200/__0_0.distcp   shard objects, one per rank (per writer thread)
      quarantine/step-00001100/... failed verification; with step-00001100.reason.txt
      pins/step-00001000           an empty object: that step is pinned
      .dckpt-verified/step-N.json  the last `dckpt verify` of step N (for `dckpt ls`)
      .dckpt-resumes/step-N.json   how the last resumes of step N went (dckpt.root.resume_record)
      .dckpt-lock                  the run lock (dckpt.tiers.object_lock)

Invariants (an object store has no rename, so the manifest is the commit):
- a step is committed iff ``step-N/manifest.json`` exists; a prefix without one is a save in
  flight or a crash's debris, never listed as committed, never loaded;
- a delete removes the manifest first, then the rest: a half-deleted step is never whole;
- ``latest`` only ever names a committed step, and is written after the manifest;
- ``recover`` (at a job's start, under the run lock) removes prefixes without a manifest and
  aborts multipart uploads left open;
- ``restore`` brings a quarantined step back as a save does: every object but the manifest
  copied to ``step-N/`` and re-hashed there against the quarantined manifest, then that
  manifest PUT last (the commit point, refused if one is there), then the quarantined objects
  and the reason deleted and ``latest`` republished. A crash before the manifest leaves a
  prefix without one (``recover`` removes it, and so does the next restore).

Knows keys and manifests, never tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IntegrityError,
    ManifestError,
    StorageError,
)
from ..owned import Access, prove_root
from ..root import upkeep
from ..root.commit import FileCommit
from ..root.fence import Fence
from ..root.layout import (
    FOREIGN_LISTED,
    LATEST_FILE,
    PINS_DIR,
    QUARANTINE_DIR,
    QUARANTINED_RE,
    STEP_RE,
    Status,
    is_ours,
    step_dir_name,
)
from ..root.lock import RunLock
from ..root.manifest import MANIFEST_FILE, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ..root.memory_ledger import MemoryLedger
from ..root.protocol import Entry, Lock
from ..root.quarantined import (
    RestoreError,
    committed_refusal,
    pick_quarantined,
    refused_restore,
)
from ..root.resume_record import (
    KEEP,
    MAX_RECORDS_BYTES,
    RESUMES_DIR,
    ResumeRecord,
    decode,
    encode,
    record_name,
    step_of_record_name,
)
from ..root.retention import Decision, RetentionPolicy
from ..root.source import CheckpointSource
from ..root.upkeep import decide_for, log_retention
from ..root.verify import (
    MAX_RECORD_BYTES,
    VERIFIED_DIR,
    FileProblem,
    VerifyResult,
    verify_checkpoint,
)
from .s3_store import ListedObject, S3Store, UnsupportedError

if TYPE_CHECKING:
    pass

__all__ = ["ObjectRecords", "ObjectRoot"]

log = logging.getLogger("dckpt")


class ObjectRoot:
    """The checkpoints under one ``s3://bucket/prefix``: the ``Root`` (dckpt.root.protocol)
    of an object store; see the module docstring.

    ``mirror``: the local directory a job's saves are written into before they go up, and
    a resume fetches into (each node its own); a job needs one, the CLI does not."""

    def __init__(self, store: S3Store, *, mirror: Path | None = None) -> None:
        self.store = store
        self.url = store.url
        self._mirror = mirror
        self.fence = Fence()
        """Rank 0's claim on the root (dckpt.root.fence): the bucket lock's check, once
        ``locks`` made it, and the steps found at ``recover``."""

    def __str__(self) -> str:
        return str(self.url)

    def expect_checkpoints(self) -> None:
        """A prefix holding nothing dckpt wrote is refused, as a directory that is not a root
        is. One HEAD of ``latest`` answers for a root that committed a step; without it, one
        listing (a missing bucket or refused credentials fail it, by name)."""
        if self.store.head(self.key(LATEST_FILE)) is not None:
            return
        if not any(is_ours(head.split("/")[0]) for head in self._grouped()):
            raise CheckpointNotFoundError(
                f"{self.url} is not a dckpt checkpoint root (no step-* prefixes, no latest, "
                "no .dckpt-lock under it); pass the s3:// root a training run used"
            )

    # --- a job's parts ----------------------------------------------------------------------

    def _local(self) -> Path:
        if self._mirror is None:
            raise ValueError(f"{self.url} was opened without a local mirror: a job needs one")
        return self._mirror

    def prepare(self, *, coordinator: bool, access: Access = "private") -> None:
        """Every node has its own mirror (unless shared): each rank makes it and proves it
        the job's own (a planted step there would be read as fetched); the node's first rank
        tidies it (the coordinator's ``recover`` does its own)."""
        from .object_source import local_share

        mirror = self._local()
        if mirror.exists() and not mirror.is_dir():
            raise CheckpointError(f"the local mirror {mirror} exists and is not a directory")
        try:
            prove_root(mirror, access=access)
            if not coordinator and local_share()[0] == 0:
                upkeep.recover(mirror)
        except OSError as exc:  # this node's disk, not the bucket: say which
            raise CheckpointError(
                f"cannot use the local mirror {mirror} of {self.url}: {exc}; give this node a "
                "writable directory (CheckpointConfig(mirror=...))"
            ) from exc

    def locks(self, run_id: str, lease_s: float) -> list[Lock]:
        """The mirror's lock, then the bucket's. A second job on one s3:// root meets the
        mirror's first, on one host: its refusal names the root the user gave, too."""
        from .object_lock import ObjectLock

        mirror = self._local()
        lock = ObjectLock(self.store, run_id, lease_s)
        self.fence = Fence(held=lock.check_held, run_id=run_id)
        return [RunLock(mirror, run_id, lease_s, name=f"{self} (its local mirror {mirror})"),
                lock]  # fmt: skip

    def commit_strategy(self) -> FileCommit:
        from .object_commit import ObjectCommit

        return ObjectCommit(self, self.fence)

    def source(self) -> CheckpointSource:
        from .object_source import ObjectSource

        return ObjectSource(self, self._local())

    def memory_ledger(self) -> MemoryLedger:
        from .object_ledger import ObjectLedger

        return ObjectLedger(self, self.fence.check)

    def lock_holder(self) -> str | None:
        from .object_lock import ObjectLock

        return ObjectLock(self.store, "dckpt-cli").holder()

    @contextlib.contextmanager
    def local_steps(
        self, steps: Sequence[int], progress: Callable[[int], None], note: Callable[[str], None]
    ) -> Iterator[Path]:
        """The steps fetched into a temporary directory, each object hashed as it arrives
        (dckpt.tiers.object_source); one ``note`` per step."""
        from .object_source import ObjectSource

        with tempfile.TemporaryDirectory(prefix="dckpt-fetch-") as tmp:
            source = ObjectSource(self, Path(tmp), (0, 1), keep_one=False)
            for step in steps:
                report = source.fetch(step, progress=progress)
                note(f"step {step}: {report.line()}")
            yield Path(tmp)

    def key(self, *parts: str) -> str:
        return self.url.key(*parts)

    def url_of(self, *parts: str) -> str:
        return f"s3://{self.url.bucket}/{self.key(*parts)}"

    # --- reading ----------------------------------------------------------------------------

    def _grouped(self) -> dict[str, list[ListedObject]]:
        """Every object under the root, by its first path part (quarantine: first two)."""
        under = self.url.under()
        groups: dict[str, list[ListedObject]] = {}
        for obj in self.store.list(under):
            rel = obj.key[len(under) :]
            head, _, rest = rel.partition("/")
            if head == QUARANTINE_DIR and rest:
                head = f"{QUARANTINE_DIR}/{rest.partition('/')[0]}"
            groups.setdefault(head, []).append(obj)
        return groups

    def foreign(self) -> list[str]:
        """The names under the prefix dckpt did not write (one listing, on a fresh start); a
        listing that fails names nothing: this is a courtesy of the report, never a refusal."""
        try:
            heads = self._grouped()
        except (OSError, CheckpointError) as exc:
            log.warning("dckpt: cannot list %s for what it holds besides dckpt's: %s", self, exc)
            return []
        names = sorted(head for head in heads if not is_ours(head.split("/")[0]))
        shown = [f"{self.url_of(n)}" for n in names[:FOREIGN_LISTED]]
        if len(names) > FOREIGN_LISTED:
            shown.append(f"and {len(names) - FOREIGN_LISTED} more")
        return shown

    def entries(self) -> list[Entry]:
        """Every step prefix (committed or incomplete) and every quarantined one. Committed:
        ``step-N/manifest.json`` exists (the one rule, for an object store)."""
        found: list[Entry] = []
        for head, objects in self._grouped().items():
            size = sum(o.size for o in objects)
            if m := STEP_RE.fullmatch(head):
                done = any(o.key == self.key(head, MANIFEST_FILE) for o in objects)
                status: Status = "committed" if done else "incomplete"
            elif head.startswith(f"{QUARANTINE_DIR}/") and (
                m := QUARANTINED_RE.fullmatch(head.split("/", 1)[1])
            ):
                status = "quarantined"
            else:
                continue
            found.append(
                Entry(
                    step=int(m.group(1)),
                    status=status,
                    name=head,
                    where=self.url_of(head),
                    bytes=size,
                )
            )
        return sorted(found, key=lambda e: (e.step, e.status, e.name))

    def committed_steps(self) -> list[int]:
        """Steps with a manifest, oldest first."""
        return [e.step for e in self.entries() if e.status == "committed"]

    def manifest_raw(self, step: int) -> bytes:
        """The bytes of ``step``'s manifest (ManifestError if it has none, or too many)."""
        name = step_dir_name(step)
        got = self.store.get_small(self.key(name, MANIFEST_FILE), MAX_MANIFEST_BYTES)
        if got is None:
            raise ManifestError(
                f"{self.url_of(name, MANIFEST_FILE)} does not exist: step {step} is not committed"
            )
        raw = got[0]
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{self.url_of(name, MANIFEST_FILE)} is over {MAX_MANIFEST_BYTES} bytes"
            )
        return raw

    def read_manifest(self, step: int) -> Manifest:
        """``step``'s manifest, validated exactly as one on disk."""
        raw = self.manifest_raw(step)
        manifest = parse_manifest(raw, self.url_of(step_dir_name(step), MANIFEST_FILE))
        if manifest.step != step:
            raise ManifestError(
                f"{self.url_of(step_dir_name(step), MANIFEST_FILE)} says step {manifest.step}"
            )
        return manifest

    def manifest_of(self, entry: Entry) -> Manifest:
        """The manifest under the entry's prefix (``quarantine/step-N`` too), validated as
        one on disk."""
        name = entry.name
        where = self.url_of(name, MANIFEST_FILE)
        got = self.store.get_small(self.key(name, MANIFEST_FILE), MAX_MANIFEST_BYTES)
        if got is None or len(got[0]) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where} does not exist or is over {MAX_MANIFEST_BYTES} bytes")
        return parse_manifest(got[0], where)

    def measure(self, entry: Entry) -> int:
        return entry.bytes or 0

    def shared(self, entry: Entry) -> int:
        return 0  # every step's objects are its own

    def where(self, step: int) -> str:
        return self.url_of(step_dir_name(step))

    def resume_records(self) -> ObjectRecords:
        """Where resumes of this root's steps are recorded (``.dckpt-resumes/``)."""
        return ObjectRecords(self)

    def pinned_steps(self) -> set[int]:
        prefix = self.key(PINS_DIR) + "/"
        return {
            int(m.group(1))
            for o in self.store.list(prefix)
            if (m := STEP_RE.fullmatch(o.key[len(prefix) :]))
        }

    def verify(
        self, step: int, *, threads: int, deep: bool, progress: Callable[[int], None]
    ) -> VerifyResult:
        """Stream every object through its digest (``check_objects``); ``deep``: once they
        hash right, fetch the step and read DCP's metadata as a load would."""
        name = step_dir_name(step)
        try:
            manifest, problems = self.check_objects(step, progress)
        except (ManifestError, IntegrityError, StorageError) as exc:
            problem = FileProblem(  # `where` names the step
                path=MANIFEST_FILE, error=str(exc), unreadable=isinstance(exc, StorageError)
            )
            return VerifyResult(step_dir=Path(name), step=step, problems=[problem],
                                where=self.url_of(name))  # fmt: skip
        incompatible = None
        if deep and not problems:
            problems, incompatible = self._deep(step, threads)
        return VerifyResult(
            step_dir=Path(name),
            step=step,
            files_checked=len(manifest.files),
            bytes_checked=manifest.total_bytes,
            problems=problems,
            where=self.url_of(name),
            incompatible=incompatible,
            files_digest=manifest.files_digest,
            captured=(manifest.capture.get("items"), manifest.capture.get("uncompared", 0)),
        )

    def _deep(self, step: int, threads: int) -> tuple[list[FileProblem], str | None]:
        """Fetch ``step`` (verified) into a temporary copy and read DCP's metadata as a load
        would. Problems name the object's path within the step, never the temporary copy
        (gone when this returns); a fetch that finds damage is a problem of this step, so
        the other steps of the same ``verify`` are still checked."""
        name = step_dir_name(step)
        try:
            with self.local_steps([step], lambda _n: None, lambda _line: None) as local:
                deeper = verify_checkpoint(local / name, threads=threads, deep=True)
                base = str(local / name)
        except (IntegrityError, ManifestError) as exc:
            return [FileProblem(path=name, error=f"fetching it to read: {exc}")], None
        problems = [
            dataclasses.replace(p, path=os.path.relpath(p.path, base))
            if os.path.isabs(p.path) and p.path.startswith(base)
            else p
            for p in deeper.problems
        ]
        return problems, deeper.incompatible

    def check_objects(
        self,
        step: int,
        progress: Callable[[int], None] | None = None,
        only: frozenset[str] | None = None,
    ) -> tuple[Manifest, list[FileProblem]]:
        """Stream every object of ``step`` (``only``: those files of it) through its digest
        and compare it with the manifest (nothing is written to disk); returns the manifest
        and the problems."""
        manifest = self.read_manifest(step)
        return manifest, self._check_files(manifest, step_dir_name(step), progress, only)

    def _check_files(
        self,
        manifest: Manifest,
        name: str,
        progress: Callable[[int], None] | None,
        only: frozenset[str] | None = None,
    ) -> list[FileProblem]:
        """Every object ``manifest`` lists (``only``: of those files), under ``name``
        (``step-N``), streamed through its digest; the problems found (paths relative to
        ``name``)."""
        listed = {o.key: o.size for o in self.store.list(self.key(name) + "/")}
        problems: list[FileProblem] = []
        for record in manifest.files:
            if only is not None and record.path not in only:
                continue
            key = self.key(name, record.path)
            if key not in listed:
                problems.append(FileProblem(path=record.path, error="object missing"))
                continue
            if listed[key] != record.bytes:
                problems.append(
                    FileProblem(
                        path=record.path,
                        error="size mismatch",
                        expected=f"{record.bytes} bytes",
                        actual=f"{listed[key]} bytes",
                    )
                )
                continue
            try:  # a mismatch is read again: one flipped bit on the wire is not damage
                actual = self.store.check(key, record.bytes, record.digest, progress)
            except IntegrityError as exc:
                problems.append(FileProblem(path=record.path, error=exc.detail or str(exc)))
                continue
            except StorageError as exc:  # the store did not serve it: no word on its bytes
                problems.append(FileProblem(path=record.path, error=str(exc), unreadable=True))
                continue
            if actual != record.digest:
                problems.append(
                    FileProblem(
                        path=record.path,
                        error="digest mismatch",
                        expected=record.digest,
                        actual=actual,
                    )
                )
        return problems

    def record_verification(self, result: VerifyResult) -> None:
        """Remember a ``dckpt verify`` outcome in the bucket, as a directory root does beside
        its steps (``.dckpt-verified/step-N.json``); ``ls`` shows it while the step's files
        digest is unchanged (a re-save makes it stale). Best effort: a store that refuses
        the write loses the record, not the verification."""
        if result.step is None or result.files_digest is None:  # no manifest to bind it to
            return
        record = {"ok": result.ok, "time": time.time(), "files_digest": result.files_digest}
        key = self.key(VERIFIED_DIR, f"{step_dir_name(result.step)}.json")
        with contextlib.suppress(StorageError):
            self.store.put_small(key, json.dumps(record).encode())

    def verification(self, step: int, files_digest: str) -> dict[str, Any] | None:
        """The last recorded verification of that very checkpoint (same files digest)."""
        key = self.key(VERIFIED_DIR, f"{step_dir_name(step)}.json")
        got = self.store.get_small(key, MAX_RECORD_BYTES)
        if got is None or len(got[0]) > MAX_RECORD_BYTES:
            return None
        try:
            record = json.loads(got[0])
        except (ValueError, RecursionError):
            return None
        if not isinstance(record, dict) or not isinstance(record.get("ok"), bool):
            return None
        return record if record.get("files_digest") == files_digest else None

    # --- changing ---------------------------------------------------------------------------

    def publish_latest(self, steps: list[int] | None = None) -> None:
        """Point ``latest`` at the newest committed step (or remove it when there is none);
        ``steps``: the committed steps, when the caller just listed them."""
        steps = self.committed_steps() if steps is None else steps
        if steps:
            self.store.put_small(self.key(LATEST_FILE), step_dir_name(steps[-1]).encode())
        else:
            self.store.delete([self.key(LATEST_FILE)])

    def _keys(self, head: str) -> list[str]:
        return [o.key for o in self.store.list(self.key(head) + "/")]

    def uncommit(self, step: int) -> None:
        """Remove ``step``'s manifest: from here on it is not a checkpoint."""
        self.store.delete([self.key(step_dir_name(step), MANIFEST_FILE)])

    def delete_steps(self, steps: list[int]) -> list[str]:
        """Delete committed steps: every manifest first (so none is half a checkpoint),
        then ``latest``, then the remaining objects."""
        names = [step_dir_name(s) for s in steps]
        for step in steps:
            self.uncommit(step)
        if steps:
            self.publish_latest()
        for name in names:
            self.store.delete(self._keys(name))
        self.store.delete([self.key(VERIFIED_DIR, f"{name}.json") for name in names])
        return names

    def quarantine(self, step: int, reason: str) -> str:
        """Copy ``step`` to ``quarantine/``, with the reason, then delete it (manifest
        first). Returns where it went."""
        name = step_dir_name(step)
        taken = {e.name for e in self.entries() if e.status == "quarantined"}
        target = f"{QUARANTINE_DIR}/{name}"
        if target in taken:
            target = f"{target}-{uuid.uuid4().hex[:8]}"
        for key in self._keys(name):
            self.store.copy(key, self.key(target, key[len(self.key(name)) + 1 :]))
        self.store.put_small(self.key(f"{target}.reason.txt"), (reason + "\n").encode())
        self.delete_steps([step])
        log.warning(
            "dckpt: moved %s to %s: %s",
            self.url_of(name),
            self.url_of(target),
            reason.split(". ", maxsplit=1)[0],
        )
        return self.url_of(target)

    def restore(
        self,
        step: int,
        name: str | None = None,
        *,
        progress: Callable[[int], None] = lambda _n: None,
    ) -> str:
        """Put the quarantined ``step`` back as committed (the module docstring says how,
        dckpt.root.protocol what); returns its URL. The copies are re-hashed before the
        manifest goes up: damage is named and the copies deleted, the quarantined step left
        where it is. Objects under ``step-N/`` without a manifest (a save or a restore cut
        short: never a checkpoint) are deleted first."""
        final = step_dir_name(step)
        entries = self.entries()
        committed = any(e.step == step and e.status == "committed" for e in entries)
        quarantined = [e.name for e in entries if e.status == "quarantined"]
        chosen = pick_quarantined(quarantined, step, name, str(self), committed=committed)
        manifest, raw = self._quarantined_manifest(step, chosen)
        debris = self._keys(final)
        if self.key(final, MANIFEST_FILE) in debris:  # committed since entries() was read
            raise RestoreError(committed_refusal(str(self), step))
        if debris:  # no manifest: not a checkpoint (the entries said so), as recover finds
            self.store.delete(debris)
            log.warning(
                "dckpt: removed %d object(s) of the uncommitted %s before restoring into it",
                len(debris),
                self.url_of(final),
            )
        source = self._keys(chosen)
        for key in source:
            if key != self.key(chosen, MANIFEST_FILE):
                self.store.copy(key, self.key(final, key[len(self.key(chosen)) + 1 :]))
        problems = self._check_files(manifest, final, progress)
        result = VerifyResult(
            step_dir=Path(final),
            step=step,
            files_checked=len(manifest.files),
            bytes_checked=manifest.total_bytes,
            problems=problems,
            where=self.url_of(final),
            files_digest=manifest.files_digest,
            captured=(manifest.capture.get("items"), manifest.capture.get("uncompared", 0)),
        )
        if problems:
            self.store.delete(self._keys(final))  # copies without a manifest: never a step
            raise refused_restore(step, self.url_of(chosen), result)
        self._commit_restored(step, raw)
        try:
            self.store.delete(source)
            self.store.delete([self.key(f"{chosen}.reason.txt")])
            self.publish_latest()
            self.record_verification(result)
        except StorageError as exc:  # committed already: said, not raised
            log.warning(
                "dckpt: %s is restored, but tidying up after it failed (%s): the next start "
                "brings latest forward; delete what is left of %s by hand",
                self.url_of(final),
                exc,
                self.url_of(chosen),
            )
        log.info(
            "dckpt: restored %s from %s (%d objects verified)",
            self.url_of(final),
            self.url_of(chosen),
            len(manifest.files),
        )
        return self.url_of(final)

    def _quarantined_manifest(self, step: int, chosen: str) -> tuple[Manifest, bytes]:
        """The manifest of the quarantined ``chosen`` and its bytes (what the restore
        commits), validated and of ``step``; RestoreError (it stays) when it is not."""
        where = self.url_of(chosen, MANIFEST_FILE)
        got = self.store.get_small(self.key(chosen, MANIFEST_FILE), MAX_MANIFEST_BYTES)
        try:
            if got is None or len(got[0]) > MAX_MANIFEST_BYTES:
                raise ManifestError(f"{where} is missing or over {MAX_MANIFEST_BYTES} bytes")
            manifest = parse_manifest(got[0], where)
        except (ManifestError, IntegrityError) as exc:
            problem = FileProblem(path=MANIFEST_FILE, error=str(exc))
            damaged = VerifyResult(step_dir=Path(chosen), step=step, problems=[problem])
            raise refused_restore(step, self.url_of(chosen), damaged) from exc
        if manifest.step != step:
            raise RestoreError(f"{where} is of step {manifest.step}, not {step}: it stays")
        return manifest, got[0]

    def _commit_restored(self, step: int, raw: bytes) -> None:
        """PUT ``step``'s manifest unless one is there: the commit point of a restore. A
        manifest found there that is not ``raw`` (a save of that step meanwhile) refuses."""
        key = self.key(step_dir_name(step), MANIFEST_FILE)
        failed: StorageError | None = None
        try:
            if self.store.put_small(key, raw, if_absent=True) is not None:
                return
        except StorageError as exc:  # a reply lost after the store applied it? read back
            failed = exc
        there = self.store.get_small(key, MAX_MANIFEST_BYTES)
        if there is not None and there[0] == raw:
            return  # ours: a retried PUT found its own first one
        where = self.url_of(step_dir_name(step), MANIFEST_FILE)
        if there is None:
            raise StorageError(
                f"the PUT of {where} failed ({failed or 'refused, yet nothing is there'}): "
                f"step {step} is not restored, its quarantined copy stays; run the restore "
                "again"
            )
        raise RestoreError(
            f"{where} appeared while step {step} was restored (a job saving that step?): the "
            f"quarantined copy stays; check what is committed: dckpt verify {self} --step {step}"
        )

    def recover(self) -> list[str]:
        """At a job's start, under the run lock: tidy the mirror as a directory root is
        tidied, then remove step prefixes without a manifest (a save cut short) and abort
        multipart uploads left open. Returns one line per action.

        A store that cannot list open uploads (501 to ListMultipartUploads: s3rver, some
        gateways) skips that part with one warning: the parts of an upload a crash left open
        are invisible and never committed, so they cost storage, not correctness, and the
        store's lifecycle rule can reap them instead."""
        # upkeep.recover logs its own lines; only the bucket's actions are logged below.
        mirrored = [] if self._mirror is None else upkeep.recover(self._mirror)
        actions: list[str] = []
        try:
            uploads = self.store.open_uploads(self.url.under())
        except UnsupportedError as exc:
            uploads = []
            log.warning(
                "dckpt recover: the store cannot list open multipart uploads, so those a crash "
                "left under %s are not aborted (%s). Their parts are never part of a "
                "checkpoint but take space: set a lifecycle rule on the bucket that aborts "
                "them (S3: AbortIncompleteMultipartUpload, DaysAfterInitiation 1).",
                self.url,
                exc,
            )
        for upload in uploads:
            self.store.abort(upload)
            actions.append(f"aborted the unfinished upload of {upload.key}")
        for entry in self.entries():
            if entry.status == "incomplete":
                keys = self._keys(entry.name)
                self.store.delete(keys)
                actions.append(f"removed {len(keys)} object(s) of the uncommitted {entry.where}")
        self.publish_latest()  # a crash between the manifest and `latest` left it behind
        self.fence.start(self.committed_steps())  # what this job found: its to move
        for line in actions:
            log.warning("dckpt recover: %s", line)
        return mirrored + actions

    def run_of(self, step: int) -> str | None:
        """The run id ``step``'s manifest records (None: unreadable)."""
        try:
            return self.read_manifest(step).run_id
        except CheckpointError:
            return None

    def pin(self, step: int) -> str:
        if step not in self.committed_steps():
            raise FileNotFoundError(f"no committed checkpoint for step {step} under {self.url}")
        self.store.put_small(self.key(PINS_DIR, step_dir_name(step)), b"")
        return self.url_of(PINS_DIR, step_dir_name(step))

    def unpin(self, step: int) -> bool:
        key = self.key(PINS_DIR, step_dir_name(step))
        if self.store.head(key) is None:
            return False
        self.store.delete([key])
        return True

    def plan_retention(self, policy: RetentionPolicy) -> list[Decision]:
        manifests: dict[int, Manifest | None] = {}
        for step in self.committed_steps():
            try:
                manifests[step] = self.read_manifest(step)
            except (ManifestError, IntegrityError):
                manifests[step] = None
        return decide_for(manifests, self.pinned_steps(), policy)

    def apply_retention(
        self, policy: RetentionPolicy, *, dry_run: bool = False, fence: Fence | None = None
    ) -> tuple[list[Decision], list[str]]:
        """Decide and (unless ``dry_run``) delete, manifest first; logs one line. ``fence``:
        a job's (dckpt.root.fence): a step it may not delete is kept."""
        decisions = self.plan_retention(policy)
        if fence is not None:
            decisions = fence.spare(decisions, self.run_of)
        victims = [d.step for d in decisions if not d.keep]
        deleted = [] if dry_run or not victims else self.delete_steps(victims)
        log_retention(decisions, dry_run=dry_run)
        return decisions, deleted


class ObjectRecords:
    """``PREFIX/.dckpt-resumes/step-N.json`` in the bucket (dckpt.root.resume_record): what
    ``DirectoryRecords`` is for a directory root. Only rank 0 of the job holding the run
    lock writes them, so a read, an append and a PUT need no condition."""

    def __init__(self, root: ObjectRoot) -> None:
        self.root = root

    def __str__(self) -> str:
        return self.root.url_of(RESUMES_DIR)

    def where(self, step: int) -> str:
        return self.root.url_of(RESUMES_DIR, record_name(step))

    def forget(self, step: int) -> str:
        return f"aws s3 rm {self.where(step)} (with --endpoint-url for a store other than AWS)"

    def read(self, step: int) -> list[ResumeRecord]:
        got = self.root.store.get_small(
            self.root.key(RESUMES_DIR, record_name(step)), MAX_RECORDS_BYTES
        )
        return decode(None if got is None else got[0], step)

    def steps(self) -> list[int]:
        prefix = self.root.key(RESUMES_DIR) + "/"
        found = (step_of_record_name(o.key[len(prefix) :]) for o in self.root.store.list(prefix))
        return sorted(s for s in found if s is not None)

    def add(self, record: ResumeRecord) -> list[ResumeRecord]:
        kept = [*self.read(record.step), record][-KEEP:]
        data = encode(record.step, kept)
        self.root.store.put_small(self.root.key(RESUMES_DIR, record_name(record.step)), data)
        return kept
