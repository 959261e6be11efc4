"""A tier as one value: ``Tier`` (its name, its save half, its load half), and the durable
tier's factory, ``durable_tier``. The memory tier's factory is dckpt.memory_tier.

The manager builds each tier with its factory and hands the one list to the ``Saver`` (which
sees a tier as ``dckpt.save.route.SaveTier``) and to the ``Resumer``
(``dckpt.load.resumer.LoadTier``): neither asks which tier it holds. Invariants:

- a tier's ``name`` is its one id: in ``save(tier=...)``, the ranks' agreement of a save, the
  resume records (dckpt.root.resume_record reads an older dckpt's names as these);
- exactly one tier is the ``anchor``: the root's, on which the run's lineage rests (a
  preemption's final save, the step later memory saves follow, what ``load()`` reads); it is
  listed last, so a tie between two tiers' newest steps goes to the other;
- ``close`` lets go of what the tier holds at the manager's ``close()``; it is told whether
  the run's last committed save was the anchor's (then nothing in memory is newer than the
  root) and nothing is left stuck.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from .collective.comm import Comm
from .config import CheckpointConfig
from .load.checks import CandidateChecks
from .load.durable import DurableReader
from .load.resumer import Reader
from .root.commit import FileCommit
from .root.source import CheckpointSource
from .save.durable import DurableRoute
from .save.route import SaveRoute
from .save.stager import Stager
from .train.state import TrainState

__all__ = ["DURABLE", "MEMORY", "Tier", "durable_tier"]

DURABLE: Final = "durable"
MEMORY: Final = "memory"


@dataclass(frozen=True)
class Tier:
    """One tier: where a save goes and where a resume finds it; see the module docstring."""

    name: str
    """Its one id (``DURABLE``, ``MEMORY``)."""
    words: str
    """How a report names it ("root", "memory tier")."""
    route: SaveRoute
    """Its part of the save protocol (dckpt.save.route)."""
    source: CheckpointSource
    """Where a resume finds its committed steps."""
    reader: Reader
    """How a resume proves and loads one of them."""
    anchor: bool = False
    """Whether the run's lineage rests on it (the root's tier)."""
    survey: Callable[[], list[str]] | None = None
    """What a resume's report says of it beyond its candidates (the memory tier: steps held
    in memory that the root has no record of)."""
    close: Callable[[bool], None] | None = None
    """Let go of what it holds at ``close()``, told whether the run's last committed save
    was the anchor's and nothing is stuck."""


def durable_tier(
    *,
    ctl: Comm,
    io: Comm,
    strategy: FileCommit,
    source: CheckpointSource,
    config: CheckpointConfig,
    state: TrainState,
    checks: CandidateChecks,
) -> Tier:
    """The root's tier: DCP's save through the hashing writer (``DurableRoute``) with the
    root's commit strategy, and the verified DCP load (``DurableReader``) over its source."""
    route = DurableRoute(
        io=io,
        strategy=strategy,
        config=config,
        state=state,
        stager=Stager(config.device_staging_bytes),
    )
    reader = DurableReader(
        ctl=ctl, source=source, state=state, checks=checks, read_threads=config.read_threads
    )

    def close(_last_was_anchor: bool) -> None:
        # DCP keeps cached plans in class-level dicts (rank 0's hold every rank's): a closed
        # manager's would stay for the life of the process
        route.plans.forget()

    return Tier(DURABLE, "root", route, source, reader, anchor=True, close=close)
