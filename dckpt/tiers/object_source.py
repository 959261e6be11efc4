"""Fetching a committed step from an object store into the local mirror, verified.

``ObjectSource`` is the ``CheckpointSource`` (dckpt.root.source) of an s3:// root. A resume
asks it for the committed steps (listed in the bucket: a manifest present), and before the
usual checks of a candidate every rank calls ``fetch``:

1. the manifest is read from the store and validated exactly as one on disk, and written
   into ``MIRROR/step-N/`` (replacing any other save's);
2. the files are shared out among the ranks of a node (``LOCAL_RANK``/``LOCAL_WORLD_SIZE``,
   by position in the sorted manifest); for each file of its share a rank keeps the mirror's
   copy only if its size and digest match the manifest (a cached copy is re-verified before
   use), and otherwise downloads it, hashing every byte as it is written, into a part file
   renamed into place; an object whose bytes differ from the writer's digest raises
   ``IntegrityError`` naming its URL, and the resume falls back past the step (quarantined
   in the bucket); once every rank's share is in (``complete``, after a barrier), a rank
   whose mirror still lacks a file (mirrors not shared by a node's ranks) downloads it too,
   so a wrong guess about which ranks share a mirror costs traffic, never a checkpoint;
3. the resume then runs the same checks as for a directory root on the mirror's copy (the
   layout, ``.metadata`` through the allow-list, the digests across ranks as DCP loads).

The mirror keeps one step (the newest fetched or saved); without torchrun's variables every
rank fetches every file it lacks (correct, if slower, on any node layout).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, IntegrityError, StorageError, UnreadableError
from ..owned import file_mode, make_dir, write_atomic
from ..root.layout import step_dir_name
from ..root.manifest import MANIFEST_FILE, Manifest, parse_manifest
from ..root.source import Fetcher
from ..storage.records import FileRecord
from ..storage.verified_files import open_verified
from ..units import human_bytes, plural
from .bucket import Bucket
from .object_commit import keep_only

__all__ = ["FetchReport", "ObjectSource", "local_share"]


@dataclass(frozen=True)
class FetchReport:
    """What one rank's fetch did."""

    source: str
    downloaded: int
    downloaded_bytes: int
    reused: int
    seconds: float
    reread: tuple[str, ...] = ()  # files whose first download mismatched and a second matched

    def line(self) -> str:
        speed = self.downloaded_bytes / max(self.seconds, 1e-9)
        again = (
            f"; re-read {', '.join(self.reread)}: the first download differed from the "
            "writer's digest, a fresh read matched (damaged on the way, not in the store)"
            if self.reread
            else ""
        )
        return (
            f"{plural(self.downloaded, 'file')} ({human_bytes(self.downloaded_bytes)}) "
            f"downloaded from {self.source} at {human_bytes(speed)}/s, each hashed as it "
            f"arrived; {self.reused} cached in the mirror, re-verified{again}"
        )


def local_share() -> tuple[int, int]:
    """(index, count) of this rank among its node's ranks, from torchrun's variables;
    (0, 1), fetch everything, where they are not set."""
    try:
        index = int(os.environ["LOCAL_RANK"])
        count = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return 0, 1
    return (index, count) if 0 <= index < count else (0, 1)


