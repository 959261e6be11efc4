"""The commit of an s3:// root: every shard object uploaded and re-hashed, the manifest last.

``ObjectCommit`` is the second ``CommitStrategy`` (dckpt.root.commit), for stores with no
rename. A save still writes into a local tmp dir first (the root's *mirror*, a local
directory: DCP's writer, the digests computed while writing and the snapshot staging are
unchanged), then:

1. ``make_tmp`` (every rank makes its tmp dir in its mirror; rank 0 first, before any rank
   writes): if the step is already committed (a re-save), its manifest is deleted first,
   since objects of a committed step are never overwritten under its manifest; the older
   steps stay whole, but the step is gone until the re-save commits (an object store cannot
   swap two copies; logged); the run lock is read back before that delete, as before a
   commit (dckpt.root.fence);
2. ``uploads`` opens one ``ObjectUpload`` per save on each rank, which holds that save's
   state; its ``tee`` (every rank, while DCP writes its files): every byte the hashing writer
   writes to the local file also goes to ``step-N/<file>`` in the store, part by part as the parts
   fill, several in flight (``UploadStream``), hashed once for both: the digest in the
   manifest is of the bytes that went out. A file is complete in the store when it closes
   cleanly (its upload is aborted otherwise; rank 0's include ``.metadata``); ``publish``
   then checks that every file this rank wrote went up whole (and uploads, re-hashing, any
   that did not). A file an incremental save linked from the mirror's copy of an earlier
   step instead of writing it (dckpt.storage.stable_file) is copied inside the store from that
   step's object, its size checked (uploaded when the store refuses the copy);
3. ``finalize`` (rank 0, after every rank reported success): every object the manifest names
   must be listed at its size, and the run lock must still be this job's (read back); then
   ``manifest.json`` is put last: that PUT is the commit point (a PUT that errors is read
   back, so a reply lost after the store applied it is reported as the commit it is). Then
   (failures logged, never raised) a rollback's newer steps move to ``quarantine/``,
   ``latest`` is written, and the tmp dir becomes the mirror's copy of the step (the newest
   only), which a resume on this node re-verifies and uses instead of downloading.

A crash before step 3 leaves objects without a manifest: never listed as committed, removed
with any open multipart upload by ``ObjectRoot.recover`` at the next start.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import IntegrityError, LockError, StorageError
from ..faults import fault_point
from ..owned import make_dir
from ..phases import Phase, Trace
from ..root.commit import Flag, RenameCommit
from ..root.fence import Fence
from ..root.layout import STEP_RE, TMP_RE, step_dir_name
from ..root.manifest import MANIFEST_FILE, Manifest, parse_manifest
from ..root.retention import RetentionPolicy
from ..storage.records import FileRecord
from ..storage.sink import Sink, Tee
from .bucket import Bucket
from .s3_store import UploadStream

__all__ = ["ObjectCommit", "ObjectUpload", "keep_only"]

log = logging.getLogger("dckpt")


class _FirstPart:
    """Fires the ``upload`` fault point when a file's first part is sent (its multipart
    upload is then open in the store), or just before a one-part file's PUT."""

    def __init__(self, trace: Trace) -> None:
        self.trace, self.fired = trace, False

    def __call__(self, n: int) -> None:
        if not self.fired:
            self.fired = True
            self.trace.at(Phase.UPLOAD)


class _Counted:
    """An upload whose completed size ``ObjectCommit.publish`` checks against the record."""

    def __init__(self, stream: UploadStream, name: str, done: dict[str, int]) -> None:
        self.stream, self.name, self.done = stream, name, done

    def write(self, data: bytes | bytearray | memoryview, /) -> None:
        self.stream.write(data)

    def close(self) -> None:
        self.stream.close()
        self.done[self.name] = self.stream.sent

    def abort(self) -> None:
        self.stream.abort()


def keep_only(mirror: Path, step: int | None) -> None:
    """Remove the mirror's committed copies of every step but ``step`` (a cache of one)."""
    for child in Path(mirror).iterdir():
        m = STEP_RE.fullmatch(child.name)
        if m and int(m.group(1)) != step and child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)


