"""A tiny model, its training step and its whole state, for the multi-rank save tests.

``model`` is Linear, BatchNorm (buffers that change in forward), ReLU, Linear, wrapped in DDP
or sharded with FSDP2, with AdamW; ``full_state`` gathers every weight and moment whole, so
ranks and wrappers compare alike.
"""

from __future__ import annotations

import torch
from torch import nn


def model(parallel: str = "ddp", width: int = 256) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net: nn.Module = nn.Sequential(
        nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 4)
    )
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(net[0])
        fully_shard(net[3])
        fully_shard(net)
    else:
        net = nn.parallel.DistributedDataParallel(net)
    return net, torch.optim.AdamW(net.parameters(), lr=0.05)


def step(net: nn.Module, opt: torch.optim.Optimizer, seed: int, width: int = 256) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    net(torch.randn(8, width, generator=g)).pow(2).mean().backward()
    opt.step()


def full_state(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every weight and moment, gathered whole (the same on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for pid, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{pid}.{k}"] = v.detach().clone()
    return out
