"""The CUDA path: device staging, the snapshot guarantee on a GPU, NCCL and mixed groups.

Skipped without a CUDA device (CI has none); ``bench/gpu_checks.sh`` runs this file on a GPU
machine with world size 1 (one GPU: NCCL refuses two ranks on one device).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import crash_and_resume_matches
from dist_harness import run_world
from torch import nn

import dckpt
from dckpt.root.manifest import read_manifest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _model(width: int = 512, layers: int = 4) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(64, 512, device="cuda")).square().mean().backward()
    opt.step()


def _values(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.detach().clone() for v in st.values() if torch.is_tensor(v)]
    return out


def _save_train_load(root: Path, budget: int | None) -> dict[str, float]:
    """Save, then at once train and edit in place without waiting; the checkpoint must hold
    the values of save() time. Returns the manifest's staging figures."""
    model, opt = _model()
    config = dckpt.CheckpointConfig(root=root, device_staging_bytes=budget)
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        expected = _values(model, opt)
        handle = mgr.save(1)
        for _ in range(3):
            _step(model, opt)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1000.0)
        result = handle.result()
        now = _values(model, opt)
        assert not all(torch.equal(a, b) for a, b in zip(expected, now, strict=True))
        mgr.load(step=1)
        loaded = _values(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(expected, loaded, strict=True))
    return read_manifest(result.path).timings


def test_device_snapshot_holds_save_time_values_while_training_goes_on(tmp_path: Path) -> None:
    timings = _save_train_load(tmp_path, None)
    assert timings["staged_device_bytes"] > 0 and timings["staged_pinned_bytes"] == 0
    assert timings["drain_s"] > 0 and timings["device_copy_s"] > 0


def test_what_does_not_fit_the_budget_goes_device_to_host(tmp_path: Path) -> None:
    one_layer = 512 * 512 * 4 + 512 * 4
    timings = _save_train_load(tmp_path / "part", 2 * one_layer)
    assert 0 < timings["staged_device_bytes"] <= 2 * one_layer
    assert timings["staged_pinned_bytes"] > 0
    timings = _save_train_load(tmp_path / "off", 0)
    assert timings["staged_device_bytes"] == 0 and timings["staged_pinned_bytes"] > 0


def test_staging_buffers_are_allocated_once_and_reused(tmp_path: Path) -> None:
    model, opt = _model()
    with dckpt.CheckpointManager(tmp_path, dckpt.TrainState(model, opt)) as mgr:
        first = read_manifest(mgr.save(1).result().path).timings
        _step(model, opt)
        expected = _values(model, opt)
        second = read_manifest(mgr.save(2).result().path).timings
        mgr.load(step=2)
        assert all(torch.equal(a, b) for a, b in zip(expected, _values(model, opt), strict=True))
    assert first["staging_alloc_bytes"] > 0 and first["staging_alloc_s"] > 0
    assert second["staging_alloc_bytes"] == 0


