"""What every root kind says about its quarantined steps: which copy a restore takes
(``pick_quarantined``), and the words of a refused restore (``RestoreError``).

Names only, no file system and no store: a directory root (dckpt.root.upkeep) and a bucket
(dckpt.tiers.object_root) both restore through these, and the CLI reads them without asking
which kind of root it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import CheckpointError, CheckpointNotFoundError
from .layout import QUARANTINE_DIR, QUARANTINED_RE
from .verify import FileProblem, VerifyResult

__all__ = ["RestoreError", "committed_refusal", "pick_quarantined", "refused_restore"]


class RestoreError(CheckpointError):
    """A restore refused, in words: step N is committed (a newer save of it), several
    quarantined copies and none named, or the copy did not pass verification (``result``:
    what it found; it stays in quarantine). Nothing was committed."""

    def __init__(self, message: str, result: VerifyResult | None = None) -> None:
        super().__init__(message)
        self.result = result


def committed_refusal(root: str, step: int) -> str:
    """Why a restore of ``step`` is refused while a step of that number is committed."""
    return (
        f"step {step} is committed under {root} (a newer save of that step); set it aside "
        f"first: dckpt set-aside {root} {step}"
    )


def _quarantined_step(name: str) -> int | None:
    """The step of ``quarantine/step-N[-<8hex>]``, else None."""
    head, _, tail = name.partition("/")
    m = QUARANTINED_RE.fullmatch(tail) if head == QUARANTINE_DIR else None
    return int(m.group(1)) if m else None


def pick_quarantined(
    names: Sequence[str], step: int, name: str | None, root: str, *, committed: bool = False
) -> str:
    """The quarantined entry of ``step`` a restore takes, among ``names`` (every quarantined
    entry, relative to the root: ``quarantine/step-N``, ``quarantine/step-N-<8hex>``):
    ``name`` when given (``step-N-1a2b3c4d`` alone is read under ``quarantine/``), else the
    step's only one. CheckpointNotFoundError when there is none; RestoreError when a step of
    that number is ``committed`` (a newer save), and, listing them, when there are several
    and no name says which."""
    mine = sorted(n for n in names if _quarantined_step(n) == step)
    wanted: str | None = None
    if name is not None:
        wanted = name.strip("/")
        if "/" not in wanted:
            wanted = f"{QUARANTINE_DIR}/{wanted}"
        other = _quarantined_step(wanted)
        if other is not None and other != step:
            raise RestoreError(f"{wanted} holds step {other}, not step {step}")
        if wanted not in mine:
            raise CheckpointNotFoundError(
                f"no {wanted} under {root}; step {step} in quarantine: "
                f"{', '.join(mine) or 'none'} (see `dckpt ls {root}`)"
            )
    elif not mine:
        held = sorted({s for n in names if (s := _quarantined_step(n)) is not None})
        raise CheckpointNotFoundError(
            f"step {step} is not in quarantine under {root}"
            + (" (it is committed)" if committed else "")
            + f"; quarantined steps: {', '.join(map(str, held)) or 'none'} (see `dckpt ls "
            f"{root}`)"
        )
    if committed:
        raise RestoreError(committed_refusal(root, step))
    if wanted is not None:
        return wanted
    if len(mine) > 1:
        raise RestoreError(
            f"step {step} is in quarantine {len(mine)} times under {root}: {', '.join(mine)} "
            "(each a save of that step set aside, its reason beside it in NAME.reason.txt); "
            f"say which to restore: dckpt restore {root} {step} --name {mine[-1]}"
        )
    return mine[0]


def _problem_text(problem: FileProblem) -> str:
    detail = f" (expected {problem.expected}, got {problem.actual})" if problem.expected else ""
    return f"{problem.path}: {problem.error}{detail}"


def refused_restore(step: int, where: str, result: VerifyResult) -> RestoreError:
    """The refusal of a restore whose copy at ``where`` did not verify; names what is
    damaged (or what the storage did not serve), five files at most, then a count."""
    shown = "; ".join(_problem_text(p) for p in result.problems[:5])
    if len(result.problems) > 5:
        shown += f"; and {len(result.problems) - 5} more"
    if result.damaged:
        why = (
            f"step {step} in {where} is damaged, so it stays in quarantine and nothing was "
            f"committed: {shown}. Do not restore it; resume from another step (dckpt ls)."
        )
    else:
        why = (
            f"the storage did not serve every file of step {step} in {where}, so nothing is "
            f"known about their bytes; it stays in quarantine and nothing was committed: "
            f"{shown}. Run the restore again once the storage is healthy."
        )
    return RestoreError(why, result)
