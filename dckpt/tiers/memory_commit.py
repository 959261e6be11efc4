"""The memory tier's commit: a memory save becomes a checkpoint when rank 0 puts its manifest
into the durable root's ledger. ``MemoryCommit`` is the third ``CommitStrategy``.

The bytes of a memory save are in the nodes' memory (each rank's own file, written in
``save()``, hashed in the background: dckpt.save.memory); what makes them a checkpoint is the
manifest, built by rank 0 from every rank's digests (dckpt.save.pipeline, steps 6-7):

1. ``tmp_location``, ``make_tmp``: ``ROOT/memory/step-N.tmp-<id>/``, where rank 0 writes the
   manifest (every rank makes the directory, as for any save; only rank 0's is used; a
   re-saved step replaces its record at the commit point: no room to make);
2. ``finalize`` (rank 0, once every rank reported its file hashed): the manifest becomes
   ``ROOT/memory/step-N.json`` (dckpt.root.memory_ledger; one PUT on an s3:// root): the
   commit point. The run lock is read back first on an object store. Then any record above N
   (a branch the run rolled back from) is removed;
3. ``retain``: the ledger keeps ``keep + 1`` records, one more than each node keeps in memory,
   so the step before the newest stays restorable while the newest is being replicated.

A resume restores a memory step only from a manifest in this ledger, where no outside peer
can write: files found in a node's memory without one are never read (dckpt.load.memory).

``Lineage`` is the newest durable step the run continues from (saved or resumed from; the
root's newest at start, before any resume); the manager owns it, the save pipeline moves it at
each durable commit, and every memory manifest records it (``mesh["after"]``), so a memory
step of a branch the run left is not resumed.

Knows files, never tensors.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..faults import fault_point
from ..owned import make_dir
from ..phases import Phase
from ..root.commit import Flag
from ..root.layout import TMP_RE, step_dir_name
from ..root.manifest import MANIFEST_FILE, Manifest
from ..root.memory_ledger import LEDGER_DIR, MemoryLedger
from ..root.retention import RetentionPolicy

__all__ = ["Lineage", "MemoryCommit"]

log = logging.getLogger("dckpt")


@dataclass
class Lineage:
    """The newest durable step this run continues from; see the module docstring."""

    anchor: int | None = None

    def committed(self, step: int, *, anchor: bool) -> None:
        """A save of ``step`` committed: one to the tier the lineage rests on (``anchor``: the
        root's) is what later memory saves follow (a memory save follows the durable step
        before it)."""
        if anchor:
            self.anchor = step

    def resumed(self, manifest: Manifest) -> None:
        """The run goes on from ``manifest``: a durable step, or a memory step, which follows
        the durable step it recorded."""
        if manifest.mesh.get("tier") == "memory":
            after = manifest.mesh.get("after")
            self.anchor = after if isinstance(after, int) else None
        else:
            self.anchor = manifest.step


class MemoryCommit:
    """Commit a memory save by recording its manifest in the root's ledger."""

    def __init__(self, ledger: MemoryLedger, keep: int, where_held: str) -> None:
        self.ledger = ledger
        self.keep = keep
        self.where_held = where_held
        """Where the nodes keep the bytes (for logs): the memory directory."""

    def tmp_location(self, root: Path, step: int, save_id: str) -> Path:
        return Path(root) / LEDGER_DIR / f"{step_dir_name(step)}.tmp-{save_id}"

    def make_tmp(self, root: Path, tmp: Path, step: int, *, coordinator: bool) -> None:
        make_dir(tmp, parents=True)

    def where(self, root: Path, step: int) -> str:
        return f"{self.where_held} ({self.ledger.where(step)})"

    def finalize(self, root: Path, tmp: Path, step: int, *, cancelled: Flag | None = None) -> Path:
        if TMP_RE.fullmatch(tmp.name) is None or tmp.parent != Path(root) / LEDGER_DIR:
            raise ValueError(f"{tmp} is not a memory save's tmp dir under {root}")
        fault_point(Phase.MEMORY_COMMIT, 0, step)
        if cancelled is not None and cancelled.is_set():
            raise RuntimeError(f"the memory save of step {step} was cancelled before its commit")
        final = Path(self.ledger.commit(step, tmp / MANIFEST_FILE))  # the commit point
        try:  # committed: what follows only tidies up
            shutil.rmtree(tmp, ignore_errors=True)
            dropped = self.ledger.drop_above(step)
            if dropped:
                log.warning(
                    "dckpt: memory step %d follows a rollback: the records of memory steps %s "
                    "(the branch the run left) were removed",
                    step,
                    dropped,
                )
        except Exception as exc:
            log.warning("dckpt: memory step %d is committed, but tidying up failed: %r", step, exc)
        return final

    def retain(self, root: Path, policy: RetentionPolicy) -> None:
        self.ledger.keep_newest(self.keep + 1)

    def recover(self, root: Path) -> None:
        """At start (rank 0): memory saves in flight when the last workers died are abandoned."""
        with contextlib.suppress(OSError):
            for entry in (Path(root) / LEDGER_DIR).iterdir():
                if TMP_RE.fullmatch(entry.name) is not None and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