def _fsdp_overlap(rank: int, world: int, root: str) -> dict[str, Any]:
    """FSDP2 on CUDA with overlap and no device budget: the deferred device-to-host copy
    path, whose version-counter guard once refused every save (a false alarm)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    config = dckpt.CheckpointConfig(root=Path(root), overlap_staging=True, device_staging_bytes=0)
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        for step in (1, 2):
            _step(model, opt)
            expected = [t.full_tensor() for t in model.state_dict().values()]
            handle = mgr.save(step)
            _step(model, opt)  # held back by the pre-hook until the copy is taken
            handle.result()
        mgr.load(step=2)
        loaded = [t.full_tensor() for t in model.state_dict().values()]
    return {"exact": all(torch.equal(a, b) for a, b in zip(expected, loaded, strict=True))}


def test_fsdp2_with_overlap_commits_the_save_time_state(tmp_path: Path) -> None:
    (result,) = run_world(_fsdp_overlap, 1, str(tmp_path), backend="nccl")
    assert result["exact"]


def _mixed_group(rank: int, world: int, root: str) -> dict[str, Any]:
    _, _, device = dckpt.init_distributed()
    model, opt = _model()
    with dckpt.CheckpointManager(root, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1).result()
    with dckpt.CheckpointManager(root, dckpt.TrainState(model, opt)) as mgr:
        report = mgr.resume()
    return {"device": str(device), "checks": [(c.name, c.ok) for c in report.checks]}


def test_a_cpu_gloo_cuda_nccl_group_trains_on_the_gpu(tmp_path: Path) -> None:
    (result,) = run_world(_mixed_group, 1, str(tmp_path), backend="cpu:gloo,cuda:nccl")
    assert result["device"] == "cuda:0"
    assert ("warmup all-reduce", True) in result["checks"]


@pytest.mark.multiproc
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_crashed_and_resumed_gpu_run_equals_uninterrupted_run(
    tmp_path: Path, parallel: str
) -> None:
    crash_and_resume_matches(tmp_path, ["--parallel", parallel], nproc=1)


def test_value_checks_on_the_gpu_see_save_time_values(tmp_path: Path) -> None:
    """A NaN written into a weight right after save() returned is not what the check sees
    (its kernels were queued on the training stream inside save()); one there before is."""
    from dckpt.storage.tensor_digest import fingerprint as _fingerprint

    model, opt = _model()
    weight = next(model.parameters())
    # integer sums are exact: the GPU fingerprint equals the same one computed on the host
    assert _fingerprint(weight).tolist() == _fingerprint(weight.detach().cpu()).tolist()
    config = dckpt.CheckpointConfig(root=tmp_path, async_save=True)
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        handle = mgr.save(1)
        with torch.no_grad():
            weight[0, 0] = float("nan")  # after save(): must not fail save 1
        handle.result()
        with pytest.raises(dckpt.SaveError, match=r"0\.weight on rank 0: NaN or Inf"):
            mgr.save(2).result()
        with pytest.raises(dckpt.SaveError):
            mgr.wait()
    assert read_manifest(tmp_path / "step-00000001").finite


@pytest.mark.parametrize(
    ("budget", "phase"),
    [(None, "prepare"), (None, "stage"), (0, "prepare")],
    ids=["device-buffer", "drain-to-pinned", "pinned"],
)
def test_a_falsified_gpu_staging_copy_is_refused_and_a_clean_one_commits(
    tmp_path: Path, budget: int | None, phase: str
) -> None:
    """The capture check on the GPU (issue 53): each tensor's fingerprint queued on the
    training stream in save() against the same fingerprint of the host bytes written. A
    device buffer not refreshed (prepare), a drain to pinned memory cut short (stage), a
    pinned copy changed after it was made: each save is refused naming the tensor; the saves
    around them commit, and the manifest counts what was compared."""
    import os

    model, opt = _model()
    config = dckpt.CheckpointConfig(root=tmp_path, async_save=True, device_staging_bytes=budget)
    outcomes = []
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        for step, action in ((1, None), (2, "stale"), (3, "skip"), (4, "torn"), (5, None)):
            _step(model, opt)
            if action is not None:
                os.environ["DCKPT_FAULT"] = f"phase={phase},action={action},step={step}"
            try:
                mgr.save(step).result()
                outcomes.append("committed")
            except dckpt.SaveError as exc:
                outcomes.append(str(exc))
                with pytest.raises(dckpt.SaveError):
                    mgr.wait()
            finally:
                os.environ.pop("DCKPT_FAULT", None)
    assert outcomes[0] == outcomes[4] == "committed", outcomes
    for said in outcomes[1:4]:
        assert "not the state at save()" in said and "on rank 0" in said, said
        assert "g:" in said, said  # the GPU's fingerprint, not a host digest
    assert read_manifest(tmp_path / "step-00000005").capture["items"] > 0
