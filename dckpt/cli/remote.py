"""The ``dckpt`` commands on an s3:// root.

``ls``, ``verify``, ``gc``, ``pin`` and ``unpin`` work in the bucket itself (``verify``
streams every object through its digest, downloading nothing to disk, and records its
outcome in the bucket for ``ls``'s ``verified`` column, as on a directory root; ``ls``'s
``resumes`` column reads the resume records in the bucket, ``.dckpt-resumes/``).
``inspect``, ``diff``, ``export`` and ``plan`` first fetch the steps they read into a
temporary directory, each object hashed as it arrives (dckpt.tiers.object_source), then run
as on a directory root, their output titled with the s3:// root, not the directory.
The output contract is the directory root's (``ls --json`` and ``verify --json`` have the
same keys; ``path`` is the object's URL).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from ..errors import CheckpointError, IntegrityError, ManifestError
from ..root.layout import step_dir_name
from ..root.retention import RetentionPolicy
from ..root.verify import FileProblem, VerifyResult
from ..tiers.object_ledger import ObjectLedger
from ..tiers.object_root import ObjectRoot
from ..tiers.object_source import ObjectSource
from .common import EXIT_INTEGRITY, EXIT_OK, EXIT_USAGE, err, fail, open_root, out
from .manage import print_gc
from .memory_tier import memory_dir_for, memory_records
from .reading import (
    ls_record,
    print_ls_with_memory,
    print_verify,
    read_resumes,
    with_manifest,
    with_resumes,
)

__all__ = ["run_remote"]

IN_PLACE = ("ls", "verify", "gc", "pin", "unpin")


@contextlib.contextmanager
def _bar(what: str, total: int, quiet: bool) -> Iterator[Callable[[int], None]]:
    with Progress(
        TextColumn(what),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        disable=quiet or not err.is_terminal,
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


def run_remote(args: argparse.Namespace) -> int:
    """Run ``args.command`` on the s3:// root ``args.root``."""
    objects = open_root(args.root)
    try:
        if args.command in IN_PLACE:
            handler: Callable[[argparse.Namespace, ObjectRoot], int] = globals()[f"_{args.command}"]
            return handler(args, objects)
        return _fetched_then(args, objects)
    except (IntegrityError, ManifestError) as exc:
        fail(EXIT_INTEGRITY, str(exc))
    except CheckpointError as exc:  # a missing bucket, refused credentials, no network
        fail(EXIT_USAGE, str(exc))


def _committed(objects: ObjectRoot) -> list[int]:
    steps = objects.committed_steps()
    if not steps:
        fail(EXIT_USAGE, f"no committed checkpoint under {objects} (see `dckpt ls {objects}`)")
    return steps


def _ls(args: argparse.Namespace, objects: ObjectRoot) -> int:
    now = time.time()
    pins = objects.pinned_steps()
    checks = objects.verifications()
    resumes = read_resumes(objects.resume_records())
    records: list[dict[str, Any]] = []
    for entry in objects.entries():
        record = ls_record(entry.step, entry.status, objects.where(entry.name), entry.bytes, pins)
        if entry.status == "quarantined" and entry.step in resumes:  # why it is there, maybe
            with contextlib.suppress(ManifestError, IntegrityError):
                with_resumes(record, resumes, objects.manifest_at(entry.name).save_id)
        if entry.status == "committed":
            try:
                manifest = objects.read_manifest(entry.step)
            except (ManifestError, IntegrityError) as exc:
                record["error"] = str(exc)
                records.append(record)
                continue
            with_manifest(record, manifest, now)
            with_resumes(record, resumes, manifest.save_id)
            check = checks.get(entry.step)
            if check is not None and check.get("files_digest") == manifest.files_digest:
                record.update(
                    verified="ok" if check["ok"] else "failed", verified_at=check.get("time")
                )
        records.append(record)
    memory_root = memory_dir_for(str(objects), args.memory_dir)
    memory = memory_records(ObjectLedger(objects), memory_root)
    return print_ls_with_memory(args, records, str(objects), memory, memory_root)


