"""The ``dckpt`` command: look at, check and inspect checkpoints without writing Python.

Output contract (tests and scripts read it):
- ``dckpt ls ROOT [--json]``: one object per checkpoint with ``step`` (int), ``status``
  (``committed``, ``incomplete`` or ``quarantined``), ``path``, ``bytes``, ``milestone``.
- ``dckpt verify ROOT [--step N | --all] [--json]``: re-hashes every file of every committed
  checkpoint (or of step N); the bad file's path is printed.
- ``dckpt inspect ROOT [--step N] [--json]``: the manifest, with ``step``, ``world_size``,
  ``files`` (``path`` relative to the step dir, ``bytes``, ``digest``) and ``state``.

Exit codes: 0 ok; 2 bad usage, or a root/step that does not exist; 3 an integrity failure
(a digest or size mismatch, a damaged or hostile manifest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from . import __version__
from .errors import IntegrityError, ManifestError
from .layout import CheckpointEntry, list_checkpoints
from .manifest import read_manifest
from .verify import VerifyResult, verify_checkpoint

__all__ = ["main"]

EXIT_OK, EXIT_USAGE, EXIT_INTEGRITY = 0, 2, 3

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class _ExitError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _fail(code: int, message: str) -> NoReturn:
    raise _ExitError(code, message)


def _root(path: str) -> Path:
    root = Path(path)
    if not root.exists():
        _fail(EXIT_USAGE, f"{root} does not exist; pass the --ckpt-dir of a training run")
    if not root.is_dir():
        _fail(EXIT_USAGE, f"{root} is not a directory; pass a checkpoint root, not a file in it")
    return root


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def _committed_dir(root: Path, step: int | None) -> Path:
    entries = [e for e in list_checkpoints(root) if e.status == "committed"]
    if step is None:
        if not entries:
            _fail(EXIT_USAGE, f"no committed checkpoint under {root} (see `dckpt ls {root}`)")
        return entries[-1].path
    for e in entries:
        if e.step == step:
            return e.path
    have = ", ".join(str(e.step) for e in entries) or "none"
    _fail(EXIT_USAGE, f"no committed checkpoint for step {step} under {root} (committed: {have})")


# --- ls ------------------------------------------------------------------------------------


def _ls_record(entry: CheckpointEntry, now: float) -> dict[str, Any]:
    record: dict[str, Any] = {
        "step": entry.step,
        "status": entry.status,
        "path": str(entry.path),
        "bytes": 0,
        "milestone": False,
        "files": None,
        "created_at": None,
        "age_s": None,
        "error": None,
    }
    if entry.status == "committed":
        try:
            manifest = read_manifest(entry.path)
        except (ManifestError, IntegrityError) as exc:
            record["error"] = str(exc)
            record["bytes"] = _dir_bytes(entry.path)
            return record
        record.update(
            bytes=manifest.total_bytes,
            milestone=manifest.milestone,
            files=len(manifest.files),
            created_at=manifest.created_at,
            age_s=max(0.0, now - manifest.created_at),
        )
    else:
        record["bytes"] = _dir_bytes(entry.path)
    return record


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def cmd_ls(args: argparse.Namespace) -> int:
    root = _root(args.root)
    now = time.time()
    records = [_ls_record(e, now) for e in list_checkpoints(root)]
    if args.json:
        print(json.dumps(records, indent=1))
        return EXIT_OK
    if not records:
        out.print(f"no checkpoints under {root}")
        return EXIT_OK
    table = Table(title=f"checkpoints under {root}")
    for col in ("step", "status", "size", "files", "age", "milestone", "note"):
        table.add_column(col, justify="right" if col in ("step", "size", "files") else "left")
    for r in records:
        table.add_row(
            str(r["step"]),
            r["status"] if r["error"] is None else "committed (damaged)",
            _human(r["bytes"]),
            "-" if r["files"] is None else str(r["files"]),
            _age(r["age_s"]),
            "yes" if r["milestone"] else "",
            "" if r["error"] is None else r["error"][:80],
        )
    out.print(table)
    return EXIT_OK


# --- verify --------------------------------------------------------------------------------


def _verify_json(result: VerifyResult) -> dict[str, Any]:
    return {
        "step": result.step,
        "path": str(result.step_dir),
        "ok": result.ok,
        "files_checked": result.files_checked,
        "bytes_checked": result.bytes_checked,
        "problems": [
            {"path": p.path, "error": p.error, "expected": p.expected, "actual": p.actual}
            for p in result.problems
        ],
    }


def cmd_verify(args: argparse.Namespace) -> int:
    root = _root(args.root)
    if args.step is not None:
        dirs = [_committed_dir(root, args.step)]
    else:
        dirs = [e.path for e in list_checkpoints(root) if e.status == "committed"]
        if not dirs:
            _fail(EXIT_USAGE, f"no committed checkpoint under {root} (see `dckpt ls {root}`)")
    total = sum(_dir_bytes(d) for d in dirs)
    results: list[VerifyResult] = []
    show_bar = not args.json and err.is_terminal
    with Progress(
        TextColumn("verifying"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        disable=not show_bar,
        transient=True,
    ) as bar:
        task = bar.add_task("verify", total=total)
        for d in dirs:
            results.append(
                verify_checkpoint(d, threads=args.threads, progress=lambda n: bar.advance(task, n))
            )
    ok = all(r.ok for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "checkpoints": [_verify_json(r) for r in results]}, indent=1))
    else:
        for r in results:
            label = r.step_dir.name
            if r.ok:
                out.print(f"OK      {label}: {r.files_checked} files, {_human(r.bytes_checked)}")
            for p in r.problems:
                detail = f" (expected {p.expected}, got {p.actual})" if p.expected else ""
                out.print(f"FAILED  {label}: {p.path}: {p.error}{detail}")
        if not ok:
            out.print(
                "integrity failure: do not load the FAILED checkpoints. A training job's "
                "resume() quarantines them and falls back to the newest good one; check the "
                "storage for bit rot."
            )
    return EXIT_OK if ok else EXIT_INTEGRITY


# --- inspect -------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    root = _root(args.root)
    step_dir = _committed_dir(root, args.step)
    try:
        manifest = read_manifest(step_dir)
    except (ManifestError, IntegrityError) as exc:
        _fail(EXIT_INTEGRITY, str(exc))
    obj = manifest.to_json_obj()
    obj["path"] = str(step_dir)
    if args.json:
        print(json.dumps(obj, indent=1, sort_keys=True))
        return EXIT_OK
    out.print(f"[bold]{step_dir}[/bold]")
    rows = [
        ("step", manifest.step),
        ("epoch", manifest.epoch),
        ("world size", manifest.world_size),
        ("state", ", ".join(manifest.state)),
        ("size", f"{_human(manifest.total_bytes)} in {len(manifest.files)} files"),
        ("digests", manifest.digest_algorithm),
        ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created_at))),
        ("run id", manifest.run_id),
        ("milestone", manifest.milestone),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted(manifest.versions.items()))),
        ("timings", ", ".join(f"{k} {v:.3f}" for k, v in sorted(manifest.timings.items()))),
        ("config", json.dumps(manifest.config, sort_keys=True)),
    ]
    for key, value in rows:
        out.print(f"  {key:<10} {value}")
    table = Table(title="files")
    for col in ("path", "rank", "bytes", "digest"):
        table.add_column(col)
    for f in manifest.files:
        table.add_row(f.path, str(f.rank), _human(f.bytes), f.digest)
    out.print(table)
    return EXIT_OK


# --- entry point ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dckpt", description="Inspect and verify dckpt checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"dckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="list the checkpoints under a root")
    p.add_argument("root")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("verify", help="re-hash every file against its manifest")
    p.add_argument("root")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="only this step")
    which.add_argument("--all", action="store_true", help="every committed step (the default)")
    p.add_argument("--threads", type=int, default=4, help="files hashed in parallel")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", help="show a checkpoint's manifest")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="this step (default: the newest committed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # exits 2 on bad usage
    try:
        code: int = args.func(args)
    except _ExitError as exc:
        err.print(f"dckpt {args.command}: {exc}")
        return exc.code
    except BrokenPipeError:
        return EXIT_OK
    return code


if __name__ == "__main__":
    sys.exit(main())
