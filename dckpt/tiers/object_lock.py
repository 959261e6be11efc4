"""The run lock on an object store: ``PREFIX/.dckpt-lock``, taken by a conditional put.

The same owner record and staleness rules as the directory lock (dckpt.root.lock): a second
job on the root fails fast, naming the owner; a restart of the same run, a dead pid where this
process can judge it (the same host, boot and pid namespace: ``elsewhere``), or an owner
anywhere else (another host, or a container beside this one) whose renewal count stayed still
for its whole lease on the taker's own clock (no host's wall clock compared with another's)
lets the next job take over, with a log line.

How, with no O_EXCL and no rename: acquire is ``PUT If-None-Match: *`` (exactly one of two
racing jobs gets it); a takeover and every lease renewal is ``PUT If-Match: <the ETag read>``,
so a taker that read a stale record loses to anyone who wrote since. Stores without
conditional writes (S3 before Aug. 2024, some S3-compatible servers) are refused with that
reason rather than locked unsafely; ``lock=False`` (or ``DCKPT_LOCK=0``) opts out.

A record that is not dckpt's (``LockOwner.parse``: not JSON, a field of the wrong type) is a
LockError naming the object, never a takeover: a PUT is atomic, so no crash leaves one torn,
and a live job's record that a tool rewrote still means a live job.
"""

from __future__ import annotations

import logging
import threading
import uuid

from ..errors import LockError, StorageError
from ..root.layout import LOCK_FILE
from ..root.lock import (
    MAX_RECORD_BYTES,
    LockOwner,
    OnWait,
    apart,
    elsewhere,
    stale_reason,
    watch,
)
from .s3_store import S3Store

__all__ = ["ObjectLock"]

log = logging.getLogger("dckpt")


