"""Asynchronous saves on real gloo ranks: staging correctness, back-to-back saves, failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from tiny_training import full_state as _flat
from tiny_training import model as _model
from tiny_training import step as _step
from torch import nn

pytestmark = pytest.mark.multiproc


def _back_to_back(
    rank: int,
    world: int,
    root: str,
    n: int,
    if_busy: str,
    drain_at: int | None = None,
    held: Path | None = None,
) -> list[int]:
    import dckpt

    model, opt = _model(width=64)
    config = dckpt.CheckpointConfig(root=Path(root), if_busy=if_busy, timeout_s=60)
    handles = []
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        for step in range(1, n + 1):
            _step(model, opt, seed=step, width=64)
            handles.append(mgr.save(step))
            if step == 2 and held is not None and rank == 0:
                held.touch()  # save 2 was decided (by both ranks): save 1 may go on
            if step == drain_at:
                mgr.wait()  # nothing in flight: the next save is taken, whatever the timing
    return [h.step for h in handles if not h.skipped]


@pytest.mark.parametrize("if_busy", ["wait", "skip"])
def test_fifty_back_to_back_saves_commit_and_verify(tmp_path: Path, if_busy: str) -> None:
    # skip: save 1 is held in the background on every rank until save 2 was decided, so
    # save 2 finds it busy and is skipped; after save 25 the loop drains, so save 26 is taken.
    # Timing decides only the others.
    gate = tmp_path / "save-2-decided"
    held = {"DCKPT_FAULT": f"phase=make_tmp,action=wait,path={gate},seconds=300,step=1"}
    root = tmp_path / "ckpt"
    skip = if_busy == "skip"
    saved = run_world(
        _back_to_back,
        2,
        str(root),
        50,
        if_busy,
        25 if skip else None,
        gate if skip else None,
        timeout=300,
        env=held if skip else {},
    )
    assert saved[0] == saved[1], "ranks disagreed on which saves were skipped"
    from dckpt.root.layout import committed_steps
    from dckpt.root.verify import verify_checkpoint

    steps = committed_steps(root)
    assert steps == saved[0]
    if if_busy == "wait":
        assert steps == list(range(1, 51))
    else:
        # some were skipped, and every one not skipped committed
        assert 1 in steps and 2 not in steps and 26 in steps
    for step in steps:
        result = verify_checkpoint(root / f"step-{step:08d}")
        assert result.ok, result.problems
    assert not list(root.glob("*.tmp-*"))


def _failing_write(rank: int, world: int, root: str) -> dict[str, Any]:
    import dckpt

    model, opt = _model(width=64)
    config = dckpt.CheckpointConfig(root=Path(root), timeout_s=60)
    mgr = dckpt.CheckpointManager(config, dckpt.TrainState(model, opt))
    mgr.save(1).result()
    good = _flat(model, opt)
    _step(model, opt, seed=5, width=64)
    mgr.save(2)  # fails on rank 1 in the background (DCKPT_FAULT)
    _step(model, opt, seed=6, width=64)
    raised = ""
    try:
        mgr.save(3)
    except dckpt.SaveError as exc:
        raised = str(exc)
    # The error was raised once; the manager is usable again and the old checkpoint loads.
    loaded_step = mgr.load().step
    ok = all(torch.equal(v, _flat(model, opt)[k]) for k, v in good.items())
    mgr.close()
    return {"raised": raised, "loaded": loaded_step, "exact": ok}


def test_write_failing_on_one_rank_fails_the_save_everywhere(tmp_path: Path) -> None:
    fault = {"DCKPT_FAULT": "phase=write_shards,rank=1,action=raise,step=2"}
    results = run_world(_failing_write, 2, str(tmp_path), env=fault)
    for r in results:
        assert "step 2" in r["raised"] and "injected fault" in r["raised"], r["raised"]
        assert r["loaded"] == 1 and r["exact"]
    from dckpt.root.layout import committed_steps

    assert committed_steps(tmp_path) == [1]
    assert not list(tmp_path.glob("*.tmp-*"))


def _end_saves_late(mgr: Any, gate: Path) -> None:
    """This rank's save thread lingers after each save is over (agreed, committed or failed),
    as one tidying up a large tmp dir would, until ``gate`` exists: the real save runs
    unchanged, and the other rank opens the gate only once its own thread has ended, so the
    split is reached however fast or slow the machine is."""
    import time

    pipeline = mgr._saver._pipeline
    run = pipeline.run

    def late(*args: Any) -> Any:
        try:
            return run(*args)
        finally:
            deadline = time.monotonic() + 120  # a hang's bound only
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.01)

    pipeline.run = late


def _until_ended(mgr: Any, gate: Path) -> bool:
    """Wait (a hang's bound only) until this rank's save thread has ended, then open the
    other rank's gate; whether it ended."""
    import time

    deadline = time.monotonic() + 120
    while mgr._saver.current is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.touch()
    return mgr._saver.current is None


def _failure_seen_apart(rank: int, world: int, root: str) -> dict[str, Any]:

    import dckpt

    model, opt = _model(width=64)
    config = dckpt.CheckpointConfig(root=Path(root), timeout_s=60, async_save=True)
    mgr = dckpt.CheckpointManager(config, dckpt.TrainState(model, opt))
    mgr.save(1).result()
    gate = Path(root).parent / "gate"
    if rank == 0:  # rank 0's save thread lives on after the agreed failure (a slow tidy-up)
        _end_saves_late(mgr, gate)
    _step(model, opt, seed=5, width=64)
    mgr.save(2)  # fails on rank 1 in the background (DCKPT_FAULT), agreed by both
    # rank 1's thread has ended (waited for); rank 0's has not (it waits for rank 1 to see that)
    ended = _until_ended(mgr, gate) if rank == 1 else mgr._saver.current is None
    raised = ""
    try:
        mgr.save(3)
    except dckpt.SaveError as exc:
        raised = str(exc)
    loaded_step = mgr.load().step  # the next collective: every rank must get here together
    mgr.close()
    return {"ended": ended, "raised": raised, "loaded": loaded_step}


def test_a_failure_seen_at_different_times_is_raised_by_the_next_save_on_every_rank(
    tmp_path: Path,
) -> None:
    # A rank whose save thread had ended used to raise before the save's broadcast, while a
    # rank still tidying up entered it: the two then met at different collectives.
    fault = {"DCKPT_FAULT": "phase=write_shards,rank=1,action=raise,step=2"}
    results = run_world(_failure_seen_apart, 2, str(tmp_path / "ckpt"), env=fault, timeout=300)
    assert [r["ended"] for r in results] == [False, True], "the split was not reached"
    for r in results:
        assert "step 2" in r["raised"] and "injected fault" in r["raised"], r
        assert r["loaded"] == 1, r


def _memory_failure_waited_apart(rank: int, world: int, base: str) -> dict[str, Any]:
    import os

    import dckpt

    model, opt = _model(width=64)
    config = dckpt.CheckpointConfig(
        root=Path(base) / "root", memory=True, memory_dir=Path(base) / "mem", timeout_s=30
    )
    mgr = dckpt.CheckpointManager(config, dckpt.TrainState(model, opt))
    mgr.save(1).result()
    gate = Path(base) / "gate"
    if rank == 1:  # rank 1's save thread lives on after the agreed failure
        _end_saves_late(mgr, gate)
    _step(model, opt, seed=5, width=64)
    os.environ["DCKPT_FAULT"] = "phase=memory_commit,rank=0,action=raise,step=2"
    mgr.save(2, tier="memory")  # fails on rank 0 at its commit; every rank learns it
    # rank 0's thread has ended (waited for); rank 1's has not (it waits for rank 0 to see that)
    ended = _until_ended(mgr, gate) if rank == 0 else mgr._saver.current is None
    try:
        mgr.wait()
        waited = "returned"
    except dckpt.SaveError as exc:
        waited = f"raised: {exc}"
    loaded = mgr.latest_step()  # the next collective: every rank must get here together
    mgr.close()
    return {"ended": ended, "waited": waited, "loaded": loaded}


def test_wait_after_a_failed_memory_save_does_the_same_on_every_rank(tmp_path: Path) -> None:
    # A memory save's failure fails only its handle (logged, agreed). wait() used to re-raise
    # it only where the save was still running: that rank left while the others went on.
    results = run_world(_memory_failure_waited_apart, 2, str(tmp_path), timeout=300)
    assert [r["ended"] for r in results] == [True, False], "the split was not reached"
    assert [r["waited"] for r in results] == ["returned", "returned"], results
    assert [r["loaded"] for r in results] == [1, 1], results


def _save_close_exit(rank: int, world: int, root: str) -> None:
    import dckpt

    model, opt = _model(width=512)
    _step(model, opt, seed=1, width=512)
    mgr = dckpt.CheckpointManager(root, dckpt.TrainState(model, opt))
    mgr.save(9)
    mgr.close()  # drains; the process exits right after


def test_close_drains_the_save_in_flight(tmp_path: Path) -> None:
    run_world(_save_close_exit, 2, str(tmp_path))
    from dckpt.root.layout import committed_steps, read_latest
    from dckpt.root.verify import verify_checkpoint

    assert committed_steps(tmp_path) == [9]
    assert read_latest(tmp_path) == "step-00000009"
    assert verify_checkpoint(tmp_path / "step-00000009").ok


def test_a_parameter_changed_before_its_copy_fails_the_save_not_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dckpt

    go = tmp_path / "go"
    monkeypatch.setenv("DCKPT_FAULT", f"phase=stage,action=wait,path={go},seconds=300,step=2")
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    root = tmp_path / "ckpt"
    config = dckpt.CheckpointConfig(root=root, overlap_staging=True)
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1).result()
        handle = mgr.save(2)  # the background waits before taking the deferred copies ...
        with torch.no_grad():
            model.weight.add_(1.0)  # in place, outside optimizer.step(), without the hook
        go.touch()  # ... until this change was made
        with pytest.raises(dckpt.SaveError, match=r"weight changed in place after save"):
            handle.result()
        with pytest.raises(dckpt.SaveError):
            mgr.wait()  # the same error, latched for the next call, raised once
        assert mgr.wait() is None
    from dckpt.root.layout import committed_steps

    assert committed_steps(root) == [1]


