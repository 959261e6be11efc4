"""dckpt: verified, sharded, atomic checkpoints for distributed PyTorch training.

The public API is small on purpose: a training script holds one ``CheckpointManager`` over a
``TrainState``; everything else is reached through them or the ``dckpt`` command.

Names are imported on first use, so the ``dckpt`` command starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointConfig": "config",
    "CheckpointError": "errors",
    "CheckpointManager": "manager",
    "CheckpointNotFoundError": "errors",
    "IntegrityError": "errors",
    "LoadResult": "manager",
    "ManifestError": "errors",
    "SaveError": "errors",
    "SaveResult": "manager",
    "TrainState": "state",
}

__all__ = [*sorted(_EXPORTS), "__version__"]

if TYPE_CHECKING:
    from .config import CheckpointConfig
    from .errors import (
        CheckpointError,
        CheckpointNotFoundError,
        IntegrityError,
        ManifestError,
        SaveError,
    )
    from .manager import CheckpointManager, LoadResult, SaveResult
    from .state import TrainState


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
