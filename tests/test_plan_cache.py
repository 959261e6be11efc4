"""DCP's save plan is reused only while every rank's layout is unchanged (dckpt.save.plan_cache).

Two gloo ranks save a state holding a sharded DTensor ten times in one manager. An unchanged
layout reuses the plan (the manifest's ``plan_cached`` timing says so); a dtype change (of the
DTensor, then of plain tensors: a model cast to float64, a tensor to bf16), a new key, a
changed sharding, and a new key on one rank alone each re-plan on every rank, and the
committed ``.metadata`` records the new layout (the dtype above all: DCP's own plan comparison
ignores it, so a cache keyed as DCP keys it would commit the old one). Every step verifies and
the re-sharded step loads back bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world

from dckpt.root.layout import step_dir_name
from dckpt.root.manifest import read_manifest
from dckpt.root.verify import verify_checkpoint

pytestmark = pytest.mark.multiproc


def _held(key: str | None) -> list[str]:
    """Which of DCP's class-level plan caches hold an entry under ``key``."""
    from torch.distributed.checkpoint.planner import SavePlanner

    from dckpt.save.plan_cache import _CACHES

    return [n for n in _CACHES if key in (getattr(SavePlanner, n, None) or {})]


def _saves(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dckpt

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(4, 6)

    class Holder:
        def __init__(self) -> None:
            self.sd: dict[str, Any] = {"w": distribute_tensor(full, mesh, [Shard(0)])}

        def state_dict(self) -> dict[str, Any]:
            return dict(self.sd)

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            for k, v in sd.items():
                self.sd[k] = v

    holder = Holder()
    model = torch.nn.Linear(2, 2)
    state = dckpt.TrainState(model, extra={"h": holder})
    config = dckpt.CheckpointConfig(root=Path(root), async_save=False, timeout_s=60, keep_last=12)
    out: dict[str, Any] = {"meta": {}}
    with dckpt.CheckpointManager(config, state) as mgr:
        mgr.save(1)  # the first save plans
        mgr.save(2)  # nothing changed: the plan is reused
        holder.sd["w"] = holder.sd["w"].to(torch.float64)
        mgr.save(3)  # a dtype change
        holder.sd["v"] = torch.arange(3.0)
        mgr.save(4)  # a new key
        holder.sd["w"] = distribute_tensor(full.to(torch.float64), mesh, [Shard(1)])
        mgr.save(5)  # a changed sharding
        mgr.save(6)
        if rank == 1:
            holder.sd["only_on_1"] = torch.ones(2)
        mgr.save(7)  # one rank's new key re-plans on both
        mgr.save(8)
        holder.sd["v"] = holder.sd["v"].to(torch.bfloat16)  # plain tensors cast: a model's ...
        model.to(torch.float64)  # ... parameters, or a buffer
        mgr.save(9)
        mgr.save(10)
        key = mgr._tiers[-1].route.plans.key
        out["held_open"] = _held(key)
    out["held_closed"] = _held(key)  # DCP's class-level caches let go at close
    for step in range(1, 11):
        md = FileSystemReader(str(Path(root) / step_dir_name(step))).read_metadata()
        w = md.state_dict_metadata["extra.h.w"]
        v = md.state_dict_metadata.get("extra.h.v")
        out["meta"][step] = {
            "dtype": str(w.properties.dtype),  # type: ignore[union-attr]
            "v": str(v.properties.dtype) if v is not None else None,  # type: ignore[union-attr]
            "weight": str(md.state_dict_metadata["model.weight"].properties.dtype),  # type: ignore[union-attr]
            "offsets": sorted(tuple(c.offsets) for c in w.chunks),  # type: ignore[union-attr]
            "keys": sorted(k for k in md.state_dict_metadata if k.startswith("extra.h.")),
        }
    fresh = Holder()
    fresh.sd = {
        "w": distribute_tensor(torch.zeros(4, 6, dtype=torch.float64), mesh, [Shard(1)]),
        "v": torch.zeros(3),
    }
    back = dckpt.TrainState(torch.nn.Linear(2, 2), extra={"h": fresh})
    with dckpt.CheckpointManager(config, back) as mgr:
        mgr.load(5)
    out["w_back"] = torch.equal(fresh.sd["w"].full_tensor(), full.to(torch.float64))
    out["v_back"] = torch.equal(fresh.sd["v"], torch.arange(3.0))
    return out


def test_the_plan_is_reused_only_while_no_rank_changed_its_layout(tmp_path: Path) -> None:
    results = run_world(_saves, 2, str(tmp_path), timeout=180)
    cached = {
        s: read_manifest(tmp_path / step_dir_name(s)).timings["plan_cached"] for s in range(1, 11)
    }
    want = {1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0, 5: 0.0, 6: 1.0, 7: 0.0, 8: 1.0, 9: 0.0, 10: 1.0}
    assert cached == want, cached
    assert all(read_manifest(tmp_path / step_dir_name(s)).timings["plan_s"] > 0 for s in cached)
    meta = results[0]["meta"]
    assert [meta[s]["dtype"] for s in range(1, 11)] == ["torch.float32"] * 2 + ["torch.float64"] * 8
    # plain tensors, as DTensors: the metadata holds the dtype they were saved in
    assert [meta[s]["v"] for s in (8, 9, 10)] == ["torch.float32"] + ["torch.bfloat16"] * 2
    assert [meta[s]["weight"] for s in (8, 9, 10)] == ["torch.float32"] + ["torch.float64"] * 2
    assert meta[2]["offsets"] == [(0, 0), (2, 0)] and meta[5]["offsets"] == [(0, 0), (0, 3)]
    assert meta[3]["keys"] == ["extra.h.w"] and meta[4]["keys"] == ["extra.h.v", "extra.h.w"]
    assert "extra.h.only_on_1" in meta[7]["keys"] and "extra.h.only_on_1" in meta[8]["keys"]
    for s in range(1, 11):
        assert verify_checkpoint(tmp_path / step_dir_name(s)).ok
    assert all(r["w_back"] and r["v_back"] for r in results), results
    assert all(r["held_open"] for r in results) and not any(r["held_closed"] for r in results)
