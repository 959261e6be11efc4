"""An exact resume, checked: the replay journal and its comparison (after a SIGKILL, under
torchrun: test_replay_kill.py), the config changes the restored state overrides, no re-save
of the step just resumed from, a save decided by rank 0, no change to the process's
warnings, a root holding another checkpointer's files."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from torch import nn

import dckpt
from dckpt.load.config_check import ConfigChange
from dckpt.load.overrides import find_overrides
from dckpt.load.replay import Replay, ReplayCheck
from dckpt.root.layout import committed_steps
from dckpt.root.manifest import read_manifest
from dckpt.root.replay_journal import MAX_ENTRIES, JournalWriter, journal_path, read_journal

# --- the journal and the comparison, in one process --------------------------------------------


def test_replay_check_exact_close_nan_and_a_run_that_ends_first() -> None:
    exact = ReplayCheck("exact", 1e-3)
    assert exact.arm(4, [(3, (9.0).hex()), (5, (1.5).hex()), (6, (1.25).hex())]) == [5, 6]
    assert exact.observe(5, 1.5) is None
    verdict = exact.observe(6, 1.25)
    assert verdict is not None and verdict.ok
    assert (
        verdict.line()
        == "dckpt resume: [ok  ] replay: steps 5..6 identical to the run that stopped"
    )
    assert not exact.armed and exact.observe(7, 1.0) is None  # one verdict per resume

    exact.arm(4, [(5, (1.5).hex()), (6, (1.25).hex())])
    verdict = exact.observe(5, 1.5000000000000002)  # one ulp: not the same bits
    assert verdict is not None and not verdict.ok
    assert verdict.detail.startswith("step 5 differs from the run that stopped: ")
    assert "1.5000000000000002 now, 1.5 then" in verdict.detail

    close = ReplayCheck("close", 1e-3)
    close.arm(0, [(1, (2.0).hex()), (2, (2.0).hex())])
    assert close.observe(1, 2.001) is None  # 5e-4 relative
    verdict = close.observe(2, 2.01)
    assert verdict is not None and not verdict.ok and "by more than 0.001" in verdict.detail
    assert "(step 1 within 0.001 of the run that stopped" in verdict.detail

    nan = ReplayCheck("exact", 0.0)
    nan.arm(0, [(1, float("nan").hex()), (2, (1.0).hex())])
    assert nan.observe(1, float("nan")) is None  # NaN then and now: the same
    verdict = nan.observe(2, float("nan"))
    assert verdict is not None and not verdict.ok

    short = ReplayCheck("exact", 0.0)
    short.arm(0, [(1, (1.0).hex()), (2, (2.0).hex()), (3, (3.0).hex())])
    assert short.observe(1, 1.0) is None
    ended = short.finish()
    assert ended is not None and ended.ok
    assert ended.detail == "step 1 identical to the run that stopped (the run ended before step 3)"


def test_journal_survives_its_writer_and_refuses_a_torn_or_planted_file(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path)
    writer.start(4, "save-a", "run")
    for step, loss in ((5, 1.5), (6, -0.25), (7, float("inf"))):
        writer.append(step, loss)
    # No close(): what a SIGKILL leaves. Every line written is in the file.
    journal = read_journal(tmp_path, 4)
    assert journal is not None and journal.save_id == "save-a"
    assert journal.entries == [(5, (1.5).hex()), (6, (-0.25).hex()), (7, "inf")]
    path = journal_path(tmp_path, 4)
    with open(path, "a") as f:
        f.write("8 0x1.8p+0\n9 0x1.")  # a line cut mid-write, then garbage
    assert [s for s, _ in read_journal(tmp_path, 4).entries] == [5, 6, 7, 8]  # type: ignore[union-attr]
    with open(path, "a") as f:
        f.write("\nrm -rf /\n10 0x1p+0\n")
    assert [s for s, _ in read_journal(tmp_path, 4).entries] == [5, 6, 7, 8]  # type: ignore[union-attr]
    assert read_journal(tmp_path, 5) is None  # none
    path.rename(journal_path(tmp_path, 5))
    assert read_journal(tmp_path, 5) is None  # a header naming another step is no journal
    journal_path(tmp_path, 6).write_text("not json\n5 0x1p+0\n")
    assert read_journal(tmp_path, 6) is None
    writer.close()


def test_journal_is_capped_and_pruned_below_the_newest_committed_step(tmp_path: Path) -> None:
    writer = JournalWriter(tmp_path)
    writer.start(1, "s1", "run")
    for i in range(MAX_ENTRIES + 10):
        writer.append(2 + i, 1.0)
    journal = read_journal(tmp_path, 1)
    assert journal is not None and len(journal.entries) == MAX_ENTRIES
    lines = journal_path(tmp_path, 1).read_text().splitlines()
    assert len(lines) == 1 + MAX_ENTRIES  # the writer stops at the cap, not the reader only
    idle = JournalWriter(tmp_path / "idle")
    idle.append(1, 1.0)  # never started (or stopped by a full disk): nothing, no error
    assert not (tmp_path / "idle").exists()
    writer.start(9, "s9", "run")
    writer.start(12, "s12", "run")
    (tmp_path / ".dckpt-replay" / "notes.txt").write_text("not ours")
    writer.prune(9)
    left = sorted(p.name for p in (tmp_path / ".dckpt-replay").iterdir())
    assert left == ["notes.txt", "step-00000009.log", "step-00000012.log"]
    writer.close()


def test_the_newest_committed_step_s_journal_outlives_the_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Step 3 is committed and step 6's save is still in flight: a crash now resumes from 3, so
    # 3's journal must still be there to compare with (step 1's may go).
    import shutil
    import threading

    from dckpt.collective import progress
    from dckpt.phases import Phase

    held, go = threading.Event(), threading.Event()
    real = progress.fault_point

    def hold_step_6(phase: Phase | str, rank: int, step: int | None = None) -> bool:
        if phase == Phase.MAKE_TMP and step == 6:
            held.set()
            assert go.wait(300), "the test never let step 6's save go on"
        return real(phase, rank, step)

    monkeypatch.setattr(progress, "fault_point", hold_step_6)
    root, crashed = tmp_path / "ckpt", tmp_path / "crashed"

    def manager() -> dckpt.CheckpointManager:
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        state = dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return dckpt.CheckpointManager(dckpt.CheckpointConfig(root=root, lock=False), state)

    losses = {2: 0.5, 3: 0.25, 4: 0.125, 5: 0.0625}
    with manager() as mgr:
        mgr.save(1).result()
        for step in (2, 3):
            mgr.observe(losses[step])
        mgr.save(3).result()
        for step in (4, 5):
            mgr.observe(losses[step])
        in_flight = mgr.save(6)
        try:
            assert held.wait(300) and not in_flight.done()
            assert read_journal(root, 1) is None  # below the newest committed step: pruned
            journal = read_journal(root, 3)
            assert journal is not None and [s for s, _ in journal.entries] == [4, 5]
            shutil.copytree(root, crashed)  # what a crash right now leaves
        finally:
            go.set()  # a failed check must not leave close() waiting on the held save
        in_flight.result()
    root = crashed
    with manager() as mgr:
        report = mgr.resume()
        assert report.step == 3, report.format()
        assert "steps 4..5 of the run that stopped to compare (exact)" in report.format()
        with caplog.at_level(logging.INFO, logger="dckpt"):
            for step in (4, 5):
                mgr.observe(losses[step])
    assert "[ok  ] replay: steps 4..5 identical to the run that stopped" in caplog.text


def _journal_of(root: Path, losses: list[float]) -> None:
    """The run after ``save(4)``: its losses as steps 5, 6, ..."""
    run = Replay(rank=0, root=root, mode="exact", rtol=0.0, run_id="r")
    run.saved(4, "save-4", committed=None)
    for loss in losses:
        run.observe(loss, None)
    run.finish()


def test_a_resumed_run_appends_after_the_journal_and_never_replaces_it(tmp_path: Path) -> None:
    _journal_of(tmp_path, [1.0, 2.0, 3.0])
    journal = read_journal(tmp_path, 4)
    assert journal is not None and [s for s, _ in journal.entries] == [5, 6, 7]

    second = Replay(rank=0, root=tmp_path, mode="exact", rtol=0.0, run_id="r")
    line = second.resumed(4, "save-4", None)
    assert line.startswith("steps 5..7 of the run that stopped to compare (exact)")
    assert second.observe(1.0, None) is None
    verdict = second.observe(2.5, None)
    assert verdict is not None and not verdict.ok and verdict.detail.startswith("step 6 differs")
    second.observe(3.5, None)
    second.observe(4.5, None)
    second.finish()
    again = read_journal(tmp_path, 4)
    assert again is not None  # the first run's lines kept; only step 8 is the second run's
    assert again.entries == [(5, (1.0).hex()), (6, (2.0).hex()), (7, (3.0).hex()), (8, (4.5).hex())]
    third = Replay(rank=0, root=tmp_path, mode="exact", rtol=0.0, run_id="r")
    assert third.resumed(4, "save-4", None).startswith("steps 5..8")
    assert third.observe(1.0, None) is None
    verdict = third.observe(2.5, None)  # the same shift, again: reported again
    assert verdict is not None and not verdict.ok and verdict.detail.startswith("step 6 differs")

    # Steps given to observe() name the journal's lines: step 5 was not observed.
    fourth = Replay(rank=0, root=tmp_path, mode="exact", rtol=0.0, run_id="r")
    fourth.resumed(4, "save-4", None)
    assert fourth.observe(2.0, step=6) is None
    assert fourth.observe(3.0, step=7) is None
    verdict = fourth.observe(4.5, step=8)
    assert verdict is not None and verdict.ok and verdict.detail.startswith("steps 6..8 identical")

    # Rank 1 neither reads, writes nor judges; load() starts no journal.
    other = Replay(rank=1, root=tmp_path, mode="exact", rtol=0.0, run_id="r")
    assert other.resumed(4, "save-4", None) == "" and other.observe(9.0, None) is None
    fourth.reset()
    fourth.observe(7.0, None)
    assert read_journal(tmp_path, 4) == read_journal(tmp_path, 4)  # readable, unchanged
    assert [s for s, _ in read_journal(tmp_path, 4).entries] == [5, 6, 7, 8]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("save_id", "changed", "said"),
    [
        ("another-save", None, "not compared: the journal of step 4 is of another save"),
        ("save-4", "the world size changed (2 -> 4)", "not compared: the world size changed"),
        ("save-4", "the config changed (lr)", "not compared: the config changed (lr)"),
    ],
)
def test_a_resume_that_compares_nothing_starts_the_journal_afresh(
    tmp_path: Path, save_id: str, changed: str | None, said: str
) -> None:
    _journal_of(tmp_path, [1.0, 2.0])
    resumed = Replay(rank=0, root=tmp_path, mode="exact", rtol=0.0, run_id="r")
    assert resumed.resumed(4, save_id, changed).startswith(said)
    assert not resumed.check.armed
    assert resumed.observe(7.5, None) is None
    resumed.finish()
    journal = read_journal(tmp_path, 4)
    # This run's steps, not glued after the other world's: the next resume compares them.
    assert journal is not None and journal.save_id == save_id
    assert journal.entries == [(5, (7.5).hex())]
    assert (
        Replay(rank=0, root=tmp_path / "none", mode="exact", rtol=0.0, run_id="r")
        .resumed(4, "save-4", None)
        .startswith("not compared: no journal")
    )


def test_a_torn_tail_is_dropped_before_the_resumed_run_appends(tmp_path: Path) -> None:
    _journal_of(tmp_path, [1.0, 2.0])
    with open(journal_path(tmp_path, 4), "a") as f:
        f.write("7 0x1.")  # a power loss mid-line
    resumed = Replay(rank=0, root=tmp_path, mode="exact", rtol=0.0, run_id="r")
    resumed.resumed(4, "save-4", None)
    for loss in (1.0, 2.0, 3.0):
        resumed.observe(loss, None)
    resumed.finish()
    journal = read_journal(tmp_path, 4)
    assert journal is not None
    assert journal.entries == [(5, (1.0).hex()), (6, (2.0).hex()), (7, (3.0).hex())]


def test_a_planted_journal_neither_crashes_nor_compares(tmp_path: Path) -> None:
    path = journal_path(tmp_path, 4)
    path.parent.mkdir()
    path.write_text("[" * 100_000 + "\n5 0x1p+0\n")  # past the recursion limit
    assert read_journal(tmp_path, 4) is None
    head = '{"dckpt_replay": 1, "step": 4, "save_id": "s", "run_id": "r"}\n'
    path.write_text(head + "5 0x1p+0\n6 0x..p+1\n7 0x1p+0\n")
    assert read_journal(tmp_path, 4).entries == [(5, "0x1p+0")]  # type: ignore[union-attr]
    path.write_text(head + "5 0x1p+99999\n")
    assert read_journal(tmp_path, 4).entries == []  # type: ignore[union-attr]


def test_replay_off_writes_no_journal(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = dckpt.CheckpointConfig(root=tmp_path, async_save=False, replay_check="off")
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1)
        mgr.observe(1.0)
    assert not (tmp_path / ".dckpt-replay").exists()
    with pytest.raises(ValueError, match="replay_check must be"):
        dckpt.CheckpointConfig(root=tmp_path, replay_check="bits")  # type: ignore[arg-type]


# --- overrides -----------------------------------------------------------------------------------


def _adamw_state(lr: float = 0.1) -> tuple[dckpt.TrainState, torch.optim.AdamW, Any]:
    model = nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    return dckpt.TrainState(model, opt, scheduler=sched), opt, sched


def test_overrides_name_what_the_restored_state_holds_and_the_lines_shown_apply_it() -> None:
    state, opt, sched = _adamw_state()
    changes = [
        ConfigChange("optim.learning_rate", 0.1, 0.2),
        ConfigChange("beta2", 0.95, 0.99),
        ConfigChange("weight_decay", 0.01, 0.1),
        ConfigChange("gamma", 0.5, 0.7),
        ConfigChange("dropout", 0.1, 0.0),  # not in the state: nothing to say
        ConfigChange("eps", 1e-7, 1e-6),  # the state holds neither value: not an override
    ]
    found = {o.change.key: o for o in find_overrides(changes, state)}
    assert sorted(found) == ["beta2", "gamma", "optim.learning_rate", "weight_decay"]
    lr = found["optim.learning_rate"]
    assert lr.fix == (
        "r = 0.2 / 0.1",
        'for g in optimizer.param_groups: g["lr"] *= r; g["initial_lr"] = 0.2 if '
        'g["initial_lr"] == 0.1 else g["initial_lr"] * r',
        "scheduler.base_lrs = [0.2 if b == 0.1 else b * r for b in scheduler.base_lrs]",
    )
    assert "came back from the checkpoint holding 0.1" in lr.describe()
    assert found["gamma"].fix == ("scheduler.gamma = 0.7",)
    # Half applied (the groups, not the scheduler's base_lrs): the scheduler would put the
    # old LR back at its next step, so it stands.
    namespace = {"optimizer": opt, "scheduler": sched}
    exec("\n".join(lr.fix[:2]), namespace)
    assert lr.still_restored()
    # The lines shown, run as a user would: every override is applied.
    exec(lr.fix[2], namespace)
    for override in found.values():
        if override is not lr:
            exec("\n".join(override.fix), namespace)
    assert not any(o.still_restored() for o in found.values())
    assert [g["initial_lr"] for g in opt.param_groups] == [0.2] and sched.base_lrs == [0.2]
    assert opt.param_groups[0]["betas"] == (0.9, 0.99) and sched.gamma == 0.7


def test_an_lr_change_keeps_each_group_s_multiple_and_the_schedule_s_point() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.01}],
        lr=0.1,
        weight_decay=0.01,
    )
    opt.param_groups[1]["weight_decay"] = 0.0  # a no-decay group
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for _ in range(3):
        opt.step()
        sched.step()
    state = dckpt.TrainState(model, opt, scheduler=sched)
    before = [g["lr"] for g in opt.param_groups]
    found = {
        o.change.key: o
        for o in find_overrides(
            [ConfigChange("lr", 0.1, 0.05), ConfigChange("weight_decay", 0.01, 0.1)], state
        )
    }
    namespace = {"optimizer": opt, "scheduler": sched}
    for override in found.values():
        exec("\n".join(override.fix), namespace)
    assert not any(o.still_restored() for o in found.values())
    assert opt.param_groups[0]["initial_lr"] == 0.05  # exactly the new LR
    assert [g["initial_lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.005])
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([b / 2 for b in before])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # no-decay kept


class _Plateau:
    """A scheduler-like state object with a string setting (``mode``)."""

    def __init__(self) -> None:
        self.mode = "min"

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self.mode = state_dict["mode"]


def test_a_scheduler_s_string_setting_is_named_by_its_value() -> None:
    state = dckpt.TrainState(nn.Linear(2, 2), scheduler=_Plateau())
    found = find_overrides([ConfigChange("sched.mode", "min", "max")], state)
    assert [o.fix for o in found] == [("scheduler.mode = 'max'",)]
    assert find_overrides([ConfigChange("mode", "max", "min")], state) == []  # holds neither


def test_a_scaler_setting_is_named_when_the_checkpoint_brings_it_back() -> None:
    scaler = torch.amp.GradScaler("cpu", growth_interval=100)
    state = dckpt.TrainState(nn.Linear(2, 2), scaler=scaler)
    # The running scale is the scaler's own, not a setting: a changed "scale" is not named.
    held = scaler.state_dict()["scale"]
    assert find_overrides([ConfigChange("scale", held, held * 2)], state) == []
    found = find_overrides([ConfigChange("amp.growth_interval", 100, 500)], state)
    assert [o.where for o in found] == ["the GradScaler's growth_interval"]
    exec(found[0].fix[0], {"scaler": scaler})  # the line shown, as a user would run it
    assert scaler.state_dict()["growth_interval"] == 500 and not found[0].still_restored()


# --- no re-save of the step resumed from; rank 0 decides a save ---------------------------------


def _resave_and_when(rank: int, world: int, root: str) -> dict[str, Any]:
    def state() -> tuple[dckpt.TrainState, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return dckpt.TrainState(model, opt), model, opt

    config = dckpt.CheckpointConfig(root=root, async_save=False)
    st, _, _ = state()
    with dckpt.CheckpointManager(config, st) as mgr:
        mgr.save(2)
    first_id = read_manifest(Path(root) / "step-00000002").save_id
    out: dict[str, Any] = {}
    st, model, opt = state()
    with dckpt.CheckpointManager(config, st) as mgr:
        mgr.resume()
        again = mgr.save(2)
        out["resave_skipped"] = again.skipped
        try:
            again.result()
        except dckpt.CheckpointError as exc:
            out["resave_why"] = str(exc)
        out["same_save"] = read_manifest(Path(root) / "step-00000002").save_id == first_id
        out["no_when"] = mgr.save(3, when=(rank == 1)).skipped  # rank 0 says no
        out["none_when"] = mgr.save(3, when=False if rank == 0 else None).skipped
        out["steps_after_no"] = committed_steps(root)
        out["when"] = mgr.save(3, when=True if rank == 0 else None).skipped  # rank 0: yes
        out["steps_after_yes"] = committed_steps(root)
        mgr.resume()  # from 3, then an edit in place: a save of 3 is a real one
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        out["edited_resave"] = mgr.save(3).skipped
        mgr.resume()  # from 3, then one optimizer step: a save of 3 is a real one
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        out["trained_resave"] = mgr.save(3).skipped
    third_id = read_manifest(Path(root) / "step-00000003").save_id
    st, _, _ = state()
    with dckpt.CheckpointManager(config, st) as mgr:
        mgr.watch_preemption()
        mgr.resume()  # a preemption before the first step: step 3 is committed already
        if rank == 1:
            signal.raise_signal(signal.SIGUSR1)
        out["preempted"] = mgr.preempted(3)
    out["preempt_kept"] = read_manifest(Path(root) / "step-00000003").save_id == third_id
    return out


@pytest.mark.multiproc
def test_no_resave_of_the_step_just_resumed_and_rank_0_decides_when(tmp_path: Path) -> None:
    for out in run_world(_resave_and_when, 2, str(tmp_path)):
        assert out["resave_skipped"] and out["same_save"], out
        assert (
            "it is the step just resumed from, and nothing has trained since" in out["resave_why"]
        )
        assert out["no_when"] and out["none_when"] and out["steps_after_no"] == [2]
        assert not out["when"] and out["steps_after_yes"] == [2, 3]
        assert not out["trained_resave"] and not out["edited_resave"]
        assert out["preempted"] and out["preempt_kept"], out


def test_a_memory_step_resumed_is_still_saved_to_the_root(tmp_path: Path) -> None:
    from test_memory_ledger import _manager

    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    mgr, _net = _manager(root, memory)
    with mgr:
        mgr.save(2, tier="memory").result()
    mgr, _net = _manager(root, memory)
    with mgr:
        assert mgr.resume().step == 2 and committed_steps(root) == []
        assert mgr.save(2, tier="memory").skipped  # the memory tier holds it
        assert not mgr.save(2).skipped  # the root does not: a preemption save must land
        mgr.wait()
    assert committed_steps(root) == [2]


# --- the process's warnings are the user's -------------------------------------------------------


def _warned_once(rank: int, world: int, root: str) -> dict[str, Any]:
    import warnings

    seen: list[str] = []
    warnings.showwarning = lambda message, *a, **k: seen.append(str(message))
    before = list(warnings.filters)

    def once() -> None:
        warnings.warn("the user's warning, printed once by Python's default action", stacklevel=1)

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    state = dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    once()
    config = dckpt.CheckpointConfig(root=root, async_save=True)
    for _ in range(2):
        with dckpt.CheckpointManager(config, state) as mgr:
            mgr.resume()
            for step in range(state.step + 1, state.step + 3):
                mgr.observe(1.0)
                mgr.save(step).result()
                once()
            mgr.load()
            once()
    return {"seen": [s for s in seen if "user's warning" in s], "same": warnings.filters == before}


@pytest.mark.multiproc
def test_saves_and_resumes_leave_the_warnings_registry_and_filters_alone(tmp_path: Path) -> None:
    for out in run_world(_warned_once, 2, str(tmp_path)):
        assert out["same"], "dckpt changed warnings.filters"
        assert len(out["seen"]) == 1, out["seen"]  # a reset registry prints it at every save


# --- a root that holds something else -------------------------------------------------------------


def test_a_root_of_other_checkpoints_says_what_it_found(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch.distributed.checkpoint as dcp

    model = nn.Linear(2, 2)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(model.state_dict(), checkpoint_id=tmp_path / "dcp-step-100", no_dist=True)
    (tmp_path / "notes.txt").write_text("hello")
    with (
        caplog.at_level(logging.INFO, logger="dckpt"),
        dckpt.CheckpointManager(tmp_path, dckpt.TrainState(model)) as mgr,
    ):
        report = mgr.resume()
    assert not report.resumed
    assert report.foreign == [
        "dcp-step-100/ (a DCP checkpoint: .metadata, no dckpt manifest)",
        "model.pt (a torch.save file)",
        "notes.txt",
    ]
    text = caplog.text
    assert "dckpt resume: no dckpt checkpoint; files that are not dckpt checkpoints: " in text
    assert "model.pt (a torch.save file); notes.txt; starting from scratch" in text
    # dckpt's own files (the lock, the journal) are never listed as foreign.
    with dckpt.CheckpointManager(tmp_path / "empty", dckpt.TrainState(model)) as mgr:
        assert mgr.resume().foreign == []
