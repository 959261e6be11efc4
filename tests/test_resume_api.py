"""Resume through the API: resharding across world sizes, fallback control, the warmup
collective, the loss watch, config comparison, the data sampler and the RNG."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_harness import run_world
from torch import nn

import dckpt
from dckpt.load.config_check import check_config, config_changes

# --- multi-process ---------------------------------------------------------------------------


def _fsdp_setup(rank: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 24), nn.ReLU(), nn.Linear(24, 6)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = dckpt.GlobalBatchSampler(600, 12, rank=rank, world_size=world, seed=3)
    return model, opt, sched, sampler


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"m.{k}": v.clone() for k, v in msd.items()}
    for pid, st in osd["state"].items():
        out.update({f"o.{pid}.{k}": v.clone() for k, v in st.items()})
    return out


def _save_fsdp(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt, sched, sampler = _fsdp_setup(rank, world)
    batches = iter(sampler)
    for _ in range(5):
        idx = next(batches)
        x = torch.tensor(idx, dtype=torch.float32).unsqueeze(1).repeat(1, 24) / 600
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()
    state = dckpt.TrainState(model, opt, scheduler=sched, data=sampler, seed=3)
    with dckpt.CheckpointManager(root, state) as mgr:
        mgr.save(5).result()
    nxt = next(batches)
    return {"full": _full(model, opt), "next": nxt, "lr": sched.get_last_lr()}


def _resume_fsdp(rank: int, world: int, root: str) -> dict[str, Any]:
    model, opt, sched, sampler = _fsdp_setup(rank, world)
    state = dckpt.TrainState(model, opt, scheduler=sched, data=sampler, seed=3)
    with dckpt.CheckpointManager(root, state) as mgr:
        report = mgr.resume()
    return {
        "full": _full(model, opt),
        "next": next(iter(sampler)),
        "lr": sched.get_last_lr(),
        "rng": report.rng,
        "warnings": report.warnings,
        "step": report.step,
    }


@pytest.mark.multiproc
@pytest.mark.parametrize("new_world", [1, 3])
def test_two_ranks_save_fsdp2_and_other_world_sizes_resume(tmp_path: Path, new_world: int) -> None:
    saved = run_world(_save_fsdp, 2, str(tmp_path))
    resumed = run_world(_resume_fsdp, new_world, str(tmp_path))
    want = saved[0]["full"]
    global_next = [i for r in saved for i in r["next"]]  # the next global batch, in rank order
    for r in resumed:
        assert r["step"] == 5
        assert r["full"].keys() == want.keys()
        assert all(torch.equal(r["full"][k], want[k]) for k in want), "model/optimizer not exact"
        assert r["lr"] == saved[0]["lr"]
        assert "reseeded" in r["rng"] and "from 2 to" in r["rng"]
        assert any("RNG reseeded" in w for w in r["warnings"])
    # The data continues with the same global batch, split over the new world size.
    assert sorted(i for r in resumed for i in r["next"]) == sorted(global_next)


def _resume_no_fallback(rank: int, world: int, root: str) -> str:
    model, opt, _s, _d = _fsdp_setup(rank, world)
    config = dckpt.CheckpointConfig(root=Path(root), fallback=False)
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        try:
            mgr.resume()
        except dckpt.IntegrityError as exc:
            return str(exc)
    return "resumed"


def _save_two(rank: int, world: int, root: str) -> None:
    model, opt, _s, _d = _fsdp_setup(rank, world)
    with dckpt.CheckpointManager(root, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1)
        mgr.save(2)


@pytest.mark.multiproc
def test_fallback_false_raises_and_quarantines_nothing(tmp_path: Path) -> None:
    run_world(_save_two, 2, str(tmp_path))
    shard = tmp_path / "step-00000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0x80
    shard.write_bytes(bytes(data))
    results = run_world(_resume_no_fallback, 2, str(tmp_path))
    assert all("__1_0.distcp" in r and "digest mismatch" in r for r in results), results
    assert not (tmp_path / "quarantine").exists()
    assert (tmp_path / "step-00000002").is_dir()


def _warmup_hang(rank: int, world: int, root: str) -> str:
    model, opt, _s, _d = _fsdp_setup(rank, world)
    config = dckpt.CheckpointConfig(root=Path(root), timeout_s=8)
    mgr = dckpt.CheckpointManager(config, dckpt.TrainState(model, opt))
    try:
        mgr.resume()
    except dckpt.WorldError as exc:
        return str(exc)
    finally:
        if rank == 0:  # rank 1 waits at the warmup until rank 0 has its answer
            (Path(root).parent / "answered").touch()
    return "no error"


@pytest.mark.multiproc
def test_a_rank_that_hangs_in_the_warmup_collective_is_named(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_world(_save_two, 2, str(root))
    gate = tmp_path / "answered"
    fault = {"DCKPT_FAULT": f"phase=warmup,rank=1,action=wait,path={gate},seconds=300"}
    results = run_world(_warmup_hang, 2, str(root), env=fault, timeout=300)
    assert "rank(s) 1 did not join" in results[0], results[0]


# --- single process --------------------------------------------------------------------------


def _tiny(tmp_path: Path, **kwargs: Any) -> tuple[dckpt.CheckpointManager, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = dckpt.TrainState(model, opt, **kwargs)
    return dckpt.CheckpointManager(tmp_path, state, run_config={"lr": 0.1, "width": 3}), model


def test_resume_on_an_empty_root_is_a_fresh_start(tmp_path: Path) -> None:
    mgr, _ = _tiny(tmp_path)
    report = mgr.resume()
    assert not report.resumed and "starting from scratch" in report.format()
    mgr.close()


def test_a_skipped_checkpoints_checks_and_warnings_stay_out_of_the_report(
    tmp_path: Path,
) -> None:
    """Step 2 was saved with log_every 2: its config check warns, then its damaged shard skips
    it. Step 1, saved with today's config, is what loads: its report has no config warning."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    state = dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step, every in ((1, 1), (2, 2)):
        with dckpt.CheckpointManager(tmp_path, state, run_config={"log_every": every}) as mgr:
            mgr.save(step).result()
    shard = next((tmp_path / "step-00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0x80
    shard.write_bytes(bytes(data))
    with dckpt.CheckpointManager(tmp_path, state, run_config={"log_every": 1}) as mgr:
        report = mgr.resume()
    assert report.step == 1 and [s for s, _ in report.skipped] == [2]
    assert report.warnings == [], report.warnings  # step 2's "log_every: 2 -> 1" is not here
    config = [c for c in report.checks if c.name == "config"]
    assert len(config) == 1 and config[0].detail == "identical"
    assert "config changed" not in report.format()


def test_rng_is_restored_exactly_in_one_process(tmp_path: Path) -> None:
    mgr, _ = _tiny(tmp_path)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    mgr.save(1).result()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    report = mgr.resume()
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    assert "restored on every rank" in report.rng
    mgr.close()


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


def test_extra_objects_scaler_and_counters_round_trip(tmp_path: Path) -> None:
    counter = _Counter()
    scaler = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0)
    mgr, _ = _tiny(tmp_path, extra={"counter": counter}, scaler=scaler)
    counter.n = 41
    mgr.state.epoch, mgr.state.samples_seen = 2, 900
    mgr.save(7).result()
    counter.n, mgr.state.epoch, mgr.state.samples_seen = 0, 0, 0
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0})
    report = mgr.resume()
    assert (counter.n, mgr.state.step, mgr.state.epoch, mgr.state.samples_seen) == (41, 7, 2, 900)
    assert scaler.get_scale() == 1024.0
    restored = next(c for c in report.checks if c.name == "state").detail
    assert "extra" in restored and "scaler" in restored
    mgr.close()


