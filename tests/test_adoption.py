"""Adoption without surprises (issue 16): the config policy, the loss watch that catches a
broken resume, per-rank state, and values the ranks must agree on.

Single process unless a rank count is the point; the training here is a drifting linear
task small enough to run in-process in a second: the target moves with the data position, so
a model that resumes at the wrong position, or with re-initialised weights, sees a loss jump.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from torch import nn

import dckpt
from dckpt.load.config_check import ALLOW_ENV, ConfigPolicy
from dckpt.load.loss_watch import LossWatch

# --- the config policy -----------------------------------------------------------------------


def test_the_policy_sorts_each_changed_key_by_what_it_does() -> None:
    policy = ConfigPolicy.build(environ={})
    verdicts = {
        key: policy.verdict(key)
        for key in (
            "log_interval",
            "max_iters",
            "init_from",
            "compile",
            "lr",
            "model.n_layer",
            "precision",
            "my_knob",
        )
    }
    assert verdicts == {
        "log_interval": "operational",
        "max_iters": "operational",
        "init_from": "operational",
        "compile": "operational",
        "lr": "strict",
        "model.n_layer": "strict",
        "precision": "strict",  # no PrecisionPolicy to compare: dckpt never sees the dtype
        "my_knob": "unlisted",
    }
    assert ConfigPolicy.build(environ={}, precision_checked=True).verdict("dtype") == "checked"
    assert policy.verdict("world_size") == "checked"
    assert ConfigPolicy.build(strict_keys="all", environ={}).verdict("my_knob") == "strict"
    assert ConfigPolicy.build(strict_keys=["my_knob"], environ={}).verdict("lr") == "unlisted"
    for listed in ("lr, warmup", "lr warmup", "lr,warmup,"):
        from_env = ConfigPolicy.build(environ={ALLOW_ENV: listed})
        assert from_env.allowed == {"lr", "warmup"}, listed


def test_a_refusal_shows_the_diff_and_both_ways_out() -> None:
    policy = ConfigPolicy.build(environ={})
    saved = {"lr": 0.1, "log_interval": 10, "n_layer": 2}
    with pytest.raises(dckpt.ConfigMismatchError) as caught:
        policy.check(saved, {"lr": 0.2, "log_interval": 1, "n_layer": 2}, "step-00000004")
    text = str(caught.value)
    assert "lr: 0.1 -> 0.2   <- refused" in text and "log_interval: 10 -> 1\n" in text
    assert f"{ALLOW_ENV}=lr" in text and "allow_config_changes" in text
    judged = policy.check(saved, {"lr": 0.1, "log_interval": 1, "n_layer": 2, "x": 1}, "s")
    lines = policy.describe(judged)
    assert lines[0] == "config changed in operational keys: log_interval: 10 -> 1"
    assert "keys dckpt does not know: x: '<absent>' -> 1" in lines[1]


def _linear(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(8, 1, bias=False)
    return model, torch.optim.SGD(model.parameters(), lr=0.2)


class Stream:
    """The data position of a drifting task: batch t is y = x @ (w0 + t * dw) + noise."""

    def __init__(self) -> None:
        self.t = 0

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t = int(sd["t"])

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.t)
        x = torch.randn(64, 8, generator=g)
        w = torch.linspace(-1, 1, 8).unsqueeze(1) + self.t * 0.05
        self.t += 1
        return x, x @ w + 0.05 * torch.randn(64, 1, generator=g)


def _train(mgr: dckpt.CheckpointManager, model: nn.Module, opt: Any, data: Stream, n: int) -> None:
    for _ in range(n):
        x, y = data.batch()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mgr.observe(float(loss.detach()))


def _saved_run(root: Path, config: dict[str, Any]) -> None:
    model, opt = _linear()
    data = Stream()
    state = dckpt.TrainState(model, opt, data=data)
    with dckpt.CheckpointManager(root, state, run_config=config) as mgr:
        _train(mgr, model, opt, data, 40)
        mgr.save(40).result()


def test_train_longer_passes_and_says_what_it_means_for_the_schedule(tmp_path: Path) -> None:
    _saved_run(tmp_path, {"max_iters": 40, "log_interval": 10, "lr": 0.2})
    model, opt = _linear(1)
    state = dckpt.TrainState(model, opt, data=Stream())
    new = {"max_iters": 80, "log_interval": 1, "lr": 0.2}
    with dckpt.CheckpointManager(tmp_path, state, run_config=new) as mgr:
        report = mgr.resume()
    assert report.step == 40
    assert sorted(c.key for c in report.config_changes) == ["log_interval", "max_iters"]
    text = report.format()
    assert "training length changed (max_iters: 40 -> 80)" in text
    assert "[ok  ] config: 2 change(s) passed" in text


def test_the_environment_allows_a_strict_change_without_a_code_edit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved_run(tmp_path, {"lr": 0.2})
    model, opt = _linear(1)
    state = dckpt.TrainState(model, opt, data=Stream())
    with (
        dckpt.CheckpointManager(tmp_path, state, run_config={"lr": 0.1}) as mgr,
        pytest.raises(dckpt.ConfigMismatchError, match=r"lr: 0\.2 -> 0\.1"),
    ):
        mgr.resume()
    monkeypatch.setenv(ALLOW_ENV, "lr")
    with dckpt.CheckpointManager(tmp_path, state, run_config={"lr": 0.1}) as mgr:
        report = mgr.resume()
    assert report.step == 40
    assert any(f"allowed by ${ALLOW_ENV}: lr: 0.2 -> 0.1" in w for w in report.warnings)
    knob = {"lr": 0.1, "my_knob": 1}  # unknown: passes by default, refused under "all"
    with (
        dckpt.CheckpointManager(tmp_path, state, run_config=knob, strict_keys="all") as mgr,
        pytest.raises(dckpt.ConfigMismatchError, match="my_knob: '<absent>' -> 1   <- refused"),
    ):
        mgr.resume()


# --- the loss watch --------------------------------------------------------------------------


def _resumed(
    root: Path,
    sabotage: str,
    caplog: pytest.LogCaptureFixture,
    action: str = "warn",
    steps: int = 5,
) -> list[str]:
    """Resume the saved run, break it the way ``sabotage`` says, train ``steps`` steps and
    close: the watch's log lines."""
    model, opt = _linear(1)
    data = Stream()
    # The loss watch alone: the replay check (tests/test_replay.py) names a sabotaged step
    # first, and with "raise" raises before the watch has its window.
    config = dckpt.CheckpointConfig(root=root, loss_watch=action, replay_check="off")  # type: ignore[arg-type]
    state = dckpt.TrainState(model, opt, data=data)
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="dckpt"),
        dckpt.CheckpointManager(config, state, run_config={}) as mgr,
    ):
        mgr.resume()
        if sabotage == "reinit":
            model.reset_parameters()
        elif sabotage == "data":
            data.t = 0  # the script forgot to restore its data position
        _train(mgr, model, opt, data, steps)
    return [r.getMessage() for r in caplog.records if "loss watch:" in r.getMessage()]


