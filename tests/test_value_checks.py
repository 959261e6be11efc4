"""What a save checks of the values themselves: replicas that agree across real gloo ranks,
finite tensors, and non-tensor values snapshotted at ``save()`` time.

Every test saves for real (DCP, the hashing writer, the commit) and reads the root back; the
replica tests run two ranks under DDP, where every parameter is a replica DCP keeps once.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from torch import nn

from dckpt.root.layout import committed_steps, read_latest, step_dir_name
from dckpt.root.manifest import read_manifest


def _ddp(width: int = 32) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, width), nn.Linear(width, 4)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()


def _replicas(rank: int, world: int, root: str, asynchronous: bool) -> dict[str, Any]:
    import dckpt

    model, opt = _ddp()
    weight = model.module[1].weight
    config = dckpt.CheckpointConfig(root=Path(root), async_save=asynchronous, timeout_s=60)
    out: dict[str, Any] = {}
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        _step(model, opt, 1)
        mgr.save(1).result()  # equal replicas: saved (and DCP's plan is learned)
        _step(model, opt, 2)
        good = weight.detach().clone()
        if rank == 1:  # after DDP's broadcast, as a faulty device would: only rank 1's copy
            with torch.no_grad():
                weight[0, 0] += 0.5
        out["error"] = None
        try:
            mgr.save(2).result()
        except dckpt.SaveError as exc:
            out["error"] = str(exc)
        with contextlib.suppress(dckpt.SaveError):
            mgr.wait()  # the failure is latched for the next call once: taken here
        with torch.no_grad():
            weight.copy_(good)  # the replicas agree again: the next save commits
        mgr.save(3).result()
        if rank == 1:
            with torch.no_grad():
                weight[0, 0] += 0.5
    warn = dckpt.CheckpointConfig(root=Path(root), replica_check="warn", timeout_s=60)
    with dckpt.CheckpointManager(warn, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(4).result()  # committed, marked
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("asynchronous", [True, False])
def test_replicas_that_differ_fail_the_save_on_every_rank_and_commit_nothing(
    tmp_path: Path, asynchronous: bool
) -> None:
    results = run_world(_replicas, 2, str(tmp_path), asynchronous)
    for r in results:
        error = r["error"]
        assert error is not None, "the save of differing replicas committed"
        assert "save of step 2 failed, nothing was committed" in error
        assert "model.1.weight" in error and "replicated value(s) differ" in error
        # which ranks hold which copy: one digest each
        assert "ranks [0] hold x:" in error and "ranks [1] hold x:" in error
        assert "model.1.bias" not in error  # only the value that differs is named
    assert committed_steps(tmp_path) == [1, 3, 4]
    assert not (tmp_path / step_dir_name(2)).exists()
    assert read_manifest(tmp_path / step_dir_name(3)).integrity == {}
    marked = read_manifest(tmp_path / step_dir_name(4)).integrity
    assert list(marked) == ["replicas_differ"]
    assert list(marked["replicas_differ"]) == ["model.1.weight"]
    holders = marked["replicas_differ"]["model.1.weight"]
    assert sorted(holders.values()) == [[0], [1]]


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_nan_weight_fails_its_save_and_latest_keeps_the_finite_step(
    tmp_path: Path, dtype: torch.dtype, asynchronous: bool
) -> None:
    # bf16 is the default precision, fp16 the scaler's: a model kept in either is checked as
    # an fp32 one is; a synchronous save (a preemption's final one) checks the live tensors,
    # an asynchronous one its staged copies
    import dckpt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = dckpt.CheckpointConfig(root=tmp_path, keep_last=2, async_save=asynchronous)
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1).result()
        with torch.no_grad():
            model[1].weight[2, 3] = float("nan")
            model[0].bias[0] = float("-inf")
        with pytest.raises(dckpt.SaveError) as raised:
            mgr.save(2).result()
        if asynchronous:
            with pytest.raises(dckpt.SaveError):
                mgr.wait()  # a background failure is latched for the next call, raised once
        mgr.wait()  # then nothing more (a synchronous save raised it in save() itself)
    said = str(raised.value)
    assert "model.1.weight on rank 0: 1 NaN, 0 Inf of 64 values" in said
    assert "model.0.bias on rank 0: 0 NaN, 1 Inf of 16 values" in said
    assert "allow_nonfinite=True" in said and "nothing was committed" in said
    assert committed_steps(tmp_path) == [1]
    assert read_latest(tmp_path) == step_dir_name(1)


def test_allow_nonfinite_saves_marks_and_retention_keeps_the_newest_finite_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    import dckpt

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    state = dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    config = dckpt.CheckpointConfig(root=tmp_path, keep_last=2, allow_nonfinite=True)
    with dckpt.CheckpointManager(config, state) as mgr:
        mgr.save(1).result()
        mgr.save(2).result()
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
        for step in (3, 4, 5):
            mgr.save(step).result()
    # keep_last=2 keeps 4 and 5 (NaN); 2, the newest finite step, stays beside them
    assert committed_steps(tmp_path) == [2, 4, 5]
    assert read_manifest(tmp_path / step_dir_name(2)).finite
    marked = read_manifest(tmp_path / step_dir_name(5))
    assert not marked.finite
    assert marked.integrity["nonfinite"] == {"model.weight": "1 NaN, 0 Inf of 32 values"}
    assert "committed with non-finite values (allow_nonfinite): model.weight" in caplog.text
    assert "newest finite" in caplog.text
    from dckpt.cli import main

    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--json"]) == 0
    shown = {r["step"]: r["marks"] for r in json.loads(capsys.readouterr().out)}
    assert shown == {2: {}, 4: marked.integrity, 5: marked.integrity}
    assert main(["ls", str(tmp_path)]) == 0
    assert "NaN/Inf" in capsys.readouterr().out


class _Counter:
    """A stateful whose state_dict hands out its own live dict and list (no copy)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"seen": [1, 2, 3], "meta": {"epoch": 1}, "count": 3}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state = sd


