"""The coordinator: every rank reports what it wrote; rank 0 commits what every rank reported.

Used by the save pipeline in this order (the pipeline's docstring states the whole protocol):

- ``agree``: all ranks learn whether any rank failed to prepare; all raise together if so;
- ``gather``: rank 0 gathers every rank's ``RankReport`` (files with digests, or the error
  that stopped them: a rank stopped by another rank's failure reports that one, under that
  rank, so the save's error names the rank and the object that failed, once); a route that
  needs them on every rank (the memory tier's replicas) has them all-gathered instead;
- on rank 0, ``refusal``: the reports' errors, if any (the tmp location is removed, nothing is
  committed); else the pipeline builds the manifest from the reports and ``commit`` writes it
  into the tmp location and runs the commit strategy;
- ``announce``: rank 0 broadcasts the outcome; every rank returns it or raises the same
  ``SaveError``, which names each failed rank and its error.

A commit happens only after every rank finished writing. This layer knows files, not tensors.
What a rank other than 0 receives in these steps does not grow with the world's size (but for
a route that asks for every report): an agreement is an all-reduce, a report goes to rank 0
alone, and the outcome comes back in one broadcast.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..collective.comm import Comm
from ..errors import LockError, SaveError, describe_os_error
from ..faults import fault_point
from ..phases import Phase
from ..root.commit import CommitStrategy, Flag
from ..root.manifest import Manifest, write_manifest
from ..storage.records import FileRecord
from .findings import Findings

__all__ = ["Coordinator", "RankReport", "SaveOutcome"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """What one rank sends the coordinator after its part of a save."""

    rank: int
    records: tuple[FileRecord, ...] = ()
    error: str | None = None
    error_rank: int | None = None
    """Set when ``error`` is not this rank's own but that of the rank it names: DCP fails
    every rank with the failures of the ranks that raised, and a rank that failed only
    because another did (or stopped sending because of it) reports that one. None: the
    error, if any, is this rank's own."""
    timings: dict[str, float] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=dict)
    """This rank's recent losses (``LossWatch.summary``): rank 0 records its own, and says
    when another rank's are not like them."""
    metric: dict[str, float] = field(default_factory=dict)
    """The ``save(metric=...)`` this rank passed: rank 0 records its own."""
    findings: Findings | None = None
    """What this rank's value checks found (replica digests, non-finite tensors): names and
    digests only; rank 0 judges them before it commits (dckpt.save.findings)."""
    route: dict[str, Any] = field(default_factory=dict)
    """What the tier's route adds for the other ranks (the memory tier: the layout its file
    was written with)."""


@dataclass(frozen=True, kw_only=True)
class SaveOutcome:
    """Rank 0's decision, as broadcast: the committed path, or why nothing was committed."""

    path: str | None
    error: str | None
    total_bytes: int = 0
    files: int = 0
    fenced: bool = False
    """The run lock was no longer this job's at the commit point: it commits nothing more."""


_LISTED = 3
"""Failures named in a save's error; beyond them only how many more ranks failed (a bucket
gone fails every rank alike, and the message must stay readable at thousands of ranks)."""


def _describe(failed: list[RankReport]) -> str:
    """Each failure once, under the rank it happened on. A rank that failed only because
    another did (``error_rank``) adds nothing when that rank reported its own error (its
    copy may be worse: DCP's); it is shown, under the other rank, only when no rank did."""
    own = [r for r in failed if r.error_rank is None]
    seen: dict[tuple[int, str], None] = {}
    for r in own or failed:
        origin = r.rank if r.error_rank is None else r.error_rank
        seen.setdefault((origin, str(r.error)), None)
    told = sorted(seen)
    listed = "; ".join(f"rank {rank}: {error}" for rank, error in told[:_LISTED])
    more = len({rank for rank, _ in told[_LISTED:]} - {rank for rank, _ in told[:_LISTED]})
    return listed + (f"; and {more} more rank(s) failed" if more else "")


