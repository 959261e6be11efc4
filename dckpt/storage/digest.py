"""Digest helpers: one streaming hasher interface over xxh3-128 (default) and sha256.

A digest is written as ``"<algorithm>:<lowercase hex>"`` so a manifest names how each of its
files was hashed, and a reader never guesses. The streaming interface lets writers hash bytes as
they go out and readers hash bytes as they come in: no file is read twice to be checked.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable
from typing import Protocol

import xxhash

__all__ = [
    "ALGORITHMS",
    "Hasher",
    "digest_of_digests",
    "format_digest",
    "hash_file",
    "hash_stream",
    "new_hasher",
    "parse_digest",
]

ALGORITHMS: dict[str, int] = {"xxh3_128": 32, "sha256": 64}
"""Supported algorithms and the length of their hex digests."""

_DIGEST_RE = re.compile(r"(xxh3_128|sha256):([0-9a-f]+)")
READ_CHUNK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """A fresh streaming hasher for ``algorithm`` (``xxh3_128`` or ``sha256``)."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r}; use one of {sorted(ALGORITHMS)}")


def format_digest(algorithm: str, hasher: Hasher) -> str:
    return f"{algorithm}:{hasher.hexdigest()}"


def parse_digest(digest: str) -> tuple[str, str]:
    """Split ``algo:hex`` and check the hex length for that algorithm; ValueError if malformed."""
    match = _DIGEST_RE.fullmatch(digest)
    if match is None or len(match.group(2)) != ALGORITHMS[match.group(1)]:
        raise ValueError(f"malformed digest {digest!r}: expected '<xxh3_128|sha256>:<hex>'")
    return match.group(1), match.group(2)


def hash_file(
    path: str | os.PathLike[str],
    algorithm: str,
    progress: Callable[[int], None] | None = None,
) -> tuple[str, int]:
    """Stream a file through ``algorithm``; returns (digest, bytes read)."""
    with open(path, "rb", buffering=0) as f:
        return hash_stream(f, algorithm, progress)


class Readable(Protocol):
    def readinto(self, buffer: bytearray, /) -> int | None: ...


def hash_stream(
    f: Readable, algorithm: str, progress: Callable[[int], None] | None = None
) -> tuple[str, int]:
    """Hash ``f`` from where it is to its end through one reused buffer; (digest, bytes).

    ``progress`` receives the size of each chunk as it is hashed (for progress bars).
    """
    hasher = new_hasher(algorithm)
    size = 0
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        hasher.update(view[:n])
        size += n
        if progress is not None:
            progress(n)
    return format_digest(algorithm, hasher), size


def digest_of_digests(entries: Iterable[tuple[str, int, str]], algorithm: str = "xxh3_128") -> str:
    """One digest over (path, bytes, digest) triples, independent of their order.

    Ranks compare this single value to learn whether they saw the same checkpoint.
    """
    hasher = new_hasher(algorithm)
    for path, size, digest in sorted(entries):
        hasher.update(f"{path}\0{size}\0{digest}\n".encode())
    return format_digest(algorithm, hasher)
