"""``dckpt gc``, ``pin``, ``unpin``, ``set-aside`` and ``restore``: retention run by hand,
exemptions from it, and moving a step to ``quarantine/`` and back.

``gc`` applies the same policy as a training job (dckpt.root.retention) to any root kind: it
never deletes the newest checkpoint, a milestone or a pinned one, and deletes so that no half
of a step ever looks committed (a directory: renamed to a trash name first; a bucket: the
manifest first). ``set-aside`` moves a committed step to ``quarantine/`` as a resume does
with a damaged one (``Root.quarantine``), with a reason naming who set it aside and why: the
next resume picks the step before. ``restore`` puts a quarantined step back
(``Root.restore``): verified first, as ``dckpt verify`` would, and committed at the root
kind's own commit point, never over a committed step of that number; it says when the step's
resume records would set it aside again (a restart loop, dckpt.root.resume_record) and which
records to remove, and removes none. Each of them refuses while a live job holds the root's
lock, unless ``--force``. Output: a few lines, or with ``--json`` one object (``set-aside``:
``step``, ``name``, ``where``, ``reason``, ``newest``, ``restore``; ``restore``: ``step``,
``from``, ``where``, ``files_checked``, ``bytes_checked``, ``newest``, ``restart_loop``,
``resume_records``, ``forget``).
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import socket
import time
from pathlib import PurePosixPath

from rich.markup import escape
from rich.table import Table

from ..errors import CheckpointError
from ..root.layout import QUARANTINE_DIR
from ..root.protocol import Root
from ..root.quarantined import RestoreError, pick_quarantined
from ..root.resume_record import restart_loop
from ..root.retention import Decision, RetentionPolicy
from .common import (
    EXIT_INTEGRITY,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
    bar,
    cli_root,
    committed_step,
    fail,
    human,
    out,
    plural,
)

__all__ = ["cmd_gc", "cmd_pin", "cmd_restore", "cmd_set_aside", "cmd_unpin", "print_gc"]


def cmd_gc(args: argparse.Namespace) -> int:
    root = cli_root(args.root)
    try:
        policy = RetentionPolicy(keep_last=args.keep_last, best_k=args.best_k, best_mode=args.mode)
    except ValueError as exc:
        fail(EXIT_USAGE, str(exc))
    owner = root.lock_holder()
    if owner is not None and not args.dry_run and not args.force:
        fail(
            EXIT_USAGE,
            f"{root} is held by {owner}; its own retention runs after each save. Stop it, or "
            "use --dry-run to see the plan, or --force.",
        )
    if args.dry_run:
        decisions, deleted = root.plan_retention(policy), list[str]()
    else:
        decisions, deleted = root.apply_retention(policy)
    return print_gc(args, decisions, deleted, str(root))


def print_gc(
    args: argparse.Namespace, decisions: list[Decision], deleted: list[str], root: str
) -> int:
    """``gc``'s table (or JSON) of the retention decisions; the exit code."""
    if args.json:
        rows = [{"step": d.step, "keep": d.keep, "reasons": list(d.reasons)} for d in decisions]
        print(json.dumps({"dry_run": args.dry_run, "decisions": rows, "deleted": deleted}))
        return EXIT_OK
    table = Table(title=f"retention under {root}" + (" (dry run)" if args.dry_run else ""))
    for col in ("step", "decision", "why"):
        table.add_column(col)
    for d in decisions:
        verb = "keep" if d.keep else ("would delete" if args.dry_run else "deleted")
        table.add_row(str(d.step), verb, ", ".join(d.reasons))
    out.print(table)
    return EXIT_OK


def cmd_pin(args: argparse.Namespace) -> int:
    root = cli_root(args.root)
    try:
        marker = root.pin(args.step)
    except FileNotFoundError as exc:
        fail(EXIT_USAGE, str(exc))
    out.print(f"pinned step {args.step} ({marker}): retention will keep it")
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace) -> int:
    root = cli_root(args.root)
    if not root.unpin(args.step):
        fail(EXIT_USAGE, f"step {args.step} is not pinned under {root}")
    out.print(f"unpinned step {args.step}")
    return EXIT_OK


def _refuse_while_held(root: Root, args: argparse.Namespace, doing: str) -> None:
    """Exit 2 while a live job holds ``root``'s lock, unless ``--force``."""
    owner = root.lock_holder()
    if owner is not None and not args.force:
        fail(
            EXIT_USAGE,
            f"{root} is held by {owner}; a running job may be saving or resuming step "
            f"{args.step} while you {doing} it. Stop the job first, or use --force.",
        )


