"""The memory tier as one rank sees it: its node's memory, the topology, the node's commit.

A memory save (``save(step, tier="memory")``) is the same save as a durable one, down to the
manifest; only where the bytes go differs. The protocol (run by dckpt.save.pipeline):

1. in ``save()``, ``dckpt.save.memory.stage``: this rank's state dict is copied into its file
   ``own/step-N.tmp-<id>/rank-<r>.mem`` in the node's memory directory (dckpt.tiers.
   memory_layout), one memcpy per tensor into pages reused from the save before last (the
   snapshot: training may change the state as soon as ``save()`` returns);
2. in the background, ``digest``: each rank hashes its file (the writer's digest);
3. every rank's record is gathered; rank 0 builds the manifest (``mesh["nodes"]``: each rank's
   node; ``mesh["replicas"]``: which node keeps each node's replica) and broadcasts it;
4. ``MemoryNode.commit_node``, on each node's first rank: ``manifest.json`` is written into
   the tmp dir, which is renamed to ``own/step-N`` (the node's commit; a step at or above N,
   left by a branch the run rolled back from, is retired first). The memory save is
   committed when every node committed; if any node failed, the nodes that committed
   uncommit it again and the save fails on every rank;
5. ``replicate``, on each node's first rank: the node's keeper retires the oldest own steps
   and sends this node's files to the partner's keeper, which commits its replica only once
   every file hashed to the writer's digest as it arrived. A failed replica is logged, never
   fails the committed save (the local copy and the durable tier still stand).

The topology (which node each rank is on, each node's keeper and its partner: the next node
on a ring, dckpt.tiers.memory_layout.partner_of) is learned once, at start, by an all-gather.
Knows files and keepers, never tensors (the flat file is dckpt.storage.memory_file's).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StorageError
from ..root.layout import step_dir_name
from ..root.manifest import MANIFEST_FILE
from ..storage.digest import format_digest, new_hasher
from ..storage.records import FileRecord
from . import memory_layout as layout
from .keeper_client import KeeperClient

__all__ = ["MemoryNode", "Topology", "memory_file_name"]

log = logging.getLogger("dckpt")


def memory_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.mem"


@dataclass(frozen=True)
class Topology:
    """The nodes of this world, as learned at start by an all-gather."""

    node_of: tuple[int, ...]
    """Each rank's node index."""
    keepers: dict[int, str]
    """Each node's keeper, ``host:port``."""

    @property
    def nodes(self) -> int:
        return len(set(self.node_of))

    def partner(self, node: int) -> int | None:
        return layout.partner_of(node, self.nodes)

    def first_rank(self, node: int) -> int:
        return self.node_of.index(node)

    def replicas(self) -> dict[str, int]:
        """node -> the node that keeps its replica (JSON keys), for the manifest."""
        pairs = {n: self.partner(n) for n in sorted(set(self.node_of))}
        return {str(n): p for n, p in pairs.items() if p is not None}


class MemoryNode:
    """One rank's view of the memory tier; see the module docstring."""

    def __init__(
        self, memory_root: Path, rank: int, topology: Topology, keep: int, root_id: str
    ) -> None:
        self.rank = rank
        self.root_id = root_id
        """The durable root's id (dckpt.root.layout.root_identity), in every memory manifest:
        a memory checkpoint is only ever resumed into the root it was saved beside."""
        self.owners: tuple[str, frozenset[str], str] | None = None
        """The layout the ranks agreed on at the last memory save: (signature of the
        replicated tensors, those this rank leaves to others, "world" or "node": who reads
        whose files). dckpt.save.memory keeps it."""
        self.pending_sizes: dict[str, int] = {}
        self.anchor: int | None = None
        """The newest durable step this run continues from (saved, or resumed from), in every
        memory manifest: a memory step whose durable step is gone (a rollback) is not used."""
        self.topology = topology
        self.node = topology.node_of[rank]
        self.first = topology.first_rank(self.node) == rank
        self.keep = keep
        self.dir = layout.node_dir(memory_root, self.node)
        self.own = layout.own_dir(self.dir)
        self.keeper = KeeperClient(topology.keepers[self.node])

    def partner_addr(self) -> str | None:
        partner = self.topology.partner(self.node)
        return None if partner is None else self.topology.keepers[partner]

    def tmp_location(self, step: int, save_id: str) -> Path:
        return self.own / f"{step_dir_name(step)}.tmp-{save_id}"

    # --- step 2: in the background ----------------------------------------------------------

    def digest(self, path: Path, algorithm: str) -> FileRecord:
        """The writer's digest of this rank's file, read from memory once."""
        hasher = new_hasher(algorithm)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            populate = getattr(mmap, "MAP_POPULATE", 0)  # one call, not a fault per page
            with mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED | populate, mmap.PROT_READ) as mm:
                hasher.update(memoryview(mm))
        return FileRecord(
            path=path.name, bytes=size, digest=format_digest(algorithm, hasher), rank=self.rank
        )

    def reserve(self, path: Path) -> None:
        """After the first memory save of this process: reserve a spare of the same size, so
        the next save reuses pages instead of allocating them and the tier's footprint after
        the first save is already its steady state."""
        try:
            layout.reserve_spare(layout.spare_dir(self.dir, "own"), path.name, path.stat().st_size)
        except OSError as exc:
            log.warning(
                "dckpt: could not reserve a second memory slot for %s in %s (%s): the next "
                "memory save allocates it, and may find the memory full",
                path.name,
                self.dir,
                exc,
            )

    # --- steps 4 and 5: the node's first rank ------------------------------------------------

    def commit_node(self, tmp: Path, step: int, raw_manifest: bytes) -> None:
        """Write the manifest into ``tmp`` and make it this node's ``own/step-N``."""
        final = self.own / step_dir_name(step)
        for stale in layout.committed_memory_steps(self.own):
            if stale >= step:  # a rolled-back branch, or this step saved again
                self.uncommit(stale)
        part = tmp / f".{MANIFEST_FILE}.part"
        part.write_bytes(raw_manifest)
        os.replace(part, tmp / MANIFEST_FILE)
        os.rename(tmp, final)  # the node's commit point

    def uncommit(self, step: int) -> None:
        """Drop this node's copy of ``step`` (manifest first: never half a checkpoint)."""
        d = self.own / step_dir_name(step)
        with contextlib.suppress(OSError):
            (d / MANIFEST_FILE).unlink()
        shutil.rmtree(d, ignore_errors=True)

    def replicate(self, step: int) -> dict[str, Any]:
        """Ask this node's keeper to retire old steps and copy ``step`` to the partner. Never
        raises: the other ranks wait for this answer in an all-gather, and a failed replica
        never fails the committed save."""
        try:
            return self.keeper.committed(step, self.partner_addr())
        except StorageError as exc:
            return {"ok": False, "error": str(exc)}
        except Exception as exc:
            return {"ok": False, "error": f"asking the keeper failed: {exc!r}"}

    def clean_abandoned(self) -> None:
        """At start, on the node's first rank: saves in flight when the last workers died
        are abandoned (no save runs yet)."""
        try:
            entries = list(self.own.iterdir())
        except OSError:
            return
        for entry in entries:
            if ".tmp-" in entry.name:
                shutil.rmtree(entry, ignore_errors=True)
