"""Root URLs: which roots live in an object store, and where their local mirror is.

A root is either a directory path or ``s3://bucket[/prefix]``. S3-compatible stores (MinIO,
Ceph, GCS's XML API, R2) are reached through ``s3://`` with ``AWS_ENDPOINT_URL``; other
schemes are refused with that advice rather than guessed at.

Invariants: a parsed prefix never starts or ends with ``/`` and has no empty, ``.`` or ``..``
part, so ``prefix + "/" + name`` is the only key a name maps to; a root written like a URL
that cannot be parsed as one (``s3:/bucket``, what ``pathlib.Path("s3://bucket")`` turns it
into) is refused, never taken for a local directory named ``s3:``.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ObjectURL",
    "default_mirror",
    "is_url",
    "parse_root",
    "parse_url",
    "refuse_mangled_url",
]

_SCHEME_RE = re.compile(r"([a-z][a-z0-9+.-]*)://", re.IGNORECASE)
# A scheme of two letters or more and one slash or none: a URL that lost a slash on the way
# (pathlib collapses "//"), or was mistyped. One letter is a drive ("C:/..."), not a scheme.
_MANGLED_RE = re.compile(r"([a-z][a-z0-9+.-]+):(/?)(?!/)", re.IGNORECASE)
# Schemes of object stores and remote filesystems: "s3:bucket" is a typo, not a directory.
_REMOTE_SCHEMES = frozenset(
    {"s3", "s3a", "s3n", "gs", "gcs", "az", "abfs", "abfss", "wasb", "r2", "oss", "cos", "hdfs"}
)
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


def refuse_mangled_url(root: str | os.PathLike[str]) -> None:
    """ValueError if ``root`` reads like a URL but is not one: ``s3:/bucket/prefix`` (a
    ``pathlib.Path`` made of ``s3://bucket/prefix``) or ``s3:bucket``. Such a root would
    otherwise become a local directory, and the checkpoints would never reach the store."""
    text = os.fspath(root)
    if is_url(text):
        return
    m = _MANGLED_RE.match(text)
    if m is None or (not m.group(2) and m.group(1).lower() not in _REMOTE_SCHEMES):
        return
    scheme = m.group(1).lower()
    fixed = f"{scheme}://{text[m.end() :].lstrip('/')}"
    hint = (
        " pathlib.Path() collapses '//', so pass the URL as a str, not a Path."
        if isinstance(root, os.PathLike)
        else ""
    )
    raise ValueError(
        f"root {text!r} reads as a {scheme}:// URL without its '//', not a directory: write "
        f"{fixed!r}.{hint} Nothing was written. (For a local directory with a ':' in its "
        f"name, write './{text}'.)"
    )


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


def parse_root(root: str | os.PathLike[str]) -> ObjectURL | Path:
    """What a root names: an object store (``ObjectURL``) or a directory (``Path``); the one
    place that tells the two apart. ValueError for a URL that cannot be one of dckpt's, or a
    path that reads like a mangled URL (``refuse_mangled_url``)."""
    refuse_mangled_url(root)
    if is_url(root):
        return parse_url(str(root))
    return Path(root)


def default_mirror(url: ObjectURL) -> Path:
    """The local mirror of ``url`` when none is given: ``$DCKPT_CACHE_DIR`` (or
    ``~/.cache/dckpt``) / ``s3`` / bucket / a short hash of the prefix plus its last part."""
    base = Path(os.environ.get("DCKPT_CACHE_DIR") or Path.home() / ".cache" / "dckpt")
    tag = hashlib.sha256(url.prefix.encode()).hexdigest()[:12]
    last = url.prefix.rsplit("/", 1)[-1] if url.prefix else "top"
    return base / "s3" / url.bucket / f"{last}-{tag}"