def test_without_an_optimizer_nothing_is_deferred(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dckpt

    go = tmp_path / "go"  # the background's copies, were any deferred, wait for the change
    monkeypatch.setenv("DCKPT_FAULT", f"phase=stage,action=wait,path={go},seconds=300")
    model = nn.Linear(8, 8)
    before = model.weight.detach().clone()
    with dckpt.CheckpointManager(tmp_path / "ckpt", dckpt.TrainState(model)) as mgr:
        handle = mgr.save(1)
        with torch.no_grad():
            model.weight.add_(1.0)  # no optimizer hook guards it: it was copied in save()
        go.touch()
        handle.result()
        mgr.load()
    assert torch.equal(model.weight, before)


def test_a_saves_fate_is_one_word_and_a_commit_is_never_read_as_cancelled() -> None:
    from dckpt.errors import SaveError
    from dckpt.save.handle import Fate, SaveHandle, SaveResult, SaveTicket

    ticket = SaveTicket(3, 0.0)
    handle = SaveHandle(ticket)
    assert handle.fate is Fate.PENDING and not handle.done()
    result = SaveResult(step=3, path=Path("x"), bytes=1, files=1, stall_s=0.0, commit_s=0.1)
    assert ticket.finish(result, None)
    ticket.cancel(SaveError("the watchdog, a moment too late"))  # loses: it committed
    assert handle.fate is Fate.COMMITTED and handle.result() is result

    skipped = SaveTicket(4, 0.0)
    skipped.skip()
    assert SaveHandle(skipped).skipped and skipped.fate is Fate.SKIPPED

    late = SaveTicket(5, 0.0)
    with pytest.raises(SaveError, match="did not finish within"):
        SaveHandle(late).wait_staged(0.01)
    assert late.cancelled.is_set() and late.fate is Fate.CANCELLED
    late.finish(None, SaveError("the save was cancelled"))  # how the save thread ends it
    assert late.fate is Fate.CANCELLED and SaveHandle(late).staged.is_set()
