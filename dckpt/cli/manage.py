"""``dckpt gc``, ``pin`` and ``unpin``: retention run by hand, and exemptions from it.

``gc`` applies the same policy as a training job (dckpt.root.retention) to any root kind: it
never deletes the newest checkpoint, a milestone or a pinned one, and deletes so that no half
of a step ever looks committed (a directory: renamed to a trash name first; a bucket: the
manifest first). It refuses to run while a live job holds the root's lock, unless ``--force``.
"""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from ..root.retention import Decision, RetentionPolicy
from .common import EXIT_OK, EXIT_USAGE, cli_root, fail, out

__all__ = ["cmd_gc", "cmd_pin", "cmd_unpin", "print_gc"]


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