class Coordinator:
    """The collective steps of a save's close; see the module docstring."""

    def __init__(self, comm: Comm, root: Path, strategy: CommitStrategy) -> None:
        self.comm = comm
        self.root = root
        self.strategy = strategy
        self.fenced: str | None = None
        """Set on every rank by ``announce`` when rank 0 found the run lock in other hands."""

    def agree(self, error: str | None, what: str, step: int | str | None = None) -> None:
        """All ranks learn whether any rank failed ``what``, or (``step``, which names the
        tier too: ``"5 (memory)"``) was asked to save another step or tier than the others;
        all raise together if so.

        What a rank receives does not grow with the world: one all-reduce of an int says
        whether any rank failed (the lowest failing rank's error is then broadcast), one of a
        hash whether every rank names the same step; only when they differ does rank 0
        gather the steps, to name the ranks in the error every rank raises."""
        failed = self.comm.first_failure(None if error is None else SaveError(error))
        if failed is not None:
            more = f"; and {failed.count - 1} more rank(s) failed" if failed.count > 1 else ""
            raise SaveError(
                f"{what} failed, nothing was committed: rank {failed.rank}: {failed.error}{more}"
            )
        if self.comm.all_equal(repr(step)):
            return
        steps = self.comm.gather(step)
        listed = None
        if steps is not None:  # rank 0: each rank's step, the first few that differ from 0's
            odd = [r for r, s in enumerate(steps) if s != steps[0]]
            shown = ", ".join(f"rank {r}: {steps[r]}" for r in [0, *odd[:_LISTED]])
            listed = shown + (f", and {len(odd) - _LISTED} more" if len(odd) > _LISTED else "")
        listed = self.comm.broadcast(listed)
        # each rank would write another step's files: refuse
        raise SaveError(
            f"save() was called with different steps or tiers on different ranks ({listed}); "
            "nothing was committed. Every rank must call save() with the same step, in "
            "the same order."
        )

    def gather(self, report: RankReport, *, everywhere: bool) -> list[RankReport]:
        """Every rank's report on rank 0; on the other ranks, every rank's when the route
        needs them there (``everywhere``: the memory tier's replicas), else their own alone
        (a report costs rank 0 one receive per rank, and no other rank N of them)."""
        if everywhere:
            return self.comm.all_gather(report)
        told = self.comm.gather(report)
        return told if told is not None else [report]

    def refusal(
        self, tmp: Path, reports: list[RankReport], refused: str | None = None
    ) -> SaveOutcome | None:
        """Rank 0: the outcome of a save some rank failed, or that the tier refused (``refused``
        says why), its tmp location removed; None when it may be committed."""
        failed = [r for r in reports if r.error is not None]
        if failed or refused is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return SaveOutcome(path=None, error=_describe(failed) or refused)
        return None

    def commit(self, tmp: Path, manifest: Manifest, cancelled: Flag) -> SaveOutcome:
        """Rank 0: write the manifest into ``tmp`` and commit it; any failure leaves nothing
        committed and becomes the outcome's error."""
        step = manifest.step
        try:
            sealed = manifest.sealed()
            fault_point(Phase.WRITE_MANIFEST, 0, step)
            write_manifest(tmp, sealed)
            final = self.strategy.finalize(self.root, tmp, step, cancelled=cancelled)
        except LockError as exc:  # fenced: another job holds the root now
            shutil.rmtree(tmp, ignore_errors=True)
            return SaveOutcome(path=None, error=f"rank 0 did not commit: {exc}", fenced=True)
        except Exception as exc:  # any failure here must leave nothing committed
            shutil.rmtree(tmp, ignore_errors=True)
            return SaveOutcome(
                path=None, error=f"rank 0 could not commit: {describe_os_error(exc, self.root)}"
            )
        return SaveOutcome(
            path=str(final), error=None, total_bytes=sealed.total_bytes, files=len(sealed.files)
        )

    def announce(self, outcome: SaveOutcome | None, step: int) -> SaveOutcome:
        """Rank 0's outcome on every rank; raises its error as the same SaveError everywhere."""
        mine = outcome or SaveOutcome(path=None, error="rank 0 did not decide")
        told = self.comm.broadcast(mine)
        if told.fenced:
            self.fenced = told.error
        if told.error is not None:
            raise SaveError(
                f"save of step {step} failed, nothing was committed and older checkpoints are "
                f"intact: {told.error}"
            )
        return told
