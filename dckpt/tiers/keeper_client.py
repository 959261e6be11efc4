"""Talking to a node's keeper (dckpt.tiers.keeper): the wire format, the client, and starting one.

Wire format: every message is a 4-byte big-endian length and that many bytes of UTF-8 JSON (an
object, at most ``MAX_HEADER`` bytes); raw bytes follow only a header that declares their size.
One request per connection. Every final reply carries ``"ok"``, and ``"error"`` when false;
a long request (``committed``, which pushes a save to the partner) sends ``{"progress": n}``
frames first, so a client's timeout bounds a stall, not the whole push.

Invariants: a client never returns bytes it has not hashed to the digest it was given (a
mismatch is an IntegrityError naming ``keeper://host:port/node-K/step-N/path``); every socket
operation is bounded by the client's timeout; a keeper that cannot be reached is a
StorageError that names it and says what to do.

``ensure_keeper`` starts at most one keeper per node directory (an flock serialises the
node's workers) and starts it detached, so it outlives the worker that spawned it.
Stdlib + xxhash only (no torch).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, StorageError
from ..root.manifest import MANIFEST_FILE, MAX_MANIFEST_BYTES
from ..storage.digest import format_digest, new_hasher, parse_digest
from .memory_layout import KEEPER_FILE, KEEPER_LOG

__all__ = [
    "CHUNK",
    "MAX_HEADER",
    "KeeperClient",
    "advertised_host",
    "ensure_keeper",
    "parse_addr",
    "read_keeper_file",
    "recv_exact",
    "recv_msg",
    "send_msg",
]

MAX_HEADER = 1 << 20
CHUNK = 8 << 20
"""Bytes moved per recv/hash step: large enough that per-call overhead vanishes."""
START_LOCK = ".keeper-start.lock"
_LEN = struct.Struct(">I")


# --- framing -------------------------------------------------------------------------------


def send_msg(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_HEADER:
        raise ValueError(f"message of {len(data)} bytes is over the {MAX_HEADER}-byte cap")
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; ConnectionError when the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    """One framed JSON object; ConnectionError on EOF, ValueError on a malformed header."""
    (n,) = _LEN.unpack(recv_exact(sock, 4))
    if n > MAX_HEADER:
        raise ValueError(f"header of {n} bytes is over the {MAX_HEADER}-byte cap")
    obj = json.loads(recv_exact(sock, n).decode("utf-8"))
    if not isinstance(obj, dict):
        raise ValueError("header is not a JSON object")
    return obj


def recv_reply(sock: socket.socket) -> dict[str, Any]:
    """The final reply of a request, skipping ``progress`` frames (each resets the timeout)."""
    while True:
        msg = recv_msg(sock)
        if "ok" in msg:
            return msg


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"keeper address {addr!r} is not 'host:port'")
    return host.strip("[]"), int(port)


# --- where a keeper is -------------------------------------------------------------------


def advertised_host() -> str:
    """The address partners should use to reach this node's keeper.

    ``$DCKPT_KEEPER_HOST`` if set; else the local address of the route to ``$MASTER_ADDR``
    (the interface the job's traffic already uses); else 127.0.0.1 (single node).
    """
    env = os.environ.get("DCKPT_KEEPER_HOST")
    if env:
        return env
    master = os.environ.get("MASTER_ADDR")
    if master:
        port = os.environ.get("MASTER_PORT", "29500")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                # A UDP connect sends nothing: it only asks the kernel for the route.
                s.connect((master, int(port) if port.isdigit() else 29500))
                host = s.getsockname()[0]
            if isinstance(host, str) and host != "0.0.0.0":
                return host
        except OSError:
            pass
    return "127.0.0.1"


def read_keeper_file(node_dir: Path) -> dict[str, Any] | None:
    """The live keeper's record (``keeper.json``), or None when absent or unreadable."""
    try:
        obj = json.loads((Path(node_dir) / KEEPER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(obj, dict):
        return None
    for key, kind in (("pid", int), ("host", str), ("port", int), ("node", int)):
        if not isinstance(obj.get(key), kind):
            return None
    return obj


def _log_tail(node_dir: Path, lines: int = 20) -> str:
    try:
        text = (Path(node_dir) / KEEPER_LOG).read_text(errors="replace")
    except OSError:
        return "(no keeper.log)"
    return "\n".join(text.splitlines()[-lines:]) or "(keeper.log is empty)"


def _answers(addr: str, node: int, pid: int | None, timeout_s: float) -> bool:
    try:
        reply = KeeperClient(addr, timeout_s=timeout_s).hello()
    except StorageError:
        return False
    return (
        bool(reply.get("ok"))
        and reply.get("node") == node
        and (pid is None or reply.get("pid") == pid)
    )


def ensure_keeper(
    node_dir: Path,
    node: int,
    *,
    keep: int = 1,
    host: str | None = None,
    timeout_s: float = 20.0,
) -> str:
    """``host:port`` of this node's keeper; starts one (detached) when none answers."""
    node_dir = Path(node_dir)
    try:
        node_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(node_dir / START_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StorageError(
            f"cannot create the memory tier's node directory {node_dir}: {exc}; check that its "
            "file system (e.g. /dev/shm) exists, is writable and has room"
        ) from exc
    try:
        # Two workers of one node may get here at once: only one starts a keeper, the other
        # waits and then finds it answering.
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        rec = read_keeper_file(node_dir)
        if rec is not None and rec["node"] == node:
            addr = f"{rec['host']}:{rec['port']}"
            if _answers(addr, node, rec["pid"], min(timeout_s, 5.0)):
                return addr
        return _spawn(node_dir, node, keep, host or advertised_host(), timeout_s)
    finally:
        os.close(lock_fd)  # releases the flock


IDLE_EXIT_S = 24 * 3600.0
"""A keeper a job started leaves after this long without a request (``$DCKPT_KEEPER_IDLE_S``;
0: never): a job that ended, and was not restarted, does not hold host memory forever."""


def _idle_exit_s() -> float:
    try:
        return max(0.0, float(os.environ.get("DCKPT_KEEPER_IDLE_S", IDLE_EXIT_S)))
    except ValueError:
        return IDLE_EXIT_S


def _spawn(node_dir: Path, node: int, keep: int, host: str, timeout_s: float) -> str:
    cmd = [
        sys.executable,
        "-m",
        "dckpt.tiers.keeper",
        "--dir",
        str(node_dir),
        "--node",
        str(node),
        "--host",
        host,
        "--port",
        "0",
        "--keep",
        str(keep),
        "--idle-exit-s",
        str(_idle_exit_s()),
    ]
    env = dict(os.environ)
    # The keeper must import this very dckpt, whatever the worker's cwd.
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    try:
        with open(node_dir / KEEPER_LOG, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # no SIGINT/SIGHUP from the worker's group or tty
                close_fds=True,
                cwd="/",
                env=env,
            )
    except OSError as exc:
        raise StorageError(f"cannot start the memory keeper ({' '.join(cmd)}): {exc}") from exc
    # Reap it when it exits if this process is still around then (no zombie); if this worker
    # dies first, init adopts it.
    threading.Thread(target=proc.wait, name="dckpt-keeper-reaper", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StorageError(
                f"the memory keeper for node {node} exited with status {proc.returncode} "
                f"before answering; its log ({node_dir / KEEPER_LOG}) ends with:\n"
                f"{_log_tail(node_dir)}"
            )
        rec = read_keeper_file(node_dir)
        if rec is not None and rec["pid"] == proc.pid:
            addr = f"{rec['host']}:{rec['port']}"
            if _answers(addr, node, proc.pid, 2.0):
                return addr
        time.sleep(0.02)
    with contextlib.suppress(OSError):
        proc.kill()
    raise StorageError(
        f"the memory keeper for node {node} (pid {proc.pid}) did not answer within "
        f"{timeout_s:.0f} s; it was killed. Check that {node_dir} is writable and that the "
        f"advertised address {host!r} is this node's (set DCKPT_KEEPER_HOST). Its log ends "
        f"with:\n{_log_tail(node_dir)}"
    )


# --- the client -----------------------------------------------------------------------------


class KeeperClient:
    """Requests to one keeper at ``host:port``; each opens its own connection."""

    def __init__(self, addr: str, timeout_s: float = 60.0) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self._host, self._port = parse_addr(addr)

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self.timeout_s)
        except OSError as exc:
            raise self._unreachable(exc) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _unreachable(self, exc: BaseException) -> StorageError:
        return StorageError(
            f"memory keeper at {self.addr} is unreachable or broke off ({exc!r}); its node may "
            "be down or its keeper gone. The memory tier on that node cannot be used: fall "
            "back to the disk checkpoint, or restart the node's keeper (ensure_keeper)"
        )

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._connect() as sock:
            try:
                send_msg(sock, request)
                return recv_reply(sock)
            except (OSError, ValueError) as exc:
                raise self._unreachable(exc) from exc

    def hello(self) -> dict[str, Any]:
        reply = self._call({"op": "hello"})
        if not reply.get("ok"):
            raise StorageError(f"memory keeper at {self.addr} refused hello: {reply.get('error')}")
        return reply

    def committed(
        self, step: int, to: str | None, nodes: list[int] | None = None
    ) -> dict[str, Any]:
        """Tell the keeper ``own/step-N`` is committed: it retires older steps and, when ``to``
        is given, pushes this node's files there. The reply as is (``ok`` false when the push
        failed; the local copy stays committed either way)."""
        request: dict[str, Any] = {"op": "committed", "step": step, "to": to}
        if nodes is not None:
            request["nodes"] = list(nodes)
        return self._call(request)

    def _url(self, node: int, step: int, path: str) -> str:
        return f"keeper://{self.addr}/node-{node}/step-{step:08d}/{path}"

    def _open_get(self, node: int, step: int, path: str) -> tuple[socket.socket, int]:
        sock = self._connect()
        try:
            send_msg(sock, {"op": "get", "node": node, "step": step, "path": path})
            reply = recv_msg(sock)
        except (OSError, ValueError) as exc:
            sock.close()
            raise self._unreachable(exc) from exc
        if not reply.get("ok") or type(reply.get("bytes")) is not int:
            sock.close()
            raise StorageError(
                f"memory keeper at {self.addr} cannot serve {self._url(node, step, path)}: "
                f"{reply.get('error', 'malformed reply')}; read this checkpoint from another "
                "tier (disk) instead"
            )
        return sock, int(reply["bytes"])

    def read(
        self,
        node: int,
        step: int,
        path: str,
        expect_bytes: int,
        digest: str,
        into: memoryview | None = None,
    ) -> bytearray | memoryview:
        """The file's bytes, hashed as they arrive; ``into`` (writable, ``expect_bytes`` long
        or more) receives them in place when given and is returned."""
        url = self._url(node, step, path)
        algorithm, _ = parse_digest(digest)
        if into is not None and (into.readonly or into.nbytes < expect_bytes):
            raise ValueError(f"buffer for {url} is read-only or under {expect_bytes} bytes")
        sock, size = self._open_get(node, step, path)
        with sock:
            if size != expect_bytes:
                raise IntegrityError(url, f"{expect_bytes} bytes", f"{size} bytes", "size mismatch")
            out: bytearray | memoryview
            if into is not None:
                out = into
                view = into.cast("B") if into.format != "B" or into.ndim != 1 else into
                view = view[:expect_bytes]
            else:
                out = bytearray(expect_bytes)
                view = memoryview(out)
            hasher = new_hasher(algorithm)
            got = 0
            try:
                while got < size:
                    k = sock.recv_into(view[got : got + CHUNK])
                    if k == 0:
                        raise ConnectionError(f"connection closed after {got} of {size} bytes")
                    hasher.update(view[got : got + k])
                    got += k
            except OSError as exc:
                raise self._unreachable(exc) from exc
            actual = format_digest(algorithm, hasher)
            if actual != digest:
                raise IntegrityError(url, digest, actual, "digest mismatch")
        return out

    def manifest(self, node: int, step: int) -> bytes:
        """``manifest.json`` of node K's step N as this keeper holds it (parse it with
        ``parse_manifest``: its self-digest is its check)."""
        sock, size = self._open_get(node, step, MANIFEST_FILE)
        with sock:
            if size > MAX_MANIFEST_BYTES:
                raise IntegrityError(
                    self._url(node, step, MANIFEST_FILE),
                    f"at most {MAX_MANIFEST_BYTES} bytes",
                    f"{size} bytes",
                    "manifest too large",
                )
            try:
                return recv_exact(sock, size)
            except OSError as exc:
                raise self._unreachable(exc) from exc

    def stop(self, drop: bool = False) -> None:
        reply = self._call({"op": "stop", "drop": drop})
        if not reply.get("ok"):
            raise StorageError(f"memory keeper at {self.addr} refused stop: {reply.get('error')}")
