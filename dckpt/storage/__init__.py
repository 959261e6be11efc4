"""Storage layer: hashing DCP writer, verifying DCP reader, digests. Knows nothing of policy."""

from .digest import ALGORITHMS, digest_of_digests, hash_file, new_hasher, parse_digest
from .hashing_writer import HashingWriter
from .records import FileRecord
from .verifying_reader import SafeLoadPlanner, VerifyingReader, read_verified

__all__ = [
    "ALGORITHMS",
    "FileRecord",
    "HashingWriter",
    "SafeLoadPlanner",
    "VerifyingReader",
    "digest_of_digests",
    "hash_file",
    "new_hasher",
    "parse_digest",
    "read_verified",
]
