"""A proxy in front of the test S3 server that refuses the objects of one rank, for good.

``s3_kit.FaultProxy`` breaks requests in ways a retry cures (503 SlowDown, a dropped
connection). This one answers ``403 AccessDenied``, every time, to every request whose key
matches a pattern (``__1_\\d+\\.distcp``: rank 1's shard objects), and forwards the rest: a
store that lets one rank's writes or reads through and refuses another's for good (a
bucket policy, a prefix-scoped credential, a bucket gone under one rank's feet). botocore
does not retry a 403, so the failure is as quick as a failure can be, and a job that still
takes long to end is waiting somewhere, not retrying.

Every refusal is recorded with its wall-clock time, so a test can measure how long the job
took to end after the first one. Requests matching ``slow`` are held ``delay_s`` before they
are forwarded (a rank whose upload takes long: does it stop once another rank failed?), and
counted.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import unquote, urlsplit

from s3_kit import LoopbackServer

__all__ = ["ANSWERS", "RefusingProxy", "refusing_proxy", "shard_pattern"]

ANSWERS = {
    403: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
    b"<Message>Access Denied</Message></Error>",
    503: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate.</Message></Error>",
}
"""What a refused request is answered: 403 AccessDenied (never retried), or 503 SlowDown
(retried with backoff until the attempts are spent)."""


def shard_pattern(rank: int, step_dir: str | None = None) -> re.Pattern[str]:
    """The keys of ``rank``'s shard objects (``__<rank>_<n>.distcp``), of one step dir
    (``step-00000004``) or of every step."""
    step = re.escape(step_dir) if step_dir is not None else r"step-\d+"
    return re.compile(rf"/{step}/__{rank}_\d+\.distcp$")


class RefusingProxy(LoopbackServer):
    """Forwards every request to the S3 server on ``upstream_port`` except those whose
    decoded path matches ``refuse``, which are answered ``status`` (403 AccessDenied)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.refuse: re.Pattern[str] | None = None
        self.status = 403
        """403 (AccessDenied) or 503 (SlowDown, every time: the retries are spent)."""
        self.slow: re.Pattern[str] | None = None
        self.delay_s = 0.0
        self.slowed: list[tuple[float, str, str]] = []
        """(time.time(), method, path?query) of each request held and then forwarded."""
        self.refused: list[tuple[float, str, str]] = []
        """(time.time(), method, path?query) of each request refused."""
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = unquote(urlsplit(self.path).path)
                with proxy._lock:
                    pattern = proxy.refuse
                    refused = pattern is not None and pattern.search(path) is not None
                    status = proxy.status
                    if refused:
                        proxy.refused.append((time.time(), self.command, self.path))
                    slow = proxy.slow is not None and proxy.slow.search(path) is not None
                    if slow and not refused:
                        proxy.slowed.append((time.time(), self.command, self.path))
                if refused:
                    self._answer(status, [("Content-Type", "application/xml")], ANSWERS[status])
                    return
                if slow:
                    time.sleep(proxy.delay_s)
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    self._answer(resp.status, resp.getheaders(), resp.read())
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815

        self.serve(Handler)

    def first_refusal(self) -> float | None:
        """When the first request was refused (time.time()), or None."""
        with self._lock:
            return self.refused[0][0] if self.refused else None


@contextlib.contextmanager
def refusing_proxy(upstream_port: int) -> Iterator[RefusingProxy]:
    proxy = RefusingProxy(upstream_port)
    try:
        yield proxy
    finally:
        proxy.close()
