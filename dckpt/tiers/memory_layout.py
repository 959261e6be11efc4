"""Where the memory tier keeps its checkpoints on one node: names, slots and retention.

A node's memory is a directory on a memory-backed file system (``/dev/shm`` by default), one
per node: ``MEMORY_DIR/node-<n>/``. Its owner is the node's keeper (dckpt.tiers.keeper); the
node's workers write their own shard files into it directly (no copy through a socket):

```
node-<n>/
  keeper.json                       the live keeper: pid, host, port, node, start time
  keeper.log                        the keeper's lifecycle, one line per event
  last-restore.json                 the node's last memory resume: step, seconds, from where
  own/step-XXXXXXXX/                this node's ranks' files of a committed memory save, and
                                    its manifest.json (the whole save's, written last)
  own/step-XXXXXXXX.tmp-<32 hex>/   a save in flight, or abandoned: never read
  replica/node-<k>/step-XXXXXXXX/   node k's files of a memory save, and its manifest, copied
                                    by k's keeper; committed (renamed) only after every file
                                    hashed to the writer's digest on arrival
  spare/own/  spare/node-<k>/       retired files, reused by the next save of the same name
  fetched/step-XXXXXXXX/            files a resume fetched from other nodes (proven on
                                    arrival), mapped by the node's ranks, removed after it
```

Invariants: a step directory without ``manifest.json``, or with a ``.tmp-`` name, is never
read; a committed directory is never written into (retirement renames its files out after
removing the manifest, so a half-retired step is simply not committed). Reusing a retired
file keeps the tier's memory at the level reached after the first save: its pages are
already allocated, and writing into them costs no page faults.

Knows files only, never tensors (no torch).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path

from ..root.layout import STEP_RE, step_dir_name
from ..root.manifest import MANIFEST_FILE

__all__ = [
    "KEEPER_FILE",
    "KEEPER_LOG",
    "RESTORE_FILE",
    "committed_memory_steps",
    "node_dir",
    "own_dir",
    "partner_of",
    "replica_dir",
    "reserve_spare",
    "retire_beyond",
    "spare_dir",
    "take_spare",
    "tmp_step_dir",
]

KEEPER_FILE = "keeper.json"
KEEPER_LOG = "keeper.log"
RESTORE_FILE = "last-restore.json"
"""The node's last resume from the memory tier (step, seconds, bytes, from where): the
restore cost ``dckpt plan`` uses."""


def node_dir(memory_dir: Path, node: int) -> Path:
    return Path(memory_dir) / f"node-{node}"


def partner_of(node: int, nodes: int) -> int | None:
    """The node that keeps ``node``'s replica: the next one on a ring over the node indices
    (with two nodes, each other's; with one, none). A ring, not fixed pairs, so an odd node
    count works and losing any one node leaves every other node's copies whole."""
    return None if nodes < 2 else (node + 1) % nodes


def own_dir(node: Path) -> Path:
    return node / "own"


def replica_dir(node: Path, of_node: int) -> Path:
    return node / "replica" / f"node-{of_node}"


def spare_dir(node: Path, kind: str) -> Path:
    """``kind`` is "own" or "node-<k>" (a replica's)."""
    return node / "spare" / kind


def tmp_step_dir(parent: Path, step: int) -> Path:
    return parent / f"{step_dir_name(step)}.tmp-{uuid.uuid4().hex}"


def committed_memory_steps(parent: Path) -> list[int]:
    """Committed steps under ``own/`` or ``replica/node-<k>/``, oldest first."""
    steps: list[int] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    for entry in entries:
        m = STEP_RE.fullmatch(entry.name)
        manifest = os.path.join(entry.path, MANIFEST_FILE)
        if m and entry.is_dir(follow_symlinks=False) and os.path.isfile(manifest):
            steps.append(int(m.group(1)))
    return sorted(steps)


def take_spare(spares: Path, name: str, into: Path) -> bool:
    """Move a retired file called ``name`` to ``into`` (its pages are reused); False when
    there is none. Other retired copies of that name are deleted: one spare per name."""
    try:
        found = sorted(p for p in spares.iterdir() if p.name.split("@", 1)[0] == name)
    except OSError:
        return False
    for extra in found[1:]:
        extra.unlink(missing_ok=True)
    if not found:
        return False
    try:
        os.rename(found[0], into)
    except OSError:  # another process took it first
        return False
    return True


def retire_beyond(parent: Path, keep: int, spares: Path, newest: int | None = None) -> list[int]:
    """Keep the ``keep`` newest committed steps under ``parent``; older ones are uncommitted
    (manifest first) and their files moved to ``spares`` for reuse, at most one per name.
    With ``newest`` (the step just committed), steps above it are retired first: they belong
    to a branch the run rolled back from. Returns the steps retired."""
    steps = committed_memory_steps(parent)
    stale = [s for s in steps if newest is not None and s > newest]
    steps = [s for s in steps if s not in stale]
    retired = stale + steps[: max(0, len(steps) - keep)]
    spares.mkdir(parents=True, exist_ok=True)
    taken = {p.name.split("@", 1)[0] for p in spares.iterdir()}
    for step in retired:
        d = parent / step_dir_name(step)
        with contextlib.suppress(OSError):
            (d / MANIFEST_FILE).unlink()  # uncommitted from here on
        for f in _files(d):
            if f.name in taken:
                f.unlink(missing_ok=True)
                continue
            with contextlib.suppress(OSError):
                os.rename(f, spares / f"{f.name}@{step}")
                taken.add(f.name)
        shutil.rmtree(d, ignore_errors=True)
    return retired


def reserve_spare(spares: Path, name: str, size: int) -> None:
    """Make sure a spare called ``name`` of ``size`` bytes exists, its pages allocated: after
    the first save the tier's footprint is its steady state, and a memory too small for two
    copies fails now, not at some later save. Raises OSError (ENOSPC) when it cannot."""
    spares.mkdir(parents=True, exist_ok=True)
    if any(p.name.split("@", 1)[0] == name for p in spares.iterdir()):
        return
    spare = spares / f"{name}@reserved"
    try:
        fd = os.open(spare, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError:
        spare.unlink(missing_ok=True)
        raise


def _files(d: Path) -> list[Path]:
    try:
        return [p for p in d.iterdir() if p.is_file() and not p.is_symlink()]
    except OSError:
        return []
