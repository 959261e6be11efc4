"""Root upkeep: what happens to checkpoints besides their commit.

- ``recover`` undoes what a crash can leave, at every start (rank 0): abandoned tmp dirs are
  removed, a replaced copy whose successor never landed is renamed back, an interrupted delete
  is finished, and a dangling ``latest`` is repointed;
- ``quarantine`` moves a committed checkpoint that failed verification (or was superseded by a
  rollback, or was set aside by hand: ``dckpt set-aside``) to ``quarantine/`` with the reason;
- ``restore`` puts a quarantined checkpoint back (``dckpt restore``): it is verified where it
  lies, then one rename is its commit, so a crash leaves it either in quarantine or committed
  and whole; never over a committed step of that number (``pick_quarantined`` says which
  quarantined copy, and the words of a refusal are ``RestoreError``'s, for every root kind);
- ``delete_checkpoints`` renames to a trash name first, so a crash mid-delete never leaves a
  half-deleted directory that looks committed;
- ``pin``/``unpin`` mark steps retention must keep; ``plan_retention``/``apply_retention``
  carry out the pure decision of dckpt.root.retention (after every committed save, and
  ``dckpt gc``). A manifest that cannot be read makes its checkpoint a keeper.

Knows directories and files only, never tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

from ..errors import IntegrityError, ManifestError
from ..faults import fault_point
from ..owned import create_new, make_dir, open_dir, write_atomic
from ..phases import Phase
from .durable import fsync_dir, publish_latest
from .fence import Fence
from .layout import (
    LATEST_FILE,
    PINS_DIR,
    QUARANTINE_DIR,
    REPLACED_RE,
    STEP_RE,
    TMP_RE,
    TRASH_RE,
    committed_steps,
    is_committed_dir,
    list_checkpoints,
    pinned_steps,
    step_dir_name,
)
from .manifest import MANIFEST_FILE, Manifest, read_manifest
from .quarantined import RestoreError, pick_quarantined, refused_restore
from .retention import Candidate, Decision, RetentionPolicy, decide
from .verify import VerifyResult, record_verification, verify_checkpoint

__all__ = [
    "apply_retention",
    "decide_for",
    "delete_checkpoints",
    "log_retention",
    "pin",
    "plan_retention",
    "quarantine",
    "recover",
    "restore",
    "unpin",
]

log = logging.getLogger("dckpt")


def recover(root: str | os.PathLike[str]) -> list[str]:
    """Clean up after crashed saves; returns one line per action taken (also logged)."""
    base = Path(root)
    actions: list[str] = []
    for child in sorted(base.iterdir()):
        ours = any(r.fullmatch(child.name) for r in (TMP_RE, TRASH_RE, REPLACED_RE))
        if child.is_symlink() and ours:  # dckpt never makes these links: drop, never follow
            child.unlink()
            actions.append(f"removed the symlink {child.name}")
            continue
        if child.is_symlink() or not child.is_dir():
            continue
        if TMP_RE.fullmatch(child.name):
            shutil.rmtree(child, ignore_errors=True)
            actions.append(f"removed abandoned save {child.name}")
        elif TRASH_RE.fullmatch(child.name):
            shutil.rmtree(child, ignore_errors=True)
            actions.append(f"finished deleting {child.name}")
        elif m := REPLACED_RE.fullmatch(child.name):
            final = base / f"step-{m.group(1)}"
            if not final.exists() and (child / MANIFEST_FILE).is_file():
                os.rename(child, final)
                actions.append(f"restored {final.name}: its re-save never committed")
            else:
                shutil.rmtree(child, ignore_errors=True)
                actions.append(f"removed superseded copy {child.name}")
    for child in base.glob(f"{LATEST_FILE}.tmp-*"):
        if child.is_file() and not child.is_symlink():
            child.unlink(missing_ok=True)
    if actions:
        fsync_dir(base)
    # A crash between the commit rename and `latest` leaves `latest` behind: bring it forward.
    publish_latest(base)
    for line in actions:
        log.warning("dckpt recover: %s", line)  # debris of a crash: worth seeing
    return actions


def quarantine(root: str | os.PathLike[str], step_dir: Path, reason: str) -> Path:
    """Move a committed checkpoint that failed verification to ``quarantine/``, with the reason."""
    base = Path(root)
    if not STEP_RE.fullmatch(step_dir.name) or step_dir.parent != base:
        raise ValueError(f"{step_dir} is not a committed step dir under {base}")
    qdir = make_dir(base / QUARANTINE_DIR)
    target = qdir / step_dir.name
    if target.exists():
        target = qdir / f"{step_dir.name}-{uuid.uuid4().hex[:8]}"
    os.rename(step_dir, target)
    write_atomic(target.parent, f"{target.name}.reason.txt", (reason + "\n").encode(), sync=False)
    fsync_dir(qdir)
    fsync_dir(base)
    publish_latest(base)
    log.warning(
        "dckpt: moved %s to %s: %s", step_dir.name, target, reason.split(". ", maxsplit=1)[0]
    )
    return target


def restore(
    root: str | os.PathLike[str],
    step: int,
    name: str | None = None,
    *,
    threads: int = 4,
    progress: Callable[[int], None] = lambda _n: None,
) -> tuple[Path, VerifyResult]:
    """Put the quarantined ``step`` (``name``: which copy, see ``pick_quarantined``) back as
    the committed ``ROOT/step-N``; returns where it is and its verification.

    Refused (RestoreError, CheckpointNotFoundError) while ``step-N`` is there, when no copy
    or several are in quarantine (``pick_quarantined``), and when the copy does not verify
    as ``dckpt verify`` would (every file re-hashed against its manifest, which must be of
    ``step``): it stays in quarantine. The commit point is one rename of the quarantined
    directory to ``step-N`` (one file system), relative to descriptors of both directories
    opened without following a link; both are fsynced, then ``latest`` is republished and
    the reason file removed. A crash before the rename leaves it in quarantine, after it
    committed and whole (``recover`` brings ``latest`` forward)."""
    base = Path(root)
    final = step_dir_name(step)
    names = [
        e.path.relative_to(base).as_posix()
        for e in list_checkpoints(base)
        if e.status == "quarantined"
    ]
    committed = is_committed_dir(base / final)
    chosen = pick_quarantined(names, step, name, str(base), committed=committed)
    source = chosen.split("/", 1)[1]
    qfd = open_dir(base / QUARANTINE_DIR)  # never through a link put in its place
    try:
        bfd = open_dir(base)
        try:
            if os.path.lexists(base / final):
                raise RestoreError(
                    f"{base / final} exists and is not a committed step (no {MANIFEST_FILE} "
                    "in a real directory): dckpt never leaves one, so it is left for you to "
                    "look at; move it away, then restore again"
                )
            result = verify_checkpoint(base / chosen, threads=threads, progress=progress)
            if not result.ok:
                raise refused_restore(step, str(base / chosen), result)
            if result.step != step:
                raise RestoreError(
                    f"{base / chosen / MANIFEST_FILE} is of step {result.step}, not {step}: it "
                    "stays in quarantine"
                )
            if not stat.S_ISDIR(os.stat(source, dir_fd=qfd, follow_symlinks=False).st_mode):
                raise RestoreError(f"{base / chosen} is no longer a directory: nothing restored")
            try:
                os.rename(source, final, src_dir_fd=qfd, dst_dir_fd=bfd)  # the commit point
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                raise RestoreError(
                    f"{base / final} appeared while {base / chosen} was verified (a job saving "
                    "that step?): nothing restored"
                ) from exc
            try:
                os.fsync(bfd)
                os.fsync(qfd)
                publish_latest(base)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{source}.reason.txt", dir_fd=qfd)
                os.fsync(qfd)
            except OSError as exc:  # committed already: said, not raised
                log.warning(
                    "dckpt: %s is restored, but syncing and tidying up after it failed (%s): "
                    "the next start brings latest forward; remove %s by hand",
                    base / final,
                    exc,
                    base / f"{chosen}.reason.txt",
                )
        finally:
            os.close(bfd)
    finally:
        os.close(qfd)
    result = dataclasses.replace(result, step_dir=base / final)
    record_verification(result)  # `dckpt ls` shows it verified (best effort)
    log.info(
        "dckpt: restored %s from %s (%d files verified)",
        base / final,
        base / chosen,
        result.files_checked,
    )
    return base / final, result


def delete_checkpoints(root: str | os.PathLike[str], steps: list[int]) -> list[str]:
    """Delete committed checkpoints: rename each to a trash name (fsynced), then remove it.

    After the rename the directory no longer looks committed, so a crash mid-delete leaves
    only a trash dir, which ``recover`` removes. ``latest`` is never left pointing at one.
    """
    base = Path(root)
    trashed: list[Path] = []
    for step in steps:
        src = base / step_dir_name(step)
        if not (src / MANIFEST_FILE).is_file():
            continue
        dst = base / f"{src.name}.trash-{uuid.uuid4().hex}"
        os.rename(src, dst)
        trashed.append(dst)
    if trashed:
        fsync_dir(base)
        publish_latest(base)
        fault_point(Phase.RETENTION, 0)
    for path in trashed:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name.split(".trash-")[0] for p in trashed]


def pin(root: str | os.PathLike[str], step: int) -> Path:
    """Mark a committed step as pinned: retention never deletes it."""
    base = Path(root)
    if not (base / step_dir_name(step) / MANIFEST_FILE).is_file():
        raise FileNotFoundError(f"no committed checkpoint for step {step} under {base}")
    pins = make_dir(base / PINS_DIR)
    marker = pins / step_dir_name(step)
    with contextlib.suppress(FileExistsError):  # pinned already
        os.close(create_new(marker))
    fsync_dir(pins)
    return marker


def unpin(root: str | os.PathLike[str], step: int) -> bool:
    """Remove a pin; returns whether there was one."""
    marker = Path(root) / PINS_DIR / step_dir_name(step)
    if not marker.exists():
        return False
    marker.unlink()
    fsync_dir(marker.parent)
    return True


def plan_retention(root: str | os.PathLike[str], policy: RetentionPolicy) -> list[Decision]:
    """The decisions the policy makes for every committed checkpoint under ``root``. A step
    whose directory another user owns is not this user's to delete (nor does it take a place
    among those kept): kept, as "another user's"."""
    base = Path(root)
    manifests: dict[int, Manifest | None] = {}
    theirs: list[int] = []
    me = os.geteuid()
    for step in committed_steps(base):
        where = base / step_dir_name(step)
        with contextlib.suppress(OSError):  # its directory or its manifest: as a resume asks
            if {os.lstat(where).st_uid, os.lstat(where / MANIFEST_FILE).st_uid} != {me}:
                theirs.append(step)
                continue
        try:
            manifests[step] = read_manifest(base / step_dir_name(step))
        except (ManifestError, IntegrityError):
            manifests[step] = None
    decisions = decide_for(manifests, pinned_steps(base), policy)
    decisions += [Decision(step=s, keep=True, reasons=("another user's",)) for s in theirs]
    return sorted(decisions, key=lambda d: d.step)


def decide_for(
    manifests: dict[int, Manifest | None], pins: set[int], policy: RetentionPolicy
) -> list[Decision]:
    """The policy's decisions over committed steps and their manifests (None: unreadable,
    always kept), for any root kind."""
    candidates: list[Candidate] = []
    unreadable: set[int] = set()
    for step, manifest in manifests.items():
        if manifest is None:
            unreadable.add(step)
            continue
        value = manifest.metric.get("value")
        candidates.append(
            Candidate(
                step=step,
                milestone=manifest.milestone,
                pinned=step in pins,
                metric=float(value) if isinstance(value, (int, float)) else None,
                finite=manifest.finite,
            )
        )
    decisions = decide(candidates, policy)
    decisions += [Decision(step=s, keep=True, reasons=("unreadable manifest",)) for s in unreadable]
    return sorted(decisions, key=lambda d: d.step)


def _run_of(root: Path, step: int) -> str | None:
    """The run id ``step``'s manifest records (None: unreadable)."""
    try:
        return read_manifest(root / step_dir_name(step)).run_id
    except (ManifestError, IntegrityError):
        return None


def log_retention(decisions: list[Decision], *, dry_run: bool) -> None:
    """The one line retention logs when it deletes (or would delete) something."""
    victims = [d.step for d in decisions if not d.keep]
    if victims:
        kept = ", ".join(f"{d.step} ({'+'.join(d.reasons)})" for d in decisions if d.keep)
        verb = "would delete" if dry_run else "deleted"
        log.info(
            "dckpt retention: %s step(s) %s; kept %s",
            verb,
            ", ".join(map(str, victims)),
            kept,
        )


def apply_retention(
    root: str | os.PathLike[str],
    policy: RetentionPolicy,
    *,
    dry_run: bool = False,
    fence: Fence | None = None,
) -> tuple[list[Decision], list[str]]:
    """Decide and (unless ``dry_run``) delete; logs one line; returns decisions and deleted.
    ``fence``: a job's (dckpt.root.fence): a step it may not delete is kept."""
    decisions = plan_retention(root, policy)
    if fence is not None:
        decisions = fence.spare(decisions, lambda step: _run_of(Path(root), step))
    victims = [d.step for d in decisions if not d.keep]
    deleted = [] if dry_run or not victims else delete_checkpoints(root, victims)
    log_retention(decisions, dry_run=dry_run)
    return decisions, deleted