def test_the_loss_watch_passes_an_exact_resume_and_trips_a_broken_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved_run(tmp_path, {})
    lines = _resumed(tmp_path, "none", caplog)
    assert len(lines) == 1 and lines[0].startswith("dckpt resume: [ok  ] loss watch: median")
    for sabotage in ("reinit", "data"):
        lines = _resumed(tmp_path, sabotage, caplog)
        assert lines[-1].startswith("dckpt resume: [warn] loss watch:"), (sabotage, lines)
        assert "ABOVE" in lines[-1]
    with pytest.raises(dckpt.LossDeviationError, match="ABOVE"):
        _resumed(tmp_path, "reinit", caplog, action="raise")
    (short,) = _resumed(tmp_path, "reinit", caplog, steps=2)  # the run ends first: at close()
    assert "[warn]" in short and "(the run ended after 2 of 5)" in short


def test_the_loss_watch_is_robust_and_relative() -> None:
    def verdict(before: list[float], after: list[float]) -> str:
        saving, watch = LossWatch(), LossWatch()
        for v in before:
            saving.observe(v, "warn")
        watch.arm(saving.summary(), len(after), "step-9")
        results = [watch.observe(v, "warn") for v in after]
        final = [r for r in results if r is not None]
        assert len(final) == 1 and not watch.armed
        return final[0].line()

    falling = [5.0 - 0.1 * i for i in range(16)]
    assert "[ok  ]" in verdict(falling, [3.4, 3.3, 9.0, 3.2, 3.1])  # one bad batch: the median
    assert "ABOVE" in verdict(falling, [4.2, 4.25, 4.3, 4.2, 4.2])
    assert "BELOW" in verdict(falling, [1.0, 1.1, 1.0, 0.9, 1.0])
    negative = [-2.9e6 - 1e3 * i for i in range(16)]  # a loss that trends negative
    assert "[ok  ]" in verdict(negative, [-2.917e6, -2.918e6, -2.919e6])
    assert "ABOVE" in verdict(negative, [0.1, -0.2, 0.0])  # an untrained model
    assert "not finite" in verdict(falling, [3.4, float("nan"), 3.3])
    short = LossWatch()  # the run ends before the window is full: the verdict at close
    short.arm({"tail": falling}, 5, "step-9")
    assert short.observe(3.4, "raise") is None and short.observe(9.0, "raise") is None
    last = short.finish()
    assert last is not None and "(the run ended after 2 of 5)" in last.line()
    assert short.finish() is None  # once
    old = LossWatch()  # a manifest from before the tail was saved: mean and std only
    old.arm({"mean": 2.0, "std": 0.1, "n": 30.0, "last": 2.0}, 2, "step-1")
    assert old.band() == pytest.approx((1.6, 2.4))