def test_non_tensor_values_are_saved_as_they_were_at_save_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dckpt

    # The background is held before it writes a byte, until the loop has changed the values.
    go = tmp_path / "go"
    monkeypatch.setenv("DCKPT_FAULT", f"phase=make_tmp,action=wait,path={go},seconds=300,step=1")
    model = nn.Linear(4, 2)
    counter = _Counter()
    state = dckpt.TrainState(model, extra={"counter": counter})
    config = dckpt.CheckpointConfig(root=tmp_path / "ckpt", async_save=True)
    with dckpt.CheckpointManager(config, state) as mgr:
        handle = mgr.save(1)
        assert not handle.done()
        counter.state["seen"].append(4)
        counter.state["meta"]["epoch"] = 2
        counter.state["count"] = 4
        go.touch()
        handle.result()
        counter.state = {"seen": [9], "meta": {"epoch": 9}, "count": 9}  # a load fills these keys
        mgr.load()
    assert counter.state == {"seen": [1, 2, 3], "meta": {"epoch": 1}, "count": 3}


def test_the_checks_compare_digests_made_the_same_way_only() -> None:
    from dckpt.save.findings import Findings, judge

    same = Findings(replicas={"w": "x:aa", "b": "x:bb"})
    gpu = Findings(replicas={"w": "g:cc", "b": "x:bb"})
    assert judge([(0, same), (1, gpu)], step=1, replica_check="error", allow_nonfinite=False) == (
        judge([], step=1, replica_check="error", allow_nonfinite=False)
    )
    odd = Findings(replicas={"w": "x:ab", "b": "x:bb"})
    verdict = judge(
        [(0, same), (1, same), (2, odd)], step=1, replica_check="error", allow_nonfinite=False
    )
    assert verdict.refusal is not None
    assert "w (ranks [0, 1] hold x:aa; ranks [2] hold x:ab)" in verdict.refusal
    off = judge([(0, same), (2, odd)], step=1, replica_check="off", allow_nonfinite=False)
    assert off.refusal is None and off.marks == {}