class ObjectCommit:
    """Commit to an object store by writing the manifest last; see the module docstring."""

    shares_reused = False  # a reused file is copied in the store: an object of its own

    def __init__(self, root: Bucket, fence: Fence | None = None) -> None:
        self.objects = root
        self._local = RenameCommit()  # names of the mirror's tmp dirs
        self.fence = fence or Fence()
        """Rank 0's claim on the root: the bucket's run lock, read right before each commit;
        which steps it may move aside or delete (dckpt.root.fence)."""

    def tmp_location(self, root: Path, step: int, save_id: str) -> Path:
        return self._local.tmp_location(root, step, save_id)

    def where(self, root: Path, step: int) -> str:
        return self.objects.url_of(step_dir_name(step))

    def committed_file(self, root: Path, step: int, name: str) -> Path:
        # The mirror's copy of the newest step (on rank 0's node: ``finalize``): a file
        # linked from it is not uploaded but copied in the store (``publish``)
        return Path(root) / step_dir_name(step) / name

    def make_tmp(self, root: Path, tmp: Path, step: int, *, coordinator: bool) -> None:
        if coordinator:
            try:
                self._make_room(root, step)
            except LockError:
                raise  # fenced: said as such (SaveError "commits nothing more")
            except Exception as exc:
                raise StorageError(f"cannot prepare {self.where(root, step)}: {exc}") from exc
        make_dir(tmp, parents=True)

    def _make_room(self, root: Path, step: int) -> None:
        """A step saved again is uncommitted first: its objects are about to be overwritten."""
        if self.objects.store.head(self.objects.key(step_dir_name(step), MANIFEST_FILE)) is None:
            return
        self.fence.check()  # a delete: a job that lost its lock must not uncommit a step
        log.warning(
            "dckpt: step %d is saved again: its committed copy at %s is uncommitted first (an "
            "object store cannot swap two copies); older steps stay whole",
            step,
            self.where(root, step),
        )
        self.objects.uncommit(step)
        self.objects.publish_latest()

    def uploads(self, tmp: Path, step: int, trace: Trace) -> ObjectUpload:
        """One save's uploads on this rank."""
        return ObjectUpload(self.objects, tmp, step, trace)

    def finalize(self, root: Path, tmp: Path, step: int, *, cancelled: Flag | None = None) -> Path:
        if TMP_RE.fullmatch(tmp.name) is None or tmp.parent != Path(root):
            raise ValueError(f"{tmp} is not a dckpt tmp dir under {root}")
        raw = (tmp / MANIFEST_FILE).read_bytes()
        name = step_dir_name(step)
        fault_point(Phase.RENAME, 0, step)
        if cancelled is not None and cancelled.is_set():
            raise RuntimeError(f"the save of step {step} was cancelled before its commit")
        self._check_objects(step, parse_manifest(raw, str(tmp / MANIFEST_FILE)))
        self.fence.check()  # a job that lost its lock may have lost its objects too
        self._put_manifest(step, raw)  # the commit point
        self.fence.committed(step)
        final = Path(root) / name
        try:
            steps = self.objects.committed_steps()
            for newer in [s for s in steps if s > step]:
                if not self.fence.movable(newer, functools.partial(self.objects.run_of, newer)):
                    continue  # another job's: left, and said
                self.objects.quarantine(
                    newer,
                    f"superseded: the run was rolled back and saved step {step} after {newer}",
                )
            fault_point(Phase.PUBLISH_LATEST, 0, step)
            self.objects.publish_latest([s for s in steps if s <= step])
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            keep_only(Path(root), step)
        except Exception as exc:
            log.warning("dckpt: step %d is committed, but tidying up failed: %r", step, exc)
        return final

    def _check_objects(self, step: int, manifest: Manifest) -> None:
        """Every object the manifest lists is in the store at its recorded size."""
        name = step_dir_name(step)
        listed = {o.key: o.size for o in self.objects.store.list(self.objects.key(name) + "/")}
        for record in manifest.files:
            size = listed.get(self.objects.key(name, record.path))
            if size != record.bytes:
                raise IntegrityError(
                    self.objects.url_of(name, record.path),
                    f"{record.bytes} bytes, uploaded",
                    "no object" if size is None else f"{size} bytes",
                    detail="an uploaded object is gone or changed before the commit",
                )

    def _put_manifest(self, step: int, raw: bytes) -> None:
        """PUT the manifest; when the PUT fails, read it back: a reply lost after the store
        applied it means the step IS committed, and the caller must not say otherwise."""
        key = self.objects.key(step_dir_name(step), MANIFEST_FILE)
        try:
            self.objects.store.put_small(key, raw)
        except StorageError as exc:
            try:
                there = self.objects.store.get_small(key, len(raw))
            except StorageError:
                raise StorageError(
                    f"{exc} The manifest may or may not have landed; the next resume lists "
                    "and verifies what is committed."
                ) from None
            if there is None or there[0] != raw:
                raise
            log.warning("dckpt: the manifest PUT of step %d failed but landed: %s", step, exc)

    def retain(self, root: Path, policy: RetentionPolicy) -> None:
        if policy.enabled:
            self.objects.apply_retention(policy, fence=self.fence)