class ObjectLock:
    """Holds ``PREFIX/.dckpt-lock`` for one job; renews its lease on a daemon thread."""

    def __init__(self, store: S3Store, run_id: str, lease_s: float = 300.0) -> None:
        self.store = store
        self.key = store.url.key(LOCK_FILE)
        self.url = f"{store.url}/{LOCK_FILE}"
        self.run_id = run_id
        self.lease_s = lease_s
        self._token = uuid.uuid4().hex
        self._etag: str | None = None
        self._beat = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: str | None = None
        self.lost: str | None = None
        """Set when a renewal found the lock in other hands: this job must not commit."""

    def _record(self) -> bytes:
        return LockOwner.me(self.run_id, self._token, self.lease_s, self._beat).record()

    def _owner(self) -> LockOwner | None:
        found = self._read()
        return None if found is None else found[0]

    def _read(self) -> tuple[LockOwner, str] | None:
        """The owner the lock names and the object's ETag; None if there is no lock; a
        LockError if the object is not a lock record (``LockOwner.parse``)."""
        got = self.store.get_small(self.key, MAX_RECORD_BYTES)
        if got is None:
            return None
        raw, etag = got
        remove = f"aws s3 rm {self.url}, with --endpoint-url for a store other than AWS"
        return LockOwner.parse(raw, self.url, remove), etag

    def acquire(self, on_wait: OnWait | None = None) -> None:
        """Take the lock, or raise LockError naming the live owner. ``on_wait`` is told before
        a lock whose pid cannot be judged here (another host or pid namespace) is watched
        (dckpt.root.lock.watch)."""
        try:
            etag = self.store.put_small(self.key, self._record(), if_absent=True)
            if etag is None:
                etag = self._take_over(on_wait)
        except StorageError as exc:
            raise LockError(f"cannot take the run lock {self.url}: {exc}") from None
        self._etag = etag
        # A store that ignores If-None-Match would let two jobs both "take" the lock: ask
        # again for the key that now exists, which a store that honours it must refuse.
        if self.store.put_small(self.key, self._record(), if_absent=True) is not None:
            self.store.delete([self.key])
            raise LockError(
                f"{self.store.url}: the store does not honour conditional writes "
                "(If-None-Match), so a run lock there would not keep a second job out. Use "
                "a store that does (AWS S3, recent MinIO), or turn the lock off "
                "(CheckpointConfig(lock=False), or DCKPT_LOCK=0 in the environment) and make "
                "sure only one job writes this root."
            )
        self._thread = threading.Thread(target=self._renew, name="dckpt-lock", daemon=True)
        self._thread.start()

    def _take_over(self, on_wait: OnWait | None) -> str:
        current = self._read()
        if current is None:  # released between the two looks: try once more
            etag = self.store.put_small(self.key, self._record(), if_absent=True)
            if etag is None:
                raise LockError(f"{self.store.url}: lost the race for the run lock")
            return etag
        owner, seen = current
        reason = stale_reason(owner, self.run_id)
        if reason is None and elsewhere(owner):
            reason = watch(self._owner, owner, self.lease_s, str(self.store.url), on_wait)
            if reason is None:  # released while watched: take it afresh
                return self._take_over(on_wait)
            again = self._read()  # the record watched: a takeover needs its ETag now
            if again is None:
                return self._take_over(on_wait)
            if (again[0].token, again[0].beat) != (owner.token, owner.beat):
                # renewed (or taken) between the watch's last look and this one: it lives
                raise LockError(
                    f"{self.store.url} is in use by {again[0].describe()}: its lock moved "
                    "as this job was about to take it over. Two jobs writing one checkpoint "
                    "root would corrupt each other's history: stop that job, or point this "
                    "one at another root."
                )
            seen = again[1]
        if reason is None:
            raise LockError(
                f"{self.store.url} is in use by {owner.describe()}. Two jobs writing one "
                "checkpoint root would corrupt each other's history: stop that job, or point "
                "this one at another root."
            )
        etag = self.store.put_small(self.key, self._record(), if_match=seen)
        if etag is None:
            raise LockError(f"{self.store.url}: lost the race for the run lock to another job")
        self.took_over = f"took over the lock of {owner.describe()}: {reason}"
        log.warning("dckpt: %s", self.took_over)
        return etag

    def holder(self) -> str | None:
        """Who holds the lock now, unless it is stale (for ``dckpt gc``); None if free. A
        lock that is not a record dckpt can read may be a live job's: it is described, and so
        is one whose pid cannot be judged here (``stale_reason``: a CLI does not wait a
        lease to watch it)."""
        try:
            current = self._read()
        except LockError as exc:
            return f"a lock dckpt cannot read ({exc})"
        if current is None or stale_reason(current[0], self.run_id) is not None:
            return None
        where = apart(current[0])
        return current[0].describe() + ("" if where is None else f" {where}")

    def _renew(self) -> None:
        # A daemon on purpose: if the process dies, the lease must stop being renewed.
        while not self._stop.wait(self.lease_s / 3):
            self._beat += 1
            try:
                etag = self.store.put_small(self.key, self._record(), if_match=self._etag)
            except StorageError as exc:
                log.warning("dckpt: could not renew the run lock (will retry): %s", exc)
                continue
            if etag is None:  # the ETag changed: a lost reply to our own retried PUT?
                try:
                    current = self._read()
                except LockError:
                    self.lost = (
                        f"the run lock {self.url} was overwritten with a record dckpt cannot read"
                    )
                    log.error("dckpt: %s; this job commits nothing more", self.lost)
                    return
                except StorageError as exc:
                    log.warning("dckpt: could not read the run lock back (will retry): %s", exc)
                    continue
                if current is not None and current[0].token == self._token:
                    self._etag = current[1]
                    continue
                self.lost = f"the run lock {self.url} was taken by " + (
                    current[0].describe() if current is not None else "no one (it was deleted)"
                )
                log.error("dckpt: %s; this job commits nothing more", self.lost)
                return
            self._etag = etag

    def check_held(self) -> None:
        """Raise LockError unless this job still holds the lock (read from the store now):
        the commit runs this right before its manifest PUT."""
        if self.lost is None:
            try:
                current = self._read()
            except LockError:  # overwritten with something that is not a record
                self.lost = f"the run lock {self.url} holds a record dckpt cannot read"
            else:
                if current is None or current[0].token != self._token:
                    who = current[0].describe() if current is not None else "no one"
                    self.lost = f"the run lock {self.url} is held by {who}"
        if self.lost is not None:
            raise LockError(
                f"{self.lost}: another job may own {self.store.url} now, so this job commits "
                "nothing more to it. Stop this job; the other one goes on."
            )

    def abandon(self) -> None:
        """Stop renewing the lease but leave the lock: it runs out by itself."""
        self._stop.set()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._etag is None:  # never taken (a refused start: a missing bucket, a live owner)
            return
        try:
            current = self._read()
            if current is not None and current[0].token == self._token:
                self.store.delete([self.key])
        except LockError:
            pass  # overwritten with something that is not a record: not ours to delete
        except StorageError as exc:
            log.warning("dckpt: could not release the run lock (its lease runs out): %s", exc)
