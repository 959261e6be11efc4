"""Retention (policy, crash mid-delete, the trainer's keep-last and milestones), the run lock,
and the gc / pin / unpin commands."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import dckpt_cli, torchrun_train
from lock_kit import renewing
from torch import nn

import dckpt
from dckpt.root.layout import committed_steps, list_checkpoints
from dckpt.root.retention import Candidate, RetentionPolicy, decide
from dckpt.root.upkeep import delete_checkpoints, recover


def _manager(root: Path, **config: object) -> dckpt.CheckpointManager:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    state = dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return dckpt.CheckpointManager(dckpt.CheckpointConfig(root=root, **config), state)


def test_policy_keeps_newest_last_milestones_pins_and_best() -> None:
    cands = [
        Candidate(step=s, milestone=s % 10 == 0, pinned=s == 4, metric=float(abs(s - 13)))
        for s in range(2, 41, 2)
    ]
    keep = {d.step for d in decide(cands, RetentionPolicy(keep_last=3, best_k=2))}
    kept = {d.step for d in decide(cands, RetentionPolicy(keep_last=3, best_k=2)) if d.keep}
    assert keep == set(range(2, 41, 2))
    assert kept == {36, 38, 40, 10, 20, 30, 4, 12, 14}
    maxi = decide(cands, RetentionPolicy(keep_last=2, best_k=1, best_mode="max"))
    assert {d.step for d in maxi if d.keep} == {38, 40, 10, 20, 30, 4}  # best: 40 (27)
    mini = decide(cands, RetentionPolicy(keep_last=2, best_k=1, best_mode="min"))
    assert {d.step for d in mini if d.keep} == {38, 40, 10, 20, 30, 4, 12, 14} - {14}
    assert all(d.keep for d in decide(cands, RetentionPolicy()))  # off: keep everything
    assert [d.reasons for d in decide(cands, RetentionPolicy(keep_last=2)) if d.step == 40] == [
        ("newest", "keep_last=2", "milestone")
    ]
    with pytest.raises(ValueError, match="at least 2"):
        RetentionPolicy(keep_last=1)
    with pytest.raises(ValueError, match="needs keep_last"):
        dckpt.CheckpointConfig(root=Path("/tmp/x"), best_k=2)


def test_trainer_keeps_exactly_the_newest_three_and_the_milestones(tmp_path: Path) -> None:
    args = ["--steps", "40", "--save-every", "2", "--keep-last", "3", "--milestone-every", "10"]
    proc = torchrun_train(tmp_path / "ckpt", *args)
    assert proc.returncode == 0, proc.stderr
    assert committed_steps(tmp_path / "ckpt") == [10, 20, 30, 36, 38, 40]
    assert "dckpt retention: deleted step(s)" in proc.stderr
    listing = json.loads(dckpt_cli("ls", str(tmp_path / "ckpt"), "--json").stdout)
    assert {r["step"]: r["milestone"] for r in listing} == {
        10: True, 20: True, 30: True, 36: False, 38: False, 40: True,
    }  # fmt: skip
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".trash-" in p.name]


def test_a_crash_between_rename_to_trash_and_delete_leaves_nothing_committed(
    tmp_path: Path,
) -> None:
    with _manager(tmp_path) as mgr:
        for step in (1, 2, 3):
            mgr.save(step).result()
    env = {**os.environ, "DCKPT_FAULT": "phase=retention,action=sigkill"}
    code = (
        "import sys; from dckpt.root.upkeep import delete_checkpoints as d; d(sys.argv[1], [1, 2])"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, check=False)
    assert proc.returncode == -9  # killed after the renames, before the deletes
    trash = [p.name for p in tmp_path.iterdir() if ".trash-" in p.name]
    assert len(trash) == 2
    assert committed_steps(tmp_path) == [3]  # trash never looks committed
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"
    actions = recover(tmp_path)
    assert sum("finished deleting" in a for a in actions) == 2
    assert not [p for p in tmp_path.iterdir() if ".trash-" in p.name]
    assert delete_checkpoints(tmp_path, [7]) == []  # not committed: nothing to do


def test_a_second_job_on_the_same_root_is_refused_naming_the_owner(tmp_path: Path) -> None:
    with _manager(tmp_path):
        code = (
            "import sys, torch, dckpt\n"
            "m = torch.nn.Linear(2, 2)\n"
            "try:\n"
            "    dckpt.CheckpointManager(sys.argv[1], dckpt.TrainState(m))\n"
            "except dckpt.CheckpointError as e:\n"
            "    print(type(e).__name__, e); sys.exit(7)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False
        )
        assert proc.returncode == 7, proc.stdout + proc.stderr
        assert "LockError" in proc.stdout and f"pid {os.getpid()}" in proc.stdout
        assert socket.gethostname() in proc.stdout
    assert not (tmp_path / ".dckpt-lock").exists()  # released on close


def test_a_stale_lock_of_a_dead_process_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = {
        "host": socket.gethostname(),
        "pid": dead.pid,
        "started": time.time() - 100,
        "run_id": "crashed-run",
        "token": "x",
        "lease_until": time.time() + 1000,
    }
    (tmp_path / ".dckpt-lock").write_text(json.dumps(lock))
    with _manager(tmp_path) as mgr:
        owner = json.loads((tmp_path / ".dckpt-lock").read_text())
        assert owner["pid"] == os.getpid() and owner["run_id"] == mgr.run_id
    assert "took over the lock of run crashed-run" in caplog.text
    assert f"pid {dead.pid} is no longer running" in caplog.text


def test_gc_pin_and_unpin_on_the_command_line(tmp_path: Path) -> None:
    with _manager(tmp_path) as mgr:
        for step in range(1, 7):
            mgr.save(step, milestone=step == 2).result()
    assert dckpt_cli("pin", str(tmp_path), "3").returncode == 0
    assert dckpt_cli("pin", str(tmp_path), "99").returncode == 2
    dry = json.loads(
        dckpt_cli("gc", str(tmp_path), "--keep-last", "2", "--dry-run", "--json").stdout
    )
    assert {d["step"] for d in dry["decisions"] if not d["keep"]} == {1, 4}
    assert committed_steps(tmp_path) == [1, 2, 3, 4, 5, 6]  # a dry run deletes nothing
    assert dckpt_cli("gc", str(tmp_path), "--keep-last", "1").returncode == 2  # too few
    done = dckpt_cli("gc", str(tmp_path), "--keep-last", "2")
    assert done.returncode == 0 and "deleted" in done.stdout
    assert committed_steps(tmp_path) == [2, 3, 5, 6]
    listing = {r["step"]: r for r in json.loads(dckpt_cli("ls", str(tmp_path), "--json").stdout)}
    assert listing[3]["pinned"] and listing[2]["milestone"]
    assert dckpt_cli("unpin", str(tmp_path), "3").returncode == 0
    assert dckpt_cli("unpin", str(tmp_path), "3").returncode == 2
    dckpt_cli("gc", str(tmp_path), "--keep-last", "2")
    assert committed_steps(tmp_path) == [2, 5, 6]
    assert [e.status for e in list_checkpoints(tmp_path)] == ["committed"] * 3


def test_a_requeued_job_of_the_same_run_takes_over_a_live_looking_lock_from_another_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The lock of the job before the requeue: another host, still renewing its lease.
    lock = {
        "host": "node-17", "pid": 4242, "started": time.time() - 100, "run_id": "slurm-991",
        "token": "x", "lease_until": time.time() + 1000,
    }  # fmt: skip
    with renewing(tmp_path / ".dckpt-lock", lock):
        with pytest.raises(dckpt.CheckpointError, match="slurm-991"):
            _manager(tmp_path)  # another run: refused while the holder renews
        monkeypatch.setenv("DCKPT_RUN_ID", "slurm-991")  # the requeue keeps the run id
        mgr = _manager(tmp_path)  # at once: the same run restarted
    with mgr:
        assert mgr.run_id == "slurm-991"
    assert "the same run restarted" in caplog.text


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_lock_that_is_a_fifo_or_a_symlink_is_taken_over_without_hanging_or_following(
    tmp_path: Path, kind: str
) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text('{"secret": 1}')
    root = tmp_path / "root"
    root.mkdir()
    if kind == "fifo":
        os.mkfifo(root / ".dckpt-lock")
    else:
        (root / ".dckpt-lock").symlink_to(outside)
    with _manager(root):  # would block forever on the FIFO before the fix
        assert json.loads((root / ".dckpt-lock").read_text())["pid"] == os.getpid()
    assert outside.read_text() == '{"secret": 1}'
