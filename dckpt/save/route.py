"""The seam between the save protocol and a tier: ``SaveRoute``, and the records they share.

The save pipeline (dckpt.save.pipeline) runs one protocol for every tier; each tier is one
route, built by the manager with its commit strategy, and picked by ``save(tier=...)``. The
pipeline calls the route at the steps its docstring names and never asks which tier it is:

- step 3, ``snapshot`` (foreground): this rank's copy of the state, as the tier keeps it;
- step 5, ``write`` (background): this rank's files, with their digests, as its report;
- step 6, ``settle`` (every rank, after the gather): why the save must be refused, if it must
  (it sees every rank's report on rank 0, and on the other ranks only when
  ``reports_everywhere``: their own otherwise);
- step 7, ``mesh`` and ``incremental`` (rank 0): what the manifest's ``mesh`` records
  besides the world size, and its ``incremental`` record (the durable tier's frozen files);
- step 10, ``finish`` (every rank, once committed, told the committed step's bytes): what
  follows a commit (the memory tier's replicas), and rank 0's words for the save's log line;
- ``abandon`` (every rank, after a failure every rank agreed on): this rank's leftovers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..phases import Trace
from ..root.commit import CommitStrategy
from .coordinator import RankReport
from .handle import SaveTicket

__all__ = ["DURABLE", "Finished", "SaveJob", "SaveRoute"]

DURABLE = "durable"
"""The root's tier: what a preemption's final save and the run's lineage rest on."""


@dataclass(frozen=True)
class Finished:
    """What followed a commit on this rank."""

    line: str | None
    """Rank 0's words for the save's log line (where the bytes went; the replicas)."""
    lost: str | None = None
    """Why dckpt's group can no longer be used (a peer stopped answering), else None."""
    ok: bool = True
    """False when part of it failed (a replica): the line is logged as a warning."""
    replicas_s: float | None = None
    """This rank's seconds moving replicas, when it moved any."""


@dataclass(frozen=True, kw_only=True)
class SaveJob:
    """What the foreground hands the save thread for one save; never changed after."""

    route: SaveRoute
    step: int
    save_id: str
    started: float
    """``time.perf_counter()`` when ``save()`` was called."""
    waited_s: float = 0.0
    """How long ``save()`` then waited for the save still in flight (part of a synchronous
    save's stall, but not of what that way of saving costs: the save before caused it)."""
    snapshot: Any
    """The route's copy of this rank's state (None when taking it failed)."""
    error: str | None
    """Why this rank could not take its snapshot (reported to every rank in step 4)."""
    epoch: int
    milestone: bool
    asynchronous: bool
    loss: dict[str, Any]
    metric: dict[str, float]
    scaler: dict[str, Any] | None
    layout: dict[str, Any]
    """What the manifest says of the state's shape at ``save()``: the device meshes of its
    DTensors (``device_mesh``) and the data position (``data``); see ``describe_layout``."""


class SaveRoute(Protocol):
    """One tier's part of the save protocol; see the module docstring."""

    tier: str
    """The tier's name, in ``save(tier=...)`` and in the agreement of the ranks."""
    label: str
    """Words for the save line after ``saved step N`` ("" or " to memory")."""
    noun: str
    """What a user calls one save of this route ("save", "memory save")."""
    can_block: bool
    """Whether a save of this route may run synchronously (and the automatic save mode
    learns from what its saves cost the loop)."""
    soft: bool
    """Whether a failure every rank agreed on fails its handle only (logged, training goes
    on) instead of being raised by the next ``save()``."""
    strategy: CommitStrategy
    reports_everywhere: bool
    """Whether ``settle`` and ``finish`` need every rank's report on every rank (an
    all-gather whose size grows with the world); else rank 0 alone gathers them."""

    def snapshot(
        self, state_dict: dict[str, Any], *, step: int, save_id: str, asynchronous: bool,
        trace: Trace,
    ) -> Any:  # fmt: skip
        ...

    def write(
        self, snapshot: Any, ticket: SaveTicket, trace: Trace, tmp: Path, report: RankReport
    ) -> RankReport: ...

    def settle(self, reports: list[RankReport]) -> str | None: ...

    def mesh(self) -> dict[str, Any]: ...

    def incremental(self, reports: list[RankReport], snapshot: Any) -> dict[str, Any]:
        """Rank 0: the manifest's ``incremental`` record ({}: none)."""
        ...

    def finish(
        self,
        job: SaveJob,
        reports: list[RankReport],
        timings: dict[str, float],
        trace: Trace,
        total_bytes: int,
    ) -> Finished: ...

    def abandon(self, snapshot: Any, step: int) -> None: ...
