"""The S3 client of an s3:// root: bytes in and out, digests computed while they move.

Role: the only module that talks to the object store. It knows keys, bytes and digests; it
knows nothing of steps, manifests or policy (dckpt.tiers.object_root knows those).

Client: boto3 (``pip install dckpt[s3]``), chosen by measurement against s3fs on the same
server (``bench/s3_clients.py``; the README has the figures). Credentials, region and
endpoint come the standard ways: the AWS environment variables, profiles and instance roles,
and ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for MinIO, Ceph and the like.

Invariants:
- an upload hashes exactly the bytes it sends, in order, as it reads them; a download hashes
  exactly the bytes it writes, in order, and its file appears under its final name only once
  all of them arrived (written beside it, then renamed);
- a multipart upload that fails is aborted (best effort; ``ObjectRoot.recover`` aborts any
  left open by a crash);
- throttling (503 SlowDown), server errors and dropped connections are retried by botocore's
  standard mode with backoff; a body that breaks off mid-read or fails botocore's checksum is
  re-requested by range here; both are bounded (``attempts``), and an error says how many
  requests were made;
- a GET reads at most one byte past the span it asked for; a listing refuses a repeated
  continuation marker and stops at ``MAX_PAGES`` pages or ``MAX_LISTING_BYTES`` of keys and
  markers held, whichever comes first (a marker is remembered as its 64-bit digest, and one
  longer than ``MAX_MARKER_BYTES`` is refused): a hostile endpoint cannot grow it past that;
- a download whose digest differs from the writer's is read once more, fresh, before it is
  called damage (``download_verified``, ``check``): one flipped bit on the wire never
  quarantines an intact checkpoint;
- a request the store does not implement (501) is ``UnsupportedError``, never retried;
- every failure is a ``StorageError`` naming the object's URL and what the user can do; a
  missing bucket and refused credentials say so in words.

Tuning (environment): ``DCKPT_S3_PART_MB`` (part size, default 32, min 5),
``DCKPT_S3_CONCURRENCY`` (parts in flight per file, default 8), ``DCKPT_S3_ATTEMPTS``
(tries per request, default 8).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..errors import IntegrityError, StorageError
from ..owned import create_new
from ..storage.digest import format_digest, new_hasher
from ..units import human_bytes, plural
from .url import ObjectURL

__all__ = ["ListedObject", "OpenUpload", "S3Store", "UnsupportedError", "UploadStream"]

MIN_PART = 5 << 20  # S3 refuses smaller parts, except the last
MAX_PAGES = 100_000  # of a listing (1000 keys each): far beyond any root, short of forever
MAX_LISTING_BYTES = 256 << 20
"""Keys and markers one listing may hold: a root of a million objects with 100-byte keys is
100 MB; a store that streams fresh markers or huge keys is refused there, not at 23 GiB."""
MAX_MARKER_BYTES = 4096  # S3's are under 1 KiB
Progress = Callable[[int], None]
"""Called with the number of bytes just moved (progress bars, fault points)."""


class UnsupportedError(StorageError):
    """The store does not implement a request (501 NotImplemented, or the like): a missing
    feature, not throttling, so it is never retried; the caller falls back or skips."""


_UNSUPPORTED = ("NotImplemented", "MethodNotAllowed", "501")


@dataclass(frozen=True)
class ListedObject:
    key: str
    size: int
    modified: float  # the server's clock, seconds since the epoch


@dataclass(frozen=True)
class OpenUpload:
    key: str
    upload_id: str
    initiated: float


def _env_int(name: str, default: int, low: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number") from None
    if value < low:
        raise ValueError(f"{name}={value} is below its minimum {low}")
    return value


def _boto() -> tuple[Any, Any, Any]:
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError:
        raise StorageError(
            "s3:// roots need boto3, which is not installed: pip install 'dckpt[s3]'"
        ) from None
    return boto3, botocore.config, botocore.exceptions


class S3Store:
    """One bucket and prefix, through one thread-safe boto3 client; see the module doc."""

    def __init__(
        self,
        url: ObjectURL,
        *,
        part_bytes: int | None = None,
        concurrency: int | None = None,
        attempts: int | None = None,
    ) -> None:
        self.url = url
        self.part_bytes = part_bytes or _env_int("DCKPT_S3_PART_MB", 32, 5) << 20
        self.part_bytes = max(self.part_bytes, MIN_PART)
        self.concurrency = concurrency or _env_int("DCKPT_S3_CONCURRENCY", 8, 1)
        self.attempts = attempts or _env_int("DCKPT_S3_ATTEMPTS", 8, 1)
        self._client: Any = None
        self._lock = threading.Lock()
        self._damaged: dict[str, int] = {}  # ranges re-read per key: botocore's checksum failed
        boto3, config, exceptions = _boto()
        self._errors = exceptions
        self._make = lambda: boto3.session.Session().client(
            "s3",
            config=config.Config(
                # total_max_attempts counts the first request (max_attempts would not)
                retries={"total_max_attempts": self.attempts, "mode": "standard"},
                # several files (io_threads) may upload at once, each `concurrency` parts
                max_pool_connections=max(16, 4 * self.concurrency),
                connect_timeout=10,
                read_timeout=60,
            ),
        )

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._make()
                except Exception as exc:  # a bad region, a broken profile
                    raise StorageError(f"cannot set up an S3 client for {self.url}: {exc}") from exc
            return self._client

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    # --- errors -----------------------------------------------------------------------------

    def _where(self, key: str) -> str:
        return f"s3://{self.url.bucket}/{key}"

    def _tries(self, exc: BaseException, tries: int | None) -> str:
        """How many requests were made, in words: botocore records its retries on a
        ClientError; a dropped connection is retried by botocore up to ``attempts``; a read
        re-requested here counts its own (``tries``)."""
        if tries is not None:
            return plural(tries, "attempt")
        if isinstance(exc, self._errors.ClientError):
            retries = exc.response.get("ResponseMetadata", {}).get("RetryAttempts")
            if isinstance(retries, int):
                return plural(retries + 1, "attempt")
        return f"up to {plural(self.attempts, 'attempt')}"

    def fail(
        self, exc: BaseException, key: str, doing: str, *, tries: int | None = None
    ) -> StorageError:
        """The StorageError for ``exc``, met while ``doing`` the object ``key`` (``tries``:
        the requests made, when the caller counted them)."""
        where = self._where(key)
        errors = self._errors
        if isinstance(exc, (errors.NoCredentialsError, errors.PartialCredentialsError)):
            return StorageError(
                f"{doing} {where}: no AWS credentials were found. Set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run where an instance role applies."
            )
        if isinstance(exc, errors.ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", "?"))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return StorageError(
                    f"{doing} {where}: the bucket {self.url.bucket!r} does not exist at "
                    f"{self.endpoint}. Create it, or fix the root URL (or AWS_ENDPOINT_URL)."
                )
            if code in (
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "AccessDenied",
                "ExpiredToken",
                "InvalidToken",
                "AllAccessDisabled",
            ) or status in (401, 403):
                return StorageError(
                    f"{doing} {where}: the store refused the credentials ({code}). Check "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and that they "
                    f"may read, write and list s3://{self.url.bucket}/{self.url.under()}."
                )
            if code in _UNSUPPORTED or status == 501:
                return UnsupportedError(
                    f"{doing} {where}: the store at {self.endpoint} does not implement this "
                    f"request ({status} {code}): a feature it lacks, not a fault that a retry "
                    "would cure."
                )
            if status is not None and (status >= 500 or code in ("SlowDown", "Throttling")):
                return StorageError(
                    f"{doing} {where}: the store kept answering {status} {code} through "
                    f"{self._tries(exc, tries)} with backoff. Nothing was committed by this "
                    "call; retry later, or raise DCKPT_S3_ATTEMPTS."
                )
            return StorageError(f"{doing} {where}: {code} ({error.get('Message', '')})")
        if isinstance(exc, (errors.BotoCoreError, OSError)):
            if isinstance(exc, errors.FlexibleChecksumError):
                return StorageError(
                    f"{doing} {where}: every read failed the store's own checksum "
                    f"({self._tries(exc, tries)}; {exc}): the bytes were damaged on the way. "
                    "Check the network path to the store (a proxy, a NIC); nothing was "
                    "committed by this call."
                )
            return StorageError(
                f"{doing} {where}: cannot reach the store at {self.endpoint} after "
                f"{self._tries(exc, tries)} ({type(exc).__name__}: {exc}). Check the endpoint "
                "and the network; nothing was committed by this call."
            )
        return StorageError(f"{doing} {where}: {type(exc).__name__}: {exc}")

    def _call(self, key: str, doing: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(Bucket=self.url.bucket, **kwargs)
        except StorageError:
            raise
        except Exception as exc:
            raise self.fail(exc, key, doing) from exc

    def _code(self, exc: BaseException) -> str | None:
        if isinstance(exc, self._errors.ClientError):
            return str(exc.response.get("Error", {}).get("Code"))
        return None

    # --- small objects ----------------------------------------------------------------------

    def head(self, key: str) -> int | None:
        """The size of ``key``, or None if there is no such object."""
        try:
            resp = self.client.head_object(Bucket=self.url.bucket, Key=key)
        except Exception as exc:
            if self._code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self.fail(exc, key, "looking up") from exc
        return int(resp["ContentLength"])

    def get_small(self, key: str, limit: int) -> tuple[bytes, str] | None:
        """Up to ``limit + 1`` bytes of ``key`` and its ETag, or None if there is no such
        object (the caller refuses anything over ``limit``)."""
        try:
            resp = self.client.get_object(Bucket=self.url.bucket, Key=key, Range=f"bytes=0-{limit}")
            return resp["Body"].read(limit + 1), str(resp.get("ETag", ""))
        except Exception as exc:
            if self._code(exc) in ("NoSuchKey", "404"):
                return None
            if self._code(exc) == "InvalidRange":  # an empty object
                return b"", ""
            raise self.fail(exc, key, "reading") from exc

    def put_small(
        self, key: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> str | None:
        """Write ``data`` to ``key``; returns its ETag, or None when the condition failed
        (``if_absent``: the key exists; ``if_match``: its ETag changed, or it is gone)."""
        kwargs: dict[str, Any] = {"Key": key, "Body": data}
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        try:
            resp = self.client.put_object(Bucket=self.url.bucket, **kwargs)
        except Exception as exc:
            if self._code(exc) in ("PreconditionFailed", "ConditionalRequestConflict", "412"):
                return None
            # S3 answers If-Match on a key that is gone with 404, not 412: to the caller it is
            # the same news (the object it read is not there any more), and a lease renewal
            # must hear it as that, not as a store to retry forever.
            if if_match is not None and self._code(exc) in ("NoSuchKey", "404"):
                return None
            raise self.fail(exc, key, "writing") from exc
        return str(resp.get("ETag", ""))

    def delete(self, keys: builtins.list[str]) -> None:
        """Delete ``keys`` (missing ones are fine), in the order given, 1000 per request."""
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            try:
                resp = self.client.delete_objects(
                    Bucket=self.url.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            except Exception as exc:
                if self._code(exc) not in _UNSUPPORTED:
                    raise self.fail(exc, batch[0], "deleting") from exc
                for key in batch:  # a store without multi-object delete (GCS's XML API)
                    self._call(key, "deleting", self.client.delete_object, Key=key)
                continue
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise StorageError(
                    f"deleting {self._where(first.get('Key', '?'))}: {first.get('Code')} "
                    f"({first.get('Message', '')}); {len(resp['Errors'])} object(s) were not "
                    "deleted"
                )

    def copy(self, src: str, dst: str) -> None:
        """Copy ``src`` to ``dst`` inside the bucket (multipart above 5 GiB, server-side)."""
        try:
            self.client.copy({"Bucket": self.url.bucket, "Key": src}, self.url.bucket, dst)
        except Exception as exc:
            raise self.fail(exc, src, "copying") from exc

    def _next_page(
        self, prefix: str, doing: str, seen: set[int], marker: Any, held: int = 0
    ) -> None:
        """Refuse a listing that would not end or would not fit: a page marker the store
        gave before (it would send the same pages again, forever), more than ``MAX_PAGES``
        pages, a marker longer than ``MAX_MARKER_BYTES``, or more than ``MAX_LISTING_BYTES``
        of keys (``held``) and markers. Markers are remembered by a 64-bit digest."""
        text = repr(marker)
        if len(text) > MAX_MARKER_BYTES:
            raise StorageError(
                f"{doing} {self._where(prefix)}: the store returned a continuation marker of "
                f"{len(text)} bytes (S3's are under 1 KiB), after {len(seen)} page(s); dckpt "
                "refuses it rather than hold what a broken or hostile endpoint sends."
            )
        if held + len(seen) * 8 > MAX_LISTING_BYTES:
            raise StorageError(
                f"{doing} {self._where(prefix)}: over {human_bytes(MAX_LISTING_BYTES)} of keys "
                f"and markers after {len(seen)} page(s); dckpt stops there rather than grow "
                "without bound. "
                "Give the run a prefix of its own, or check the endpoint."
            )
        digest = xxhash.xxh3_64_intdigest(text.encode())
        if digest in seen:
            raise StorageError(
                f"{doing} {self._where(prefix)}: the store returned a continuation marker it "
                f"had already returned ({str(marker)[:80]!r}), after {len(seen)} page(s): the "
                "listing would never end. This is a bug in the store (or a proxy in front of "
                "it); nothing was changed."
            )
        if len(seen) >= MAX_PAGES:
            raise StorageError(
                f"{doing} {self._where(prefix)}: over {MAX_PAGES} pages (about "
                f"{MAX_PAGES * 1000} objects) under one prefix; dckpt stops there rather than "
                "list without end. Give the run a prefix of its own."
            )
        seen.add(digest)

    def list(self, prefix: str) -> builtins.list[ListedObject]:
        """Every object whose key starts with ``prefix`` (bounded: see ``_next_page``)."""
        found: builtins.list[ListedObject] = []
        token: str | None = None
        seen: set[int] = set()
        held = 0
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            resp = self._call(prefix, "listing", self.client.list_objects_v2, **kwargs)
            page = [
                ListedObject(o["Key"], int(o["Size"]), o["LastModified"].timestamp())
                for o in resp.get("Contents", [])
            ]
            found += page
            held += sum(len(o.key) + 64 for o in page)  # the key and its record
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:  # no token: nothing more to ask for
                return found
            self._next_page(prefix, "listing", seen, token, held)

    def open_uploads(self, prefix: str) -> builtins.list[OpenUpload]:
        """Multipart uploads begun under ``prefix`` and neither completed nor aborted."""
        found: builtins.list[OpenUpload] = []
        marker: dict[str, Any] = {}
        seen: set[int] = set()
        held = 0
        while True:
            resp = self._call(
                prefix,
                "listing uploads",
                self.client.list_multipart_uploads,
                Prefix=prefix,
                **marker,
            )
            page = [
                OpenUpload(u["Key"], u["UploadId"], u["Initiated"].timestamp())
                for u in resp.get("Uploads", [])
            ]
            found += page
            held += sum(len(u.key) + len(u.upload_id) + 64 for u in page)
            marker = {
                k: v
                for k, v in (
                    ("KeyMarker", resp.get("NextKeyMarker")),
                    ("UploadIdMarker", resp.get("NextUploadIdMarker")),
                )
                if v
            }
            if not resp.get("IsTruncated") or not marker:
                return found
            self._next_page(prefix, "listing uploads", seen, tuple(sorted(marker.items())), held)

    def abort(self, upload: OpenUpload) -> None:
        try:
            self.client.abort_multipart_upload(
                Bucket=self.url.bucket, Key=upload.key, UploadId=upload.upload_id
            )
        except Exception as exc:
            if self._code(exc) != "NoSuchUpload":
                raise self.fail(exc, upload.key, "aborting the upload of") from exc

    # --- large objects ----------------------------------------------------------------------

    def upload_file(
        self,
        path: str | os.PathLike[str],
        key: str,
        algorithm: str,
        progress: Progress | None = None,
    ) -> tuple[str, int]:
        """Upload the file at ``path`` to ``key`` through an ``UploadStream``, hashing each
        byte as it is read to be sent; returns (digest, bytes)."""
        hasher = new_hasher(algorithm)
        stream = self.open_upload(key, progress)
        try:
            with open(path, "rb") as f:
                while chunk := f.read(self.part_bytes):
                    hasher.update(chunk)
                    stream.write(chunk)
        except BaseException:
            stream.abort()
            raise
        stream.close()
        return format_digest(algorithm, hasher), stream.sent

    def open_upload(self, key: str, progress: Progress | None = None) -> UploadStream:
        """A write-only stream into ``key``: parts go up as they fill (see ``UploadStream``)."""
        return UploadStream(self, key, progress)

    def _part(self, key: str, upload_id: str, number: int, chunk: bytes | bytearray) -> str:
        resp = self._call(
            key,
            f"uploading part {number} of",
            self.client.upload_part,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=chunk,
        )
        return str(resp["ETag"])

    def iter_ranges(self, key: str, size: int, fd: int | None = None) -> Iterator[bytes]:
        """The bytes of ``key`` in order, fetched as ranged GETs ``concurrency`` at a time;
        with ``fd``, each range is also written at its offset by the thread that fetched it
        (writes in parallel, in any order; the caller hashes in order). IntegrityError if the
        object is not ``size`` bytes long."""
        if size == 0:  # no range to ask for: look at its size instead
            actual = self.head(key)
            if actual is None:
                raise IntegrityError(self._where(key), "0 bytes", "no object", "object missing")
            if actual:
                raise IntegrityError(
                    self._where(key), "0 bytes", f"{actual} bytes", "size mismatch"
                )
            return
        spans = [(o, min(self.part_bytes, size - o)) for o in range(0, size, self.part_bytes)]
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="dckpt-s3-get") as pool:
            pending: deque[Future[bytes]] = deque()
            todo = iter(spans)
            for span in todo:
                pending.append(pool.submit(self._fetch_range, key, span, size, fd))
                if len(pending) >= self.concurrency:
                    break
            while pending:
                data = pending.popleft().result()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append(pool.submit(self._fetch_range, key, nxt, size, fd))
                yield data

    def _fetch_range(self, key: str, span: tuple[int, int], size: int, fd: int | None) -> bytes:
        data = self._get_range(key, span, size)
        if fd is not None:
            view, offset = memoryview(data), span[0]
            while view:  # os.pwrite may write less than asked
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
        return data

    def _get_range(self, key: str, span: tuple[int, int], size: int) -> bytes:
        """One ranged GET, re-requested when the body breaks off or fails the store's own
        checksum (bounded, with backoff). Reads at most one byte past the span, so a store
        that ignores ``Range`` costs one span of memory, not its whole answer."""
        errors = self._errors
        broken = (
            errors.IncompleteReadError,
            errors.ResponseStreamingError,
            errors.ReadTimeoutError,
            errors.ConnectionClosedError,
            errors.EndpointConnectionError,
            errors.FlexibleChecksumError,  # botocore's CRC of a whole-object GET: bytes damaged
            ConnectionError,
        )
        where = self._where(key)
        byte_range = f"bytes={span[0]}-{span[0] + span[1] - 1}"
        reason: BaseException = ConnectionError("no attempt made")
        for attempt in range(self.attempts):
            try:
                try:
                    resp = self.client.get_object(Bucket=self.url.bucket, Key=key, Range=byte_range)
                except broken as exc:
                    # The request itself failed (a dropped connection, no answer in time):
                    # botocore's standard mode has retried it already, `attempts` requests in
                    # all. This loop's tries are for a body that broke off after an answer;
                    # another round of botocore's here made attempts * attempts requests (64
                    # by default) and an error that said `attempts`.
                    tries = attempt + self.attempts
                    raise self.fail(exc, key, "downloading", tries=tries) from exc
                total = _total_size(resp)
                if total is not None and total != size:
                    resp["Body"].close()
                    raise IntegrityError(where, f"{size} bytes", f"{total} bytes", "size mismatch")
                data: bytes = resp["Body"].read(span[1] + 1)
                if len(data) > span[1]:
                    resp["Body"].close()  # drop the connection rather than drain the rest
                    raise StorageError(
                        f"downloading {where}: asked for {byte_range} ({span[1]} bytes), the "
                        f"store at {self.endpoint} sent more (it ignores the Range header). "
                        "dckpt reads objects in ranges; use a store that supports them."
                    )
                if len(data) == span[1]:
                    # At the end of the body a read of nothing is what makes botocore compare
                    # its checksum (a bounded read stops short of it otherwise).
                    if resp["Body"].read(1):
                        raise StorageError(f"downloading {where}: more bytes than {byte_range}")
                    return data
                reason = ConnectionError(f"{len(data)} of {span[1]} bytes arrived")
            except broken as exc:
                reason = exc
                if isinstance(exc, errors.FlexibleChecksumError):
                    with self._lock:
                        self._damaged[key] = self._damaged.get(key, 0) + 1
            except (IntegrityError, StorageError):
                raise
            except Exception as exc:
                code = self._code(exc)
                if code == "InvalidRange":
                    raise IntegrityError(where, f"{size} bytes", "fewer", "size mismatch") from None
                if code in ("NoSuchKey", "404"):
                    raise IntegrityError(
                        where, f"{size} bytes", "no object", "object missing"
                    ) from None
                raise self.fail(exc, key, "downloading") from exc
            if attempt + 1 < self.attempts:
                time.sleep(min(20.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.0))
        # Every read failing botocore's checksum cannot tell the store's bytes from the way's:
        # a StorageError (check the network), never a quarantine on that alone.
        raise self.fail(reason, key, "downloading", tries=self.attempts)

    def download_file(
        self,
        key: str,
        dest: Path,
        size: int,
        algorithm: str,
        progress: Progress | None = None,
    ) -> str:
        """Download ``key`` (``size`` bytes) to ``dest``, hashing every byte as it is written;
        returns the digest. ``dest`` appears only once every byte arrived; the caller
        compares the digest before anything uses the file."""
        hasher = new_hasher(algorithm)
        part = dest.with_name(f".{dest.name}.part-{os.getpid()}-{threading.get_ident()}")
        try:
            part.unlink(missing_ok=True)  # a crashed download of this thread's
            fd = create_new(part)  # private, and never through a link planted at the name
            try:
                for data in self.iter_ranges(key, size, fd):
                    hasher.update(data)
                    if progress is not None:
                        progress(len(data))
            finally:
                os.close(fd)
            os.replace(part, dest)
        finally:
            part.unlink(missing_ok=True)
        return format_digest(algorithm, hasher)

    def download_verified(
        self, key: str, dest: Path, size: int, want: str, progress: Progress | None = None
    ) -> int:
        """Download ``key`` to ``dest`` and compare its digest with ``want``, the writer's. A
        mismatch is read again, fresh from the store: a bit flipped on the wire (no checksum
        covers a ranged GET) is a transient fault, not damage. Returns the number of reads
        (1; more when a read was damaged, here or by botocore's checksum); IntegrityError,
        ``dest`` removed, when the fresh read mismatches too: the object itself differs from
        what its writer wrote."""
        algorithm = want.split(":", 1)[0]
        with self._lock:
            before = self._damaged.get(key, 0)
        seen: builtins.list[str] = []
        for reads in (1, 2):
            got = self.download_file(key, dest, size, algorithm, progress)
            if got == want:
                with self._lock:  # ranges botocore's checksum sent back count as reads too
                    return reads + self._damaged.get(key, 0) - before
            dest.unlink(missing_ok=True)
            seen.append(got)
        if seen[0] != seen[1]:  # two reads, two different wrong answers: the way is bad
            raise StorageError(
                f"downloading {self._where(key)}: two reads gave two different digests, "
                f"neither the writer's ({seen[0]}, {seen[1]}; want {want}): the bytes are "
                "damaged on the way, not known to be damaged in the store. Check the network "
                "path to the store (a proxy, a NIC); nothing was quarantined."
            )
        raise IntegrityError(
            self._where(key),
            want,
            got,
            detail="the object's bytes differ from the digest its writer computed (read twice)",
        )

    def check(self, key: str, size: int, want: str, progress: Progress | None = None) -> str:
        """The digest of ``key``, streamed; a mismatch with ``want`` is read again fresh from
        the store (see ``download_verified``) and the second reading is what is returned."""
        algorithm = want.split(":", 1)[0]
        got = self.digest(key, size, algorithm, progress)
        return got if got == want else self.digest(key, size, algorithm, progress)

    def digest(self, key: str, size: int, algorithm: str, progress: Progress | None = None) -> str:
        """The digest of ``key``'s bytes, streamed (nothing written)."""
        hasher = new_hasher(algorithm)
        for data in self.iter_ranges(key, size):
            hasher.update(data)
            if progress is not None:
                progress(len(data))
        return format_digest(algorithm, hasher)


def _total_size(resp: dict[str, Any]) -> int | None:
    """The object's whole size from a ranged GET's ``Content-Range: bytes a-b/TOTAL``."""
    content_range = resp.get("ContentRange")
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


class UploadStream:
    """Bytes written here go up to one object as they come: each full part is sent at once,
    ``concurrency`` parts in flight (the writer waits for the oldest beyond that, which bounds
    the memory to ``concurrency * part_bytes``). ``close`` completes the object (one PUT when
    it never filled a part); ``abort`` gives it up. The caller hashes what it writes."""

    def __init__(self, store: S3Store, key: str, progress: Progress | None) -> None:
        self.store, self.key, self.progress = store, key, progress
        self.sent = 0
        self._buf = bytearray(store.part_bytes)  # filled in place: one copy of each byte
        self._fill = 0
        # Part buffers whose upload completed, to fill again: a fresh bytearray per part
        # would zero-fill part_bytes each time (a third of the save's client CPU, measured).
        self._free: builtins.list[bytearray] = []
        self._upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Future[str], bytearray | bytes]] = deque()
        self._etags: builtins.list[str] = []
        self._number = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        part = self.store.part_bytes
        while view:
            n = min(len(view), part - self._fill)
            self._buf[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == part:
                full = self._buf
                self._buf = self._free.pop() if self._free else bytearray(part)
                self._fill = 0
                self._send(full)

    def _send(self, chunk: bytes | bytearray) -> None:
        store = self.store
        if self._upload_id is None:
            self._upload_id = store._call(
                self.key, "starting the upload of", store.client.create_multipart_upload,
                Key=self.key,
            )["UploadId"]  # fmt: skip
            self._pool = ThreadPoolExecutor(store.concurrency, thread_name_prefix="dckpt-s3-up")
        assert self._pool is not None
        self._number += 1
        future = self._pool.submit(store._part, self.key, self._upload_id, self._number, chunk)
        self._pending.append((future, chunk))
        self.sent += len(chunk)
        if self.progress is not None:
            self.progress(len(chunk))
        while len(self._pending) >= store.concurrency:
            done, buffer = self._pending.popleft()
            self._etags.append(done.result())
            if isinstance(buffer, bytearray) and len(buffer) == store.part_bytes:
                self._free.append(buffer)  # its bytes are in the store: botocore is done

    def close(self) -> None:
        """Send what is left and complete the object; raises (and aborts) on any failure."""
        store = self.store
        try:
            if self._upload_id is None:
                data = bytes(self._buf[: self._fill])
                if self.progress is not None:
                    self.progress(len(data))
                store._call(self.key, "uploading", store.client.put_object, Key=self.key, Body=data)
                self.sent += len(data)
                return
            if self._fill:
                self._send(self._buf[: self._fill])
                self._fill = 0
            self._etags += [p.result() for p, _ in self._pending]
            self._pending.clear()
            parts = [{"ETag": e, "PartNumber": i + 1} for i, e in enumerate(self._etags)]
            store._call(
                self.key,
                "completing the upload of",
                store.client.complete_multipart_upload,
                Key=self.key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            self.abort()
            raise
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Give the object up (best effort: ``ObjectRoot.recover`` aborts what is left)."""
        for pending, _ in self._pending:
            pending.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            with contextlib.suppress(StorageError):
                self.store.abort(OpenUpload(self.key, self._upload_id, 0.0))
            self._upload_id = None
