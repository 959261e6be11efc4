"""A save says nothing torch has to warn about: dckpt's planner takes DCP's current
``set_up_planner`` signature (it used to print "The function definition for
SavePlanner.set_up_planner has been updated ..." on every rank, and handed the coordinator
flag to the base class as its ``storage_meta``)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.planner import SavePlan

import dckpt
from dckpt.save.stager import StagingSavePlanner


def test_a_save_warns_nothing_and_the_planner_knows_it_coordinates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    real = StagingSavePlanner.create_local_plan

    def spy(self: StagingSavePlanner) -> SavePlan:
        seen.append(self.is_coordinator)  # as set_up_planner left it
        return real(self)

    monkeypatch.setattr(StagingSavePlanner, "create_local_plan", spy)
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    cfg = dckpt.CheckpointConfig(root=tmp_path / "ckpt", lock=False, async_save=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dckpt.CheckpointManager(cfg, dckpt.TrainState(model)) as mgr:
            mgr.save(1).result()
    about_planner = [w for w in caught if "set_up_planner" in str(w.message)]
    assert about_planner == [], [str(w.message) for w in about_planner]
    assert seen == [True]  # the only rank is DCP's coordinator
