"""Preemption with real signals: SIGTERM or SIGUSR1 to ONE rank of a running 2-rank job.

The trainer only sets a flag in the handler; after the step in progress the ranks agree on one
step (an all-reduce of the flag), save it synchronously and exit 0. Expected: torchrun exits 0,
the agreed step is committed and verifies, and a rerun resumes from exactly that step and
continues the loss curve of an uninterrupted run bit for bit. An fp16 run shows the policy and
the GradScaler state in ``dckpt inspect --json``. In-process: a final save that cannot make
its deadline raises on every rank instead of claiming success.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    dckpt_cli,
    torchrun_start,
    torchrun_train,
    torchrun_train_beside,
    torchrun_workers,
)
from dist_harness import run_world

from dckpt.root.layout import committed_steps
from dckpt.root.verify import verify_checkpoint

pytestmark = pytest.mark.multiproc

STEPS = 40


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def _signal_one_rank_midway(root: Path, log: Path, sig: int, rank: int, *args: str) -> str:
    agent = torchrun_start(root, "--loss-log", str(log), *args)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and agent.poll() is None:
            if log.exists() and len(log.read_text().splitlines()) >= 5:
                break
            time.sleep(0.01)
        torchrun_workers(agent)[rank].send_signal(sig)
        out, _ = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert agent.returncode == 0, out[-12000:]
    return out


@pytest.mark.parametrize(
    ("sig", "rank", "precision", "save_every"),
    [(signal.SIGTERM, 1, "bf16", 1000), (signal.SIGUSR1, 0, "fp16", 3)],
    ids=["sigterm-rank1-bf16", "sigusr1-rank0-fp16-async-saves"],
)
def test_a_signal_to_one_rank_saves_the_agreed_step_and_exits_0(
    tmp_path: Path, sig: int, rank: int, precision: str, save_every: int
) -> None:
    args = ["--steps", str(STEPS), "--save-every", str(save_every), "--precision", precision]
    ref_log = str(tmp_path / "ref.jsonl")
    # The reference shares nothing with the preempted run (its own root and log): it runs beside.
    with torchrun_train_beside(tmp_path / "ref", *args, "--loss-log", ref_log) as ref:
        root, log = tmp_path / "run", tmp_path / "run.jsonl"
        # agreements every ~0.1 s: a few steps apart, so the signal lands between two checks
        out = _signal_one_rank_midway(root, log, sig, rank, *args, "--preempt-check-every", "0.1")

        name = signal.Signals(sig).name
        assert f"preempted ({name} on rank {rank})" in out, out[-2000:]
        agreed = max(_losses(log))  # the last step trained is the one both ranks agreed on
        assert agreed < STEPS, "the run finished before the signal: nothing was tested"
        assert f"the ranks agreed on step {agreed}" in out
        steps = committed_steps(root)
        assert steps[-1] == agreed and verify_checkpoint(root / f"step-{agreed:08d}").ok
        if save_every > STEPS:
            assert steps == [agreed]  # the one checkpoint of this run: the preemption save

        info = json.loads(dckpt_cli("inspect", str(root), "--json").stdout)
        assert info["step"] == agreed and info["precision"]["mode"] == precision
        if precision == "fp16":
            assert info["precision"]["grad_scaler"] is True
            assert info["precision"]["scaler"]["scale"] > 0

        again = torchrun_train(root, *args, "--loss-log", str(log))
        assert again.returncode == 0, again.stderr
        assert f"dckpt resume: step {agreed} from" in again.stderr
    assert ref.result().returncode == 0, ref.result().stderr
    want, got = _losses(tmp_path / "ref.jsonl"), _losses(log)
    after = range(agreed + 1, STEPS + 1)
    assert [got[s] for s in after] == [want[s] for s in after]  # bit-identical


def _deadline_world(
    rank: int,
    world: int,
    root: str,
    signal_at: int,
    deadline: float,
    check_every_s: float = 0.0,
    step_s: float = 0.0,
    signal_age_s: float = 0.0,
) -> Any:
    import torch

    import dckpt

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = dckpt.CheckpointConfig(root=Path(root), timeout_s=20)
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        mgr.watch_preemption(deadline_s=deadline, check_every_s=check_every_s)
        t0 = time.monotonic()
        for step in range(1, 60):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            time.sleep(step_s)
            if rank == 1 and step == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, to this rank only
                watch = mgr._stop._preemption
                assert watch is not None and watch.received_at is not None
                watch.received_at -= signal_age_s  # as if the signal came that long ago
            try:
                if mgr.preempted(step):
                    watch = mgr._stop._preemption
                    return {
                        "stopped_at": step,
                        "checks": mgr._stop.checks,
                        "elapsed_s": time.monotonic() - t0,
                        "first_signal": mgr._stop._first_signal,  # as the ranks agreed on it
                        "received_at": watch.received_at if watch is not None else None,
                    }
            except dckpt.SaveError as exc:
                return {"error": str(exc), "step": step}
    return {"stopped_at": None}


def test_the_ranks_agree_on_the_step_and_a_missed_deadline_raises(tmp_path: Path) -> None:
    # checks at every step: each reads the agreement the step before issued, so a signal
    # after step 4 is agreed on after step 5, by both ranks
    out = run_world(_deadline_world, 2, str(tmp_path / "a"), 4, 30.0)
    assert [r["stopped_at"] for r in out] == [5, 5], out
    assert committed_steps(tmp_path / "a") == [5]

    slow = {"DCKPT_FAULT": "phase=write_shards,rank=0,action=sleep,seconds=4"}
    out = run_world(_deadline_world, 2, str(tmp_path / "b"), 2, 1.0, env=slow, timeout=120)
    for r in out:
        assert r["step"] == 3 and "did not commit before the deadline" in r["error"]

    # The deadline runs from the signal, not from the agreement: a signal an hour old leaves
    # no time for a 10-minute deadline, on rank 0 too, which received none.
    out = run_world(_deadline_world, 2, str(tmp_path / "c"), 2, 600.0, 0.0, 0.0, 3600.0)
    for r in out:
        assert r["step"] == 3, out
        assert "no time left before the preemption deadline to save step 3" in r["error"], out
    assert committed_steps(tmp_path / "c") == []


def test_checks_come_about_check_every_s_apart_and_still_agree_on_one_step(
    tmp_path: Path,
) -> None:
    # 20 ms steps, an agreement every ~0.1 s: about one collective every 5 steps, not every
    # step; a signal to rank 1 after step 20 is still agreed on by both, within two intervals
    out = run_world(_deadline_world, 2, str(tmp_path), 20, 30.0, 0.1, 0.02)
    stopped = [r.get("stopped_at") for r in out]
    assert stopped[0] == stopped[1] and stopped[0] is not None, out
    assert 20 < stopped[0] <= 20 + 2 * 10, out  # at most two intervals (of <= 10 steps here)
    # about one agreement per check_every_s of training, however long a step took here (a
    # loaded machine makes the steps longer, and so fewer of them per agreement)
    assert out[0]["checks"] == out[1]["checks"] <= out[0]["elapsed_s"] / 0.1 + 3, out
    assert out[0]["checks"] < stopped[0], out  # not one at every step
    assert committed_steps(tmp_path) == [stopped[0]]
    # the final save's deadline runs from the signal, whose time rode the agreement: rank 0,
    # which received none, holds rank 1's (to the millisecond the agreement carries)
    assert out[0]["received_at"] is None and out[1]["received_at"] is not None, out
    assert out[0]["first_signal"] == out[1]["first_signal"], out
    assert out[0]["first_signal"] == pytest.approx(out[1]["received_at"], abs=1e-3), out


def _split_world(rank: int, world: int, root: str) -> Any:
    import torch

    import dckpt

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = dckpt.CheckpointConfig(root=Path(root), timeout_s=20, async_save=True, keep_last=2)
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        mgr.watch_preemption(deadline_s=30.0, check_every_s=0.0)
        for step in range(1, 10):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            if step <= 3:
                mgr.save(step)
            if step == 4 and rank == 1:  # rank 1's save of step 3 ends (waited for) ...
                deadline = time.monotonic() + 60
                while mgr._saver.current is not None and time.monotonic() < deadline:
                    time.sleep(0.01)
            running = mgr._saver.current is not None  # ... rank 0's sleeps in retention
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)
            if mgr.preempted(step):
                return {"stopped_at": step, "running": running}
    return {"stopped_at": None}


def test_ranks_that_see_the_save_in_flight_differently_take_the_same_branches(
    tmp_path: Path,
) -> None:
    # When the ranks agree to stop, rank 0 is still in the older save (its retention, after
    # the commit was announced) and rank 1 is done with it. A rank that decided from its own
    # view made a collective the other skipped, and gloo aborted it (box sizes differ).
    # Rank 0's retention sleeps 8 s (steps 3 and 4 delete one each): from there to the
    # ranks' agreement at step 4 is a step and rank 1's wait for its own save to end (well
    # under a second here, alone; it was 1 s of sleep, which a loaded machine outran).
    slow = {"DCKPT_FAULT": "phase=retention,rank=0,action=sleep,seconds=8"}
    out = run_world(_split_world, 2, str(tmp_path), env=slow, timeout=300)
    assert [r["stopped_at"] for r in out] == [4, 4], out
    assert [r["running"] for r in out] == [True, False], "the split was not reached: " + str(out)
    assert committed_steps(tmp_path) == [3, 4]
    assert verify_checkpoint(tmp_path / "step-00000004").ok