def _who() -> str:
    """``user on host``, for the reason a step was set aside by hand."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = f"uid {os.getuid()}"
    return f"{user} on {socket.gethostname()}"


def _newest(root: Root) -> int | None:
    steps = root.committed_steps()
    return steps[-1] if steps else None


def cmd_set_aside(args: argparse.Namespace) -> int:
    root = cli_root(args.root)
    _refuse_while_held(root, args, "set aside")
    if args.step not in root.committed_steps():
        aside = [e.name for e in root.entries() if e.step == args.step]
        if aside and all(e.startswith(f"{QUARANTINE_DIR}/") for e in aside):
            fail(
                EXIT_USAGE,
                f"step {args.step} is not committed under {root}: it is in quarantine already "
                f"({', '.join(aside)}); `dckpt restore {root} {args.step}` puts it back",
            )
        committed_step(root, args.step)  # exits 2, saying what is committed
    when = time.strftime("%Y-%m-%d %H:%M:%S %z")
    reason = f"set aside by hand (dckpt set-aside) by {_who()} at {when}"
    if args.reason:
        reason += f": {args.reason}"
    try:
        where = root.quarantine(args.step, reason)
    except OSError as exc:
        fail(EXIT_STORAGE, f"could not set step {args.step} aside: {exc} (see dckpt ls {root})")
    name = f"{QUARANTINE_DIR}/{PurePosixPath(where).name}"
    copies = [e.name for e in root.entries() if e.step == args.step]
    back = f"dckpt restore {root} {args.step}" + (f" --name {name}" if len(copies) > 1 else "")
    newest = _newest(root)
    if args.json:
        print(json.dumps({"step": args.step, "name": name, "where": where, "reason": reason,
                          "newest": newest, "restore": back}))  # fmt: skip
        return EXIT_OK
    out.print(
        f"set aside step {args.step}: moved to {escape(where)}, with its reason in "
        f"{escape(where)}.reason.txt"
    )
    out.print(
        f"the newest committed step under {escape(str(root))} is now {newest}: the next "
        "resume picks it"
        if newest is not None
        else f"no committed step is left under {escape(str(root))}: a resume refuses to start "
        "over while quarantine holds this run's steps"
    )
    out.print(f"to put it back: {escape(back)}")
    return EXIT_OK


def cmd_restore(args: argparse.Namespace) -> int:
    root = cli_root(args.root)
    _refuse_while_held(root, args, "restore")
    total, chosen = 0, args.name or ""
    with contextlib.suppress(CheckpointError):  # for the bar; restore() refuses in words
        entries = [e for e in root.entries() if e.status == "quarantined"]
        chosen = pick_quarantined([e.name for e in entries], args.step, args.name, str(root))
        total = next(root.manifest_of(e).total_bytes for e in entries if e.name == chosen)
    try:
        with bar("verifying", total, args.json) as advance:
            where = root.restore(args.step, args.name, progress=advance)
    except RestoreError as exc:
        if exc.result is None:
            fail(EXIT_USAGE, str(exc))
        fail(EXIT_INTEGRITY if exc.result.damaged else EXIT_STORAGE, str(exc))
    except OSError as exc:  # before its commit point: nothing moved
        fail(EXIT_STORAGE, f"could not restore step {args.step}: {exc}; nothing was restored")
    manifest = root.read_manifest(args.step)
    records = root.resume_records()
    loop: str | None = None
    try:  # the resume's own rule, on the records of this very checkpoint and tier
        mine = [r for r in records.read(args.step) if r.tier == "durable"]  # the root's tier
        loop = restart_loop([r for r in mine if r.save_id == manifest.save_id])
    except (OSError, CheckpointError) as exc:
        out.print(f"(cannot read its resume records in {escape(str(records))}: {exc})")
    newest = _newest(root)
    if args.json:
        print(json.dumps({
            "step": args.step, "from": chosen, "where": where,
            "files_checked": len(manifest.files), "bytes_checked": manifest.total_bytes,
            "newest": newest, "restart_loop": loop,
            "resume_records": records.where(args.step) if loop else None,
            "forget": records.forget(args.step) if loop else None,
        }))  # fmt: skip
        return EXIT_OK
    out.print(
        f"restored step {args.step} from {escape(chosen)}: committed again at {escape(where)}"
    )
    out.print(
        f"verified first: {plural(len(manifest.files), 'file')}, {human(manifest.total_bytes)}, "
        "every one re-hashed against its manifest, as dckpt verify does"
    )
    if newest == args.step:
        out.print("it is the newest committed step: the next resume may pick it")
    else:
        out.print(
            f"the newest committed step is {newest}: a resume picks that first, and step "
            f"{args.step} only if the newer ones fail"
        )
    if loop is not None:
        out.print(
            f"its resume records end in a restart loop ({escape(loop)}): the next start that "
            "picks it would set it aside again. Once the cause is fixed, remove its records "
            f"({escape(records.where(args.step))}): {escape(records.forget(args.step))}"
        )
    return EXIT_OK
