"""No silent wrongs in adoption (issue 41, item 6), and ``dckpt verify`` on a storage that
fails a read (item 5), in one process:

- ``len()`` of a resumed ``GlobalBatchSampler`` is a whole epoch (a script that derived its
  starting epoch from it stopped early, exit 0, no word); the iteration yields what is left;
- a sampler whose saved state does not fit (another global batch, as after a world-size
  change with a per-rank batch) refuses the resume as a ``StateMismatchError`` inside the
  ``REFUSED`` block (a plain ``ValueError`` escaped it, after the tensors were loaded);
- an LR change behind a scheduler wrapper (Accelerate's ``AcceleratedScheduler`` keeps the
  real scheduler in ``.scheduler``): the advice names ``scheduler.scheduler.base_lrs``, and
  "applied" is said only once the schedule's bases hold the new LR; a schedule that puts
  the saved LR back at its first step is caught at the second optimizer step;
- ``dckpt verify`` of a file the storage cannot read: no traceback, ``UNREAD`` and exit 5
  (a storage error), never 3 (damage: "do not load").
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dckpt
from dckpt.load.config_check import ConfigChange
from dckpt.load.overrides import find_overrides


def test_len_of_a_resumed_sampler_is_a_whole_epoch_and_the_iteration_what_is_left() -> None:
    sampler = dckpt.GlobalBatchSampler(100, 10, seed=3)
    assert len(sampler) == sampler.batches_per_epoch == 10
    first = list(sampler)
    resumed = dckpt.GlobalBatchSampler(100, 10, seed=3)
    resumed.load_state_dict({**sampler.state_dict(), "epoch": 0, "batches_done": 4})
    assert len(resumed) == 10 and resumed.remaining == 6  # a whole epoch: len(); the rest
    assert list(resumed) == first[4:]  # what is left of epoch 0, then epoch 1 from its start
    assert (resumed.epoch, resumed.remaining, len(resumed)) == (1, 10, 10)


def _job(root: Path, global_batch: int) -> tuple[dckpt.CheckpointManager, nn.Module]:
    torch.manual_seed(0)
    net = nn.Linear(4, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sampler = dckpt.GlobalBatchSampler(64, global_batch)
    state = dckpt.TrainState(net, opt, data=sampler)
    return dckpt.CheckpointManager(dckpt.CheckpointConfig(root=root), state), net


def test_a_sampler_that_does_not_fit_refuses_in_the_refused_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mgr, _ = _job(tmp_path / "ckpt", 8)
    with mgr:
        mgr.save(1).result()
    mgr, _ = _job(tmp_path / "ckpt", 4)  # another global batch (a per-rank batch, resized)
    with mgr, pytest.raises(dckpt.StateMismatchError, match="global_batch_size was 8"):
        mgr.resume()
    refused = [r.getMessage() for r in caplog.records if "REFUSED" in r.getMessage()]
    assert refused and "StateMismatchError" in refused[0], refused


class _Wrapper:
    """What Accelerate's scheduler wrapper looks like to dckpt: the real one in ``.scheduler``."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def test_an_lr_change_behind_a_scheduler_wrapper_is_named_with_its_base_lrs() -> None:
    net = nn.Linear(4, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.001)
    sched = _Wrapper(torch.optim.lr_scheduler.StepLR(opt, step_size=5))
    state = dckpt.TrainState(net, opt, scheduler=sched)
    (override,) = find_overrides([ConfigChange("lr", 0.001, 0.0005)], state)
    assert any("scheduler.scheduler.base_lrs" in line for line in override.fix), override.fix
    for g in opt.param_groups:  # the param groups alone: the schedule's bases still hold it
        g["lr"] *= 0.5
        g["initial_lr"] = 0.0005
    assert override.still_restored()
    sched.scheduler.base_lrs = [0.0005]
    assert not override.still_restored()


