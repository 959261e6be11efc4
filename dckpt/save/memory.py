"""A memory save's step in ``save()``: this rank's state copied into its node's memory.

The rest of a memory save (digest, manifest, each node's commit, the replica) is the
protocol in dckpt.tiers.memory_node, run by dckpt.save.pipeline. This is the only part that
sees tensors: one memcpy per tensor into ``own/step-N.tmp-<id>/rank-<r>.mem``, into pages
reused from the save before last (dckpt.storage.memory_file), before ``save()`` returns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import StorageError
from ..storage.memory_file import plan_flat, write_into
from ..tiers import memory_layout as layout
from ..tiers.memory_node import MemoryNode, memory_file_name

__all__ = ["stage"]


def stage(node: MemoryNode, step: int, save_id: str, state_dict: dict[str, Any]) -> Path:
    """Copy this rank's state into its memory file; returns the file. A memory file system
    too small for it raises StorageError (nothing durable is touched)."""
    tmp = node.tmp_location(step, save_id)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / memory_file_name(node.rank)
    spares = layout.spare_dir(node.dir, "own")
    plan = plan_flat(state_dict)
    try:
        write_into(path, plan, lambda p: layout.take_spare(spares, p.name, p))
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise StorageError(
            f"the memory tier at {node.dir} could not hold rank {node.rank}'s "
            f"{plan.size / 2**20:.1f} MiB for step {step} "
            f"({os.strerror(exc.errno) if exc.errno else exc}): the memory save failed and "
            "the durable checkpoints are untouched. Give the memory file system more room "
            "(memory_dir, or /dev/shm's size) or lower memory_keep."
        ) from None
    return path
