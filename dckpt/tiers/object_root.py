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
  aborts multipart uploads left open.

Knows keys and manifests, never tensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import IntegrityError, ManifestError, StorageError
from ..root.layout import (
    LATEST_FILE,
    PINS_DIR,
    QUARANTINE_DIR,
    QUARANTINED_RE,
    STEP_RE,
    Status,
    step_dir_name,
)
from ..root.manifest import MANIFEST_FILE, MAX_MANIFEST_BYTES, Manifest, parse_manifest
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
from ..root.upkeep import decide_for, log_retention
from ..root.verify import MAX_RECORD_BYTES, VERIFIED_DIR, FileProblem
from .s3_store import ListedObject, S3Store, UnsupportedError

__all__ = ["ObjectEntry", "ObjectRecords", "ObjectRoot"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True, kw_only=True)
class ObjectEntry:
    """A checkpoint-like prefix in the bucket (``dckpt ls``)."""

    step: int
    status: Status
    name: str  # step-N, or quarantine/step-N[-hex]
    bytes: int
    objects: int


class ObjectRoot:
    """The checkpoints under one ``s3://bucket/prefix``; see the module docstring."""

    def __init__(self, store: S3Store) -> None:
        self.store = store
        self.url = store.url

    def __str__(self) -> str:
        return str(self.url)

    def key(self, *parts: str) -> str:
        return self.url.key(*parts)

    def where(self, *parts: str) -> str:
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

    def entries(self) -> list[ObjectEntry]:
        """Every step prefix (committed or incomplete) and every quarantined one."""
        found: list[ObjectEntry] = []
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
                ObjectEntry(
                    step=int(m.group(1)), status=status, name=head, bytes=size, objects=len(objects)
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
                f"{self.where(name, MANIFEST_FILE)} does not exist: step {step} is not committed"
            )
        raw = got[0]
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(
                f"{self.where(name, MANIFEST_FILE)} is over {MAX_MANIFEST_BYTES} bytes"
            )
        return raw

    def read_manifest(self, step: int) -> Manifest:
        """``step``'s manifest, validated exactly as one on disk."""
        raw = self.manifest_raw(step)
        manifest = parse_manifest(raw, self.where(step_dir_name(step), MANIFEST_FILE))
        if manifest.step != step:
            raise ManifestError(
                f"{self.where(step_dir_name(step), MANIFEST_FILE)} says step {manifest.step}"
            )
        return manifest

    def manifest_at(self, name: str) -> Manifest:
        """The manifest under the prefix ``name`` (an entry's: ``quarantine/step-N`` too),
        validated as one on disk."""
        where = self.where(name, MANIFEST_FILE)
        got = self.store.get_small(self.key(name, MANIFEST_FILE), MAX_MANIFEST_BYTES)
        if got is None or len(got[0]) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where} does not exist or is over {MAX_MANIFEST_BYTES} bytes")
        return parse_manifest(got[0], where)

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
        self, step: int, progress: Callable[[int], None] | None = None
    ) -> tuple[Manifest, list[FileProblem]]:
        """Stream every object of ``step`` through its digest and compare it with the
        manifest (nothing is written to disk); returns the manifest and the problems."""
        manifest = self.read_manifest(step)
        name = step_dir_name(step)
        listed = {o.key: o.size for o in self.store.list(self.key(name) + "/")}
        problems: list[FileProblem] = []
        for record in manifest.files:
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
            if actual != record.digest:
                problems.append(
                    FileProblem(
                        path=record.path,
                        error="digest mismatch",
                        expected=record.digest,
                        actual=actual,
                    )
                )
        return manifest, problems

    def record_verification(self, step: int, ok: bool, files_digest: str) -> None:
        """Remember a ``dckpt verify`` outcome in the bucket, as a directory root does beside
        its steps (``.dckpt-verified/step-N.json``); ``ls`` shows it while the step's files
        digest is unchanged (a re-save makes it stale). Best effort: a store that refuses
        the write loses the record, not the verification."""
        record = {"ok": ok, "time": time.time(), "files_digest": files_digest}
        key = self.key(VERIFIED_DIR, f"{step_dir_name(step)}.json")
        with contextlib.suppress(StorageError):
            self.store.put_small(key, json.dumps(record).encode())

    def verifications(self) -> dict[int, dict[str, Any]]:
        """Every step's last recorded verification (one listing, one small GET each)."""
        prefix = self.key(VERIFIED_DIR) + "/"
        found: dict[int, dict[str, Any]] = {}
        for obj in self.store.list(prefix):
            m = STEP_RE.fullmatch(obj.key[len(prefix) :].removesuffix(".json"))
            got = self.store.get_small(obj.key, MAX_RECORD_BYTES) if m else None
            if m is None or got is None or len(got[0]) > MAX_RECORD_BYTES:
                continue
            try:
                record = json.loads(got[0])
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict) and isinstance(record.get("ok"), bool):
                found[int(m.group(1))] = record
        return found

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
            self.where(name),
            self.where(target),
            reason.split(". ", maxsplit=1)[0],
        )
        return self.where(target)

    def recover(self) -> list[str]:
        """At a job's start, under the run lock: remove step prefixes without a manifest (a
        save cut short) and abort multipart uploads left open. Returns one line per action.

        A store that cannot list open uploads (501 to ListMultipartUploads: s3rver, some
        gateways) skips that part with one warning: the parts of an upload a crash left open
        are invisible and never committed, so they cost storage, not correctness, and the
        store's lifecycle rule can reap them instead."""
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
                self.store.delete(self._keys(entry.name))
                actions.append(
                    f"removed {entry.objects} object(s) of the uncommitted {self.where(entry.name)}"
                )
        self.publish_latest()  # a crash between the manifest and `latest` left it behind
        for line in actions:
            log.warning("dckpt recover: %s", line)
        return actions

    def pin(self, step: int) -> str:
        if step not in self.committed_steps():
            raise FileNotFoundError(f"no committed checkpoint for step {step} under {self.url}")
        self.store.put_small(self.key(PINS_DIR, step_dir_name(step)), b"")
        return self.where(PINS_DIR, step_dir_name(step))

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
        self, policy: RetentionPolicy, *, dry_run: bool = False
    ) -> tuple[list[Decision], list[str]]:
        """Decide and (unless ``dry_run``) delete, manifest first; logs one line."""
        decisions = self.plan_retention(policy)
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
        return self.root.where(RESUMES_DIR)

    def where(self, step: int) -> str:
        return self.root.where(RESUMES_DIR, record_name(step))

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
