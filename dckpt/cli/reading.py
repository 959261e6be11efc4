"""``dckpt ls``, ``verify`` and ``inspect``: look at and check checkpoints of any root kind,
through the ``Root`` protocol (a read-only view, except that ``verify`` records its result
beside the steps, ``.dckpt-verified/``, for ``ls``). On an s3:// root ``verify`` streams every
object through its digest, downloading nothing to disk unless ``--deep``; ``inspect`` reads
the manifest alone.

Output contract (tests and scripts read it):
- ``ls --json``: one object per checkpoint with ``step`` (int), ``status`` (``committed``,
  ``incomplete`` or ``quarantined``), ``path``, ``bytes``, ``milestone``, ``pinned``,
  ``verified`` (``ok``, ``failed`` or null), ``files``, ``created_at``, ``age_s``, ``error``,
  ``resumes`` (the resume records of that very checkpoint, oldest first: each with ``step``,
  ``kind`` (``replay`` or ``loss watch``), ``tier``, ``save_id``, ``ok``, ``verdict``,
  ``run_id``, ``attempt``, ``job``, ``start``, ``time``; see dckpt.root.resume_record) and
  ``resumed`` (``"2 replays differed"``: replays that differed in a row since the last one
  that matched, ``"replay ok"``; with no replay record the loss watch's ``"ok"`` or
  ``"loss watch warned"``; null when never resumed).
- ``verify --json``: ``{"ok": bool, "checkpoints": [{"step", "path", "ok", "files_checked",
  "bytes_checked", "problems": [{"path", "error", "expected", "actual", "unreadable"}]}]}``
  (``unreadable``: the storage failed to serve the file: no word on its bytes; exit code 5,
  where evidence of damage is 3).
- ``inspect --json``: the manifest, with ``step``, ``world_size``, ``files`` (``path`` relative
  to the step dir, ``bytes``, ``digest``), ``state``, ``precision``, ``config``, ``timings``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from ..errors import CheckpointError, IntegrityError, ManifestError, StorageError
from ..root.manifest import Manifest
from ..root.protocol import Entry, Root
from ..root.provenance import ManifestKey
from ..root.resume_record import ResumeRecord, ResumeRecords, summary
from ..root.verify import VerifyResult
from ..save.step_clock import describe_cost
from ..units import describe_staging
from .common import (
    EXIT_INCOMPATIBLE,
    EXIT_INTEGRITY,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_UNSIGNED,
    EXIT_USAGE,
    bar,
    cli_root,
    committed_step,
    fail,
    human,
    out,
    plural,
)
from .memory_tier import memory_dir_for, memory_records, print_memory_ls

__all__ = [
    "cmd_inspect",
    "cmd_ls",
    "cmd_verify",
    "ls_record",
    "print_ls",
    "print_ls_with_memory",
    "print_verify",
    "read_resumes",
    "with_manifest",
    "with_resumes",
]


# --- ls ------------------------------------------------------------------------------------


def ls_record(step: int, status: str, path: str, nbytes: int, pins: set[int]) -> dict[str, Any]:
    """One ``ls --json`` record, before its manifest is read (see the output contract)."""
    return {
        "step": step,
        "status": status,
        "path": path,
        "bytes": nbytes,
        "milestone": False,
        "pinned": status == "committed" and step in pins,
        "verified": None,
        "files": None,
        "created_at": None,
        "age_s": None,
        "error": None,
        "resumes": [],
        "resumed": None,
        "marks": {},
    }


def read_resumes(records: ResumeRecords) -> dict[int, list[ResumeRecord]]:
    """Every step's resume records (one listing, one read per step that has any)."""
    return {step: records.read(step) for step in records.steps()}


def with_resumes(
    record: dict[str, Any], resumes: dict[int, list[ResumeRecord]], save_id: str
) -> dict[str, Any]:
    """``record`` with the resume records of its checkpoint (its step, its save id)."""
    mine = [r for r in resumes.get(record["step"], []) if r.save_id == save_id]
    record.update(resumes=[r.to_json() for r in mine], resumed=summary(mine) or None)
    return record


def with_manifest(record: dict[str, Any], manifest: Manifest, now: float) -> dict[str, Any]:
    """``record`` completed from its checkpoint's manifest."""
    record.update(
        bytes=manifest.total_bytes,
        milestone=manifest.milestone,
        files=len(manifest.files),
        created_at=manifest.created_at,
        age_s=max(0.0, now - manifest.created_at),
        marks=manifest.integrity,  # what the save's value checks let through
    )
    return record


def _marks(integrity: dict[str, Any]) -> str:
    words = {"nonfinite": "NaN/Inf", "replicas_differ": "replicas differ"}
    return ", ".join(words.get(k, k) for k in integrity)


