"""A memory save's step in ``save()``: this rank's state copied into its node's memory.

The rest of a memory save (digest, manifest, each node's commit, the replica) is the
protocol in dckpt.tiers.memory_node, run by dckpt.save.pipeline. This is the only part that
sees tensors: one memcpy per tensor into ``own/step-N.tmp-<id>/rank-<r>.mem``, into pages
reused from the save before last (dckpt.storage.memory_file), before ``save()`` returns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StorageError
from ..storage.memory_file import (
    MemoryFileError,
    plan_flat,
    share_out,
    signature,
    write_into,
)
from ..tiers import memory_layout as layout
from ..tiers.memory_node import MemoryNode, memory_file_name

__all__ = ["Staged", "agree_on_layout", "stage"]


@dataclass(frozen=True)
class Staged:
    """A memory save's file, and what the ranks must agree on about its layout."""

    path: Path
    signature: str
    """Digest of this rank's replicated-looking tensors (dckpt.storage.memory_file)."""
    shared: str | None
    """The layout this file was written with: the signature whose owners it followed (it
    holds only the replicated tensors it owns), or None (it holds every tensor)."""


def stage(node: MemoryNode, step: int, save_id: str, state_dict: dict[str, Any]) -> Staged:
    """Copy this rank's state into its memory file. Replicated tensors (as DCP counts them:
    plain tensors every rank holds alike) are written by one rank each, as agreed at the
    previous memory save (``MemoryNode.owners``), so under DDP each rank copies about
    1/world of them; the first save, or one whose tensors changed, writes everything. A
    memory file system too small for it raises StorageError (nothing durable is touched)."""
    tmp = node.tmp_location(step, save_id)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(
            f"cannot make {tmp} in the memory tier ({exc}): the memory save failed and the "
            "durable checkpoints are untouched"
        ) from None
    path = tmp / memory_file_name(node.rank)
    spares = layout.spare_dir(node.dir, "own")
    sig, sizes = signature(state_dict)
    shared = sig if node.owners is not None and node.owners[0] == sig else None
    skip: frozenset[str] = frozenset()
    if shared is not None and node.owners is not None:
        skip = node.owners[1]
    node.pending_sizes = sizes
    try:
        plan = plan_flat(state_dict, skip)
    except MemoryFileError as exc:
        raise StorageError(f"this state cannot be kept in the memory tier: {exc}") from None
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
    return Staged(path, sig, shared)


def agree_on_layout(node: MemoryNode, told: list[tuple[str, str | None]]) -> str | None:
    """In the background, after every rank's ``(signature, shared)``: why this save's files
    cannot be read together (None when they can), and the owners the next save follows.
    Every rank computes the same from the same list."""
    signatures = {sig for sig, _ in told}
    used = {shared for _, shared in told}
    problem = None
    if used != {None} and (len(used) != 1 or signatures != used):
        problem = (
            "the ranks' replicated tensors changed while some ranks wrote only their share "
            "of them (signatures differ), so no rank could restore this save: it is refused, "
            "and the next memory save writes every tensor on every rank"
        )
    scope, kind = sharing_scope(node)
    if problem is None and len(signatures) == 1 and node.pending_sizes and kind is not None:
        sig = next(iter(signatures))
        if node.owners is None or node.owners[0] != sig:
            owners = share_out(node.pending_sizes, len(scope))
            skip = frozenset(k for k, i in owners.items() if scope[i] != node.rank)
            node.owners = (sig, skip, kind)
    else:
        node.owners = None
    return problem


def sharing_scope(node: MemoryNode) -> tuple[list[int], str | None]:
    """The ranks that share out the replicated tensors, and what a resume must read: with at
    most two nodes, the whole world ("world": each node holds every file, its own and its
    partner's replica); with more, the ranks of each node ("node": each node's files and
    their replica suffice, no node reads another's). None: nothing to share (one rank)."""
    node_of = node.topology.node_of
    if node.topology.nodes <= 2:
        scope, kind = list(range(len(node_of))), "world"
    else:
        scope, kind = [r for r, n in enumerate(node_of) if n == node.node], "node"
    if len(scope) < 2 and (kind == "world" or max(node_of.count(n) for n in node_of) < 2):
        return scope, None
    return scope, kind
