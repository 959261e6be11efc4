"""Storage layer: hashing DCP writer, verifying DCP reader, digests. Knows nothing of policy.

Modules: ``digest`` (hashers, no torch), ``records`` (FileRecord), ``hashing_writer``,
``verifying_reader`` with ``one_pass`` (a verified file read once into the state),
``verified_files``, ``item_digests``, ``safe_unpickle`` (DCP glue), ``direct_file``,
``stable_file``, ``memory_file``, ``sink``. Names below are imported on first use,
so importing this package (as the CLI does) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ALGORITHMS": "digest",
    "digest_of_digests": "digest",
    "hash_file": "digest",
    "new_hasher": "digest",
    "parse_digest": "digest",
    "FileRecord": "records",
    "HashingWriter": "hashing_writer",
    "SafeLoadPlanner": "verifying_reader",
    "VerifyingReader": "verifying_reader",
    "open_verified": "verified_files",
    "read_verified": "verified_files",
}

__all__ = [
    "ALGORITHMS",
    "FileRecord",
    "HashingWriter",
    "SafeLoadPlanner",
    "VerifyingReader",
    "digest_of_digests",
    "hash_file",
    "new_hasher",
    "open_verified",
    "parse_digest",
    "read_verified",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dckpt.storage' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