# --- per-rank state and agreed values --------------------------------------------------------


def _per_rank_save(rank: int, world: int, root: str) -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("dckpt").addHandler(Keep())
    model, opt = _linear()
    pending = dckpt.PerRank()
    state = dckpt.TrainState(model, opt, extra={"pending": pending})
    with dckpt.CheckpointManager(root, state) as mgr:
        for i in range(16):  # the same falling loss on every rank: no warning about losses
            mgr.observe(5.0 - 0.05 * i)
        pending.value = {"batch": torch.full((2, 3), float(rank)), "cursor": 7 + rank}
        mgr.save(1, metric=0.5 + rank).result()  # validation that ran on every rank, unsynced
        records.append("-- after the save of step 1 --")
        for i in range(16):  # now each rank passes its own, unreduced loss
            mgr.observe(5.0 - 0.05 * i + 2.0 * rank)
        mgr.save(2, metric=0.5).result()
        mgr.save(3, metric=0.5).result()  # warned once a run, not at every save
        model2, opt2 = _linear(3)
        fresh = dckpt.PerRank()
        state2 = dckpt.TrainState(model2, opt2, extra={"pending": fresh})
    with dckpt.CheckpointManager(root, state2) as mgr2:
        mgr2.resume()
    assert fresh.value["cursor"] == 7 + rank
    assert torch.equal(fresh.value["batch"], torch.full((2, 3), float(rank)))
    return records


@pytest.mark.multiproc
def test_per_rank_values_come_back_to_their_rank_and_refuse_a_new_world(tmp_path: Path) -> None:
    records = run_world(_per_rank_save, 2, str(tmp_path))
    first, later = records[0][: records[0].index("-- after the save of step 1 --")], records[0]
    assert any("save(metric=...) differs across ranks (rank 0: 0.5; rank 1: 1.5)" in m
               for m in first), first  # fmt: skip
    losses = [m for m in later if "the ranks pass observe() different losses" in m]
    assert len(losses) == 1 and "rank 1: median 6.6" in losses[0], later
    assert not any("different losses" in m for m in first)
    model, opt = _linear()
    state = dckpt.TrainState(model, opt, extra={"pending": dckpt.PerRank()})
    with (
        dckpt.CheckpointManager(tmp_path, state) as mgr,
        pytest.raises(dckpt.StateMismatchError, match=r"saved by 2 rank\(s\).*on_resize='fresh'"),
    ):
        mgr.resume()
    keep = dckpt.PerRank("mine", on_resize="fresh")
    state = dckpt.TrainState(model, opt, extra={"pending": keep})
    with dckpt.CheckpointManager(tmp_path, state) as mgr:
        report = mgr.resume()
    assert report.step == 3 and keep.value == "mine"
    assert any("per-rank value(s) pending not restored" in w for w in report.warnings)


def test_a_per_rank_value_a_resume_could_not_read_fails_its_save(tmp_path: Path) -> None:
    import numpy as np

    model, opt = _linear()
    pending = dckpt.PerRank(np.arange(3))  # weights_only loading refuses numpy arrays
    state = dckpt.TrainState(model, opt, extra={"pending": pending})
    with dckpt.CheckpointManager(tmp_path, state) as mgr:
        with pytest.raises(dckpt.SaveError, match=r"holds a ndarray, which torch\.load"):
            mgr.save(1).result()
        with pytest.raises(dckpt.SaveError, match="ndarray"):
            mgr.wait()  # the same error, latched for the next call, once
        pending.value = torch.arange(3)  # a tensor is fine
        assert mgr.save(2).result().step == 2