def test_a_gpu_fingerprint_sees_one_changed_bit_and_a_swap() -> None:
    from dckpt.storage.tensor_digest import fingerprint as _fingerprint

    torch.manual_seed(0)
    t = torch.randn(3000, 7)
    base = _fingerprint(t).tolist()
    assert _fingerprint(t.clone()).tolist() == base
    flipped = t.clone()
    flipped.view(torch.int32)[1234, 5] ^= 1 << 7
    assert _fingerprint(flipped).tolist() != base
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert _fingerprint(swapped).tolist()[1] != base[1]
    odd = torch.randn(101, dtype=torch.bfloat16)[1:]  # a byte offset of 2: summed bytewise
    assert _fingerprint(odd).numel() == 2
    assert not math.isnan(float(_fingerprint(t.to(torch.bfloat16))[0]))


def _memory_replicas(rank: int, world: int, base: str) -> dict[str, Any]:
    import dckpt

    model, opt = _ddp()
    root, memory = Path(base) / "ckpt", Path(base) / "mem"
    config = dckpt.CheckpointConfig(root=root, memory=True, memory_dir=memory, timeout_s=60)
    out: dict[str, Any] = {}
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1).result()
        for step in (2, 3):  # the second memory save has each rank copy only its share
            _step(model, opt, step)
            mgr.save(step, tier="memory").result()
        if rank == 1:
            with torch.no_grad():
                model.module[0].weight[1, 1] += 1.0
        try:
            mgr.save(4, tier="memory").result()
        except dckpt.SaveError as exc:
            out["replicas"] = str(exc)
        with torch.no_grad():
            model.module[0].weight.fill_(float("nan"))  # on every rank alike
        try:
            mgr.save(5, tier="memory").result()
        except dckpt.SaveError as exc:
            out["nan"] = str(exc)
    return out


@pytest.mark.multiproc
def test_the_memory_tier_makes_the_same_checks(tmp_path: Path) -> None:
    from dckpt.root.memory_ledger import DirectoryLedger

    results = run_world(_memory_replicas, 2, str(tmp_path))
    for r in results:
        assert "model.0.weight" in r["replicas"] and "replicated value(s) differ" in r["replicas"]
        assert "ranks [0] hold x:" in r["replicas"] and "ranks [1] hold x:" in r["replicas"]
        assert "model.0.weight on rank" in r["nan"] and "256 NaN, 0 Inf of 256" in r["nan"]
    assert DirectoryLedger(tmp_path / "ckpt").steps() == [2, 3]


def test_equal_non_tensor_values_give_one_digest_whatever_their_pickle() -> None:
    import subprocess
    import sys

    from dckpt.save.value_checks import value_digest

    # a tensor pickles with its storage's identity; equal tuples of tensors must still agree
    assert value_digest((torch.ones(2), 3)) == value_digest((torch.ones(2), 3))
    assert value_digest((torch.ones(2), 3)) != value_digest((torch.zeros(2), 3))
    shared = "x" * 40
    assert value_digest([shared, shared]) == value_digest(["x" * 40, "y"[:0] + "x" * 40])
    assert value_digest({"b": 1, "a": 2}) == value_digest({"a": 2, "b": 1})
    assert value_digest({"a": 1}) != value_digest({"a": 1.0})
    # a set iterates in hash-seed order: two processes with other seeds must agree
    code = (
        "from dckpt.save.value_checks import value_digest; "
        "print(value_digest({'lr', 'wd', 'beta', 'eps'}))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(seen) == 1


_FLOAT_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.complex64,
    torch.complex128,
]


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES, ids=str)
def test_every_floating_dtype_has_its_nan_and_inf_found_and_a_finite_tensor_passes(
    dtype: torch.dtype,
) -> None:
    from dckpt.save.value_checks import Inspection

    values = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
    if dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        values = {"nan": float("nan")}  # no infinity in these: an Inf becomes their NaN
    checks = Inspection(replicas=False, finite=True)
    for what, bad in values.items():
        t = torch.linspace(-2, 2, 16).to(dtype)
        t[5] = bad
        checks.host(what, t, replica=None, finite=True)
    checks.host("finite", torch.linspace(-2, 2, 16).to(dtype), replica=None, finite=True)
    checks.host("integers", torch.arange(16), replica=None, finite=True)  # no NaN to have
    found = checks.findings()
    assert set(found.nonfinite) == set(values) and found.unchecked == (), found
    assert found.nonfinite["nan"] == "1 NaN, 0 Inf of 16 values", found


