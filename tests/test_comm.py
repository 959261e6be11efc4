"""dckpt's agreements on five gloo ranks (a world that is not a power of two, so the binomial
tree has a rank with no children, one with a grandchild, and a rank whose parent skips one):
every rank gets the same, right answer from ``any``, ``lowest``, ``all_equal`` and
``first_failure``, in any mix, and ``gather`` hands rank 0 alone every rank's object. Ranks
that reach different agreements (a bug) get an error naming both on every rank, not a gloo
abort.
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


def _meetings(rank: int, world: int) -> dict[str, Any]:
    import datetime
    import time

    import torch.distributed as dist

    from dckpt.collective.comm import Comm

    comm = Comm(30)
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    # 0 meets 1 and 2 at once; 1 and 2 each meet 0 (every pair of a ring of three)
    out["all"] = comm.meet({(rank + 1) % 3, (rank + 2) % 3}, 10.0)
    out["again"] = comm.meet({1 - rank}, 10.0) if rank < 2 else comm.meet(set(), 1.0)  # 0-1
    # rank 2 reaches its next meeting with 0 only after 0 gave up on it (1 s): both learn so
    gave_up = "test/rank-0-gave-up"
    if rank == 2:  # waits for that (a store key), however long it took on this machine
        store.wait([gave_up], datetime.timedelta(seconds=120))
    t0 = time.monotonic()
    if rank == 0:
        out["late"] = comm.meet({2}, 1.0)
        out["late_s"] = time.monotonic() - t0
        store.set(gave_up, b"1")
    else:  # rank 2 would wait 30 s for a rank that is there
        out["late"] = comm.meet({0}, 30.0) if rank == 2 else []
        out["late_s"] = time.monotonic() - t0
    comm.barrier()
    name = comm.group.group_name if comm.group is not None else ""
    # what a met meeting left behind (nothing) and an abandoned one (its mark, naming it so)
    out["met_left"] = store.check([f"dckpt/meet/{name}/0-1/1", f"dckpt/meet/{name}/0-1/2"])
    out["gone_left"] = store.get(f"dckpt/meet/{name}/0-2/2/second") if rank == 0 else None
    comm.close()
    return out


def test_ranks_meet_through_the_store_and_a_late_peer_is_named_on_both_ends() -> None:
    """``Comm.meet`` (the memory tier's exchanges open with it): every pair meets; a peer
    that arrives after the other gave up is told so at once (the meeting was marked
    abandoned), so neither end posts a message to a rank that left; a met meeting's keys are
    removed from the job's store."""
    results = run_world(_meetings, 3)
    assert [r["all"] for r in results] == [[], [], []], results
    assert [r["again"] for r in results] == [[], [], []], results
    assert results[0]["late"] == [2] and results[2]["late"] == [0], results
    assert 1.0 <= results[0]["late_s"] < 20, results  # its own 1 s, not rank 2's arrival
    assert results[2]["late_s"] < 20, results  # told at once, not its own 30 s
    assert not any(r["met_left"] for r in results), results
    assert results[0]["gone_left"].startswith(b"gone#"), results  # sealed (collective.sealed)


def _diverging(rank: int, world: int) -> dict[str, Any]:
    from dckpt.collective.comm import Comm, DivergedError

    comm = Comm(30)
    out: dict[str, Any] = {"first": comm.any(rank == 1)}
    try:
        # rank 0 skips an agreement the others make, then all go on: rank 0's next agreement
        # (2 ints) meets the others' (1 int), which once made gloo abort rank 0's process
        if rank != 0:
            comm.any(False)
        comm.first_failure(None)
        out["second"] = "agreed"
    except DivergedError as exc:
        out["second"] = str(exc)
    comm.close()
    return out


def test_ranks_that_reach_different_agreements_all_raise_instead_of_aborting() -> None:
    results = run_world(_diverging, 3)
    for r in results:
        assert r["first"] is True, r
        assert "dckpt's ranks took different paths" in r["second"], r
        assert "agreement #2 (of 1 ints)" in r["second"] and "bug in dckpt" in r["second"], r
