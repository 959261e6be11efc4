"""Which device training runs on, for every form of process group a script may make.

``nccl``, ``gloo`` and the per-device form ``cpu:gloo,cuda:nccl`` (which DCP's own
``async_save`` asks for) are parsed without a GPU; on gloo ranks, a group the script made
itself, in the per-device form, is kept by ``init_distributed`` and a resume's warmup runs on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from torch import nn

from dckpt.collective.world import backends_by_device, training_device


@pytest.mark.parametrize(
    ("backend", "with_cuda", "without_cuda"),
    [
        ("nccl", "cuda:1", "cpu"),
        ("gloo", "cpu", "cpu"),
        ("cpu:gloo,cuda:nccl", "cuda:1", "cpu"),
        ("cuda:nccl,cpu:gloo", "cuda:1", "cpu"),
        ("cpu:gloo", "cpu", "cpu"),
        ("cpu:gloo,cuda:gloo", "cpu", "cpu"),
        ("cuda:nccl", "cuda:1", "cpu"),
    ],
)
def test_the_device_follows_the_groups_backend_for_cuda(
    backend: str, with_cuda: str, without_cuda: str
) -> None:
    assert str(training_device(backend, cuda_available=True, local_rank=1)) == with_cuda
    assert str(training_device(backend, cuda_available=False, local_rank=1)) == without_cuda


def test_per_device_backends_are_parsed() -> None:
    assert backends_by_device("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert backends_by_device(" CPU:gloo , cuda:NCCL ") == {"cpu": "gloo", "cuda": "nccl"}
    assert backends_by_device("nccl") == {"cuda": "nccl"}


def _user_made_group(rank: int, world: int, root: str) -> dict[str, Any]:
    """The harness made the group in the per-device form before dckpt was called."""
    import torch.distributed as dist

    import dckpt

    group_before = dist.distributed_c10d._get_default_group()
    got_rank, got_world, device = dckpt.init_distributed()
    assert dist.distributed_c10d._get_default_group() is group_before  # kept, not replaced
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dckpt.CheckpointManager(root, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1).result()
    with dckpt.CheckpointManager(root, dckpt.TrainState(model, opt)) as mgr:
        report = mgr.resume()
    return {
        "rank": got_rank,
        "world": got_world,
        "device": str(device),
        "backend": str(dist.get_backend_config()),
        "warmup": [c for c in report.checks if c.name == "warmup all-reduce"],
    }


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["cpu:gloo", "cpu:gloo,cuda:gloo"])
def test_a_group_the_script_made_is_kept_and_answers_the_warmup(
    tmp_path: Path, backend: str
) -> None:
    results = run_world(_user_made_group, 2, str(tmp_path / "ckpt"), backend=backend)
    for rank, r in enumerate(results):
        assert (r["rank"], r["world"], r["device"]) == (rank, 2, "cpu")
        assert r["backend"].startswith("cpu:gloo")
        assert len(r["warmup"]) == 1 and r["warmup"][0].ok, r["warmup"]
