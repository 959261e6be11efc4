"""The run lock: one training job per checkpoint root.

``ROOT/.dckpt-lock`` (JSON) names the owner: host, pid, process start time, run id, its lease
(``lease_s``), a renewal counter (``beat``) that the owner moves every ``lease_s / 3`` while
it lives, and, on Linux, the host's boot id and the owner's pid namespace (``boot_id``,
``pid_ns``). A second job on the same root fails fast with a message naming the owner. The
lock is taken over, with a log line, when the owner is provably gone:

- a restart of the same run (same run id: a requeue) takes it over at once;
- where its pid can be judged (``elsewhere`` is False: the same host name, and the same boot
  and pid namespace where the record names them): its pid no longer runs, or runs another
  program;
- anywhere else: its renewal counter did not move for a whole lease, watched on *this*
  host's monotonic clock (``watch``): the new job waits that long, saying so. No wall clock
  of another host is ever compared with this one's (a host whose clock ran ten minutes ahead
  took a live job's lock over), so clock skew between hosts changes nothing. "Anywhere else"
  includes another pid namespace on this host (a container or pod sharing the node's host
  name): pid 5 there is not pid 5 here, and judging it here took a live job's lock over. A
  record without ``boot_id`` and ``pid_ns`` (an older dckpt's) is judged by host name alone.

A takeover that is wrong (a holder stalled for a whole lease, or a second launch with the
same run id) loses nothing: every commit checks the lock right before its commit point
(``check_held``; dckpt.root.fence), so the job that lost the lock commits nothing more, and a
job deletes or moves aside only steps it found at its start or wrote itself.

Acquire writes a fresh file with O_EXCL, or, to take over, writes a tmp file and renames it
over the old one, then reads it back to confirm it won a race with another taker.

A lock record is checked field by field (``LockOwner.parse``) before any rule reads it: one
that is not dckpt's record (not JSON, a list, a pid that is a string, a lease that is not a
number) is a LockError naming the file, the field and what to do, never a takeover, since a
live job's record that some tool rewrote still means a live job. Only what a crash leaves
behind is taken over without a record: an empty or zero-filled file (a write the disk never
got, after a power cut), and a FIFO, symlink or directory in the lock's place (planted).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from ..errors import LockError, StorageError
from ..owned import create_new, write_atomic
from .layout import LOCK_FILE

__all__ = [
    "MAX_RECORD_BYTES",
    "LockOwner",
    "OnWait",
    "RunLock",
    "apart",
    "elsewhere",
    "stale_reason",
    "watch",
]

log = logging.getLogger("dckpt")

MAX_RECORD_BYTES = 1 << 16
"""A lock record is ~200 bytes; anything past this is not one."""
READ_BACKOFF_S = (0.2, 1.0, 3.0)
"""Pauses between reads of a lock file that failed to read (EIO, ESTALE)."""
_PID_MAX = 1 << 22  # Linux's highest pid_max
_EPOCH_MAX = 1e11  # seconds: the year 5138
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_UUID = re.compile(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}")


def _kind(value: object) -> str:
    """``value`` as the lock record holds it, for an error message."""
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "the whole number", float: "the number", str: "the string"}
    name = names.get(type(value), "a list" if isinstance(value, list) else "an object")
    try:
        shown = json.dumps(value)
    except (ValueError, RecursionError):
        shown = "..."
    return f"{name} {shown[:40]}{'...' if len(shown) > 40 else ''}"


def _text(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{_kind(value)}, not a non-empty string")
    return value


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{_kind(value)}, not a time in seconds since the epoch")
    try:
        seconds = float(value)
    except OverflowError:  # a whole number past any float
        seconds = math.inf
    if not 0 <= seconds < _EPOCH_MAX:  # NaN too; time.localtime must be able to show it
        raise ValueError(f"{_kind(value)}, not a time in seconds since the epoch")
    return seconds


def _pid(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_kind(value)}, not a process id (a whole number)")
    if not 0 < value <= _PID_MAX:
        raise ValueError(f"{_kind(value)}, not a process id (1 to {_PID_MAX})")
    return value


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{_kind(value)}, not a renewal count (a whole number >= 0)")
    return value


def _boot(value: object) -> str:
    if not isinstance(value, str) or not _UUID.fullmatch(value):
        raise ValueError(f"{_kind(value)}, not a boot id (a UUID, as {_BOOT_ID} holds)")
    return value


def _namespace(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 64:
        raise ValueError(
            f"{_kind(value)}, not a pid namespace (the inode number of /proc/self/ns/pid)"
        )
    return value


def _lease(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{_kind(value)}, not a lease in seconds")
    if not 0 < float(value) <= 86400 * 7:
        raise ValueError(f"{_kind(value)}, not a lease in seconds (up to a week)")
    return float(value)


_FIELDS: dict[str, Callable[[object], object]] = {
    "host": _text,
    "pid": _pid,
    "started": _seconds,
    "run_id": _text,
    "token": _text,
    "lease_until": _seconds,
}
"""Each field of a lock record, and its reader (ValueError saying what the value is not)."""
_OPTIONAL: dict[str, Callable[[object], object]] = {
    "beat": _count,
    "lease_s": _lease,
    "boot_id": _boot,
    "pid_ns": _namespace,
}
"""Fields an older dckpt's record lacks (then ``beat`` 0, the others unknown: None), and that
a record leaves out where they are unknown (``boot_id``, ``pid_ns`` off Linux)."""


@dataclass(frozen=True)
class LockOwner:
    """Who holds a run lock (the lock file's JSON)."""

    host: str
    pid: int
    started: float
    run_id: str
    token: str
    lease_until: float
    """This host's wall clock plus the lease, at the last renewal: for people only (``ls``,
    messages); staleness never compares it with another host's clock."""
    beat: int = 0
    """How many times the owner renewed the lease: what a taker that cannot judge its pid
    (another host, boot or pid namespace) watches."""
    lease_s: float | None = None
    """The owner's lease: it renews every third of it (None: an older dckpt's record)."""
    boot_id: str | None = None
    """The owner's host's boot id (``/proc/sys/kernel/random/boot_id``); None: not Linux, or
    an older dckpt's record."""
    pid_ns: int | None = None
    """The owner's pid namespace (the inode of ``/proc/self/ns/pid``): ``pid`` means that
    process only in this namespace. None: not Linux, or an older dckpt's record."""

    @classmethod
    def me(cls, run_id: str, token: str, lease_s: float, beat: int = 0) -> LockOwner:
        """This process, holding the lock for ``lease_s`` from now, renewed ``beat`` times."""
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            pid=pid,
            started=_my_start() or time.time(),
            run_id=run_id,
            token=token,
            lease_until=time.time() + lease_s,
            beat=beat,
            lease_s=lease_s,
            boot_id=_boot_id(),
            pid_ns=_pid_ns(),
        )

    def record(self) -> bytes:
        """The lock record (JSON), without the fields that are unknown (None): ``parse``
        reads an absent field as unknown, and refuses a null one like any ill-typed field."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}).encode()

    @classmethod
    def parse(cls, raw: bytes, where: str, remove: str) -> LockOwner:
        """The owner the lock record ``raw`` names, every field checked (type and range).

        Raises LockError naming ``where`` (the lock's path or URL), what is wrong, and what
        to do: ``remove`` says how to delete the lock. Fields it does not know are ignored (a
        newer dckpt's record still names its owner)."""

        def refuse(problem: str) -> LockError:
            return LockError(
                f"the run lock {where} is not a lock record dckpt can read: {problem}. A job "
                "may still hold the root, so dckpt does not take the lock over. If no job "
                f"runs on this root, remove the lock ({remove}) and start again."
            )

        if len(raw) > MAX_RECORD_BYTES:
            raise refuse(f"it is over {MAX_RECORD_BYTES} bytes")
        try:
            record = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise refuse(f"it is not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise refuse(f"it is {_kind(record)}, not a JSON object")
        values: dict[str, Any] = {}
        for name, read in [*_FIELDS.items(), *_OPTIONAL.items()]:
            if name not in record:
                if name in _OPTIONAL:
                    continue
                raise refuse(f"it has no field {name!r}")
            try:
                values[name] = read(record[name])
            except ValueError as exc:
                raise refuse(f"field {name!r} is {exc}") from None
        return cls(**values)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"run {self.run_id} (pid {self.pid} on {self.host}, started {when})"


def _boot_id() -> str | None:
    """This host's boot id; None where the kernel does not give one (not Linux)."""
    try:
        found = _BOOT_ID.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None
    return found if _UUID.fullmatch(found) else None


def _pid_ns() -> int | None:
    """This process's pid namespace (its inode); None where /proc has none (not Linux)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _proc_is_mine() -> bool:
    """Whether psutil sees this process's own pid namespace. On Linux it reads /proc, which
    may be mounted from another namespace (``unshare --pid`` without ``--mount-proc``: pid
    N there is another process) or not at all (every pid would look gone)."""
    if not sys.platform.startswith("linux"):
        return True  # psutil asks the kernel itself
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def apart(owner: LockOwner) -> str | None:
    """Where ``owner`` runs, in words, when this process cannot judge its pid; None when it
    can: the same host name, the same boot and pid namespace where the record names them (an
    older dckpt's record does not: the host name decides), and a /proc of this process's
    own namespace. The one rule ``stale_reason`` and ``elsewhere`` share: a pid is judged
    only where it means the owner's process."""
    if owner.host != socket.gethostname():
        return "on another host"
    if owner.boot_id is not None and owner.boot_id != _boot_id():
        return (
            "on a host of this name in another boot (another machine of the same name, or "
            "this one before a reboot)"
        )
    if owner.pid_ns is not None and owner.pid_ns != _pid_ns():
        return "in another pid namespace on this host (a container)"
    if not _proc_is_mine():
        return "on this host, whose processes this process cannot see (/proc is not its own)"
    return None


def stale_reason(owner: LockOwner, run_id: str) -> str | None:
    """Why ``owner``'s lock may be taken over by ``run_id`` at once, or None: it is live, or
    (``elsewhere``) its pid cannot be judged here, where only ``watch`` can tell."""
    if owner.run_id == run_id:
        return "the same run restarted"
    if apart(owner) is None:
        started = _proc_started(owner.pid)
        if started is None:
            return f"pid {owner.pid} is no longer running"
        if abs(started - owner.started) > 1.0:
            return f"pid {owner.pid} now belongs to another process"
    return None


def elsewhere(owner: LockOwner) -> bool:
    """Whether ``owner``'s pid cannot be judged from this process (another host, boot or pid
    namespace): its liveness is watched (``watch``), never assumed."""
    return apart(owner) is not None


OnWait = Callable[[float, str], None]
"""Told, before a lock is watched, how many seconds the watch may take and why: the job's
other ranks wait that long with the rank that takes the lock (dckpt.collective.gate)."""


def watch(
    read: Callable[[], LockOwner | None],
    first: LockOwner,
    lease_s: float,
    where: str,
    on_wait: OnWait | None = None,
) -> str | None:
    """Watch the lock whose record ``first`` was, held where its pid cannot be judged
    (``elsewhere``): the reason to take it over once its renewal counter stayed still for the
    owner's whole lease (``lease_s`` if its record does not say) on this host's monotonic
    clock, or None when the lock went away meanwhile. LockError naming the owner as soon as
    it moves (a renewal: it lives) or another job takes it. Reads the record every 2 s at
    most (a small read), so a live owner, which renews every third of its lease, is seen at
    its next renewal. ``on_wait`` is told the lease and why before the watch begins."""
    lease = first.lease_s or lease_s
    there = apart(first) or "on this host"
    log.warning(
        "dckpt: the run lock %s is held by %s %s; waiting up to %.0f s (its lease) to see "
        "whether it is renewed before taking it over. A requeued job with the same "
        "DCKPT_RUN_ID takes its own lock over at once.",
        where,
        first.describe(),
        there,
        lease,
    )
    if on_wait is not None:
        on_wait(
            lease + 5.0,  # the watch, and its last read
            f"it watches the run lock {where}, held by {first.describe()} {there}, "
            f"for up to {lease:.0f} s (the lock's lease) before taking it over",
        )
    start = time.monotonic()
    while (waited := time.monotonic() - start) < lease:
        time.sleep(min(max(lease / 30, 0.2), 2.0, lease - waited))
        now = read()
        if now is None:
            return None
        if now.token != first.token or now.beat != first.beat:
            who = "it was renewed" if now.token == first.token else "another job took it"
            raise LockError(
                f"{where} is in use by {now.describe()} {apart(now) or 'on this host'}: "
                f"{who} while this job watched it "
                f"({time.monotonic() - start:.0f} s). Two jobs writing one checkpoint root "
                "would corrupt each other's history: stop that job, or point this one at "
                "another root."
            )
    return (
        f"its renewal count stayed at {first.beat} for {time.monotonic() - start:.0f} s "
        f"(its lease, on this host's clock)"
    )


def _my_start() -> float | None:
    """When this process started, as a taker in its own pid namespace reads it
    (``_proc_started``). Where /proc is another namespace's (``unshare --pid`` without
    ``--mount-proc``), psutil would read another process by this pid: ``/proc/self`` is
    still this process, so its start is read there."""
    if _proc_is_mine():
        return _proc_started(os.getpid())
    try:
        raw = Path("/proc/self/stat").read_text(encoding="ascii", errors="replace")
        ticks = int(raw.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return float(psutil.boot_time()) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _proc_started(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


class RunLock:
    """Holds ``ROOT/.dckpt-lock`` for one job; renews its lease on a daemon thread."""

    def __init__(
        self, root: Path, run_id: str, lease_s: float = 300.0, *, name: str | None = None
    ) -> None:
        self.path = root / LOCK_FILE
        self.name = name or str(root)
        """The root as the user named it, in a refusal: an s3:// root's mirror is locked too,
        and a user who started two jobs on one bucket should read the bucket's name."""
        self.run_id = run_id
        self.lease_s = lease_s
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat = 0
        self.took_over: str | None = None
        self.lost: str | None = None
        """Set once this job found its lock in other hands: it must not commit again."""

    def _me(self) -> LockOwner:
        return LockOwner.me(self.run_id, self._token, self.lease_s, self._beat)

    def _owner(self) -> LockOwner | None:
        """The record now, for ``watch`` (anything that is not a record: as gone)."""
        found = self._read_retried()
        return found if isinstance(found, LockOwner) else None

    def _read(self) -> LockOwner | str | None:
        """The owner the lock file names; a string saying why the file is nobody's record (a
        crash's or a planter's leftover, to take over); None if there is no lock. A record
        that is neither is a LockError (``LockOwner.parse``); a lock file that could not be
        read (EIO, EACCES, ESTALE) is a StorageError: it may be a live owner's, or this
        job's own, so it is neither taken over nor counted as lost."""
        # No symlink followed, no FIFO waited on: anyone who can write the root can plant one.
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._unreadable(exc) from None
        if not stat.S_ISREG(mode):
            return "it is not a regular file (a link, FIFO or directory put in its place)"
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None  # released between the two looks
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link put in its place between the two looks
                return "it is not a regular file (a link put in its place)"
            raise self._unreadable(exc) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "it is not a regular file (a FIFO or device put in its place)"
            raw = os.read(fd, MAX_RECORD_BYTES + 1)
        except OSError as exc:
            raise self._unreadable(exc) from None
        finally:
            os.close(fd)
        if not raw.strip(b"\0"):
            # What a power cut leaves of a record the disk never got (or of one being written
            # by O_EXCL right now: then the writer finds our record on its read-back, and loses)
            return "it is empty or zero-filled (a write cut short by a crash)"
        return LockOwner.parse(raw, str(self.path), f"rm {self.path}")

    def _unreadable(self, exc: OSError) -> StorageError:
        return StorageError(
            f"cannot read the run lock {self.path} "
            f"({os.strerror(exc.errno) if exc.errno else exc}): the storage failed to serve it. "
            "dckpt neither takes over nor gives up a lock it cannot read; check the file "
            "system and the lock's permissions"
        )

    def _read_retried(self) -> LockOwner | str | None:
        """``_read``, tried again after a storage error (a flaky read is not a verdict): up to
        four times over about ``sum(READ_BACKOFF_S)`` seconds."""
        for pause in (*READ_BACKOFF_S, None):
            try:
                return self._read()
            except StorageError:
                if pause is None:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable")

    def _write_over(self) -> None:
        write_atomic(self.path.parent, LOCK_FILE, self._me().record())

    def acquire(self, on_wait: OnWait | None = None) -> None:
        """Take the lock, or raise LockError naming the live owner (or what is wrong with
        the lock record found); StorageError if the lock file cannot be read. ``on_wait`` is
        told before a lock whose pid cannot be judged here (another host, boot or pid
        namespace: ``apart``) is watched (``watch``)."""
        try:
            fd = create_new(self.path)
        except FileExistsError:
            current = self._read_retried()
            if isinstance(current, LockOwner):
                reason = stale_reason(current, self.run_id)
                if reason is None and elsewhere(current):
                    reason = watch(self._owner, current, self.lease_s, self.name, on_wait)
                    if reason is None:  # released while watched: take it afresh
                        return self.acquire(on_wait)
                if reason is None:
                    raise LockError(
                        f"{self.name} is in use by {current.describe()}. Two jobs writing one "
                        "checkpoint root would corrupt each other's history: stop that job, or "
                        "point this one at another --ckpt-dir."
                    ) from None
                self.took_over = f"took over the lock of {current.describe()}: {reason}"
            elif current is not None:
                self.took_over = f"took over the run lock {self.path}: {current}"
            self._write_over()
            if self.took_over is not None:
                log.warning("dckpt: %s", self.took_over)
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(self._me().record())
        mine = self._read_retried()
        if not isinstance(mine, LockOwner) or mine.token != self._token:
            other = mine.describe() if isinstance(mine, LockOwner) else "another job"
            raise LockError(f"{self.name}: lost the race for the lock to {other}")
        self._thread = threading.Thread(target=self._renew, name="dckpt-lock", daemon=True)
        self._thread.start()

    def _mine(self, read: Callable[[], LockOwner | str | None]) -> bool:
        """Whether the lock file holds this job's record now, read back whole: a record of
        another job, one that is not a record, or no lock at all is not this job's. A read
        that fails raises StorageError: no verdict either way."""
        try:
            owner = read()
        except LockError:
            return False
        return isinstance(owner, LockOwner) and owner.token == self._token

    def _renew(self) -> None:
        # A daemon on purpose: if the process dies, the lease must stop being renewed.
        while not self._stop.wait(self.lease_s / 3):
            try:
                mine = self._mine(self._read)
            except StorageError as exc:
                # Not renewed this time: writing over a record this job cannot read could
                # overwrite another job's. A taker that cannot judge the pid waits a lease.
                log.warning("dckpt: could not renew the run lock (will retry): %s", exc)
                continue
            if not mine:
                self._lose()
                return
            self._beat += 1
            try:
                self._write_over()
            except OSError as exc:  # the next renewal tries again; a taker sees no beat
                log.warning("dckpt: could not renew the run lock %s: %s", self.path, exc)

    def _lose(self) -> None:
        """This job's lock is in other hands: say so once; it commits nothing more."""
        if self.lost is not None:
            return
        try:
            owner = self._read()
        except (LockError, StorageError):
            owner = None
        who = owner.describe() if isinstance(owner, LockOwner) else "no one (it is gone)"
        self.lost = f"the run lock {self.path} is held by {who}"
        log.error("dckpt: %s; this job commits nothing more to %s", self.lost, self.name)

    def check_held(self) -> None:
        """Raise LockError unless this job still holds the lock, read from the file now:
        every commit runs it right before its commit point (fencing). A lock file that cannot
        be read, after retries, raises StorageError: that commit does not happen, the lock is
        not counted as lost, and the next commit reads it again."""
        if self.lost is None and not self._mine(self._read_retried):
            self._lose()
        if self.lost is not None:
            raise LockError(
                f"{self.lost}: another job may own {self.name} now, so this job commits "
                "nothing more to it. Stop this job; the other one goes on."
            )

    def abandon(self) -> None:
        """Stop renewing the lease but leave the lock in place: for a job that cannot tell
        whether a stuck write of its own may still land; the lease runs out by itself."""
        self._stop.set()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            mine = self._mine(self._read)
        except StorageError as exc:
            log.warning("dckpt: could not release the run lock (its lease runs out): %s", exc)
            return
        if mine:  # never taken (a refused start), or taken by another: left alone
            self.path.unlink(missing_ok=True)
