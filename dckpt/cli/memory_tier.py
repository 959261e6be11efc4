"""The memory tier as the CLI shows it: what this node's memory holds for a root, and its costs.

``dckpt ls ROOT`` lists the memory tier next to the durable one (``memory_records``): every
committed memory checkpoint under the root's memory directory on this node, its own copy and
the replicas it keeps for other nodes, and whether that node's keeper answers. ``dckpt plan
ROOT`` reads the newest memory save's measured costs and the last memory restore
(``memory_costs``). Reads files only; never starts a keeper.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..root.layout import step_dir_name
from ..root.manifest import MANIFEST_FILE, parse_manifest
from ..tiers import memory_layout as layout
from ..tiers.keeper_client import KeeperClient, read_keeper_file

__all__ = ["memory_costs", "memory_dir_for", "memory_records"]


def memory_dir_for(root: str, memory_dir: str | None) -> Path:
    """The memory directory a job on ``root`` uses (the same default the manager derives)."""
    given = Path(memory_dir) if memory_dir else None
    return CheckpointConfig(root=root, memory_dir=given).memory_root


def _keeper_state(node_dir: Path) -> str:
    found = read_keeper_file(node_dir)
    if found is None:
        return "no keeper"
    try:
        KeeperClient(f"{found['host']}:{found['port']}", timeout_s=2.0).hello()
    except CheckpointError:
        return f"keeper pid {found['pid']} not answering"
    return f"keeper pid {found['pid']} up"


def memory_records(memory_root: Path) -> list[dict[str, Any]]:
    """One record per committed memory checkpoint copy on this node, newest first."""
    now = time.time()
    records: list[dict[str, Any]] = []
    for node_dir in sorted(memory_root.glob("node-*")):
        node = node_dir.name.removeprefix("node-")
        keeper = _keeper_state(node_dir)
        places = [(layout.own_dir(node_dir), "own", node)]
        places += [
            (d, f"replica of node {d.name.removeprefix('node-')}", d.name.removeprefix("node-"))
            for d in sorted((node_dir / "replica").glob("node-*"))
        ]
        for parent, copy, of_node in places:
            for step in layout.committed_memory_steps(parent):
                d = parent / step_dir_name(step)
                record: dict[str, Any] = {
                    "tier": "memory",
                    "step": step,
                    "node": int(node),
                    "copy": copy,
                    "path": str(d),
                    "keeper": keeper,
                    "error": None,
                }
                try:
                    manifest = parse_manifest((d / MANIFEST_FILE).read_bytes(), str(d))
                    nodes = manifest.mesh.get("nodes") or []
                    mine = [
                        f
                        for f in manifest.files
                        if f.rank < len(nodes) and str(nodes[f.rank]) == of_node
                    ]
                    record.update(
                        bytes=sum(f.bytes for f in mine),
                        files=len(mine),
                        age_s=max(0.0, now - manifest.created_at),
                    )
                except (OSError, CheckpointError) as exc:
                    record.update(bytes=0, files=None, age_s=None, error=str(exc))
                records.append(record)
    return sorted(records, key=lambda r: (-r["step"], r["node"], r["copy"]))


def memory_costs(memory_root: Path) -> dict[str, float] | None:
    """The newest memory save's measured costs and the last memory restore on this node
    (``restore_s`` absent when no resume used the tier here yet); None: no memory save."""
    best: tuple[int, Path] | None = None
    for node_dir in memory_root.glob("node-*"):
        steps = layout.committed_memory_steps(layout.own_dir(node_dir))
        if steps and (best is None or steps[-1] > best[0]):
            best = (steps[-1], layout.own_dir(node_dir) / step_dir_name(steps[-1]))
    if best is None:
        return None
    try:
        manifest = parse_manifest((best[1] / MANIFEST_FILE).read_bytes(), str(best[1]))
    except (OSError, CheckpointError):
        return None
    t = manifest.timings
    costs = {
        "bytes": float(manifest.total_bytes),
        "stall_s": t.get("training_slowed_s", t.get("stall_s", 0.0)),
        "commit_s": t.get("to_commit_s", 0.0),
    }
    for node_dir in memory_root.glob("node-*"):
        try:
            last = json.loads((node_dir / layout.RESTORE_FILE).read_text())
            costs["restore_s"] = max(costs.get("restore_s", 0.0), float(last["seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return costs
