"""``dckpt inspect`` shows the device mesh of a sharded job and the data position's own epoch
(the issue's papercuts: it showed the world size only, and ``epoch 0`` at step 9 of epoch 2
of a script that never passed ``save(epoch=)``). 2 ranks on gloo, a model sharded on a
2-D mesh (HSDP: ``dp_replicate`` x ``dp_shard``), a DataLoader as the state's data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import dckpt_cli
from dist_harness import run_world
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dckpt

pytestmark = pytest.mark.multiproc


def _save_in_epoch_two(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    net = fully_shard(nn.Linear(8, 8), mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4, shuffle=True)
    state = dckpt.TrainState(net, opt, data=loader)
    with dckpt.CheckpointManager(dckpt.CheckpointConfig(root=root, async_save=False), state) as m:
        step = 0
        for _epoch in range(3):
            for i, (x,) in enumerate(loader):
                net(x).sum().backward()
                opt.step()
                opt.zero_grad()
                step += 1
                if _epoch == 2 and i == 0:
                    m.save(step)  # no epoch=: the manifest's epoch stays 0
                    return


def test_inspect_shows_the_device_mesh_and_the_data_epoch(tmp_path: Path) -> None:
    run_world(_save_in_epoch_two, 2, str(tmp_path))
    shown = dckpt_cli("inspect", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    out: Any = shown.stdout
    assert "epoch      0" in out, out
    assert "data       epoch 2, 1 batch into it" in out, out
    assert "world size 2 (device mesh dp_replicate=1 x dp_shard=2)" in out, out
    obj = json.loads(dckpt_cli("inspect", str(tmp_path), "--json").stdout)
    assert obj["data"] == {"epoch": 2, "batches": 1}
    assert obj["mesh"]["device_mesh"] == {"dp_replicate": 1, "dp_shard": 2}
