"""One rank alone refuses a candidate (issue 58, item 2's pattern): every rank raises the same
refusal at once, and no rank's state is touched.

The state's kinds are checked on each rank (a scheduler, a GradScaler) against the step's
manifest: a run whose ranks were built differently (rank 1 alone has a scheduler the saved
run did not have) refuses on rank 1 only. Before, rank 1 raised alone and rank 0 waited in
the load's collectives until its deadline, then blamed rank 1 as frozen or gone ("the state
may be partly loaded"): the wrong reason and the wrong advice. On the durable tier and on the
memory tier (2 ranks as 2 nodes), both ranks must raise the same StateMismatchError (rank 0
no WorldError), with every tensor as it was.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from test_memory_stream import _net, _same, _snap, _train

import dckpt

pytestmark = pytest.mark.multiproc


def _world(rank: int, world: int, base: str, tier: str) -> dict[str, Any]:
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    case = Path(base) / tier
    conf = dckpt.CheckpointConfig(
        root=case / "ckpt", lock=False, memory=tier == "memory", memory_dir=case / "mem",
        loss_watch="off", timeout_s=15.0, replica_check="off",
    )  # fmt: skip
    net, opt = _net(8, rank)
    _train(net, opt)
    with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt)) as mgr:
        mgr.save(2, tier="memory" if tier == "memory" else "durable").result()
    net, opt = _net(8, rank)
    _train(net, opt)
    _train(net, opt)
    before = _snap(net, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3) if rank == 1 else None
    try:
        with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt, scheduler=sched)) as mgr:
            got = f"resumed {mgr.resume().step}"
    except dckpt.CheckpointError as exc:
        got = f"{type(exc).__name__}: {exc}"
    return {"got": got, "untouched": _same(before, net, opt)}


@pytest.mark.parametrize("tier", ["durable", "memory"])
def test_a_state_built_differently_on_one_rank_is_refused_on_every_rank_alike(
    tmp_path: Path, tier: str
) -> None:
    got = run_world(_world, 2, str(tmp_path), tier, timeout=200)
    for rank, r in enumerate(got):
        assert r["got"].startswith("StateMismatchError: step-00000002 holds no scheduler"), (
            rank,
            r,
        )
        assert r["untouched"], (rank, r)
    assert got[0]["got"].split(" (raised on")[0] == got[1]["got"].split(" (raised on")[0]
