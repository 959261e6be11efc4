"""Root URLs: which roots live in an object store, and where their local mirror is.

A root is either a directory path or ``s3://bucket[/prefix]``. S3-compatible stores (MinIO,
Ceph, GCS's XML API, R2) are reached through ``s3://`` with ``AWS_ENDPOINT_URL``; other
schemes are refused with that advice rather than guessed at.

Invariants: a parsed prefix never starts or ends with ``/`` and has no empty, ``.`` or ``..``
part, so ``prefix + "/" + name`` is the only key a name maps to.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ObjectURL", "default_mirror", "is_url", "parse_url"]

_SCHEME_RE = re.compile(r"([a-z][a-z0-9+.-]*)://", re.IGNORECASE)
# S3's rules for new buckets (3-63 chars of lowercase, digits, dots and hyphens).
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


@dataclass(frozen=True)
class ObjectURL:
    """``s3://bucket/prefix``: a root in an object store."""

    bucket: str
    prefix: str  # "" for the bucket's top level

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under the root (joined with ``/``)."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def under(self) -> str:
        """The key prefix every object of this root starts with."""
        return f"{self.prefix}/" if self.prefix else ""

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def is_url(root: object) -> bool:
    """Whether ``root`` is written as a URL (``scheme://...``), not a path."""
    return isinstance(root, str) and _SCHEME_RE.match(root) is not None


def parse_url(root: str) -> ObjectURL:
    """Parse ``s3://bucket/prefix``; ValueError saying what to write instead."""
    m = _SCHEME_RE.match(root)
    if m is None:
        raise ValueError(f"{root!r} is not a URL")
    scheme = m.group(1).lower()
    if scheme != "s3":
        raise ValueError(
            f"{root!r}: dckpt supports directory paths and s3:// roots. For an S3-compatible "
            "store (MinIO, Ceph, GCS's XML API, R2) use s3://bucket/prefix and set "
            "AWS_ENDPOINT_URL to its endpoint."
        )
    rest = root[m.end() :]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise ValueError(
            f"{root!r}: {bucket!r} is not a valid bucket name (3-63 lowercase letters, digits, "
            "dots and hyphens)"
        )
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts) or "\\" in prefix or "\0" in prefix:
        raise ValueError(f"{root!r}: the prefix may not hold empty, '.' or '..' parts")
    return ObjectURL(bucket, prefix)


def default_mirror(url: ObjectURL) -> Path:
    """The local mirror of ``url`` when none is given: ``$DCKPT_CACHE_DIR`` (or
    ``~/.cache/dckpt``) / ``s3`` / bucket / a short hash of the prefix plus its last part."""
    base = Path(os.environ.get("DCKPT_CACHE_DIR") or Path.home() / ".cache" / "dckpt")
    tag = hashlib.sha256(url.prefix.encode()).hexdigest()[:12]
    last = url.prefix.rsplit("/", 1)[-1] if url.prefix else "top"
    return base / "s3" / url.bucket / f"{last}-{tag}"
