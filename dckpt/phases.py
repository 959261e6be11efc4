"""The one vocabulary for where a save or a resume is: ``Phase``.

Every phase names a point of the protocol (stated in ``dckpt.save.pipeline`` for a save and
``dckpt.load.resumer`` for a resume). The same names serve three readers:

- the fault hook (``DCKPT_FAULT="phase=<value>,..."``, dckpt.faults) fires *at* the point;
- the progress markers (dckpt.collective.progress) record that a rank got *past* it, so a failed
  wait names the ranks that are behind and the phase they did not complete;
- the docs (docs/ARCHITECTURE.md) and the fault tests, which iterate over the phases by side.

A ``Trace`` is what lower layers (the storage writer, the staging planner) are handed to report
a point they reach; it is a protocol defined here so that they never import the layer above.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .faults import Tamper

__all__ = ["Phase", "Trace"]


class Phase(str, Enum):
    """A point of the save or resume protocol; ``value`` is its name in ``DCKPT_FAULT``."""

    # A save, on every rank, in order.
    PREPARE = "prepare"
    MAKE_TMP = "make_tmp"
    STAGE = "stage"
    WRITE_SHARDS = "write_shards"
    DCP_FINISH = "dcp_finish"
    # A save to an object store (s3://), on every rank: a shard's first part sent.
    UPLOAD = "upload"
    # A save, on rank 0 (the coordinator), after every rank's part.
    WRITE_MANIFEST = "write_manifest"
    FSYNC_SHARDS = "fsync_shards"
    RENAME = "rename"
    RENAME_REPLY = "rename_reply"
    FSYNC_PARENT = "fsync_parent"
    PUBLISH_LATEST = "publish_latest"
    RETENTION = "retention"
    # A resume, on every rank (``list_steps``: rank 0), in order: what it reads, then checks.
    LIST_STEPS = "list_steps"
    READ_MANIFEST = "read_manifest"
    READ_METADATA = "read_metadata"
    READ_SHARD = "read_shard"
    VERIFY = "verify"
    WARMUP = "warmup"
    # After a memory resume, on a rank whose files arrived straight into its state: the
    # thread that puts them back into its node's memory, before it copies anything.
    MEMORY_REFILL = "memory_refill"
    # A memory save (``save(step, tier="memory")``): every rank, but ``memory_commit`` (rank 0).
    MEMORY_COPY = "memory_copy"
    MEMORY_HASH = "memory_hash"
    MEMORY_COMMIT = "memory_commit"
    REPLICATE = "replicate"

    def __str__(self) -> str:
        return self.value

    @property
    def side(self) -> str:
        """``rank`` (every rank, in a save), ``coordinator`` (rank 0), ``resume``, ``object``
        (every rank, in a save to an object store only) or ``memory`` (a memory save)."""
        return _SIDE[self]

    @property
    def what(self) -> str:
        """What a rank does up to and through this point, for messages."""
        return _WHAT[self]


_SIDE = {
    **dict.fromkeys(
        (Phase.PREPARE, Phase.MAKE_TMP, Phase.STAGE, Phase.WRITE_SHARDS, Phase.DCP_FINISH), "rank"
    ),
    **dict.fromkeys(
        (
            Phase.WRITE_MANIFEST,
            Phase.FSYNC_SHARDS,
            Phase.RENAME,
            Phase.RENAME_REPLY,
            Phase.FSYNC_PARENT,
            Phase.PUBLISH_LATEST,
            Phase.RETENTION,
        ),
        "coordinator",
    ),
    **dict.fromkeys(
        (
            Phase.LIST_STEPS,
            Phase.READ_MANIFEST,
            Phase.READ_METADATA,
            Phase.READ_SHARD,
            Phase.VERIFY,
            Phase.WARMUP,
            Phase.MEMORY_REFILL,
        ),
        "resume",
    ),
    Phase.UPLOAD: "object",
    **dict.fromkeys(
        (Phase.MEMORY_COPY, Phase.MEMORY_HASH, Phase.MEMORY_COMMIT, Phase.REPLICATE), "memory"
    ),
}
_WHAT = {
    Phase.PREPARE: "the start of the save",
    Phase.MAKE_TMP: "preparing the save (its state and tmp dir)",
    Phase.STAGE: "staging the deferred copies",
    Phase.WRITE_SHARDS: "writing shards",
    Phase.DCP_FINISH: "finishing its files (DCP's save, or the memory copy)",
    Phase.UPLOAD: "uploading shards to the object store",
    Phase.WRITE_MANIFEST: "writing the manifest",
    Phase.FSYNC_SHARDS: "syncing the files",
    Phase.RENAME: "the commit",
    Phase.RENAME_REPLY: "the commit's answer",
    Phase.FSYNC_PARENT: "syncing the root",
    Phase.PUBLISH_LATEST: "updating latest",
    Phase.RETENTION: "retention",
    Phase.LIST_STEPS: "listing the committed steps",
    Phase.READ_MANIFEST: "reading a manifest",
    Phase.READ_METADATA: "reading DCP's metadata",
    Phase.READ_SHARD: "reading a shard file",
    Phase.VERIFY: "verifying the files",
    Phase.WARMUP: "the warmup collective",
    Phase.MEMORY_REFILL: "putting the files it received back into its node's memory",
    Phase.MEMORY_COPY: "copying the state into the node's memory",
    Phase.MEMORY_HASH: "hashing its memory file",
    Phase.MEMORY_COMMIT: "the memory commit (the manifest into the root's ledger)",
    Phase.REPLICATE: "sending and receiving replicas",
}


class Trace(Protocol):
    """Where a lower layer reports the points of one save it reaches and passes."""

    def at(self, phase: Phase) -> None:
        """This rank reached ``phase`` (the fault hook fires here)."""
        ...

    def passed(self, phase: Phase) -> None:
        """This rank got past ``phase`` (a progress marker, to name late ranks)."""
        ...

    def tamper(self, phase: Phase) -> Tamper | None:
        """The staging copy the fault hook falsifies at ``phase`` on this rank, if any."""
        ...
