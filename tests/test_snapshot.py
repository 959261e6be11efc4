"""The snapshot guarantee on real gloo ranks: a checkpoint holds the state of save() time.

Right after ``save()`` returns, the training loop changes the state: an optimizer step, an
in-place edit of the parameters (through the parameter, through ``.data``, or through an
FSDP2 parameter's local shard). By default every committed checkpoint must hold exactly the
values of ``save()`` time. With ``overlap_staging=True`` (copies taken after ``save()``
returned), the checkpoint must hold them too, or the save must fail loudly: never commit a mix.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import tiny_training
import torch
from dist_harness import run_world
from tiny_training import full_state as _flat
from torch import nn

pytestmark = pytest.mark.multiproc

WIDTH = 64


def _model(parallel: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    return tiny_training.model(parallel, WIDTH)


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    tiny_training.step(model, opt, seed, WIDTH)


def _change(model: nn.Module, opt: torch.optim.Optimizer, how: str) -> None:
    """What a training loop does right after save() returned."""
    from torch.distributed.tensor import DTensor

    if how == "step":  # the next step: forward (BatchNorm statistics), backward, optimizer
        _step(model, opt, seed=2)
        return
    with torch.no_grad():
        for p in model.parameters():
            if how == "inplace":
                p.add_(1000.0)
            elif how == "data":
                p.data.add_(1000.0)
            elif how == "local":  # an FSDP2 parameter's shard, as its own tensor
                (p.to_local() if isinstance(p, DTensor) else p).add_(1000.0)


def _save_then_change(
    rank: int, world: int, root: str, parallel: str, how: str, overlap: bool
) -> dict[str, Any]:
    import dckpt

    model, opt = _model(parallel)
    _step(model, opt, seed=1)
    config = dckpt.CheckpointConfig(root=Path(root), overlap_staging=overlap, timeout_s=60)
    outcome: dict[str, Any] = {"error": None}
    gate = Path(root).parent / f"{Path(root).name}-copy-{rank}"
    if overlap:  # the background copies wait until the change below was made (see the test)
        os.environ["DCKPT_FAULT"] = f"phase=stage,action=wait,path={gate},seconds=300,step=1"
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        before = _flat(model, opt)
        handle = mgr.save(1)
        if how == "step":  # the optimizer's pre-hook holds this step until the copies are
            threading.Timer(1.0, gate.touch).start()  # taken: they may not wait for it
        _change(model, opt, how)
        gate.touch()
        changed = _flat(model, opt)
        assert any(not torch.equal(before[k], changed[k]) for k in before), "nothing changed"
        try:
            handle.result()
        except dckpt.SaveError as exc:
            outcome["error"] = str(exc)
            with pytest.raises(dckpt.SaveError):
                mgr.wait()  # latched for the next call too; raised once
            return outcome
        mgr.load(step=1)
        loaded = _flat(model, opt)
    outcome["wrong"] = [k for k in before if not torch.equal(before[k], loaded[k])]
    outcome["staged"] = handle.result().bytes
    return outcome


def _each_change(
    rank: int, world: int, root: str, parallel: str, hows: list[str], overlap: bool
) -> dict[str, dict[str, Any]]:
    """``_save_then_change`` once per change, each into a root of its own, in one world."""
    return {
        how: _save_then_change(rank, world, f"{root}/{how}", parallel, how, overlap) for how in hows
    }


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_by_default_a_checkpoint_holds_the_state_of_save_time(
    tmp_path: Path, parallel: str
) -> None:
    hows = ["step", "inplace", "data", "local"]
    for per_rank in run_world(_each_change, 2, str(tmp_path), parallel, hows, False):
        for how, r in per_rank.items():
            assert r["error"] is None, (how, r["error"])
            assert r["wrong"] == [], f"{how}: changes made after save() reached the checkpoint"


# With overlap, the copies are taken in the background; the fault makes them wait until the
# change was made, so it always lands before them, however slow the machine. An optimizer step
# is held back by the pre-hook (its copies wait a second instead: the step waits for them); an
# in-place edit through the parameter or its local shard is caught by version counters.
# (A write through .data bypasses every version counter: the documented limit of overlap.)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_with_overlap_a_checkpoint_is_the_save_time_state_or_the_save_fails(
    tmp_path: Path, parallel: str
) -> None:
    hows = ["step", "inplace", "local"]
    results = run_world(_each_change, 2, str(tmp_path), parallel, hows, True, timeout=300)
    from dckpt.root.layout import committed_steps

    for per_rank in results:
        assert per_rank["step"]["error"] is None and per_rank["step"]["wrong"] == []
        for how in ("inplace", "local"):
            error = per_rank[how]["error"]
            assert error is not None, f"{how}: a torn snapshot was committed: {per_rank[how]}"
            assert "changed in place after save() returned" in error, error
    assert committed_steps(tmp_path / "step") == [1]
    for how in ("inplace", "local"):
        assert committed_steps(tmp_path / how) == []
        assert not list((tmp_path / how).glob("*.tmp-*"))


def _three_saves(rank: int, world: int, root: str, parallel: str) -> dict[str, Any]:
    """Three saves, each followed at once by an in-place edit; each must load back exactly."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import dckpt
    from dckpt.root.manifest import read_manifest

    model, opt = _model(parallel)
    seen: list[dict[str, Any]] = []
    expected: dict[int, dict[str, torch.Tensor]] = {}
    config = dckpt.CheckpointConfig(root=Path(root), timeout_s=60)
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        for step in (1, 2, 3):
            _step(model, opt, seed=10 + step)
            expected[step] = _flat(model, opt)
            handle = mgr.save(step)
            _change(model, opt, "inplace")
            path = handle.result().path
            seen.append(dict(read_manifest(path).timings))
        for step, values in expected.items():
            mgr.load(step=step)
            loaded = _flat(model, opt)
            assert all(torch.equal(values[k], loaded[k]) for k in values), f"step {step}"
        msd, osd = get_state_dict(model, opt)
    tensors = [*msd.values(), *(v for st in osd["state"].values() for v in st.values())]
    replicated = sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
    return {"timings": seen, "replicated": replicated}


def test_later_saves_copy_only_what_this_rank_writes(tmp_path: Path) -> None:
    """DDP: DCP gives each replicated tensor to one rank. The first save copies everything on
    every rank; later saves copy only the tensors the previous plan gave this rank."""
    result = run_world(_three_saves, 2, str(tmp_path), "ddp")[0]
    first, second, third = (t["staged_host_bytes"] for t in result["timings"])
    # Both ranks copy every replicated byte once, then each only its share (per-rank RNG
    # states are copied by each rank every time): the second save copies one set fewer.
    assert first - second == result["replicated"], (first, second, result["replicated"])
    assert second == third
    assert all(t.get("staged_deferred_bytes", 0) == 0 for t in result["timings"])


def test_fsdp2_saves_in_a_row_each_hold_their_own_step(tmp_path: Path) -> None:
    run_world(_three_saves, 2, str(tmp_path), "fsdp")
