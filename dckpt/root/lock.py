"""The run lock: one training job per checkpoint root.

``ROOT/.dckpt-lock`` (JSON) names the owner: host, pid, process start time, run id, and a lease
that the owner renews while it lives. A second job on the same root fails fast with a message
naming the owner. The lock is taken over, with a log line, when the owner is provably gone:
on the same host, its pid no longer runs (or runs another program); on another host, its lease
expired. A restart of the same run (same run id) takes the lock over too.

Acquire writes a fresh file with O_EXCL, or, to take over, writes a tmp file and renames it
over the old one, then reads it back to confirm it won a race with another taker.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from ..errors import LockError
from .layout import LOCK_FILE, read_small_file

__all__ = ["LockOwner", "RunLock", "stale_reason"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True)
class LockOwner:
    """Who holds a run lock (the lock file's JSON)."""

    host: str
    pid: int
    started: float
    run_id: str
    token: str
    lease_until: float

    @classmethod
    def me(cls, run_id: str, token: str, lease_s: float) -> LockOwner:
        """This process, holding the lock for ``lease_s`` from now."""
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            pid=pid,
            started=_proc_started(pid) or time.time(),
            run_id=run_id,
            token=token,
            lease_until=time.time() + lease_s,
        )

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"run {self.run_id} (pid {self.pid} on {self.host}, started {when})"


def stale_reason(owner: LockOwner, run_id: str) -> str | None:
    """Why ``owner``'s lock may be taken over by ``run_id``, or None while it is live."""
    if owner.run_id == run_id:
        return "the same run restarted"
    if owner.host == socket.gethostname():
        started = _proc_started(owner.pid)
        if started is None:
            return f"pid {owner.pid} is no longer running"
        if abs(started - owner.started) > 1.0:
            return f"pid {owner.pid} now belongs to another process"
        return None
    if owner.lease_until < time.time():
        return f"its lease expired {time.time() - owner.lease_until:.0f} s ago"
    return None


def _proc_started(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


class RunLock:
    """Holds ``ROOT/.dckpt-lock`` for one job; renews its lease on a daemon thread."""

    def __init__(self, root: Path, run_id: str, lease_s: float = 300.0) -> None:
        self.path = root / LOCK_FILE
        self.run_id = run_id
        self.lease_s = lease_s
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: str | None = None

    def _me(self) -> LockOwner:
        return LockOwner.me(self.run_id, self._token, self.lease_s)

    def _read(self) -> LockOwner | None:
        # No symlink followed, no FIFO waited on: anyone who can write the root can plant one.
        # Such a lock is stale; a regular lock file that cannot be read (EACCES, EIO, ESTALE)
        # may be a live owner's, so that is an error, never a takeover.
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LockError(f"cannot read the run lock {self.path}: {exc}") from None
        if not stat.S_ISREG(mode):
            return LockOwner("?", -1, 0.0, "?", "?", 0.0)  # a link, FIFO, directory: stale
        raw = read_small_file(self.path, 1 << 16)
        if raw is None:
            if not os.path.lexists(self.path):
                return None  # released between the two looks
            raise LockError(f"cannot read the run lock {self.path}; check its permissions")
        try:
            return LockOwner(**json.loads(raw.decode("utf-8")))
        except (ValueError, TypeError):
            return LockOwner("?", -1, 0.0, "?", "?", 0.0)  # unreadable: treat as stale

    def _write_over(self) -> None:
        tmp = self.path.with_name(f"{LOCK_FILE}.tmp-{self._token}")
        tmp.write_text(json.dumps(asdict(self._me())), encoding="utf-8")
        os.replace(tmp, self.path)

    def acquire(self) -> None:
        """Take the lock, or raise LockError naming the live owner."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            owner = self._read()
            reason = None if owner is None else stale_reason(owner, self.run_id)
            if owner is not None and reason is None:
                raise LockError(
                    f"{self.path.parent} is in use by {owner.describe()}. Two jobs writing one "
                    "checkpoint root would corrupt each other's history: stop that job, or "
                    "point this one at another --ckpt-dir."
                ) from None
            self._write_over()
            if owner is not None:
                self.took_over = f"took over the lock of {owner.describe()}: {reason}"
                log.warning("dckpt: %s", self.took_over)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(asdict(self._me())))
        mine = self._read()
        if mine is None or mine.token != self._token:
            other = mine.describe() if mine else "another job"
            raise LockError(f"{self.path.parent}: lost the race for the lock to {other}")
        self._thread = threading.Thread(target=self._renew, name="dckpt-lock", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        # A daemon on purpose: if the process dies, the lease must stop being renewed.
        while not self._stop.wait(self.lease_s / 3):
            owner = self._read()
            if owner is None or owner.token != self._token:
                log.error("dckpt: the run lock %s was taken by someone else", self.path)
                return
            self._write_over()

    def abandon(self) -> None:
        """Stop renewing the lease but leave the lock in place: for a job that cannot tell
        whether a stuck write of its own may still land; the lease runs out by itself."""
        self._stop.set()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        owner = self._read()
        if owner is not None and owner.token == self._token:
            self.path.unlink(missing_ok=True)