def _ls_record(
    root: Root,
    entry: Entry,
    now: float,
    pins: set[int],
    resumes: dict[int, list[ResumeRecord]],
    key: ManifestKey | None = None,
) -> dict[str, Any]:
    record = ls_record(entry.step, entry.status, entry.where, 0, pins)
    if entry.status == "quarantined" and entry.step in resumes:  # why it is there, maybe
        with contextlib.suppress(ManifestError, IntegrityError):
            with_resumes(record, resumes, root.manifest_of(entry).save_id)
    if entry.status != "committed":
        record["bytes"] = root.measure(entry)
        return record
    try:
        manifest = root.read_manifest(entry.step)
    except (ManifestError, IntegrityError) as exc:
        record.update(error=str(exc), bytes=root.measure(entry))
        return record
    check = root.verification(entry.step, manifest.files_digest)
    record.update(
        verified=None if check is None else ("ok" if check["ok"] else "failed"),
        verified_at=None if check is None else check.get("time"),
    )
    with_manifest(record, manifest, now)
    with_signature(record, manifest, key)
    record["shared_bytes"] = root.shared(entry)
    with_resumes(record, resumes, manifest.save_id)
    return record


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def cli_key(path: str | None) -> ManifestKey | None:
    """The key ``--key-file`` names (exit 2 naming what is wrong with it), or None."""
    if path is None:
        return None
    try:
        return ManifestKey.load(path)
    except CheckpointError as exc:
        fail(EXIT_USAGE, str(exc))


def with_signature(record: dict[str, Any], manifest: Manifest, key: ManifestKey | None) -> None:
    """``signed_by``: the id of the key that signed the step (None: unsigned); with a key,
    ``signed``: whether that key signs it, and ``unsigned`` why not."""
    record["signed_by"] = manifest.signature.get("key")
    if key is not None:
        why = key.refusal(manifest)
        record.update(signed=why is None, unsigned=why)


def cmd_ls(args: argparse.Namespace) -> int:
    root = cli_root(args.root)
    key = cli_key(getattr(args, "key_file", None))
    now = time.time()
    pins = root.pinned_steps()
    resumes = read_resumes(root.resume_records())
    records = [_ls_record(root, e, now, pins, resumes, key) for e in root.entries()]
    memory_root = memory_dir_for(str(root), args.memory_dir)
    memory = memory_records(root.memory_ledger(), memory_root)
    return print_ls_with_memory(args, records, str(root), memory, memory_root)


def print_ls_with_memory(
    args: argparse.Namespace,
    records: list[dict[str, Any]],
    root: str,
    memory: list[dict[str, Any]],
    memory_root: Path,
) -> int:
    """``ls``: the durable tier's checkpoints, then the memory tier's (both in ``--json``,
    each record with its ``tier``)."""
    if args.json:
        print(json.dumps([{"tier": "durable", **r} for r in records] + memory, indent=1))
        return EXIT_OK
    if records or not memory:
        print_ls(args, records, root)
    if memory:
        print_memory_ls(memory, memory_root, _age)
    return EXIT_OK


def print_ls(args: argparse.Namespace, records: list[dict[str, Any]], root: str) -> int:
    """``ls``'s table (or JSON) of ``records`` (the shape ``_ls_record`` makes)."""
    if args.json:
        print(json.dumps(records, indent=1))
        return EXIT_OK
    if not records:
        out.print(f"no checkpoints under {root}")
        return EXIT_OK
    table = Table(title=f"checkpoints under {root}")
    keyed = any("signed" in r for r in records)  # --key-file: does it sign each step?
    for col in (
        "step",
        "status",
        "size",
        "shared",
        "files",
        "age",
        "milestone",
        "pinned",
        "verified",
        "resumes",
        "marks",
        *(("signed",) if keyed else ()),
        "note",
    ):
        right = col in ("step", "size", "shared", "files")
        table.add_column(col, justify="right" if right else "left")
    for r in records:
        table.add_row(
            str(r["step"]),
            r["status"] if r["error"] is None else "committed (damaged)",
            human(r["bytes"]),
            human(r["shared_bytes"]) if r.get("shared_bytes") else "",
            "-" if r["files"] is None else str(r["files"]),
            _age(r["age_s"]),
            "yes" if r["milestone"] else "",
            "yes" if r["pinned"] else "",
            r["verified"] or "",
            r.get("resumed") or "",
            _marks(r.get("marks") or {}),
            *([_signed_cell(r)] if keyed else []),
            "" if r["error"] is None else r["error"][:80],
        )
    out.print(table)
    return EXIT_OK


def _signed_cell(record: dict[str, Any]) -> str:
    if "signed" not in record:
        return ""
    return "yes" if record["signed"] else ("unsigned" if not record["signed_by"] else "other key")


# --- verify --------------------------------------------------------------------------------


