"""The memory tier's de-duplicated layouts, restored exactly, with several ranks per node.

DDP's replicated tensors are written once each: with two nodes, shared among all ranks
("world": every node holds every file); with three, among each node's ranks ("node": no node
reads another's files). Each case saves three memory steps (the first writes everything and
agrees the layout; the next two follow it), disturbs the model, resumes from local memory and
then, after one node's memory is wiped, from the partner's replica: the state must come back
bit for bit, and the lost node must have read only what the layout says.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world

import dckpt


def _layouts(rank: int, world: int, base: str, per_node: int) -> dict[str, Any]:
    import torch.distributed as dist

    node = rank // per_node
    os.environ.update(
        GROUP_RANK=str(node), LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node)
    )
    logging.getLogger("dckpt").setLevel(logging.WARNING)
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 96))
    )
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(4, 96)).sum().backward()
    opt.step()
    state = dckpt.TrainState(net, opt)
    memory = Path(base) / "mem"
    conf = dckpt.CheckpointConfig(
        root=Path(base) / "ckpt", lock=False, memory=True, memory_dir=memory
    )
    out: dict[str, Any] = {}
    try:
        with dckpt.CheckpointManager(conf, state) as mgr:
            mgr.save(1).result()
            for step in (2, 3, 4):
                mgr.save(step, tier="memory").result()
        manifest = Path(base) / "ckpt" / "memory" / "step-00000004.json"
        out["shared"] = json.loads(manifest.read_text())["mesh"]["shared"]
        want = {k: v.clone() for k, v in net.state_dict().items()}
        want_opt = [s["exp_avg"].clone() for s in opt.state.values()]
        for case in ("local", "partner"):
            if case == "partner" and node == 1 and rank % per_node == 0:
                shutil.rmtree(memory / "node-1")  # node 1's memory is gone
            dist.barrier()
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)
            with dckpt.CheckpointManager(conf, state) as mgr:
                report = mgr.resume()
            got = net.state_dict()
            out[case] = {
                "origin": report.origin,
                "memory": next(c.detail for c in report.checks if c.name == "memory"),
                "exact": all(torch.equal(want[k], got[k]) for k in want)
                and all(
                    torch.equal(a, s["exp_avg"])
                    for a, s in zip(want_opt, opt.state.values(), strict=True)
                ),
            }
    finally:
        dist.barrier()
    return out


@pytest.mark.parametrize(
    ("world", "per_node", "shared"),
    [(4, 2, "world"), (6, 2, "node"), (5, 3, "world")],
    ids=["2x2", "3x2", "3+2"],
)
def test_layouts_restore_exactly(tmp_path: Path, world: int, per_node: int, shared: str) -> None:
    """``3+2``: nodes of unequal size (ranks 0-2 on node 0, 3-4 on node 1): node 1's two
    ranks keep the replicas of node 0's three, and prove and receive each other's share of
    the files; no rank may take another's spare (their sizes differ: a truncated mapping)."""
    results = run_world(_layouts, world, str(tmp_path), per_node, timeout=180)
    lost_ranks = list(range(per_node, min(2 * per_node, world)))
    for r in results:
        assert r["shared"] == shared, r
        assert r["local"]["exact"] and r["partner"]["exact"], r
        assert r["local"]["origin"].startswith("the memory tier (local memory"), r
        assert f"ranks {lost_ranks} from other nodes' memory" in r["partner"]["origin"], r
    lost = results[0]["partner"]["memory"]
    if shared == "world":  # node 1 read every file, all from node 0 (its own, A's replica)
        assert all(f"rank {r}: from node 0" in lost for r in lost_ranks), lost
    else:  # node 1 read only its own two files, from the node that keeps its replica
        assert "rank 2: from node 2" in lost and "rank 3: from node 2" in lost, lost
        assert "from node 0" not in lost, lost
    assert "rank 0: local memory" in lost and "rank 1: local memory" in lost, lost