def test_float8_complex_and_misaligned_views_are_checked() -> None:
    from dckpt.save.value_checks import Inspection
    from dckpt.storage.tensor_digest import fingerprint as _fingerprint

    checks = Inspection(replicas=True, finite=True)
    f8 = torch.zeros(8).to(torch.float8_e5m2)
    f8[3] = float("inf")
    z = torch.zeros(4, dtype=torch.complex64)
    z[1] = complex(float("nan"), 0.0)
    checks.host("f8", f8, replica=None, finite=True)
    checks.host("z", z, replica=None, finite=True)
    found = checks.findings()
    assert set(found.nonfinite) == {"f8", "z"} and found.unchecked == ()
    base = torch.randn(101, dtype=torch.bfloat16)
    # one value at two byte offsets (2 and 0): one fingerprint
    assert _fingerprint(base[1:]).tolist() == _fingerprint(base[1:].clone()).tolist()
    sparse = torch.eye(3).to_sparse()
    checks.host("sparse", sparse, replica="sparse", finite=True)
    assert checks.findings().unchecked == ("sparse",)


def _dtensor_replicas(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dckpt

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(4, 4)

    class Holder:
        def __init__(self) -> None:
            self.rep = distribute_tensor(full, mesh, [Replicate()])
            self.shard = distribute_tensor(full, mesh, [Shard(0)])

        def state_dict(self) -> dict[str, Any]:
            return {"rep": self.rep, "shard": self.shard}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    holder = Holder()
    model = nn.Linear(2, 2)
    torch.manual_seed(0)
    model.reset_parameters()
    state = dckpt.TrainState(model, extra={"h": holder})
    config = dckpt.CheckpointConfig(root=Path(root), async_save=False, timeout_s=60)
    out: dict[str, Any] = {}
    with dckpt.CheckpointManager(config, state) as mgr:
        mgr.save(1)  # a Shard(0) DTensor differs per rank by nature: never compared
        if rank == 1:
            holder.rep._local_tensor[0, 0] += 1.0
        try:
            mgr.save(2)
        except dckpt.SaveError as exc:
            out["error"] = str(exc)
    return out


@pytest.mark.multiproc
def test_a_replicated_dtensor_shard_that_differs_fails_the_save(tmp_path: Path) -> None:
    results = run_world(_dtensor_replicas, 2, str(tmp_path))
    for r in results:
        assert "extra.h.rep" in r["error"] and "ranks [1] hold x:" in r["error"]
        assert "extra.h.shard" not in r["error"]
    assert committed_steps(tmp_path) == [1]


def test_a_sampled_replica_check_compares_each_tensor_once_every_k_saves() -> None:
    import dckpt
    from dckpt.save.value_checks import Inspection

    names = [f"model.{i}.weight" for i in range(40)]
    seen: list[str] = []
    for save in (7, 8, 9, 10):  # four saves with k = 4: every name exactly once
        checks = Inspection(replicas=True, finite=True, sample=(save, 4))
        for name in names:
            checks.host(name, torch.ones(3), replica=name, finite=True)
        seen += checks.findings().replicas
    assert sorted(seen) == sorted(names)
    assert dckpt.CheckpointConfig(root="/tmp/x", replica_sample=0.25).replica_every == 4
    with pytest.raises(ValueError, match="replica_sample must be in"):
        dckpt.CheckpointConfig(root="/tmp/x", replica_sample=0)