def test_an_lr_the_schedule_puts_back_is_caught_at_the_second_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The script applies the new LR to the groups and the bases, and its schedule puts the
    saved one back at its first step (a wrapper that reloads the old bases): 'applied' at the
    first optimizer step, the warning at the second."""

    def job(lr: float) -> tuple[dckpt.CheckpointManager, Any, Any]:
        torch.manual_seed(0)
        net = nn.Linear(4, 4)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
        state = dckpt.TrainState(net, opt, scheduler=sched)
        config = dckpt.CheckpointConfig(root=tmp_path / "ckpt")
        mgr = dckpt.CheckpointManager(
            config, state, run_config={"lr": lr}, allow_config_changes=["lr"]
        )
        return mgr, opt, sched

    mgr, opt, sched = job(0.001)
    with mgr:
        mgr.save(1).result()
    caplog.set_level(logging.INFO, logger="dckpt")
    mgr, opt, sched = job(0.0005)
    with mgr:
        mgr.resume()
        for g in opt.param_groups:
            g["lr"], g["initial_lr"] = 0.0005, 0.0005
        sched.base_lrs = [0.0005]
        opt.step()  # the first optimizer step: applied
        sched.base_lrs = [0.001]  # the schedule's step puts the saved bases back
        sched.step()
        opt.step()  # the second: caught
    said = [r.getMessage() for r in caplog.records if "dckpt: lr" in r.getMessage()]
    assert any("is applied" in s for s in said), said
    assert any("lr is back at 0.001" in s for s in said), said


def test_verify_of_a_file_the_storage_cannot_read_is_a_storage_error(tmp_path: Path) -> None:
    mgr, _ = _job(tmp_path / "ckpt", 8)
    with mgr:
        mgr.save(1).result()
    env = {**os.environ, "DCKPT_FAULT": "phase=read_shard,action=eio"}
    proc = subprocess.run(
        [sys.executable, "-m", "dckpt.cli", "verify", str(tmp_path / "ckpt")],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "UNREAD" in proc.stdout and "Input/output error" in proc.stdout, proc.stdout
    assert "storage error" in proc.stdout and "integrity failure" not in proc.stdout
    clean = subprocess.run(
        [sys.executable, "-m", "dckpt.cli", "verify", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert clean.returncode == 0, clean.stdout + clean.stderr


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-before-its-first-step"])
def test_torchs_own_optimizer_step_inside_a_save_is_no_training_step(
    tmp_path: Path, optimizer: str
) -> None:
    """DCP's state-dict helpers call ``optimizer.step()`` themselves on an optimizer that holds
    no state (torch's ``_init_optim_state``: zero grads, lr 0): a stateless SGD at every save
    and every load, Adam before its first step. dckpt's step pre-hook must not count it as a
    training step: the step clock (what a save costs the loop, async "auto") would time a
    phantom step inside ``save()``, and a resume's "nothing trained since" would be broken."""
    torch.manual_seed(0)
    net = nn.Linear(8, 8)
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(net.parameters(), lr=0.1)
        if optimizer == "sgd"
        else torch.optim.AdamW(net.parameters(), lr=0.1)
    )
    fired: list[int] = []
    opt.register_step_pre_hook(lambda *_: fired.append(1))  # every step(), torch's own too
    config = dckpt.CheckpointConfig(root=tmp_path / "ckpt", async_save=False)
    with dckpt.CheckpointManager(config, dckpt.TrainState(net, opt)) as mgr:
        clock = mgr._saver._clock
        trained = 0 if optimizer != "sgd" else 3
        for _ in range(trained):
            net(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        mgr.save(trained).result()
        assert len(fired) > trained, "torch no longer steps the optimizer: drop this guard"
        assert clock._seen == trained, (clock._seen, trained)
        # and the resume's own load steps it again: still no training step, so saving the
        # step just resumed from is skipped as nothing trained since
        mgr.load()
        assert clock._seen == trained
        assert mgr.save(trained).skipped


@pytest.mark.parametrize("saved_with", ["sampler", "loader"])
def test_another_kind_of_data_object_is_refused_in_its_own_words(
    tmp_path: Path, saved_with: str
) -> None:
    """A GlobalBatchSampler's checkpoint resumed with a DataLoader as ``data=``, or the
    reverse: refused before any tensor is read, naming the data object (the words once said
    the model or optimizer had parts the checkpoint lacked)."""
    from torch.utils.data import DataLoader

    def data(kind: str) -> Any:
        if kind == "sampler":
            return dckpt.GlobalBatchSampler(64, 8, seed=1)
        return DataLoader(list(range(64)), batch_size=8, shuffle=True)

    net = nn.Linear(4, 4)
    root = tmp_path / "ckpt"
    state = dckpt.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1), data=data(saved_with))
    with dckpt.CheckpointManager(root, state) as mgr:
        mgr.save(1).result()
    other = "loader" if saved_with == "sampler" else "sampler"
    state = dckpt.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1), data=data(other))
    with (
        dckpt.CheckpointManager(root, state) as mgr,
        pytest.raises(dckpt.StateMismatchError) as refused,
    ):
        mgr.resume()
    words = str(refused.value)
    assert "the data object is another kind than the one the run that saved it" in words, words
    assert "the model has parts" not in words, words
