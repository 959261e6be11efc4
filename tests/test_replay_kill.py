"""The issue's checks of an exact resume, under torchrun with a real SIGKILL: an eval after
``save()`` makes the replayed steps differ and the restart names the first one; an eval
before it replays identically; an allowed LR change that the restored optimizer overrides is
named, and its application seen. (The journal, the comparison and the rest: test_replay.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import torchrun_job

from dckpt.root.layout import committed_steps
from dckpt.root.manifest import read_manifest
from dckpt.root.replay_journal import read_journal

LOOP = Path(__file__).resolve().parent / "replay_loop.py"


def _loop(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """tests/replay_loop.py under torchrun, 2 ranks on gloo."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return torchrun_job(LOOP, ["--root", str(root), *args], env=env, timeout=180)


def _crash_with_eval_after_save(tmp_path: Path) -> None:
    """The loop with its eval after ``save()``, SIGKILLed after step 6 (step 4 committed, steps
    5 and 6 journaled); a copy of its root, taken before the restart, is the raising one's."""
    root = tmp_path / "after"
    crashed = _loop(root, "--eval", "after", "--kill-after", "6")
    assert crashed.returncode != 0 and committed_steps(root) == [4]  # SIGKILLed after step 6
    journal = read_journal(root, 4)
    assert journal is not None and [s for s, _ in journal.entries] == [5, 6], journal
    assert journal.save_id == read_manifest(root / "step-00000004").save_id
    shutil.copytree(root, tmp_path / "raising", symlinks=True)


def _eval_after_save(tmp_path: Path) -> None:
    root = tmp_path / "after"
    restart = _loop(root, "--eval", "after")
    assert restart.returncode == 0, restart.stderr
    err = restart.stderr
    assert "replay        steps 5..6 of the run that stopped to compare (exact)" in err, err
    # One line names the first differing step, both values and the likely causes.
    line = next(x for x in err.splitlines() if "[FAIL] replay:" in x)
    assert "step 5 differs from the run that stopped:" in line and " now, " in line, line
    assert "an eval or a sample after save()" in line and "not deterministic" in line, line
    assert "[ok  ] loss watch" in err  # the statistical watch cannot see it: the replay does

    # The journal keeps the run that went on after the save: a second restart is no more
    # exact than the first, and says so again.
    again = _loop(root, "--eval", "after")
    assert again.returncode == 0, again.stderr
    assert "[FAIL] replay: step 5 differs from the run that stopped" in again.stderr


def _eval_after_save_raising(tmp_path: Path) -> None:
    """With loss_watch="raise" the difference raises LossDeviationError on rank 0 (the loop
    exits 3; torchrun stops the other rank)."""
    raising = _loop(tmp_path / "raising", "--eval", "after", "--loss-watch", "raise")
    assert raising.returncode != 0 and "exitcode  : 3" in raising.stderr, raising.stderr


def _crash_with_eval_before_save(tmp_path: Path) -> None:
    """The loop with its eval before ``save()``, SIGKILLed after step 6 (step 4 committed);
    two copies of its root, taken before the restart, are the LR change's roots."""
    root = tmp_path / "before"
    crashed = _loop(root, "--eval", "before", "--kill-after", "6")
    assert crashed.returncode != 0 and committed_steps(root) == [4]
    for copy in ("lr", "lr-applied"):
        shutil.copytree(root, tmp_path / copy, symlinks=True)


def _eval_before_save(tmp_path: Path) -> None:
    restart = _loop(tmp_path / "before", "--eval", "before")
    assert restart.returncode == 0, restart.stderr
    assert "[ok  ] replay: steps 5..6 identical to the run that stopped" in restart.stderr
    assert "[FAIL] replay" not in restart.stderr


def _lr_change(tmp_path: Path) -> None:
    """Resumed from step 4 (a copy of the eval-before run's root: lr 0.1 in its run config and
    its optimizer) with lr 0.05 allowed, once as is and once with the LR set after resume()."""
    root = tmp_path / "lr"
    changed = _loop(root, "--steps", "6", "--lr", "0.05", "--allow", "lr")
    assert changed.returncode == 0, changed.stderr
    err = changed.stderr
    assert (
        "lr changed 0.1 -> 0.05, but the optimizer's param_groups came back from the "
        "checkpoint holding 0.1" in err
    ), err
    assert 'for g in optimizer.param_groups: g["lr"] = 0.05' in err
    assert "dckpt: lr is still 0.1 (the optimizer's param_groups) at the first optimizer" in err
    applied = _loop(tmp_path / "lr-applied", "--steps", "6", "--lr", "0.05", "--allow", "lr",
                    "--apply-lr")  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    assert "dckpt: lr 0.05 is applied (the optimizer's param_groups)" in applied.stderr
    assert "is still 0.1" not in applied.stderr


@pytest.mark.multiproc
def test_replay_names_the_step_an_eval_after_save_shifts_and_passes_an_eval_before_it(
    tmp_path: Path,
) -> None:
    """The issue's checks: the two crashed runs side by side, then the five restarts, three at a
    time (each job leaves a core half idle); the LR change resumes copies of the eval-before
    run's crashed root (eight launches in all)."""
    with ThreadPoolExecutor(3) as pool:
        crash_after = pool.submit(_crash_with_eval_after_save, tmp_path)
        _crash_with_eval_before_save(tmp_path)
        crash_after.result()
        restarts = (_eval_after_save, _eval_after_save_raising, _eval_before_save, _lr_change)
        for job in [pool.submit(f, tmp_path) for f in restarts]:
            job.result()