class ObjectUpload:
    """One save's uploads on one rank (``ObjectCommit.uploads``): its tee while DCP writes,
    then ``publish``; what went up is this save's, never another's."""

    def __init__(self, objects: Bucket, tmp: Path, step: int, trace: Trace) -> None:
        self.objects = objects
        self.tmp = tmp
        self.step = step
        self.trace = trace
        self._uploaded: dict[str, int] = {}  # this rank's files sent: name -> bytes
        name, progress = step_dir_name(step), _FirstPart(trace)

        def tee(relative: str) -> Sink:
            stream = objects.store.open_upload(objects.key(name, relative), progress)
            return _Counted(stream, relative, self._uploaded)

        self.tee: Tee = tee

    def publish(
        self, records: Sequence[FileRecord], *, reused: Mapping[str, int] | None = None
    ) -> float:
        """Every file went up while it was written (``tee``). One linked from a committed
        step (``reused``) is copied in the store from that step's object (server-side: no
        byte crosses the network), its size checked; one that did not go up either way (a
        writer that bypassed the tee, a copy the store refused) is uploaded now from the
        local copy, re-hashed as it is sent."""
        t0 = time.perf_counter()
        tmp, step, trace = self.tmp, self.step, self.trace
        name = step_dir_name(step)
        for record in records:
            if self._uploaded.get(record.path) == record.bytes:
                continue
            source = (reused or {}).get(record.path)
            if source is not None and self._copy(source, step, record):
                continue
            algorithm = record.digest.split(":", 1)[0]
            digest, sent = self.objects.store.upload_file(
                tmp / record.path, self.objects.key(name, record.path), algorithm,
                _FirstPart(trace),
            )  # fmt: skip
            if digest != record.digest or sent != record.bytes:
                raise IntegrityError(
                    str(tmp / record.path),
                    f"{record.digest} ({record.bytes} bytes), as written",
                    f"{digest} ({sent} bytes), as uploaded",
                    detail="the staged file changed between its write and its upload",
                )
        return time.perf_counter() - t0

    def _copy(self, source: int, step: int, record: FileRecord) -> bool:
        """``record``'s object copied from the committed ``source`` step's; False (logged)
        when the store could not, and the caller uploads it instead."""
        src = self.objects.key(step_dir_name(source), record.path)
        dst = self.objects.key(step_dir_name(step), record.path)
        try:
            self.objects.store.copy(src, dst)
            size = self.objects.store.head(dst)
        except StorageError as exc:
            log.warning("dckpt: %s; uploading it instead", exc)
            return False
        if size != record.bytes:
            log.warning(
                "dckpt: a copy of %s has %s bytes, not %d; uploading it instead",
                self.objects.url_of(step_dir_name(source), record.path), size, record.bytes,
            )  # fmt: skip
            return False
        self._uploaded[record.path] = record.bytes
        return True
