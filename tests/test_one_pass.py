"""A verified load reads each file once (dckpt/storage/one_pass.py): every byte from the
storage a single time, hashed in order, large tensors read straight into the state, and a
file that fails its digest leaves nothing committed: its non-tensor values are never applied,
the load fails naming the file, and a load of a good checkpoint afterwards restores the whole
state bit for bit."""

from __future__ import annotations

import errno
import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

import dckpt
from dckpt.errors import IntegrityError, StorageError, unwrap_dcp_error
from dckpt.root.manifest import read_manifest
from dckpt.storage import one_pass
from dckpt.storage.verifying_reader import SafeLoadPlanner, VerifyingReader

DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex64,
)


def _state(dtype: torch.dtype, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(1024, 1200, generator=g)  # > 1 MiB in every dtype: read into the tensor
    small = torch.randn(7, 5, generator=g)  # read into memory
    if dtype == torch.bool:
        big, small = big > 0, small > 0
    elif dtype.is_complex:
        big, small = torch.complex(big, -big).to(dtype), torch.complex(small, small).to(dtype)
    elif not dtype.is_floating_point:
        big, small = (big * 50).to(dtype), (small * 50).to(dtype)
    else:
        big, small = big.to(dtype), small.to(dtype)
    return {"big": big, "small": small, "steps": {"count": seed, "name": f"run-{seed}"}}


def _save(root: Path, state: dict[str, Any], step: int) -> Path:
    holder = _Holder(state)
    cfg = dckpt.CheckpointConfig(root=root, lock=False, keep_last=10, async_save=False)
    state_ = dckpt.TrainState(nn.Linear(2, 2), extra={"holder": holder})
    with dckpt.CheckpointManager(cfg, state_) as mgr:
        mgr.save(step).result()
    return root / f"step-{step:08d}"


class _Holder:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state.update(sd)


def _load(step_dir: Path, into: dict[str, Any]) -> VerifyingReader:
    manifest = read_manifest(step_dir)
    reader = VerifyingReader(step_dir, manifest.file_map(), versions=manifest.versions)
    reader.load_metadata()
    try:
        dcp_load(into, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        raise unwrap_dcp_error(exc) from None  # dckpt's own error, as a load raises it
    return reader


def _targets(dtype: torch.dtype) -> dict[str, Any]:
    zero = _state(dtype, 0)
    return {
        "extra": {
            "holder": {
                "big": torch.zeros_like(zero["big"]),
                "small": torch.zeros_like(zero["small"]),
                "steps": {"count": -1, "name": "unset"},
            }
        }
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_dtype_is_read_once_into_its_tensor_bit_for_bit(
    tmp_path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _state(dtype, 3)
    step_dir = _save(tmp_path / "ckpt", saved, 1)
    reads: dict[int, int] = {}
    real = os.preadv

    def counting(fd: int, buffers: list[Any], offset: int, *rest: Any) -> int:
        got = real(fd, buffers, offset, *rest)
        reads[fd] = reads.get(fd, 0) + got
        return got

    monkeypatch.setattr(one_pass.os, "preadv", counting)
    into = _targets(dtype)
    target = into["extra"]["holder"]["big"]
    reader = _load(step_dir, into)
    got = into["extra"]["holder"]
    assert got["big"].data_ptr() == target.data_ptr()  # filled in place
    for name in ("big", "small"):
        assert torch.equal(got[name].view(torch.uint8), saved[name].view(torch.uint8)), name
    assert got["steps"] == saved["steps"]
    manifest = read_manifest(step_dir)
    data = [f for f in manifest.files if f.path.endswith(".distcp")]
    # every byte of each data file read once, by the one pass, and hashed
    assert sum(reads.values()) == sum(f.bytes for f in data)
    assert reader.times.bytes_read == sum(f.bytes for f in data)
    assert reader.times.direct_bytes >= saved["big"].numel() * saved["big"].element_size()
    assert {f.path: f.digest for f in data}.items() <= reader.verified.items()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _record_at(path: Path, offset: int, length: int, record: str) -> int:
    """Where ``record`` of the torch.save archive at ``offset`` starts in the file."""
    with open(path, "rb") as f:
        f.seek(offset)
        archive = torch._C.PyTorchFileReader(io.BytesIO(f.read(length)))
    return offset + int(archive.get_record_offset(record))


FLIPS = ["big tensor", "small tensor", "value", "archive header", "end"]


@pytest.mark.parametrize("held", [True, False], ids=["small items held", "budget spent"])
@pytest.mark.parametrize("where", FLIPS)
def test_a_flipped_bit_anywhere_fails_the_load_and_commits_no_value(
    tmp_path: Path, where: str, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not held:  # past the budget a small item is filled as it comes, bounded first
        monkeypatch.setattr(one_pass, "HELD_BUDGET", 0)
    saved = _state(torch.float32, 5)
    step_dir = _save(tmp_path / "ckpt", saved, 1)
    good = _save(tmp_path / "good", _state(torch.float32, 9), 1)
    reader = VerifyingReader(step_dir, read_manifest(step_dir).file_map())
    meta = reader.load_metadata()
    spans = {
        idx.fqn: (info.relative_path, info.offset, info.length)
        for idx, info in meta.storage_data.items()
    }
    name, offset, length = {
        "small tensor": spans["extra.holder.small"],
        "value": spans["extra.holder.steps.count"],
    }.get(where, spans["extra.holder.big"])
    path = step_dir / name
    if where == "small tensor":  # inside its stored bytes
        at = _record_at(path, offset, length, "data/0") + 7
    elif where == "value":  # inside its pickle
        at = _record_at(path, offset, length, "data.pkl") + 5
    else:
        at = {
            "big tensor": offset + length // 2,
            "archive header": offset + 3,  # the zip header placing the tensor, read unproven
            "end": path.stat().st_size - 1,
        }[where]
    _flip(path, at)
    into = _targets(torch.float32)
    with pytest.raises(IntegrityError) as failed:
        _load(step_dir, into)
    assert name in str(failed.value)
    holder = into["extra"]["holder"]
    # a value of the failed file was never applied, nor a held small tensor
    assert holder["steps"] == {"count": -1, "name": "unset"}
    if held:
        assert not holder["small"].any(), "a small tensor was filled from an unproven file"
    if where != "archive header":  # the big tensor went straight in: the error says so
        assert "hold some of this file's bytes" in str(failed.value), str(failed.value)
    # as another rank receives it (DCP gathers failures pickled)
    assert str(pickle.loads(pickle.dumps(failed.value))) == str(failed.value)
    # the state, partly overwritten by the failed file's bytes, is whole again after the
    # next checkpoint loads (what a resume's fallback does)
    _load(good, into)
    want = _state(torch.float32, 9)
    for key in ("big", "small"):
        assert torch.equal(holder[key], want[key]), key
    assert holder["steps"] == want["steps"]


def test_a_read_the_storage_fails_part_way_is_a_storage_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_dir = _save(tmp_path / "ckpt", _state(torch.float32, 6), 1)
    real, calls = os.preadv, [0]

    def failing(fd: int, buffers: list[Any], offset: int, *rest: Any) -> int:
        calls[0] += 1
        if offset > 1 << 20:  # in the middle of the big tensor, on a reader thread
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *rest)

    monkeypatch.setattr(one_pass.os, "preadv", failing)
    into = _targets(torch.float32)
    with pytest.raises(StorageError) as failed:
        _load(step_dir, into)
    text = str(failed.value)
    assert "__0_0.distcp" in text and "Input/output error" in text, text
    assert "hold some of this file's bytes" in text, text
    assert into["extra"]["holder"]["steps"] == {"count": -1, "name": "unset"}


def test_a_tensor_it_cannot_fill_in_place_is_read_the_ordinary_way(tmp_path: Path) -> None:
    saved = _state(torch.float32, 4)
    step_dir = _save(tmp_path / "ckpt", saved, 1)
    into = _targets(torch.float32)
    # a transposed view: not contiguous, so its bytes cannot land in it as stored
    odd = torch.zeros(1200, 1024).t()
    into["extra"]["holder"]["big"] = odd
    reader = _load(step_dir, into)
    assert torch.equal(odd, saved["big"])
    assert reader.times.direct_bytes == 0
    manifest = read_manifest(step_dir)
    data = [f for f in manifest.files if f.path.endswith(".distcp")]
    assert reader.times.bytes_read == sum(f.bytes for f in data)


def test_read_threads_is_a_setting_with_bounds(tmp_path: Path) -> None:
    for bad in (0, 65):
        with pytest.raises(ValueError, match="read_threads"):
            dckpt.CheckpointConfig(root=tmp_path, read_threads=bad)


@pytest.mark.parametrize("read_threads", [1, 4])
def test_a_model_resumes_through_the_manager_bit_for_bit(tmp_path: Path, read_threads: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.LayerNorm(512), nn.Linear(512, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 512)).sum().backward()
    opt.step()
    cfg = dckpt.CheckpointConfig(root=tmp_path / "ckpt", lock=False, read_threads=read_threads)
    with dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1).result()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(512, 512), nn.LayerNorm(512), nn.Linear(512, 8))
    opt2 = torch.optim.AdamW(fresh.parameters())
    with dckpt.CheckpointManager(cfg, dckpt.TrainState(fresh, opt2)) as mgr:
        report = mgr.resume()
    assert report.step == 1
    # the report says where the load's time went
    assert {"read", "hash", "fill", "warmup"} <= set(report.timings), report.timings
    assert "timings       load_and_verify" in report.format()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert opt2.state_dict()["state"][0]["exp_avg"].abs().sum() > 0
