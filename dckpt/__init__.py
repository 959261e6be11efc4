"""dckpt: verified, sharded, atomic checkpoints for distributed PyTorch training.

The public API is small on purpose: a training script holds one ``CheckpointManager`` over a
``TrainState``; everything else is reached through them or the ``dckpt`` command.

Names are imported on first use, so the ``dckpt`` command starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .version import __version__

_EXPORTS = {
    "CheckpointConfig": "config",
    "CheckpointError": "errors",
    "CheckpointInfo": "root.peek",
    "CheckpointManager": "manager",
    "CheckpointNotFoundError": "errors",
    "ConfigMismatchError": "errors",
    "GlobalBatchSampler": "train.data",
    "IncompatibleCheckpointError": "errors",
    "IntegrityError": "errors",
    "LockError": "errors",
    "LoadResult": "manager",
    "LossDeviationError": "errors",
    "ManifestError": "errors",
    "PerRank": "train.per_rank",
    "PrecisionPolicy": "train.precision",
    "ResumeReport": "load.report",
    "SaveError": "errors",
    "SaveHandle": "manager",
    "SaveResult": "manager",
    "StateMismatchError": "errors",
    "StorageError": "errors",
    "TrainState": "train.state",
    "WorldError": "errors",
    "init_distributed": "collective.world",
    "peek": "tiers.peek",
    "read_config": "tiers.peek",
}

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ConfigMismatchError",
    "GlobalBatchSampler",
    "IncompatibleCheckpointError",
    "IntegrityError",
    "LoadResult",
    "LockError",
    "LossDeviationError",
    "ManifestError",
    "PerRank",
    "PrecisionPolicy",
    "ResumeReport",
    "SaveError",
    "SaveHandle",
    "SaveResult",
    "StateMismatchError",
    "StorageError",
    "TrainState",
    "WorldError",
    "__version__",
    "init_distributed",
    "peek",
    "read_config",
]

if TYPE_CHECKING:
    from .collective.world import init_distributed as init_distributed
    from .config import CheckpointConfig as CheckpointConfig
    from .errors import CheckpointError as CheckpointError
    from .errors import CheckpointNotFoundError as CheckpointNotFoundError
    from .errors import ConfigMismatchError as ConfigMismatchError
    from .errors import IncompatibleCheckpointError as IncompatibleCheckpointError
    from .errors import IntegrityError as IntegrityError
    from .errors import LockError as LockError
    from .errors import LossDeviationError as LossDeviationError
    from .errors import ManifestError as ManifestError
    from .errors import SaveError as SaveError
    from .errors import StateMismatchError as StateMismatchError
    from .errors import StorageError as StorageError
    from .errors import WorldError as WorldError
    from .load.report import ResumeReport as ResumeReport
    from .manager import CheckpointManager as CheckpointManager
    from .manager import LoadResult as LoadResult
    from .manager import SaveHandle as SaveHandle
    from .manager import SaveResult as SaveResult
    from .root.peek import CheckpointInfo as CheckpointInfo
    from .tiers.peek import peek as peek
    from .tiers.peek import read_config as read_config
    from .train.data import GlobalBatchSampler as GlobalBatchSampler
    from .train.per_rank import PerRank as PerRank
    from .train.precision import PrecisionPolicy as PrecisionPolicy
    from .train.state import TrainState as TrainState


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
