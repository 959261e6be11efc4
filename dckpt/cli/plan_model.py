"""Recovery planning: how often to save, what a failure costs, what storage and memory it takes.

Young's first-order optimum (Young 1974, Daly 2006) for the interval between checkpoints is
``tau = sqrt(2 * delta * M)``, where ``delta`` is what one checkpoint costs the training loop
(the stall) and ``M`` the mean time between failures of the whole job
(``M = MTBF per node / nodes``). A failure then loses on average half an interval of work, plus
the time the last save needed to commit (an asynchronous save still writing is lost), plus the
recovery time ``RTO = checkpoint bytes / read bandwidth + restart time``. The fraction of time
lost overall is ``delta / tau + (tau / 2 + commit + RTO) / M``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PlanInputs", "PlanResult", "plan"]


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    checkpoint_bytes: int
    write_gbps: float
    read_gbps: float
    restart_s: float
    mtbf_node_hours: float
    nodes: int
    stall_s: float
    commit_s: float
    keep_last: int
    milestones: int
    host_memory_bytes: int
    restore_s: float | None = None
    """Measured seconds to restore (the memory tier's); None: size / read bandwidth."""

    def __post_init__(self) -> None:
        for name in ("write_gbps", "read_gbps", "mtbf_node_hours"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.nodes < 1 or self.checkpoint_bytes < 0 or self.stall_s < 0:
            raise ValueError("nodes must be >= 1, bytes and stall >= 0")


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    job_mtbf_s: float
    interval_s: float
    expected_work_lost_s: float
    rto_s: float
    overhead_fraction: float
    storage_bytes: int
    staging_bytes_per_node: int
    staging_fits: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(x: PlanInputs) -> PlanResult:
    m = x.mtbf_node_hours * 3600.0 / x.nodes
    # A stall of zero would make every step a checkpoint; the write itself still costs I/O.
    delta = max(x.stall_s, 1e-3)
    tau = math.sqrt(2.0 * delta * m)
    read_s = x.checkpoint_bytes / (x.read_gbps * 1e9) if x.restore_s is None else x.restore_s
    rto = read_s + x.restart_s
    lost = tau / 2.0 + x.commit_s
    staging = x.checkpoint_bytes // x.nodes  # each rank stages its own share
    return PlanResult(
        job_mtbf_s=m,
        interval_s=tau,
        expected_work_lost_s=lost,
        rto_s=rto,
        overhead_fraction=delta / tau + (lost + rto) / m,
        # the kept ones, the milestones, and one more being written
        storage_bytes=x.checkpoint_bytes * (x.keep_last + x.milestones + 1),
        staging_bytes_per_node=staging,
        staging_fits=staging <= x.host_memory_bytes // 2,
    )