def _verify(args: argparse.Namespace, objects: ObjectRoot) -> int:
    steps = _committed(objects)
    if args.step is not None:
        if args.step not in steps:
            have = ", ".join(map(str, steps))
            fail(EXIT_USAGE, f"no committed checkpoint for step {args.step} under {objects} "
                 f"(committed: {have})")  # fmt: skip
        steps = [args.step]
    if args.deep:
        err.print("dckpt verify: --deep on an s3:// root: fetch the step (dckpt inspect) instead")
    results: list[VerifyResult] = []
    manifests = {}
    for step in steps:
        try:
            manifests[step] = objects.read_manifest(step)
        except (ManifestError, IntegrityError) as exc:
            problem = FileProblem(path="manifest.json", error=str(exc))
            results.append(_result(objects, step, [problem]))
    total = sum(m.total_bytes for m in manifests.values())
    with _bar("verifying", total, args.json) as advance:
        for step, manifest in manifests.items():
            _, problems = objects.verify(step, advance)
            objects.record_verification(step, not problems, manifest.files_digest)
            ok_bytes = sum(f.bytes for f in manifest.files)
            results.append(_result(objects, step, problems, len(manifest.files), ok_bytes))
    return print_verify(args, sorted(results, key=lambda r: r.step or 0))


def _result(
    objects: ObjectRoot, step: int, problems: list[FileProblem], files: int = 0, nbytes: int = 0
) -> VerifyResult:
    name = step_dir_name(step)
    return VerifyResult(
        step_dir=Path(name),
        step=step,
        files_checked=files,
        bytes_checked=nbytes,
        problems=problems,
        where=objects.where(name),
    )


def _gc(args: argparse.Namespace, objects: ObjectRoot) -> int:
    try:
        policy = RetentionPolicy(keep_last=args.keep_last, best_k=args.best_k, best_mode=args.mode)
    except ValueError as exc:
        fail(EXIT_USAGE, str(exc))
    from ..tiers.object_lock import ObjectLock

    holder = ObjectLock(objects.store, "dckpt-gc").holder()
    if holder is not None and not args.dry_run and not args.force:
        fail(
            EXIT_USAGE,
            f"{objects} is held by {holder}; its own retention runs after each save. Stop it, "
            "or use --dry-run to see the plan, or --force.",
        )
    if args.dry_run:
        decisions, deleted = objects.plan_retention(policy), list[str]()
    else:
        decisions, deleted = objects.apply_retention(policy)
    return print_gc(args, decisions, deleted, str(objects))


def _pin(args: argparse.Namespace, objects: ObjectRoot) -> int:
    try:
        where = objects.pin(args.step)
    except FileNotFoundError as exc:
        fail(EXIT_USAGE, str(exc))
    out.print(f"pinned step {args.step} ({where}): retention will keep it")
    return EXIT_OK


def _unpin(args: argparse.Namespace, objects: ObjectRoot) -> int:
    if not objects.unpin(args.step):
        fail(EXIT_USAGE, f"step {args.step} is not pinned under {objects}")
    out.print(f"unpinned step {args.step}")
    return EXIT_OK


def _fetched_then(args: argparse.Namespace, objects: ObjectRoot) -> int:
    """Fetch the steps the command reads into a temporary root, verified, and run it there."""
    committed = _committed(objects)
    if args.command == "diff":
        steps = [args.a, args.b]
    else:
        steps = [args.step if args.step is not None else committed[-1]]
    missing = [s for s in steps if s not in committed]
    if missing:
        have = ", ".join(map(str, committed))
        fail(EXIT_USAGE, f"no committed checkpoint for step {missing[0]} under {objects} "
             f"(committed: {have})")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="dckpt-fetch-") as tmp:
        source = ObjectSource(objects, Path(tmp), (0, 1), keep_one=False)
        total = sum(objects.read_manifest(s).total_bytes for s in steps)
        with _bar("fetching", total, bool(getattr(args, "json", False))) as advance:
            for step in steps:
                report = source.fetch(step, progress=advance)
                err.print(f"dckpt {args.command}: step {step}: {report.line()}")
        args.root, args.shown_root = tmp, str(objects)
        code: int = args.func(args)
        return code
