"""The coordinator: every rank reports what it wrote; rank 0 writes the manifest and commits.

Protocol (``Coordinator.finish_save``), entered by every rank after its DCP write returned or
failed:

1. all ranks all-gather a ``RankReport`` (files with digests, or the error that stopped them);
2. rank 0, if every report is clean, builds the manifest from all records, writes it into the
   tmp dir and runs the commit strategy; if any report carries an error, it removes the tmp dir
   and commits nothing;
3. rank 0 broadcasts the outcome; every rank returns the committed path or raises the same
   ``SaveError``, which names each failed rank and its error.

Commit happens only after all ranks finished writing. This layer knows files, not tensors.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..dist.comm import Comm
from ..errors import SaveError, describe_os_error
from ..faults import fault_point
from ..root.commit import RenameCommit
from ..root.manifest import Manifest, write_manifest
from ..storage.records import FileRecord

__all__ = ["Coordinator", "RankReport"]

log = logging.getLogger("dckpt")


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """What one rank sends the coordinator after its part of a save."""

    rank: int
    records: tuple[FileRecord, ...] = ()
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SaveOutcome:
    path: str | None
    error: str | None
    total_bytes: int = 0
    files: int = 0


def _describe(failed: list[RankReport]) -> str:
    return "; ".join(f"rank {r.rank}: {r.error}" for r in failed)


class Coordinator:
    """Runs the save's closing protocol; see the module docstring."""

    def __init__(self, comm: Comm, root: Path, strategy: RenameCommit | None = None) -> None:
        self.comm = comm
        self.root = root
        self.strategy = strategy or RenameCommit()
        self.committed: tuple[int, str] | None = None
        """On rank 0: (step, path) of the save it committed last, even if telling the other
        ranks failed afterwards."""

    def agree(self, error: str | None, what: str) -> None:
        """All ranks learn whether any rank failed ``what``; all raise together if so."""
        errors = self.comm.all_gather(error)
        failed = [RankReport(rank=r, error=e) for r, e in enumerate(errors) if e is not None]
        if failed:
            raise SaveError(f"{what} failed, nothing was committed: {_describe(failed)}")

    def finish_save(
        self,
        tmp_dir: Path,
        step: int,
        report: RankReport,
        build_manifest: Callable[[list[RankReport]], Manifest],
        on_decided: Callable[[], None] | None = None,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> SaveOutcome:
        reports = self.comm.all_gather(report)
        outcome = SaveOutcome(path=None, error="rank 0 did not decide")
        if self.comm.rank == 0:
            outcome = self._decide(tmp_dir, step, reports, build_manifest, abandoned)
            if on_decided is not None:
                on_decided()
        outcome = self.comm.broadcast(outcome)
        if outcome.error is not None:
            raise SaveError(
                f"save of step {step} failed, nothing was committed and older checkpoints are "
                f"intact: {outcome.error}"
            )
        return outcome

    def _decide(
        self,
        tmp_dir: Path,
        step: int,
        reports: list[RankReport],
        build_manifest: Callable[[list[RankReport]], Manifest],
        abandoned: Callable[[], bool],
    ) -> SaveOutcome:
        failed = [r for r in reports if r.error is not None]
        if failed:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            return SaveOutcome(path=None, error=_describe(failed))
        try:
            manifest = build_manifest(reports).sealed()
            fault_point("write_manifest", 0, step)
            write_manifest(tmp_dir, manifest)
            final = self.strategy.commit(self.root, tmp_dir, step, abandoned=abandoned)
            self.committed = (step, str(final))
        except Exception as exc:  # any failure here must leave nothing committed
            shutil.rmtree(tmp_dir, ignore_errors=True)
            return SaveOutcome(
                path=None, error=f"rank 0 could not commit: {describe_os_error(exc, self.root)}"
            )
        return SaveOutcome(
            path=str(final), error=None, total_bytes=manifest.total_bytes, files=len(manifest.files)
        )