class ObjectSource:
    """A committed step in the bucket, fetched into ``local`` (the mirror) on demand."""

    def __init__(
        self,
        root: Bucket,
        mirror: Path,
        share: tuple[int, int] | None = None,
        *,
        keep_one: bool = True,
    ) -> None:
        self.objects = root
        self.local = Path(mirror)
        self.share = share or local_share()
        self.keep_one = keep_one  # the mirror keeps only the step fetched last
        self.session = _session()  # a stamp vouches for a file within one attempt of a job
        self._read: tuple[int, bytes, Manifest] | None = None  # the last manifest read
        self.fetcher: Fetcher | None = self
        """A step is brought into the mirror before it is read: by this source itself."""

    def __str__(self) -> str:
        return str(self.objects.url)

    def steps(self) -> list[int]:
        return self.objects.committed_steps()

    def origin(self, step: int) -> str:
        return f"{self.objects.url_of(step_dir_name(step))} (via the mirror {self.local})"

    def fetch(
        self,
        step: int,
        files: frozenset[str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> FetchReport:
        """This rank's share of ``step`` (with ``files``: exactly those, the files this
        rank's load reads): each file kept if verified, else downloaded."""
        if files is not None:
            return self._bring(step, lambda i, name: name in files, progress, fresh=True)
        index, count = self.share
        return self._bring(
            step,
            lambda i, name: i % count == index,
            progress,
            write_manifest=index == 0,
            fresh=True,
        )

    def complete(
        self,
        step: int,
        files: frozenset[str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> FetchReport | None:
        """After every rank fetched its share: whatever this rank's mirror still lacks (a
        mirror not shared by the node's ranks; of ``files`` when given), so every rank can
        read what it reads; None when nothing was missing."""
        report = self._bring(
            step, lambda i, name: files is None or name in files, progress, missing=True
        )
        if self.keep_one:
            keep_only(self.local, step)
        return report if report.downloaded else None

    def digest_remote(self, step: int, name: str) -> str:
        """The digest of ``step``'s object ``name``, streamed from the store (nothing is
        written: a file no rank of any node reads is still hashed, by some rank)."""
        manifest = self._manifest(step)
        record = manifest.file_map()[name]
        key = self.objects.key(step_dir_name(step), name)
        got = self.objects.store.check(key, record.bytes, record.digest)
        if got != record.digest:  # read twice, twice the same: the object is not its writer's
            raise IntegrityError(
                self.objects.url_of(step_dir_name(step), name),
                record.digest,
                got,
                detail="the object's bytes differ from the digest its writer computed",
            )
        return got

    def _manifest(self, step: int, *, fresh: bool = False) -> Manifest:
        if fresh or self._read is None or self._read[0] != step:  # complete reuses fetch's
            raw = self.objects.manifest_raw(step)
            where = self.objects.url_of(step_dir_name(step), MANIFEST_FILE)
            self._read = (step, raw, parse_manifest(raw, where))
        return self._read[2]

    def _bring(
        self,
        step: int,
        mine: Callable[[int, str], bool],
        progress: Callable[[int], None] | None,
        *,
        write_manifest: bool = True,
        missing: bool = False,
        fresh: bool = False,
    ) -> FetchReport:
        t0 = time.perf_counter()
        name = step_dir_name(step)
        manifest = self._manifest(step, fresh=fresh)
        assert self._read is not None
        raw = self._read[1]
        target = self.local / name
        make_dir(target, parents=True)
        if write_manifest and _read_or_none(target / MANIFEST_FILE) != raw:
            _write_replacing(target / MANIFEST_FILE, raw)
        downloaded = reused = nbytes = 0
        reread: list[str] = []
        ordered = sorted(manifest.files, key=lambda r: r.path)
        # Ranks of a node start their walk at their own place in it: two that read the same
        # files then download different ones at once, and each finds the other's done.
        start = self.share[0] % max(len(ordered), 1)
        for i, record in [*enumerate(ordered)][start:] + [*enumerate(ordered)][:start]:
            if not mine(i, record.path):
                continue
            path = target / record.path
            # Ranks of a node that share the mirror and read the same file take turns: the
            # first downloads it, the others find it there, stamped as verified.
            with _turn(target, record.path, self.session) as turn:
                if missing:  # another rank of this node verified what it fetched: its size
                    if _size_or_none(path) == record.bytes:
                        continue
                elif turn.vouches(path, record) or _verified_copy(path, record):
                    reused += 1
                    continue
                key = self.objects.key(name, record.path)
                reads = self.objects.store.download_verified(
                    key, path, record.bytes, record.digest, progress
                )
                turn.stamp(path, record)
            if reads > 1:
                reread.append(record.path)
            downloaded += 1
            nbytes += record.bytes
        return FetchReport(
            str(self), downloaded, nbytes, reused, time.perf_counter() - t0, tuple(reread)
        )

    def confirm_damage(self, step: int, exc: CheckpointError) -> None:
        """Before a quarantine: a digest, size or missing-file failure found in the mirror
        (not while downloading) is checked against the bucket; if every object there matches
        its digest, the damage is local: the mirror's copy is dropped and StorageError
        raised, so an intact checkpoint is never quarantined for a local fault."""
        if isinstance(exc, UnreadableError) and not exc.path.startswith("s3://"):
            self._confirm_unreadable(step, exc)
            return
        if not isinstance(exc, IntegrityError) or exc.path.startswith("s3://"):
            return
        _, problems = self.objects.check_objects(step)
        if problems:
            return
        shutil.rmtree(self.local / step_dir_name(step), ignore_errors=True)
        raise StorageError(
            f"step {step} failed verification in the local mirror ({exc.detail or exc}: "
            f"{exc.path}), but every object of it in {self.objects.url_of(step_dir_name(step))} "
            "matches its digest: the local copy was damaged after it was downloaded (the "
            "disk, or a mirror shared by ranks that should not share it). It was not "
            "quarantined and the mirror's copy was removed; start the job again."
        )

    def _confirm_unreadable(self, step: int, exc: UnreadableError) -> None:
        """A mirror's file the local disk failed to read twice (the second time a fresh
        download: ``forget``) says nothing of the bucket: its object is streamed through its
        digest (that one object, on rank 0), and unless it is damaged too, StorageError:
        nothing is set aside, and the next start fetches it afresh."""
        try:
            relative = Path(exc.path).relative_to(self.local / step_dir_name(step)).as_posix()
        except ValueError:  # not a mirror's file: the bucket's own failure, as it is
            return
        _, problems = self.objects.check_objects(step, only=frozenset({relative}))
        if problems:
            return
        raise StorageError(
            f"{exc.path} could not be read from the local mirror, twice, but its object in "
            f"{self.objects.url_of(step_dir_name(step), relative)} matches its digest: the "
            "local disk failed, not the checkpoint. Nothing was set aside; check the mirror's "
            "disk, then start the job again (the file is fetched afresh)."
        )

    def forget(self, step: int, path: str) -> None:
        """Every rank: drop this node's mirror copy of ``path`` (a file of ``step`` that
        failed to read), so the next read downloads it afresh; a path outside the mirror's
        step is left alone."""
        try:
            Path(path).relative_to(self.local / step_dir_name(step))
        except ValueError:
            return
        with contextlib.suppress(FileNotFoundError):  # another rank of this node dropped it
            os.unlink(path)  # the link itself, never what it points at

    def quarantine(self, step: int, reason: str, damage: CheckpointError | None = None) -> None:
        """Rank 0: moved aside in the bucket, once ``damage`` (the failure that condemns the
        step) is confirmed there (``confirm_damage``: a local fault raises StorageError)."""
        if damage is not None:
            self.confirm_damage(step, damage)
        self.objects.quarantine(step, reason)
        shutil.rmtree(self.local / step_dir_name(step), ignore_errors=True)

    def quarantined_count(self) -> int:
        return sum(1 for e in self.objects.entries() if e.status == "quarantined")

    def save_id(self, step: int) -> str:
        return self.objects.read_manifest(step).save_id


class _Turn:
    """A rank's turn at one file of the mirror: an advisory lock on ``.NAME.turn`` beside it,
    which also holds the stamp of the last download verified into it (the file's digest,
    inode, size and mtime). The file stays: removing it would let a third process lock a
    new one while a second still waits on the old."""

    def __init__(self, fd: int | None, session: str) -> None:
        self.fd = fd  # None: no lock here (a file system without flock): every rank verifies
        self.session = session

    def _identity(self, path: Path, record: FileRecord) -> dict[str, object] | None:
        try:
            st = path.lstat()
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return {"digest": record.digest, "ino": st.st_ino, "size": st.st_size,
                "mtime_ns": st.st_mtime_ns, "session": self.session}  # fmt: skip

    def vouches(self, path: Path, record: FileRecord) -> bool:
        """Whether ``path`` is the very file a download verified against ``record`` (not
        replaced or written since): a node's second rank need not hash it again, and the
        load's reader hashes every file it reads before a tensor is filled from it."""
        if self.fd is None or not self.session:  # outside torchrun: no job to tie it to
            return False
        try:
            raw = os.pread(self.fd, 4096, 0)
            stamp = json.loads(raw) if raw else None
        except (OSError, ValueError):
            return False
        now = self._identity(path, record)
        return now is not None and stamp == now and now["size"] == record.bytes

    def stamp(self, path: Path, record: FileRecord) -> None:
        if self.fd is None:
            return
        now = self._identity(path, record)
        with contextlib.suppress(OSError):  # without a stamp the next rank re-verifies
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(now).encode(), 0)


def _session() -> str:
    """One attempt of one torchrun job, the same on all its ranks ("" outside torchrun): a
    stamp from another attempt (a file cached by an earlier job) is re-verified, not trusted."""
    keys = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
    parts = [os.environ.get(k, "") for k in keys]
    return ":".join(parts) if parts[0] or parts[3] else ""


@contextlib.contextmanager
def _turn(target: Path, name: str, session: str) -> Iterator[_Turn]:
    """This process's turn at the mirror's file ``name`` (see ``_Turn``)."""
    # shared by the node's ranks (so not exclusive), but never through a link
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(target / f".{name}.turn", flags, file_mode())
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # Lustre without flock, some FUSE mounts: no turns, no stamps
            if exc.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOLCK):
                raise
            yield _Turn(None, session)
            return
        yield _Turn(fd, session)
    finally:
        os.close(fd)  # closing releases the lock


def _verified_copy(path: Path, record: FileRecord) -> bool:
    """Whether ``path`` is a regular file holding exactly the recorded bytes (any failure to
    prove it, damage or I/O, means: download it again)."""
    try:
        with open_verified(str(path), record):
            return True
    except (CheckpointError, OSError):
        return False


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _size_or_none(path: Path) -> int | None:
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _write_replacing(path: Path, data: bytes) -> None:
    write_atomic(path.parent, path.name, data, sync=False)  # tmp names unique across nodes
