"""dckpt: verified, sharded, atomic checkpoints for distributed PyTorch training.

The public API is small on purpose: a training script holds one ``CheckpointManager`` over a
``TrainState``; everything else is reached through them or the ``dckpt`` command.
"""

from __future__ import annotations

__version__ = "0.1.0"

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

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "IntegrityError",
    "LoadResult",
    "ManifestError",
    "SaveError",
    "SaveResult",
    "TrainState",
    "__version__",
]