def _verify_json(result: VerifyResult) -> dict[str, Any]:
    return {
        "step": result.step,
        "path": result.where or str(result.step_dir),
        "ok": result.ok,
        "incompatible": result.incompatible,
        "files_checked": result.files_checked,
        "bytes_checked": result.bytes_checked,
        "captured": result.captured[0],
        "uncompared": result.captured[1],
        "problems": [
            {
                "path": p.path,
                "error": p.error,
                "expected": p.expected,
                "actual": p.actual,
                "unreadable": p.unreadable,
            }
            for p in result.problems
        ],
    }


def cmd_verify(args: argparse.Namespace) -> int:
    root = cli_root(args.root)
    steps = [committed_step(root, args.step)] if args.step is not None else root.committed_steps()
    if not steps:
        fail(EXIT_USAGE, f"no committed checkpoint under {root} (see `dckpt ls {root}`)")
    total = 0
    for step in steps:  # the bar's total; a manifest that cannot be read is the step's problem
        with contextlib.suppress(ManifestError, IntegrityError, StorageError):
            total += root.read_manifest(step).total_bytes
    key = cli_key(getattr(args, "key_file", None))
    results: list[VerifyResult] = []
    unsigned: dict[int, str] = {}
    with bar("verifying", total, args.json) as advance:
        for step in steps:
            result = root.verify(step, threads=args.threads, deep=args.deep, progress=advance)
            root.record_verification(result)
            results.append(result)
            if key is not None and result.ok:  # the bytes hashed right: whose are they?
                why = key.refusal(root.read_manifest(step))
                if why is not None:
                    unsigned[step] = why
    code = print_verify(args, results, unsigned if key is not None else None)
    if code == EXIT_OK and unsigned:
        return EXIT_UNSIGNED
    return code


def print_verify(
    args: argparse.Namespace,
    results: list[VerifyResult],
    unsigned: dict[int, str] | None = None,
) -> int:
    """``verify``'s lines (or JSON) for ``results``; the exit code. ``unsigned`` (with
    ``--key-file``): the steps whose bytes hashed right that the key does not sign, and why
    (each line then says whether the key signs its step; the caller exits 6 for them)."""
    ok = all(r.ok for r in results)
    if args.json:
        checkpoints = [_verify_json(r) for r in results]
        if unsigned is not None:
            for c in checkpoints:
                why = unsigned.get(c["step"]) if c["ok"] else None
                c.update(signed=bool(c["ok"]) and why is None, unsigned=why)
        ok_all = ok and not unsigned
        print(json.dumps({"ok": ok_all, "checkpoints": checkpoints}, indent=1))
    else:
        for r in results:
            label = r.step_dir.name
            why = None if unsigned is None or r.step is None else unsigned.get(r.step)
            if r.ok and why is not None:
                out.print(f"UNSIGNED {label}: every byte hashed right, but {why}")
            elif r.ok:
                signed = "; signed by the key" if unsigned is not None else ""
                out.print(
                    f"OK      {label}: {plural(r.files_checked, 'file')}, "
                    f"{human(r.bytes_checked)}; {_captured_text(*r.captured)}{signed}"
                )
            if r.incompatible is not None:
                out.print(f"UNREADABLE BY THIS TORCH  {label}: {r.incompatible}")
            for p in r.problems:
                detail = f" (expected {p.expected}, got {p.actual})" if p.expected else ""
                tag = "UNREAD " if p.unreadable else "FAILED "
                out.print(f"{tag} {label}: {p.path}: {p.error}{detail}")
        if any(r.damaged for r in results):
            out.print(
                "integrity failure: do not load the FAILED checkpoints. A training job's "
                "resume() quarantines them and falls back to the newest good one; check the "
                "storage for bit rot."
            )
        elif not ok:
            out.print(
                "storage error: the storage did not serve the UNREAD files, so nothing is "
                "known about their bytes (none was called damaged). Run `dckpt verify` again "
                "once the storage is healthy."
            )
    if any(r.damaged for r in results):
        return EXIT_INTEGRITY
    if not ok:
        return EXIT_STORAGE
    return EXIT_INCOMPATIBLE if any(r.incompatible for r in results) else EXIT_OK


def _captured_text(items: int | None, uncompared: int = 0) -> str:
    """What the save proved of its bytes against the training state (the capture check)."""
    if items is None:
        return "not compared with the state at save() (saved without the capture check)"
    missed = f", {plural(uncompared, 'tensor')} not compared" if uncompared else ""
    return f"{plural(items, 'tensor')} compared at save() with the bytes written{missed}"


# --- inspect -------------------------------------------------------------------------------


