"""A real S3 server for the s3:// tests: moto's standalone server on 127.0.0.1, started by the
tests, and a proxy in front of it that answers 503 or drops connections on purpose.

moto speaks the S3 HTTP API (multipart uploads, conditional writes, ranged GETs); dckpt talks
to it through boto3 exactly as to AWS, with ``AWS_ENDPOINT_URL`` pointing here. ministack
(``MinistackServer``) is a second implementation of the same API, for the tests that must not
pass only because of what moto lets through.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "dckpt-test",
    "AWS_SECRET_ACCESS_KEY": "dckpt-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """``python -m moto.server`` on a free port, in its own process."""

    def __init__(self, *, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto's server exited with {self.proc.returncode}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto's server did not start within 30 s")

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment a process needs to use this server as its S3."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def client(self, endpoint: str | None = None, **credentials: str) -> Any:
        import boto3

        creds = {
            "aws_access_key_id": credentials.get("key", CREDENTIALS["AWS_ACCESS_KEY_ID"]),
            "aws_secret_access_key": credentials.get(
                "secret", CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
            ),
        }
        return boto3.client(
            "s3", endpoint_url=endpoint or self.endpoint, region_name="us-east-1", **creds
        )

    def bucket(self) -> str:
        """A new, empty bucket."""
        name = f"t-{uuid.uuid4().hex[:20]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix``: key -> size."""
        out: dict[str, int] = {}
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        for page in pages:
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return out

    def open_uploads(self, bucket: str) -> list[str]:
        resp = self.client().list_multipart_uploads(Bucket=bucket)
        return [u["Key"] for u in resp.get("Uploads", [])]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class MinistackServer(MotoServer):
    """ministack (PyPI), a second S3 implementation beside moto, on a free port in its own
    process, without Docker: ``python -m ministack`` serves every service on one port
    (``GATEWAY_PORT``), S3 in memory. Its side listeners on fixed ports (IoT's MQTT on 8883,
    SFTP) are turned off, so two servers never collide; its pid file goes to ``workdir``.
    The client helpers are moto's: both speak the S3 HTTP API.

    What moto is lenient about, ministack may refuse: the tests that run on both keep dckpt
    honest about the API rather than about one emulator."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "ministack.log"
        env = {
            **os.environ,
            "GATEWAY_PORT": str(self.port),
            "BIND_HOST": "127.0.0.1",
            "IOT_MTLS_ENABLED": "0",
            "SFTP_ENABLED": "0",
            "S3_PERSIST": "0",
            "PERSIST_STATE": "0",
            "LOG_LEVEL": "WARNING",
            "TMPDIR": str(workdir),
        }
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ministack"], stdout=out, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/_ministack/ready")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
                conn.close()
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ministack exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"ministack did not start within 60 s: {self.log.read_text()[-2000:]}")


Rule = Callable[[str, str], str | None]
"""(method, path?query) -> None (forward), "503" (answer SlowDown), "501" (answer
NotImplemented, as a store that lacks the request does), "drop" (close the connection without
an answer) or "strip-conditions" (forward without If-None-Match/If-Match)."""


class LoopbackServer:
    """An HTTP server on 127.0.0.1 (a free port), its handler on daemon threads: what the
    test proxies in front of the S3 server are built on."""

    def serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FaultProxy(LoopbackServer):
    """An HTTP proxy in front of the S3 server that breaks chosen requests on purpose."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.rule: Rule = lambda method, path: None
        # (method, path?query, status, body) -> the body sent back instead, or (status, body)
        # (a flipped bit, a listing that repeats its continuation token); None: as they came
        self.mangle: Callable[[str, str, int, bytes], bytes | tuple[int, bytes]] | None = None
        self.seen: list[tuple[str, str, str]] = []  # (method, path, what was done)
        self.copied: list[str] = []  # the path?query of each server-side copy (CopyObject)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    action = proxy.rule(self.command, self.path)
                    proxy.seen.append((self.command, self.path, action or "forward"))
                    if self.headers.get("x-amz-copy-source"):
                        proxy.copied.append(self.path)
                if action == "drop":
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action in ("503", "501"):
                    payload = (
                        b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                        b"<Message>Please reduce your request rate.</Message></Error>"
                        if action == "503"
                        else b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>"
                        b"NotImplemented</Code><Message>A header you provided implies "
                        b"functionality that is not implemented.</Message></Error>"
                    )
                    self.send_response(int(action))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                dropped = {"connection"}
                if action == "strip-conditions":  # a store that ignores conditional writes
                    dropped |= {"if-none-match", "if-match"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                status = resp.status
                if proxy.mangle is not None:  # the answer changed on its way back
                    with proxy._lock:
                        changed = proxy.mangle(self.command, self.path, status, data)
                    status, data = changed if isinstance(changed, tuple) else (status, changed)
                self.send_response(status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815

        self.serve(Handler)


@contextlib.contextmanager
def moto_server(**kwargs: Any) -> Iterator[MotoServer]:
    server = MotoServer(**kwargs)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def ministack_server(workdir: Path) -> Iterator[MinistackServer]:
    server = MinistackServer(workdir)
    try:
        yield server
    finally:
        server.stop()