def test_a_category_the_checkpoint_lacks_is_a_clear_error(tmp_path: Path) -> None:
    mgr, model = _tiny(tmp_path)
    mgr.save(1).result()
    mgr.close()
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    mgr2, _ = _tiny(tmp_path, scheduler=sched)
    with pytest.raises(dckpt.StateMismatchError, match="holds no scheduler state"):
        mgr2.resume()
    mgr2.close()
    assert (tmp_path / "step-00000001").is_dir()  # not quarantined: it is not damaged


def test_a_tensor_of_another_shape_is_named(tmp_path: Path) -> None:
    mgr, _ = _tiny(tmp_path)
    mgr.save(1).result()
    mgr.close()
    wide = nn.Linear(4, 5)
    state = dckpt.TrainState(wide, torch.optim.SGD(wide.parameters(), lr=0.1))
    config = {"lr": 0.1, "width": 3}
    with (
        dckpt.CheckpointManager(tmp_path, state, run_config=config) as mgr2,
        pytest.raises(dckpt.StateMismatchError, match=r"model\.weight.*\(3, 4\).*\(5, 4\)"),
    ):
        mgr2.resume()
    assert not (tmp_path / "quarantine").exists()


def test_config_comparison_and_diff() -> None:
    saved = {"lr": 0.1, "model": {"width": 64, "layers": 2}, "save_every": 10}
    now = {"lr": 0.1, "model": {"width": 96, "layers": 2}, "save_every": 5, "new": 1}
    assert [c.key for c in config_changes(saved, now)] == ["model.width", "new", "save_every"]
    allowed = frozenset({"save_every", "new"})
    with pytest.raises(dckpt.ConfigMismatchError, match=r"model\.width: 64 -> 96"):
        check_config(saved, now, allowed, "step-1")
    now["model"]["width"] = 64  # type: ignore[index]
    assert [c.key for c in check_config(saved, now, allowed, "step-1")] == ["new", "save_every"]


