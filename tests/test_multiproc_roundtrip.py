"""Multi-process tier: real ranks on gloo save and load sharded DDP and FSDP2 state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from torch import nn

pytestmark = pytest.mark.multiproc


def _build(rank: int, parallel: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
    )
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer, unsharded, by a flat name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            flat[prefix] = obj.detach().clone()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        elif isinstance(obj, (int, float)):
            flat[prefix] = torch.tensor(obj)

    walk("model", msd)
    walk("optim", osd)
    return flat


def _roundtrip(rank: int, world: int, root: str, parallel: str) -> dict[str, Any]:
    import dckpt

    model, opt = _build(rank, parallel)
    state = dckpt.TrainState(model, opt)
    with dckpt.CheckpointManager(root, state) as mgr:
        saved = mgr.save(7).result()  # committed before the weights are disturbed
        before = _full_state(model, opt)
        with torch.no_grad():  # disturb weights and optimizer state
            for p in model.parameters():
                p.mul_(-3.0).add_(1.0)
        opt.zero_grad()
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        assert any(not torch.equal(before[k], v) for k, v in _full_state(model, opt).items())
        loaded = mgr.load()
        after = _full_state(model, opt)
    assert loaded.step == 7 and state.step == 7
    assert before.keys() == after.keys()
    mismatched = [k for k in before if not torch.equal(before[k], after[k])]
    assert not mismatched, f"not bit-exact after load: {mismatched[:5]}"
    return {"files": saved.files, "verified": loaded.files_verified, "tensors": len(before)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_roundtrip_is_bit_exact(tmp_path: Path, world: int, parallel: str) -> None:
    results = run_world(_roundtrip, world, str(tmp_path), parallel)
    assert results[0]["tensors"] > 10
    step_dir = tmp_path / "step-00000007"
    import dckpt.root.manifest as mf

    manifest = mf.read_manifest(step_dir)
    names = {f.path for f in manifest.files}
    # One shard file per rank with its item digests beside it, plus DCP's metadata, each
    # with a digest.
    shards = {f"__{r}_0.distcp" for r in range(world)}
    assert names == {".metadata"} | shards | {f"{s}.items" for s in shards}
    assert {f.rank for f in manifest.files} == set(range(world))
    assert manifest.world_size == world
    assert sorted(os.listdir(step_dir)) == sorted([*names, "manifest.json"])
    assert (tmp_path / "latest").read_text().strip() == "step-00000007"
    assert all(r["verified"] == len(names) for r in results)


def _load_expect_integrity_error(rank: int, world: int, root: str) -> str:
    import dckpt

    model, opt = _build(rank, "ddp")
    with dckpt.CheckpointManager(root, dckpt.TrainState(model, opt)) as mgr:
        try:
            mgr.load()
        except dckpt.IntegrityError as exc:
            return str(exc)
    raise AssertionError("load() accepted a corrupted checkpoint")


def _save_only(rank: int, world: int, root: str, step: int) -> None:
    import dckpt

    model, opt = _build(rank, "ddp")
    with dckpt.CheckpointManager(root, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(step)


def test_flipped_byte_in_any_shard_fails_load_naming_the_file(tmp_path: Path) -> None:
    run_world(_save_only, 2, str(tmp_path), 3)
    step_dir = tmp_path / "step-00000003"
    for name in ["__0_0.distcp", "__1_0.distcp", ".metadata"]:
        path = step_dir / name
        original = path.read_bytes()
        corrupted = bytearray(original)
        corrupted[len(corrupted) // 3] ^= 0x10
        path.write_bytes(bytes(corrupted))
        messages = run_world(_load_expect_integrity_error, 2, str(tmp_path))
        for msg in messages:
            assert name in msg and "digest mismatch" in msg, msg
        path.write_bytes(original)


def _save_another_step_per_rank(rank: int, world: int, root: str) -> str:
    import dckpt

    model, opt = _build(rank, "ddp")
    state = dckpt.TrainState(model, opt)
    try:
        with dckpt.CheckpointManager(root, state) as mgr:
            mgr.save(10 + rank).result()  # a script bug: each rank passes its own step
    except dckpt.SaveError as exc:
        return str(exc)
    return "saved"


def test_ranks_that_pass_different_steps_to_save_are_refused_and_nothing_is_committed(
    tmp_path: Path,
) -> None:
    from dckpt.root.layout import committed_steps

    errors = run_world(_save_another_step_per_rank, 2, str(tmp_path))
    for error in errors:
        assert "save() was called with different steps or tiers on different ranks" in error
        assert "rank 0: 10 (durable), rank 1: 11 (durable)" in error
    assert committed_steps(tmp_path) == []
