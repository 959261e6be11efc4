"""PrecisionPolicy: autocast keeps weights fp32, fp16 needs a scaler, a cast model is refused,
the FSDP2 mapping, the GradScaler sanity check, and what the manifest records."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import dckpt
from dckpt.train.precision import check_scaler


def test_bf16_autocast_on_cpu_computes_in_bf16_and_keeps_fp32_weights() -> None:
    policy = dckpt.PrecisionPolicy()
    model = nn.Linear(4, 2)
    with policy.autocast("cpu"):
        out = model(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16 and model.weight.dtype == torch.float32
    with dckpt.PrecisionPolicy(mode="fp32").autocast(torch.device("cpu")):
        assert model(torch.randn(3, 4)).dtype == torch.float32


def test_scaler_only_for_fp16_and_fallback_only_where_bf16_is_missing() -> None:
    assert dckpt.PrecisionPolicy(mode="fp16").make_scaler("cpu").is_enabled()
    assert not dckpt.PrecisionPolicy(mode="bf16").make_scaler("cpu").is_enabled()
    policy = dckpt.PrecisionPolicy()
    assert policy.for_device("cpu") is policy  # CPU autocast does bf16
    with pytest.raises(ValueError, match="precision mode must be one of"):
        dckpt.PrecisionPolicy(mode="fp8")


def test_fsdp_mapping_keeps_params_fp32_and_reduces_in_fp32() -> None:
    mp = dckpt.PrecisionPolicy(mode="bf16").fsdp_mixed_precision()
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    mp16 = dckpt.PrecisionPolicy(mode="fp16").fsdp_mixed_precision()
    assert mp16.param_dtype == torch.float16 and mp16.reduce_dtype == torch.float32
    mp32 = dckpt.PrecisionPolicy(mode="fp32").fsdp_mixed_precision()
    assert mp32.param_dtype is None and mp32.reduce_dtype is None


def test_a_model_cast_with_half_is_refused_or_warned(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).half()
    with pytest.raises(ValueError, match=r"4 trainable parameter\(s\) are float16.*\.half\(\)"):
        dckpt.PrecisionPolicy().check_model(model)
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        dckpt.PrecisionPolicy(allow_low_precision_weights=True).check_model(model)
    assert "0.weight" in caplog.text
    dckpt.PrecisionPolicy().check_model(nn.Linear(4, 2))  # fp32: fine
    frozen = nn.Linear(4, 2).half().requires_grad_(False)
    dckpt.PrecisionPolicy().check_model(frozen)  # frozen low-precision weights are not trained


def test_grad_scaler_sanity() -> None:
    assert check_scaler({}) is None  # a disabled scaler
    assert check_scaler({"scale": 65536.0, "_growth_tracker": 3}) is None
    for bad in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(ValueError, match="The run diverged"):
            check_scaler({"scale": bad})
    assert "overflowing" in (check_scaler({"scale": 0.25}) or "")


def test_the_manager_refuses_fp16_without_a_scaler_and_a_half_model(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="fp16 needs a GradScaler"):
        dckpt.CheckpointManager(
            tmp_path, dckpt.TrainState(model), precision=dckpt.PrecisionPolicy(mode="fp16")
        )
    with pytest.raises(ValueError, match="was cast"):
        dckpt.CheckpointManager(
            tmp_path,
            dckpt.TrainState(nn.Linear(4, 2).bfloat16()),
            precision=dckpt.PrecisionPolicy(),
        )


def test_the_manifest_records_the_policy_and_the_scaler_state(tmp_path: Path) -> None:
    from dckpt.root.manifest import read_manifest

    policy = dckpt.PrecisionPolicy(mode="fp16")
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = policy.make_scaler("cpu")
    with policy.autocast("cpu"):
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    state = dckpt.TrainState(model, opt, scaler=scaler)
    with dckpt.CheckpointManager(tmp_path, state, precision=policy) as mgr:
        mgr.save(1).result()
    recorded = read_manifest(tmp_path / "step-00000001").precision
    assert recorded["mode"] == "fp16" and recorded["grad_scaler"] is True
    live = scaler.state_dict()  # the step may or may not have overflowed: compare, not guess
    assert recorded["scaler"] == {"scale": live["scale"], "growth_tracker": live["_growth_tracker"]}

    # A diverged scaler (scale NaN) is refused on resume, with what to do.
    scaler.update(new_scale=float("nan"))
    with dckpt.CheckpointManager(tmp_path, state, precision=policy) as mgr:
        mgr.save(2).result()
    fresh = policy.make_scaler("cpu")
    model2 = nn.Linear(4, 2)
    state2 = dckpt.TrainState(model2, torch.optim.SGD(model2.parameters()), scaler=fresh)
    with dckpt.CheckpointManager(tmp_path, state2, precision=policy) as mgr:
        with pytest.raises(dckpt.StateMismatchError, match="scale is nan"):
            mgr.resume(fallback=False)
        assert mgr.load(1).step == 1
    assert fresh.get_scale() == recorded["scaler"]["scale"]


def _state(scaler: torch.amp.GradScaler | None = None) -> dckpt.TrainState:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler)


def test_resuming_under_another_policy_warns_or_refuses(tmp_path: Path) -> None:
    bf16, fp32, fp16 = (dckpt.PrecisionPolicy(mode=m) for m in ("bf16", "fp32", "fp16"))
    with dckpt.CheckpointManager(tmp_path, _state(), precision=bf16) as mgr:
        mgr.save(1).result()
    with dckpt.CheckpointManager(tmp_path, _state(), precision=fp32) as mgr:
        report = mgr.resume()
    assert report.step == 1
    assert any("precision changed from bf16 to fp32" in w for w in report.warnings)
    state16 = _state(fp16.make_scaler("cpu"))
    with (
        dckpt.CheckpointManager(tmp_path, state16, precision=fp16) as mgr,
        pytest.raises(dckpt.ConfigMismatchError, match="without GradScaler state"),
    ):
        mgr.resume()
    assert (tmp_path / "step-00000001").is_dir()  # refused, not quarantined


def test_bf16_falls_back_to_fp16_with_a_warning_on_a_gpu_without_bf16(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # No such GPU here: the decision is checked with CUDA's two answers stubbed.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "Tesla V100")
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        policy = dckpt.PrecisionPolicy().for_device("cuda")
    assert policy.mode == "fp16" and policy.needs_scaler
    assert policy.describe()["requested"] == "bf16"
    assert "Tesla V100 has no bfloat16 support" in caplog.text
    assert dckpt.PrecisionPolicy(mode="fp32").for_device("cuda").mode == "fp32"