@pytest.mark.parametrize("epoch", [0, 1, 3])
def test_a_restored_sampler_goes_on_with_the_epoch_and_the_batch_it_stopped_at(epoch: int) -> None:
    # Each epoch has its own order: a restore that kept the batch but not the epoch would
    # replay epoch 0's order after any later epoch (and look right in epoch 0).
    per_epoch = 5
    stop = epoch * per_epoch + 2  # two batches into `epoch`
    original = dckpt.GlobalBatchSampler(60, 12, rank=1, world_size=2, seed=7)
    it = iter(original)
    taken = 0
    while taken < stop:
        try:
            next(it)
            taken += 1
        except StopIteration:
            it = iter(original)
    assert (original.epoch, original.batches_done) == (epoch, 2)
    saved = original.state_dict()
    want = list(it) + list(iter(original))  # the rest of `epoch`, then the next one whole
    restored = dckpt.GlobalBatchSampler(60, 12, rank=1, world_size=2, seed=7)
    restored.load_state_dict(saved)
    assert (restored.epoch, restored.batches_done) == (epoch, 2)
    assert len(restored) == per_epoch and restored.remaining == per_epoch - 2
    got = list(iter(restored)) + list(iter(restored))
    assert got == want
    if epoch:
        fresh = dckpt.GlobalBatchSampler(60, 12, rank=1, world_size=2, seed=7)
        assert list(iter(fresh))[2:] != want[: per_epoch - 2]  # epoch 0's order differs


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        ({"seed": 8}, "seed was 7 when saved and is 8 now"),
        ({"dataset_len": 72}, "dataset_len was 60 when saved and is 72 now"),
        ({"shuffle": False}, "shuffle was True when saved and is False now"),
        ({"global_batch_size": 6}, "global_batch_size was 12 when saved and is 6 now"),
    ],
)
def test_a_sampler_whose_data_order_would_differ_refuses_its_state(
    changed: dict[str, Any], said: str
) -> None:
    saved = dckpt.GlobalBatchSampler(60, 12, seed=7)
    next(iter(saved))
    args: dict[str, Any] = {"dataset_len": 60, "global_batch_size": 12, "seed": 7, **changed}
    other = dckpt.GlobalBatchSampler(**args)
    with pytest.raises(dckpt.StateMismatchError, match=re.escape(said)):
        other.load_state_dict(saved.state_dict())
    assert (other.epoch, other.batches_done) == (0, 0)  # nothing taken from the refused state


def test_global_batch_sampler_is_world_size_independent() -> None:
    def shares(world: int, start: tuple[int, int], n: int) -> list[list[int]]:
        samplers = [
            dckpt.GlobalBatchSampler(100, 12, rank=r, world_size=world, seed=1)
            for r in range(world)
        ]
        out = []
        for s in samplers:
            s.set_position(*start)
            it = iter(s)
            out.append([i for _ in range(n) for i in next(it)])
        return out

    one = shares(1, (0, 3), 2)[0]
    for world in (2, 3, 4):
        assert sorted(i for share in shares(world, (0, 3), 2) for i in share) == sorted(one)
    s = dckpt.GlobalBatchSampler(100, 12, seed=1)
    it = iter(s)
    for _ in range(8):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert (s.epoch, s.batches_done) == (1, 0)
    other = dckpt.GlobalBatchSampler(100, 10, seed=1)
    with pytest.raises(dckpt.StateMismatchError, match="global_batch_size"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="not divisible"):
        dckpt.GlobalBatchSampler(100, 10, world_size=3)
