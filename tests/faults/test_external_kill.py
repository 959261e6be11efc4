"""SIGKILL from outside, at a moment nobody told dckpt about (faults 1 and 4, as a user sees them).

A real 2-rank torchrun of launch/train.py saves every other step in the background. The test
waits until a checkpoint is committed and an asynchronous save is in flight (its tmp dir is
visible), then SIGKILLs one worker chosen at random (seeded) after a random delay. Expected:
the job ends by itself (torchrun tears the world down; no hang), every committed checkpoint
verifies, nothing committed before the kill is lost, and a rerun of the same command resumes
from the newest committed step and continues the loss curve of an uninterrupted run exactly.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import torchrun_start, torchrun_train, torchrun_train_beside, torchrun_workers
from fault_kit import Check, Trials, capture, check

from dckpt.root.layout import committed_steps

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

STEPS = 24
ARGS = ["--steps", str(STEPS), "--save-every", "2", "--d-model", "96"]
TRIALS = 2


def _losses(log: Path) -> dict[int, float]:
    lines = log.read_text().splitlines() if log.exists() else []
    return {rec["step"]: rec["loss"] for rec in map(json.loads, lines)}


def test_sigkill_of_one_rank_during_an_async_save(tmp_path: Path, fault_trials: Trials) -> None:
    # The reference shares nothing with the trials (its own root and log), nor do the trials
    # with each other: all run at once, filling the cores each job leaves idle. The reference
    # is only read once a trial's run was killed and rerun.
    rng = random.Random(20261130)
    draws = []
    for _ in range(TRIALS):  # drawn in the same order as one trial after the other would
        victim = rng.randrange(2)
        draws.append((victim, rng.uniform(0.0, 0.05)))
    with (
        torchrun_train_beside(
            tmp_path / "ref", *ARGS, "--loss-log", str(tmp_path / "ref.jsonl")
        ) as pending,
        ThreadPoolExecutor(TRIALS) as pool,
    ):
        runs = [
            pool.submit(_trial, tmp_path, trial, victim, delay, pending)
            for trial, (victim, delay) in enumerate(draws)
        ]
        results = [run.result() for run in runs]
    failures: list[str] = []
    for trial, (case, outcome, why) in enumerate(results):
        fault_trials.record_check("SIGKILL from outside during an async save", case, outcome,
                                  detail="; ".join(why))  # fmt: skip
        if why or not outcome.ok:
            failures.append(f"trial {trial}: {why + outcome.problems}")
    assert not failures, failures


def _trial(
    tmp_path: Path,
    trial: int,
    victim: int,
    delay: float,
    pending: Future[subprocess.CompletedProcess[str]],
) -> tuple[str, Check, list[str]]:
    """One trial: its case, the check of its root, and what went wrong."""
    root, log = tmp_path / f"run{trial}", tmp_path / f"run{trial}.jsonl"
    agent = torchrun_start(root, "--loss-log", str(log), *ARGS)
    why: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and agent.poll() is None:
            if root.exists() and committed_steps(root) and list(root.glob("*.tmp-*")):
                break  # something committed, and a save in flight right now
            time.sleep(0.002)
        time.sleep(delay)
        workers = torchrun_workers(agent)
        listed = committed_steps(root) if root.exists() else []
        if agent.poll() is not None or victim not in workers:
            why.append("the run ended before the kill: no fault was injected")
        else:
            workers[victim].send_signal(signal.SIGKILL)
        # torchrun ends the other rank within its 30 s shutdown grace; more than 150 s is a
        # job that waits on its lost rank (a hang), not a slow machine
        t0 = time.monotonic()
        agent.communicate(timeout=300)
        if time.monotonic() - t0 > 150:
            why.append(f"the job took {time.monotonic() - t0:.0f} s to end after the kill")
        if agent.returncode == 0:
            why.append("the job exited 0 after losing a rank")
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    # Committed directories are never written into, and each one's manifest (written
    # before the kill) holds its digests: verifying them now is checking them bit for bit.
    outcome = check(root, capture(root))
    gone = sorted(set(listed) - set(committed_steps(root)))
    if gone:
        outcome.lost += len(gone)
        outcome.problems.append(f"steps {gone}, committed before the kill, are gone")
    resumed = torchrun_train(root, *ARGS, "--loss-log", str(log))
    if resumed.returncode != 0:
        why.append(f"the rerun failed: {resumed.stderr[-800:]}")
    ref = pending.result()
    assert ref.returncode == 0, ref.stderr
    want = _losses(tmp_path / "ref.jsonl")
    got = _losses(log)
    found = re.search(r"dckpt resume: step (\d+) from", resumed.stderr)
    start = int(found.group(1)) if found else 0
    if start < max(listed, default=0):
        why.append(f"resumed from step {start}, but step {max(listed)} was committed before")
    after = list(range(start + 1, STEPS + 1))
    if [got.get(s) for s in after] != [want[s] for s in after]:
        why.append("the resumed run's losses differ from the uninterrupted run's")
    case = f"kill rank {victim}; {len(listed)} committed before; resumed at {start}"
    return case, outcome, why
