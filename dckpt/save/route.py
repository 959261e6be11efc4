"""The seam between the save protocol and a tier: ``SaveRoute``, and the records they share.

The save pipeline (dckpt.save.pipeline) runs one protocol for every tier; a tier is one value
(``SaveTier``: its name, its route, whether the run's lineage rests on it), built by its
factory above this layer (dckpt.tier) with its commit strategy, and picked by
``save(tier=...)``. The pipeline calls the route at the steps its docstring names and never
asks which tier it is:

- step 3, ``snapshot`` (foreground): this rank's copy of the state, as the tier keeps it;
- step 5, ``write`` (background): this rank's files, with their digests, as its report;
- step 6, ``settle`` (every rank, after the gather): the route's verdict on the ranks'
  reports (``Settled``): why the save must be refused, if it must, and what rank 0's
  manifest records of it (``mesh`` beside the world size, the ``incremental`` record). It
  sees every rank's report on rank 0, and on the other ranks only when
  ``reports_everywhere``, their own otherwise; what rank 0 records is read on rank 0 only;
- step 10, ``finish`` (every rank, once committed, told the committed step's bytes and what
  ``settle`` said): what follows a commit (the memory tier's replicas), and rank 0's words
  for the save's log line;
- ``abandon`` (every rank, after a failure every rank agreed on): this rank's leftovers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..phases import Trace
from ..root.commit import CommitStrategy
from .coordinator import RankReport
from .handle import SaveTicket

__all__ = ["Finished", "SaveJob", "SaveRoute", "SaveTier", "Settled"]


@dataclass(frozen=True)
class Settled:
    """A route's verdict on the ranks' reports of one save (step 6)."""

    refused: str | None = None
    """Why the save must be refused, else None (the same on every rank that decides)."""
    mesh: dict[str, Any] = field(default_factory=dict)
    """Rank 0: what the manifest's ``mesh`` records besides the world size."""
    incremental: dict[str, Any] = field(default_factory=dict)
    """Rank 0: the manifest's ``incremental`` record ({}: none)."""


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

    tier: SaveTier
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
    stepped: int = 0
    """Optimizer steps since the previous ``save()`` to this tier (0 for its first)."""

    @property
    def route(self) -> SaveRoute:
        return self.tier.route


class SaveRoute(Protocol):
    """One tier's part of the save protocol; see the module docstring."""

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

    @property
    def strategy(self) -> CommitStrategy:
        """How a save of this route becomes a checkpoint (dckpt.root.commit)."""
        ...

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

    def settle(self, reports: list[RankReport], snapshot: Any) -> Settled: ...

    def finish(
        self,
        job: SaveJob,
        reports: list[RankReport],
        settled: Settled,
        timings: dict[str, float],
        trace: Trace,
        total_bytes: int,
    ) -> Finished: ...

    def abandon(self, snapshot: Any, step: int) -> None: ...


class SaveTier(Protocol):
    """A tier as the save sees it (dckpt.tier.Tier is one)."""

    @property
    def name(self) -> str:
        """Its one id: in ``save(tier=...)``, the ranks' agreement, the report, the records."""
        ...

    @property
    def route(self) -> SaveRoute: ...

    @property
    def anchor(self) -> bool:
        """Whether the run's lineage rests on it (the root's tier): a preemption's final
        save, the steps later memory saves follow, what ``load()`` reads."""
        ...