def _precision_text(policy: dict[str, Any]) -> str:
    if not policy:
        return "not recorded"
    text = f"{policy.get('mode')} (compute {policy.get('compute_dtype')}, weights "
    text += f"{policy.get('weights_dtype')}, tf32 {'on' if policy.get('tf32') else 'off'})"
    if policy.get("requested"):
        text += f", fallback from {policy['requested']}"
    scaler = policy.get("scaler")
    if isinstance(scaler, dict):
        text += f"; GradScaler scale {scaler.get('scale')}, growth tracker "
        text += f"{scaler.get('growth_tracker')}"
    return text


def _config_lines(config: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, JSON value)`` for every leaf of ``config``; an empty dict is a leaf."""
    lines: list[tuple[str, str]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            lines.extend(_config_lines(value, name + "."))
        else:
            lines.append((name, json.dumps(value, sort_keys=True)))
    return lines


def _print_config(config: dict[str, Any]) -> None:
    """One ``key = value`` per line, sorted, under the ``config`` label: a run config of fifty
    keys on one line is unreadable, and a diff of two inspect outputs should show the key."""
    lines = sorted(_config_lines(config))
    if not lines:
        out.print(f"  {'config':<10} none recorded")
        return
    for i, (key, value) in enumerate(lines):
        label = "config" if i == 0 else ""
        # markup=False: a config string such as "[red]" is data, not a rich style.
        out.print(f"  {label:<10} {key} = {value}", markup=False)


def _reused_text(manifest: Manifest) -> str:
    """What an incremental save linked instead of writing, and from which steps."""
    reused = manifest.incremental.get("reused", {})
    if not reused:
        return "nothing (every file was written by this save)"
    sizes = manifest.file_map()
    linked = sum(sizes[p].bytes for p in reused if p in sizes)
    origins = ", ".join(str(s) for s in sorted(set(reused.values())))
    return (
        f"{human(linked)} in {plural(len(reused), 'file')} linked, not written: frozen "
        f"parameters whose bytes step {origins} wrote"
    )


def _data_text(data: dict[str, object]) -> str:
    """The data position at the save: the loader's own epoch (which ``epoch`` above misses
    when the script never passes ``save(epoch=)``) and the batches into it."""
    if "epoch" not in data:
        return "not recorded"
    batches = data.get("batches")
    into = f", {plural(batches, 'batch', 'batches')} into it" if isinstance(batches, int) else ""
    return f"epoch {data['epoch']}{into}"


def _world_text(manifest: Manifest) -> str:
    """The world size, and the device mesh of the model's DTensors (``dp=2 x tp=2``)."""
    mesh = manifest.mesh.get("device_mesh")
    meshes = [mesh] if isinstance(mesh, dict) else mesh if isinstance(mesh, list) else []
    shown = "; ".join(
        " x ".join(f"{name}={size}" for name, size in m.items())
        for m in meshes
        if isinstance(m, dict)
    )
    return f"{manifest.world_size}" + (f" (device mesh {shown})" if shown else "")


def cmd_inspect(args: argparse.Namespace) -> int:
    root = cli_root(args.root)
    step = committed_step(root, args.step)
    try:
        manifest = root.read_manifest(step)
    except (ManifestError, IntegrityError) as exc:
        fail(EXIT_INTEGRITY, str(exc))
    where = str(root.where(step))
    obj = manifest.to_json_obj()
    obj["path"] = where
    if args.json:
        print(json.dumps(obj, indent=1, sort_keys=True))
        return EXIT_OK
    out.print(f"[bold]{escape(where)}[/bold]")
    rows = [
        ("step", manifest.step),
        ("epoch", manifest.epoch),
        ("data", _data_text(manifest.data)),
        ("world size", _world_text(manifest)),
        ("state", ", ".join(manifest.state)),
        ("size", f"{human(manifest.total_bytes)} in {plural(len(manifest.files), 'file')}"),
        ("digests", manifest.digest_algorithm),
        (
            "captured",
            _captured_text(manifest.capture.get("items"), manifest.capture.get("uncompared", 0)),
        ),
        ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created_at))),
        ("run id", manifest.run_id),
        ("milestone", manifest.milestone),
        ("precision", _precision_text(manifest.precision)),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted(manifest.versions.items()))),
        (
            "timings",
            ", ".join(
                f"{k} {v:.3f}" for k, v in sorted(manifest.timings.items()) if k.endswith("_s")
            ),
        ),
        (
            "save cost",
            describe_cost(manifest.timings, manifest.timings.get("to_commit_s", 0.0))
            or "not measured",
        ),
        ("staging", describe_staging(manifest.timings)),
        ("reused", _reused_text(manifest)),
    ]
    for key, value in rows:
        out.print(f"  {key:<10} {value}")
    _print_config(manifest.config)
    table = Table(title="files")
    for col in ("path", "rank", "bytes", "digest"):
        table.add_column(col)
    for f in manifest.files:
        table.add_row(f.path, str(f.rank), human(f.bytes), f.digest)
    out.print(table)
    return EXIT_OK
