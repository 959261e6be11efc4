"""``dckpt gc``, ``pin`` and ``unpin``: retention run by hand, and exemptions from it.

``gc`` applies the same policy as a training job (dckpt.root.retention): it never deletes the newest
checkpoint, a milestone or a pinned one, and deletes by renaming to a trash name first. It
refuses to run while a live job holds the root's lock, unless ``--force``.
"""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from ..errors import LockError
from ..root.layout import LOCK_FILE, read_small_file
from ..root.lock import MAX_RECORD_BYTES, LockOwner, stale_reason
from ..root.retention import Decision, RetentionPolicy
from ..root.upkeep import apply_retention, pin, plan_retention, unpin
from .common import EXIT_OK, EXIT_USAGE, fail, out, root_arg

__all__ = ["cmd_gc", "cmd_pin", "cmd_unpin", "print_gc"]


def live_lock_owner(args: argparse.Namespace) -> str | None:
    """Who holds the root's run lock now, unless it is stale (the same rules as a job's
    takeover, dckpt.root.lock); None if free. A record dckpt cannot read may be a live job's,
    so it is described, and gc refuses, as on an s3:// root."""
    path = root_arg(args.root) / LOCK_FILE
    # Never follows a symlink or waits on a FIFO put in the lock's place.
    raw = read_small_file(path, MAX_RECORD_BYTES + 1)
    if raw is None or not raw.strip(b"\0"):  # none, or what a power cut left of one
        return None
    try:
        owner = LockOwner.parse(raw, str(path), f"rm {path}")
    except LockError as exc:
        return f"a lock dckpt cannot read ({exc})"
    return None if stale_reason(owner, run_id="") is not None else owner.describe()


def cmd_gc(args: argparse.Namespace) -> int:
    root = root_arg(args.root)
    try:
        policy = RetentionPolicy(keep_last=args.keep_last, best_k=args.best_k, best_mode=args.mode)
    except ValueError as exc:
        fail(EXIT_USAGE, str(exc))
    owner = live_lock_owner(args)
    if owner is not None and not args.dry_run and not args.force:
        fail(
            EXIT_USAGE,
            f"{root} is held by {owner}; its own retention runs after each save. Stop it, or "
            "use --dry-run to see the plan, or --force.",
        )
    if args.dry_run:
        decisions, deleted = plan_retention(root, policy), list[str]()
    else:
        decisions, deleted = apply_retention(root, policy)
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
    root = root_arg(args.root)
    try:
        marker = pin(root, args.step)
    except FileNotFoundError as exc:
        fail(EXIT_USAGE, str(exc))
    out.print(f"pinned step {args.step} ({marker}): retention will keep it")
    return EXIT_OK


def cmd_unpin(args: argparse.Namespace) -> int:
    root = root_arg(args.root)
    if not unpin(root, args.step):
        fail(EXIT_USAGE, f"step {args.step} is not pinned under {root}")
    out.print(f"unpinned step {args.step}")
    return EXIT_OK
