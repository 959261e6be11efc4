"""dckpt's agreements on five gloo ranks (a world that is not a power of two, so the binomial
tree has a rank with no children, one with a grandchild, and a rank whose parent skips one):
every rank gets the same, right answer from ``any``, ``lowest``, ``all_equal`` and
``first_failure``, in any mix, and ``gather`` hands rank 0 alone every rank's object.
"""

from __future__ import annotations

from typing import Any

import pytest
from dist_harness import run_world

pytestmark = pytest.mark.multiproc


def _agreements(rank: int, world: int) -> dict[str, Any]:
    from dckpt.collective.comm import Comm

    comm = Comm(30)
    out: dict[str, Any] = {
        "none": comm.any(False),
        "only_4": comm.any(rank == 4),
        "lowest_of_3_4": comm.lowest(rank in (3, 4)),
        "lowest_none": comm.lowest(False),
        "equal": comm.all_equal("same text"),
        "one_differs": comm.all_equal("x" if rank != 2 else "y"),
        "gathered": comm.gather(rank * 10),
    }
    failed = comm.first_failure(ValueError(f"rank {rank} failed") if rank in (2, 3) else None)
    assert failed is not None
    out["failure"] = (failed.rank, str(failed.error), failed.count)
    out["no_failure"] = comm.first_failure(None)
    comm.close()
    return out


def test_every_rank_agrees_on_the_same_answers() -> None:
    results = run_world(_agreements, 5)
    for rank, r in enumerate(results):
        assert r["none"] is False and r["only_4"] is True, r
        assert r["lowest_of_3_4"] == 3 and r["lowest_none"] is None, r
        assert r["equal"] is True and r["one_differs"] is False, r
        assert r["failure"] == (2, "rank 2 failed", 2) and r["no_failure"] is None, r
        assert r["gathered"] == ([0, 10, 20, 30, 40] if rank == 0 else None), r
