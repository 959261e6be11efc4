"""The memory tier as the CLI shows it: ``dckpt ls`` lists it, ``dckpt plan`` plans with its
measured costs, ``dckpt memory clear`` frees it.

A memory checkpoint is a record in the root's ledger (its manifest: dckpt.root.memory_ledger)
and the files the nodes hold in memory. ``memory_records`` joins the two for this host: one
record per copy this host holds (``own``, or ``replica of node k``), one per recorded step
this host holds no copy of, and one per step this host holds without a record (never
restored: a save that did not commit, or files planted there). Reads files only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from ..config import CheckpointConfig
from ..errors import CheckpointError
from ..owned import NotOwnedError
from ..root.manifest import Manifest, parse_manifest
from ..root.memory_ledger import MemoryLedger
from ..tiers import memory_layout as layout
from ..units import human_bytes
from .common import EXIT_OK, EXIT_USAGE, cli_root, fail, out

__all__ = [
    "cmd_memory_clear",
    "memory_costs",
    "memory_dir_for",
    "memory_records",
    "print_memory_ls",
]


def memory_dir_for(root: str, memory_dir: str | None) -> Path:
    """The memory directory a job on ``root`` uses (the same default the manager derives)."""
    return _config(root, memory_dir).memory_root


def _config(root: str, memory_dir: str | None) -> CheckpointConfig:
    return CheckpointConfig(root=root, memory_dir=Path(memory_dir) if memory_dir else None)


def _manifests(ledger: MemoryLedger) -> dict[int, Manifest | str]:
    found: dict[int, Manifest | str] = {}
    for step in ledger.steps():
        try:
            found[step] = parse_manifest(ledger.read(step), ledger.where(step))
        except (OSError, CheckpointError) as exc:
            found[step] = str(exc)
    return found


def memory_records(ledger: MemoryLedger, memory_root: Path) -> list[dict[str, Any]]:
    """What the memory tier holds for a root, seen from this host, newest step first: one
    record per copy held here, one per recorded step held nowhere here, one per step held
    here without a record (see the module docstring)."""
    now = time.time()
    manifests = _manifests(ledger)
    records: list[dict[str, Any]] = []
    held_steps: set[int] = set()
    for node_dir in sorted(memory_root.glob("node-*")):
        node = int(node_dir.name.removeprefix("node-"))
        copies: dict[tuple[int, str], list[tuple[str, int]]] = {}
        for step, where, name, size in layout.held_steps(node_dir):
            copies.setdefault((step, where), []).append((name, size))
        for (step, where), files in copies.items():
            held_steps.add(step)
            manifest = manifests.get(step)
            record: dict[str, Any] = {
                "tier": "memory",
                "step": step,
                "node": node,
                "copy": where,
                "path": str(node_dir),
                "bytes": sum(size for _, size in files),
                "files": len(files),
                "recorded": isinstance(manifest, Manifest),
                "age_s": None,
                "error": None,
            }
            if isinstance(manifest, Manifest):
                record["age_s"] = max(0.0, now - manifest.created_at)
                want = manifest.file_map()
                odd = [n for n, size in files if n not in want or want[n].bytes != size]
                if odd:
                    record["error"] = f"{', '.join(odd)} not as recorded: never restored"
            elif manifest is None:
                record["error"] = "no record in the root: never restored"
            else:
                record["error"] = manifest
            records.append(record)
    for step, manifest in manifests.items():
        if step in held_steps:
            continue
        records.append(
            {
                "tier": "memory",
                "step": step,
                "node": None,
                "copy": "not on this host",
                "path": ledger.where(step),
                "bytes": manifest.total_bytes if isinstance(manifest, Manifest) else 0,
                "files": len(manifest.files) if isinstance(manifest, Manifest) else None,
                "recorded": True,
                "age_s": max(0.0, now - manifest.created_at)
                if isinstance(manifest, Manifest)
                else None,
                "error": None if isinstance(manifest, Manifest) else manifest,
            }
        )
    return sorted(records, key=lambda r: (-r["step"], r["node"] is None, r["node"] or 0, r["copy"]))


def print_memory_ls(records: list[dict[str, Any]], memory_root: Path, age: Any) -> None:
    """The memory tier's table (``age`` formats seconds as ``ls`` does)."""
    table = Table(title=f"memory tier (records in the root; copies on this host, {memory_root})")
    for col in ("step", "node", "copy", "size", "files", "age", "recorded", "note"):
        table.add_column(col, justify="right" if col in ("step", "node", "size") else "left")
    for r in records:
        table.add_row(
            str(r["step"]),
            "-" if r["node"] is None else str(r["node"]),
            r["copy"],
            human_bytes(r["bytes"]),
            "-" if r["files"] is None else str(r["files"]),
            age(r["age_s"]),
            "yes" if r["recorded"] else "NO",
            "" if r["error"] is None else r["error"][:80],
        )
    out.print(table)


def memory_costs(ledger: MemoryLedger, memory_root: Path) -> dict[str, float] | None:
    """The newest memory save's measured costs and the last memory restore on this host
    (``restore_s`` absent when no resume used the tier here yet); None: no memory save."""
    manifests = [m for m in _manifests(ledger).values() if isinstance(m, Manifest)]
    if not manifests:
        return None
    t = max(manifests, key=lambda m: m.step).timings
    costs = {
        "bytes": float(max(manifests, key=lambda m: m.step).total_bytes),
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


def cmd_memory_clear(args: argparse.Namespace) -> int:
    """``dckpt memory clear ROOT``: free this host's memory tier of a root (dckpt's memory
    files in every node directory under its memory directory here, nothing else, and only
    when the directory is the user's own and records this root); with ``--records``, also
    remove the root's ledger, so no resume looks for that memory again."""
    root = cli_root(args.root)
    owner, ledger, root_name = root.lock_holder(), root.memory_ledger(), str(root)
    if owner is not None and not args.force:
        fail(
            EXIT_USAGE,
            f"{root_name} is held by {owner}, which may be saving to its memory tier. Stop it "
            "first, or use --force.",
        )
    memory_root = memory_dir_for(root_name, args.memory_dir)
    freed = 0
    if os.path.lexists(memory_root):
        try:
            freed = layout.clear(memory_root, ledger.identity(create=False), root_name)
        except NotOwnedError as exc:
            fail(EXIT_USAGE, f"{exc}. Nothing was freed.")
    records = ledger.keep_newest(0) if args.records else []
    if args.json:
        doc = {"memory_dir": str(memory_root), "freed_bytes": freed, "records_removed": records}
        print(json.dumps(doc))
        return EXIT_OK
    out.print(f"freed {human_bytes(freed)} of memory under {memory_root} on this host")
    if args.records:
        out.print(f"removed the records of memory steps {records or 'none'} from {ledger}")
    return EXIT_OK
