"""The memory tier's per-node keeper: owns ``MEMORY_DIR/node-<n>/``, copies this node's
committed memory saves to a partner keeper, and serves files back to a resume.

Run as ``python -m dckpt.tiers.keeper --dir NODE_DIR --node N [--host H] [--port 0]
[--keep 1] [--idle-exit-s 0]``; ``ensure_keeper`` (dckpt.tiers.keeper_client) starts it
detached, so it outlives the training workers (a SIGKILL, a torchrun restart). The layout and
the retention helpers are dckpt.tiers.memory_layout's; the wire format is keeper_client's.

Requests (one per connection, threaded): ``hello``, ``committed`` (a worker committed
``own/step-N``: retire older steps, push this node's files to ``to``), ``put`` (a partner's
files, received into a tmp dir), ``get`` (a committed file, sent with sendfile) and ``stop``.

Invariants:
- a replica step is committed (renamed from ``.tmp-`` and given its manifest) only after every
  byte of every file hashed, as it arrived, to the digest the writer's manifest records, and
  the files are exactly that node's files of the manifest; anything else leaves no trace;
- only committed step dirs are ever served; nothing half-written survives a restart (the
  ``.tmp-`` dirs are removed on start);
- at most one keeper serves a node dir: ``keeper.json`` names it, and a keeper that finds the
  dir gone or the record naming another pid exits (the memory was wiped, or it was replaced);
- retention is ``keep`` committed steps per kind (own, each replica node); retired files are
  reused by the next save of the same name, so memory stays at its level after the first save.
Stdlib + xxhash only (no torch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import socketserver
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..root.layout import TMP_RE, step_dir_name
from ..root.manifest import MANIFEST_FILE, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ..storage.digest import format_digest, new_hasher, parse_digest
from .keeper_client import (
    CHUNK,
    advertised_host,
    parse_addr,
    recv_exact,
    recv_msg,
    recv_reply,
    send_msg,
)
from .memory_layout import (
    KEEPER_FILE,
    KEEPER_LOG,
    committed_memory_steps,
    own_dir,
    replica_dir,
    reserve_spare,
    retire_beyond,
    spare_dir,
    take_spare,
    tmp_step_dir,
)

__all__ = ["Keeper", "main", "node_files"]

VERSION = 1
IO_TIMEOUT_S = 60.0
"""Per socket operation: a peer silent this long is gone."""
WATCH_INTERVAL_S = 1.0
PROGRESS_INTERVAL_S = 1.0
_NODE_RE = re.compile(r"node-([0-9]+)")


LOG_LIMIT = 1 << 20
"""Bytes of ``keeper.log`` kept at most (about 10,000 saves' worth of lines)."""


class RequestError(Exception):
    """A request this keeper refuses; the message goes back as ``error``."""


def _plain_name(path: Any) -> str:
    if (
        not isinstance(path, str)
        or not path
        or "/" in path
        or "\\" in path
        or "\0" in path
        or path in (".", "..")
    ):
        raise RequestError(f"file path {path!r} is not a plain file name")
    return path


def _int_field(req: dict[str, Any], key: str) -> int:
    value = req.get(key)
    if type(value) is not int or value < 0:
        raise RequestError(f"{key!r} must be a non-negative integer, got {value!r}")
    return value


def node_files(manifest: Manifest, node: int, nodes: Any = None) -> dict[str, Any]:
    """The manifest's records of ``node``'s ranks, by path. ``nodes`` (rank -> node) defaults
    to ``manifest.mesh["nodes"]``."""
    if nodes is None:
        nodes = manifest.mesh.get("nodes")
    if (
        not isinstance(nodes, list)
        or len(nodes) != manifest.world_size
        or not all(type(n) is int for n in nodes)
    ):
        raise RequestError(
            f"the manifest of step {manifest.step} has no rank-to-node map (mesh['nodes'] "
            f"must list {manifest.world_size} node indices); cannot tell which files are "
            f"node {node}'s"
        )
    return {f.path: f for f in manifest.files if nodes[f.rank] == node}


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Keeper:
    """The state and the request handlers of one node's keeper."""

    def __init__(self, node_dir: Path, node: int, host: str, keep: int, idle_exit_s: float):
        self.dir = Path(node_dir)
        self.node = node
        self.host = host
        self.keep = max(1, keep)
        self.idle_exit_s = idle_exit_s
        self.pid = os.getpid()
        self.started = time.time()
        self.port = 0
        self._last_request = time.monotonic()
        self._in_flight = 0
        self._state_lock = threading.Lock()  # counters
        self._commit_lock = threading.Lock()  # own-dir retirement and pushes, in step order
        self._replica_lock = threading.Lock()  # renames and retirement under replica/
        self._log_lock = threading.Lock()
        self.stop_event = threading.Event()
        self.stop_reason = ""
        self.drop = False
        self._log_to_file = not self._stderr_is_log()

    # --- log -----------------------------------------------------------------------------

    def _stderr_is_log(self) -> bool:
        # ensure_keeper points stderr at keeper.log: write each line once, not twice.
        try:
            a, b = os.fstat(2), os.stat(self.dir / KEEPER_LOG)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def log(self, msg: str) -> None:
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        line = f"{when} keeper node={self.node} pid={self.pid}: {msg}\n"
        with self._log_lock:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(line)
                sys.stderr.flush()
            if self._log_to_file:
                with contextlib.suppress(OSError), open(self.dir / KEEPER_LOG, "a") as f:
                    f.write(line)
            self._bound_log()

    def _bound_log(self) -> None:
        """Keep ``keeper.log`` (it lives in the memory it accounts for) under LOG_LIMIT: past
        it, only its newest half is kept. Writers append (O_APPEND), so a truncated file is
        written at its new end."""
        path = self.dir / KEEPER_LOG
        with contextlib.suppress(OSError):
            if path.stat().st_size <= LOG_LIMIT:
                return
            with open(path, "rb") as f:
                f.seek(-LOG_LIMIT // 2, os.SEEK_END)
                tail = f.read()
            tail = tail[tail.find(b"\n") + 1 :]
            with open(path, "r+b") as f:
                f.write(tail)
                f.truncate(len(tail))

    # --- lifecycle -------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the node dir and remove everything half-written by a dead keeper or worker."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._log_to_file = not self._stderr_is_log()
        parents = [own_dir(self.dir)]
        with contextlib.suppress(OSError):
            parents += [p for p in (self.dir / "replica").iterdir() if _NODE_RE.fullmatch(p.name)]
        for parent in parents:
            with contextlib.suppress(OSError):
                for child in parent.iterdir():
                    if ".tmp-" in child.name:
                        _rmtree(child)

    def write_record(self) -> None:
        record = {
            "pid": self.pid,
            "host": self.host,
            "port": self.port,
            "node": self.node,
            "started": self.started,
            "keep": self.keep,
            "version": VERSION,
        }
        tmp = self.dir / f"{KEEPER_FILE}.tmp-{uuid.uuid4().hex}"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.dir / KEEPER_FILE)

    def _record_pid(self) -> int | None:
        try:
            obj = json.loads((self.dir / KEEPER_FILE).read_text())
        except (OSError, ValueError):
            return None
        pid = obj.get("pid") if isinstance(obj, dict) else None
        return pid if type(pid) is int else None

    def request_stop(self, reason: str, drop: bool = False) -> None:
        if not self.stop_event.is_set():
            self.stop_reason = reason
            self.drop = drop
            self.stop_event.set()

    def watch(self) -> None:
        """Until asked to stop: exit when the dir or our record goes, or when idle too long."""
        while not self.stop_event.wait(WATCH_INTERVAL_S):
            if not self.dir.is_dir():
                self.request_stop(f"{self.dir} is gone (the memory was wiped)")
            elif (pid := self._record_pid()) != self.pid:
                self.request_stop(
                    f"{KEEPER_FILE} names pid {pid}, not this keeper (replaced or removed)"
                )
            elif self.idle_exit_s > 0:
                with self._state_lock:
                    idle = self._in_flight == 0 and (
                        time.monotonic() - self._last_request > self.idle_exit_s
                    )
                if idle:
                    self.request_stop(f"idle for {self.idle_exit_s:g} s")

    def finish(self) -> None:
        if self._record_pid() == self.pid:
            with contextlib.suppress(OSError):
                (self.dir / KEEPER_FILE).unlink()
        if self.drop:
            for name in ("own", "replica", "spare"):
                _rmtree(self.dir / name)
        uptime = time.time() - self.started
        dropped = ", memory dropped" if self.drop else ""
        self.log(f"stopped ({self.stop_reason}{dropped}) after {uptime:.1f} s")

    # --- dispatch ------------------------------------------------------------------------

    def handle(self, sock: socket.socket, peer: str) -> None:
        with self._state_lock:
            self._in_flight += 1
            self._last_request = time.monotonic()
        try:
            try:
                req = recv_msg(sock)
            except (OSError, ValueError) as exc:
                with contextlib.suppress(OSError):
                    send_msg(sock, {"ok": False, "error": f"bad request: {exc}"})
                return
            op = req.get("op")
            try:
                if op == "hello":
                    send_msg(sock, self.op_hello())
                elif op == "committed":
                    send_msg(sock, self.op_committed(req, sock))
                elif op == "put":
                    send_msg(sock, self.op_put(req, sock, peer))
                elif op == "get":
                    self.op_get(req, sock)
                elif op == "stop":
                    drop = req.get("drop") is True
                    send_msg(sock, {"ok": True, "pid": self.pid})
                    self.request_stop(f"stop requested by {peer}", drop=drop)
                else:
                    send_msg(sock, {"ok": False, "error": f"unknown op {op!r}"})
            except RequestError as exc:
                with contextlib.suppress(OSError):
                    send_msg(sock, {"ok": False, "error": str(exc)})
            except OSError:
                pass  # the peer went away mid-request: nobody to answer
        finally:
            with self._state_lock:
                self._in_flight -= 1
                self._last_request = time.monotonic()

    # --- ops -------------------------------------------------------------------------------

    def op_hello(self) -> dict[str, Any]:
        replicas: dict[str, list[int]] = {}
        with contextlib.suppress(OSError):
            for p in sorted((self.dir / "replica").iterdir()):
                if m := _NODE_RE.fullmatch(p.name):
                    replicas[m.group(1)] = committed_memory_steps(p)
        return {
            "ok": True,
            "pid": self.pid,
            "node": self.node,
            "dir": str(self.dir),
            "started": self.started,
            "keep": self.keep,
            "own": committed_memory_steps(own_dir(self.dir)),
            "replicas": replicas,
        }

    def op_committed(self, req: dict[str, Any], sock: socket.socket) -> dict[str, Any]:
        step = _int_field(req, "step")
        to = req.get("to")
        if to is not None and not isinstance(to, str):
            raise RequestError(f"'to' must be 'host:port' or null, got {to!r}")
        with self._commit_lock:
            own = own_dir(self.dir)
            step_dir = own / step_dir_name(step)
            if not (step_dir / MANIFEST_FILE).is_file():
                raise RequestError(f"{step_dir} is not committed (no {MANIFEST_FILE})")
            # The push first, the retirement after: until the partner holds this step, the
            # older own step stays, so a node lost meanwhile still leaves a complete one.
            reply: dict[str, Any] = {
                "ok": True,
                "replicated": False,
                "files": 0,
                "bytes": 0,
                "seconds": 0.0,
                "to": to,
            }
            if to is not None:
                try:
                    files, nbytes, seconds = self._push(step_dir, step, to, req.get("nodes"), sock)
                except (RequestError, CheckpointError, OSError, ValueError) as exc:
                    msg = f"replicating own step {step} to {to} failed: {exc}"
                    self.log(msg)
                    reply = {"ok": False, "replicated": False, "to": to, "error": msg}
                else:
                    rate = nbytes / max(seconds, 1e-9) / 1e9
                    self.log(
                        f"replicated own step {step} to {to}: {files} files, {nbytes} bytes "
                        f"in {seconds:.2f} s ({rate:.2f} GB/s)"
                    )
                    reply.update(replicated=True, files=files, bytes=nbytes, seconds=seconds)
            # Never retire by ``newest``: a late request (a slow push) must not retire a newer
            # step committed since (the worker already dropped rolled-back steps). After a
            # failed push one more own step stays: the partner still holds the older one.
            keep = self.keep if reply["ok"] else self.keep + 1
            retired = retire_beyond(own, keep, spare_dir(self.dir, "own"))
            # Saves are sequential: a tmp dir of this step or an older one is dead.
            with contextlib.suppress(OSError):
                for child in own.iterdir():
                    m = TMP_RE.fullmatch(child.name)
                    if m and int(m.group(1)) <= step:
                        _rmtree(child)
            if retired:
                self.log(f"own step {step} committed; retired own steps {retired}")
            return reply

    def _push(
        self, step_dir: Path, step: int, to: str, nodes: Any, caller: socket.socket
    ) -> tuple[int, int, float]:
        """Send this node's files of ``step_dir`` to the keeper at ``to`` as a ``put``."""
        t0 = time.monotonic()
        raw = (step_dir / MANIFEST_FILE).read_bytes()
        manifest = parse_manifest(raw, str(step_dir / MANIFEST_FILE))
        records = sorted(node_files(manifest, self.node, nodes).values(), key=lambda r: r.path)
        header = {
            "op": "put",
            "node": self.node,
            "step": step,
            "manifest_bytes": len(raw),
            "files": [{"path": r.path, "bytes": r.bytes, "digest": r.digest} for r in records],
        }
        host, port = parse_addr(to)
        last_progress = time.monotonic()
        sent = 0
        with socket.create_connection((host, port), timeout=IO_TIMEOUT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_msg(sock, header)
            sock.sendall(raw)
            go = recv_msg(sock)
            if not go.get("ok"):
                raise RequestError(f"{to} refused: {go.get('error')}")
            for rec in records:
                with open(step_dir / rec.path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size != rec.bytes:
                        raise RequestError(
                            f"{step_dir / rec.path} is {size} bytes, its manifest says "
                            f"{rec.bytes}: the local copy is damaged, not sent"
                        )
                    offset = 0
                    while offset < size:  # in slices, so the caller hears progress
                        n = min(256 << 20, size - offset)
                        sock.sendfile(f, offset, n)
                        offset += n
                        sent += n
                        if time.monotonic() - last_progress > PROGRESS_INTERVAL_S:
                            send_msg(caller, {"progress": sent})
                            last_progress = time.monotonic()
            reply = recv_reply(sock)
        if not reply.get("ok"):
            raise RequestError(f"{to} refused: {reply.get('error')}")
        return len(records), sent, time.monotonic() - t0

    def op_put(self, req: dict[str, Any], sock: socket.socket, peer: str) -> dict[str, Any]:
        node = _int_field(req, "node")
        step = _int_field(req, "step")
        m_bytes = _int_field(req, "manifest_bytes")
        if m_bytes > MAX_MANIFEST_BYTES:
            raise RequestError(f"manifest of {m_bytes} bytes is over {MAX_MANIFEST_BYTES}")
        declared = req.get("files")
        if not isinstance(declared, list) or not all(isinstance(d, dict) for d in declared):
            raise RequestError("'files' must be a list of {path, bytes, digest}")
        files: list[tuple[str, int, str]] = []
        for d in declared:
            path = _plain_name(d.get("path"))
            if path == MANIFEST_FILE:
                raise RequestError(f"{MANIFEST_FILE} is sent as the manifest, not as a file")
            size = _int_field(d, "bytes")
            digest = d.get("digest")
            try:
                parse_digest(digest if isinstance(digest, str) else "")
            except ValueError as exc:
                raise RequestError(f"{path}: {exc}") from exc
            files.append((path, size, str(digest)))
        where = f"replica of node {node} step {step} from {peer}"
        raw = recv_exact(sock, m_bytes)
        try:
            manifest = parse_manifest(raw, f"manifest.json of the {where}")
        except CheckpointError as exc:
            return self._refuse(where, str(exc))
        if manifest.step != step:
            return self._refuse(where, f"its manifest is of step {manifest.step}")
        try:
            expected = node_files(manifest, node)
        except RequestError as exc:
            return self._refuse(where, str(exc))
        names = [f[0] for f in files]
        if len(set(names)) != len(names) or set(names) != set(expected):
            missing = sorted(set(expected) - set(names))[:3]
            extra = sorted(set(names) - set(expected))[:3]
            return self._refuse(
                where,
                f"declared files differ from node {node}'s files in its manifest "
                f"(missing {missing}, not in it {extra})",
            )
        for path, size, digest in files:
            rec = expected[path]
            if (rec.bytes, rec.digest) != (size, digest):
                return self._refuse(
                    where,
                    f"{path} is declared as {size} bytes {digest}, its manifest says "
                    f"{rec.bytes} bytes {rec.digest}",
                )
        send_msg(sock, {"ok": True, "go": True})
        parent = replica_dir(self.dir, node)
        parent.mkdir(parents=True, exist_ok=True)
        spares = spare_dir(self.dir, f"node-{node}")
        tmp = tmp_step_dir(parent, step)
        tmp.mkdir()
        try:
            error, total = self._receive(sock, tmp, spares, files)
            if error is not None:
                _rmtree(tmp)
                return self._refuse(where, error)
            (tmp / MANIFEST_FILE).write_bytes(raw)  # committing starts here
            with self._replica_lock:
                final = parent / step_dir_name(step)
                if final.exists():
                    # Same node, same step, sent again: the new verified copy wins. Uncommit
                    # the old one first, so no reader sees a mix.
                    aside = tmp_step_dir(parent, step)
                    with contextlib.suppress(OSError):
                        (final / MANIFEST_FILE).unlink()
                    os.rename(final, aside)
                    _rmtree(aside)
                os.rename(tmp, final)
                # Steps above this one are a branch the run rolled back from: retired too.
                retired = retire_beyond(parent, self.keep, spares, newest=step)
            for path, size, _ in files:  # the first replica reserves the steady footprint
                try:
                    reserve_spare(spares, path, size)
                except OSError as exc:
                    self.log(
                        f"could not reserve a spare for {path} ({exc}); the next replica "
                        "allocates it"
                    )
        except OSError as exc:
            _rmtree(tmp)
            self.log(f"failed to receive the {where}: {exc!r}; nothing committed")
            raise
        except BaseException:
            _rmtree(tmp)
            raise
        self.log(
            f"committed {where}: {len(files)} files, {total} bytes verified"
            + (f"; retired steps {retired}" if retired else "")
        )
        return {"ok": True, "verified": len(files), "bytes": total}

    def _refuse(self, where: str, why: str) -> dict[str, Any]:
        msg = f"refused the {where}: {why}"
        self.log(msg)
        return {"ok": False, "error": msg}

    def _receive(
        self, sock: socket.socket, tmp: Path, spares: Path, files: list[tuple[str, int, str]]
    ) -> tuple[str | None, int]:
        """Receive each file into ``tmp``, hashing every byte as it arrives. On the first
        mismatch the rest is read and dropped, so the sender gets the answer rather than a
        reset connection. Returns (the first error or None, bytes received)."""
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        error: str | None = None
        total = 0
        for path, size, digest in files:
            algorithm, _ = parse_digest(digest)
            hasher = new_hasher(algorithm)
            fd = -1
            if error is None:
                target = tmp / path
                if take_spare(spares, path, target):
                    fd = os.open(target, os.O_WRONLY | os.O_NOFOLLOW)
                    os.ftruncate(fd, size)  # pages already there are reused, not faulted
                else:
                    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:  # a full memory says so now, not as a broken connection mid-write
                    os.posix_fallocate(fd, 0, max(size, 1))
                except OSError as exc:
                    os.close(fd)
                    fd = -1
                    error = (
                        f"{path}: cannot hold its {size} bytes in {self.dir} "
                        f"({os.strerror(exc.errno) if exc.errno else exc}): this node's memory "
                        "is full"
                    )
            try:
                left = size
                while left:
                    n = sock.recv_into(view[: min(left, CHUNK)])
                    if n == 0:
                        raise ConnectionError(
                            f"connection closed with {left} of {size} bytes of {path} unsent"
                        )
                    left -= n
                    total += n
                    if fd >= 0:
                        hasher.update(view[:n])
                        done = 0
                        while done < n:
                            done += os.write(fd, view[done:n])
            finally:
                if fd >= 0:
                    os.close(fd)
            if error is None:
                actual = format_digest(algorithm, hasher)
                if actual != digest:
                    error = (
                        f"{path}: expected {digest}, got {actual} (damaged in transit or "
                        "at the sender)"
                    )
        return error, total

    def op_get(self, req: dict[str, Any], sock: socket.socket) -> None:
        node = _int_field(req, "node")
        step = _int_field(req, "step")
        path = _plain_name(req.get("path"))
        parent = own_dir(self.dir) if node == self.node else replica_dir(self.dir, node)
        step_dir = parent / step_dir_name(step)
        try:
            fd = os.open(step_dir / path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise RequestError(
                f"no node {node} step {step} file {path!r} here ({exc.strerror})"
            ) from exc
        with os.fdopen(fd, "rb") as f:
            # Checked after the open: a step retired in between is refused, not half-served.
            if not (step_dir / MANIFEST_FILE).is_file():
                raise RequestError(f"node {node} step {step} is not committed here")
            size = os.fstat(f.fileno()).st_size
            send_msg(sock, {"ok": True, "bytes": size})
            if size:
                sock.sendfile(f, 0, size)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    keeper: Keeper


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(IO_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        host, port = self.client_address[:2]
        self.server.keeper.handle(sock, f"{host}:{port}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dckpt.tiers.keeper", description=__doc__)
    ap.add_argument("--dir", required=True, type=Path, help="this node's memory dir")
    ap.add_argument("--node", required=True, type=int, help="this node's index")
    ap.add_argument("--host", default=None, help="address advertised to partners")
    ap.add_argument("--bind", default="0.0.0.0", help="address to listen on")
    ap.add_argument("--port", default=0, type=int, help="0: any free port")
    ap.add_argument("--keep", default=1, type=int, help="committed steps kept per kind")
    ap.add_argument("--idle-exit-s", default=0.0, type=float, help="0: never")
    args = ap.parse_args(argv)

    keeper = Keeper(
        args.dir, args.node, args.host or advertised_host(), args.keep, args.idle_exit_s
    )
    keeper.prepare()
    server = _Server((args.bind, args.port), _Handler)
    server.keeper = keeper
    keeper.port = server.server_address[1]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: keeper.request_stop(signal.Signals(s).name))
    keeper.write_record()
    keeper.log(
        f"started: pid {keeper.pid}, node {keeper.node}, addr {keeper.host}:{keeper.port} "
        f"(bound {args.bind}), dir {keeper.dir}, keep {keeper.keep}"
    )
    serving = threading.Thread(target=server.serve_forever, name="keeper-serve", daemon=True)
    serving.start()
    keeper.watch()  # the main thread, so signal handlers run promptly
    server.shutdown()
    server.server_close()
    keeper.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
