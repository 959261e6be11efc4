"""Load DCP's ``.metadata`` pickle with an allow-list, so a hostile file cannot run code.

DCP stores its metadata as a plain pickle and reads it with an unrestricted unpickler: anyone
who can write a checkpoint directory could otherwise execute code in every rank that loads it.
This unpickler resolves only the classes DCP's metadata is made of; anything else raises
``ManifestError`` before it is constructed.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ..errors import ManifestError

__all__ = ["load_dcp_metadata"]

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Exact names only: pickle protocol 4 resolves dotted names ("os.system") through a
        # module's own imports, so a prefix or pattern match would let any callable through.
        if name in _ALLOWED.get(module, frozenset()):
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            if name == "Size":
                return torch.Size
            value = getattr(torch, name, None)
            if isinstance(value, _TORCH_VALUE_TYPES):
                return value
        raise ManifestError(
            f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never "
            "holds; the file may be hostile. It was not loaded."
        )


def load_dcp_metadata(data: bytes, source: str) -> Any:
    """Unpickle DCP metadata bytes with the allow-list; ``source`` names the file in errors."""
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except ManifestError as exc:
        raise ManifestError(f"{source}: {exc}") from None
    except Exception as exc:
        raise ManifestError(f"cannot parse DCP metadata {source}: {exc}") from exc
