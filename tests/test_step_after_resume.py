"""One optimizer step after every resume path, a save, and one more resume (issue 58, item 2:
"one step more than the tests take").

Each resume path, in a root of its own: the run saves, a new manager resumes (the state
disturbed first, parameters, optimizer state and LR, so a resume that leaves one shows),
takes one AdamW step on a batch the saved run never saw, saves, and a third manager resumes
again. Each resume must give the
state exactly: the first the saved one, the second the one after the step (model and
optimizer tensors equal, AdamW's step count included: the first step's effects are there),
and never the state before that step.

- on two gloo ranks, each its own node (``GROUP_RANK``), DDP, one world for the cases:

  - ``durable``: the directory root (durable 1; resumed; step; durable 2; resumed);
  - ``local``: the memory tier from each node's own memory (durable 1, memory 2; resumed
    from memory; step; memory 3; resumed from memory 3);
  - ``partner``: the same after node 1 lost its memory: the first resume takes node 1's
    files from node 0, the step runs after the copy back; memory 3; resumed from memory 3;
  - ``fallback``: durable 1 and 2, a byte of step 2 flipped: the resume falls back to 1
    (step 2 set aside); step; a new step 2; resumed: the new step 2, not the damaged one;

- in this process, one rank: ``durable``'s root (saved at world size 2) resumed at world
  size 1, one step, step 3 saved at world size 1, resumed; and an s3:// root (moto's
  server): each manager on a node of its own (a fresh mirror), so each resume reads the
  bucket.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from s3_kit import MotoServer, moto_server

import dckpt

pytestmark = [pytest.mark.multiproc]

WIDTH = 16


def _net(ddp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 32), torch.nn.Linear(32, WIDTH)
    )
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(net)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer, batch: int) -> None:
    """One optimizer step on batch number ``batch`` (the same on every rank)."""
    g = torch.Generator().manual_seed(batch)
    net(torch.randn(4, WIDTH, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snap(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    out.update({f"lr.{i}": torch.tensor(g["lr"]) for i, g in enumerate(opt.param_groups)})
    return out


def _same(want: dict[str, torch.Tensor], net: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    got = _snap(net, opt)
    return set(got) == set(want) and all(torch.equal(want[k], got[k]) for k in want)


def _disturb(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Every parameter, optimizer tensor and learning rate changed: a resume that leaves one
    shows."""
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
        for s in opt.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    v.add_(1.0)
    for group in opt.param_groups:
        group["lr"] *= 2


def _config(root: Path | str, **extra: Any) -> dckpt.CheckpointConfig:
    return dckpt.CheckpointConfig(root=root, lock=False, loss_watch="off", **extra)


def _twice(
    conf: dckpt.CheckpointConfig,
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    saved: dict[str, torch.Tensor],
    step: int,
    tier: str = "durable",
    before_first: Any = None,
) -> dict[str, Any]:
    """Resume (the state disturbed first), one optimizer step, save ``step`` to ``tier``,
    resume again: what each resume gave."""
    state = dckpt.TrainState(net, opt)
    _disturb(net, opt)
    if before_first is not None:
        before_first()
    with dckpt.CheckpointManager(conf, state) as mgr:
        first = mgr.resume()
        out: dict[str, Any] = {
            "first": (first.step, first.origin or str(first.path)),
            "skipped": [step for step, _ in first.skipped],
            "exact": _same(saved, net, opt),
        }
        _train(net, opt, 100 + step)  # a batch the saved run never saw
        trained = _snap(net, opt)
        mgr.save(step, tier=tier).result()
    out["moved"] = not _same(saved, net, opt)  # the step changed the state
    _disturb(net, opt)
    with dckpt.CheckpointManager(conf, state) as mgr:
        again = mgr.resume()
    out["again"] = (again.step, again.origin or str(again.path))
    out["again_exact"] = _same(trained, net, opt)
    out["again_not_before"] = not _same(saved, net, opt)
    return out


def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def _cases(rank: int, world: int, base: str) -> dict[str, Any]:
    import torch.distributed as dist

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    out: dict[str, Any] = {}

    # durable
    root = Path(base) / "durable"
    net, opt = _net(ddp=True)
    conf = _config(root)
    with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt)) as mgr:
        _train(net, opt, 1)
        mgr.save(1).result()
        saved = _snap(net, opt)
    out["durable"] = _twice(conf, net, opt, saved, 2)

    # memory: from each node's own memory, and from the partner's replica
    for name in ("local", "partner"):
        root = Path(base) / name
        net, opt = _net(ddp=True)
        conf = _config(root / "ckpt", memory=True, memory_dir=root / "mem")
        with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt)) as mgr:
            _train(net, opt, 1)
            mgr.save(1).result()
            _train(net, opt, 2)
            mgr.save(2, tier="memory").result()
            saved = _snap(net, opt)

        def lose(where: Path = root) -> None:
            if rank == 1:
                shutil.rmtree(where / "mem" / "node-1")
            dist.barrier()

        out[name] = _twice(
            conf, net, opt, saved, 3, "memory", before_first=lose if name == "partner" else None
        )

    # a fallback past a damaged step
    root = Path(base) / "fallback"
    net, opt = _net(ddp=True)
    conf = _config(root)
    with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt)) as mgr:
        _train(net, opt, 1)
        mgr.save(1).result()
        saved = _snap(net, opt)
        _train(net, opt, 2)
        mgr.save(2).result()
        damaged = _snap(net, opt)
    if rank == 0:
        _flip(max((root / "step-00000002").glob("*.distcp"), key=lambda p: p.stat().st_size))
    dist.barrier()
    out["fallback"] = _twice(conf, net, opt, saved, 2)
    out["fallback"]["not_damaged"] = not _same(damaged, net, opt)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    base = tmp_path_factory.mktemp("step_after")
    yield base, run_world(_cases, 2, str(base), timeout=240)


@pytest.mark.parametrize(
    ("case", "first", "again"),
    [
        ("durable", (1, "durable/step-00000001"), (2, "durable/step-00000002")),
        ("local", (2, "memory"), (3, "memory")),
        ("partner", (2, "from other nodes' memory"), (3, "memory")),
        ("fallback", (1, "fallback/step-00000001"), (2, "fallback/step-00000002")),
    ],
)
def test_a_step_after_each_resume_is_saved_and_resumed_again_exactly(
    world: tuple[Path, list[dict[str, Any]]], case: str, first: tuple[int, str], again: Any
) -> None:
    for r in world[1]:
        got = r[case]
        assert isinstance(got, dict), got
        assert got["first"][0] == first[0] and first[1] in got["first"][1], got
        assert got["exact"] and got["moved"], got
        assert got["again"][0] == again[0] and again[1] in got["again"][1], got
        assert got["again_exact"] and got["again_not_before"], got
        assert got["skipped"] == ([2] if case == "fallback" else []), got
        if case == "fallback":
            assert got["not_damaged"], got


def test_a_step_after_a_resume_at_another_world_size_is_resumed_again_exactly(
    world: tuple[Path, list[dict[str, Any]]],
) -> None:
    """The durable case's root (steps 1 and 2, saved at world size 2) resumed in this
    process at world size 1."""
    base, results = world
    assert isinstance(results[0]["durable"], dict), results[0]
    root = base / "durable"
    net, opt = _net(ddp=False)
    with dckpt.CheckpointManager(_config(root), dckpt.TrainState(net, opt)) as mgr:
        mgr.resume()
        saved = _snap(net, opt)  # what world size 2 saved (its exactness: the world's case)
    got = _twice(_config(root), net, opt, saved, 3)
    assert got["first"][0] == 2 and got["exact"] and got["moved"], got
    assert got["again"][0] == 3 and got["again_exact"] and got["again_not_before"], got


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


def test_a_step_after_an_s3_resume_is_saved_and_resumed_again_exactly(
    s3: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3.bucket()}/run"
    net, opt = _net(ddp=False)
    with dckpt.CheckpointManager(
        _config(url, mirror=tmp_path / "node-a"), dckpt.TrainState(net, opt)
    ) as mgr:
        _train(net, opt, 1)
        mgr.save(1).result()
        saved = _snap(net, opt)
    mirrors = iter(("node-b", "node-c"))  # each manager a node of its own: read from the bucket

    got = {}
    state = dckpt.TrainState(net, opt)
    _disturb(net, opt)
    with dckpt.CheckpointManager(_config(url, mirror=tmp_path / next(mirrors)), state) as mgr:
        first = mgr.resume()
        got["first"] = first.step
        got["exact"] = _same(saved, net, opt)
        _train(net, opt, 102)
        trained = _snap(net, opt)
        mgr.save(2).result()
    _disturb(net, opt)
    with dckpt.CheckpointManager(_config(url, mirror=tmp_path / next(mirrors)), state) as mgr:
        again = mgr.resume()
    assert got["first"] == 1 and got["exact"], got
    assert again.step == 2 and _same(trained, net, opt), again
    assert not _same(saved, net, opt)
