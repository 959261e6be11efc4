"""Save-path and root behaviours that no other test pins down.

- the snapshot of a non-tensor value: a dict an ``extra`` stateful hands out, changed in
  place right after an asynchronous ``save()`` returned, is saved as it was at ``save()``;
- the watchdog leaves a save alone once it is decided: a committed save still busy with
  retention past ``save_timeout_s`` is reported committed, and nothing raises later;
- ``best_k`` retention over the metric real ``save(metric=...)`` calls stored, in both modes;
- the run lock's lease is renewed while its job runs, so another host's job stays refused
  after the first lease would have run out (and is let in once renewal stops);
- ``dckpt ls``'s ``verified`` column, from the records ``dckpt verify`` writes: ok, failed,
  and no verdict once the step was saved again;
- ``if_busy="skip"`` decided by all ranks together: with rank 0 still busy (retention held)
  and rank 1 idle, both skip the same save.

Single-rank cases run in this process (the manager needs no process group for one rank);
the skip agreement spawns one 2-rank gloo world.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import dckpt_cli
from dist_harness import run_world
from tiny_training import model as _tiny_model
from tiny_training import step as _tiny_step
from torch import nn

import dckpt
from dckpt.root.layout import committed_steps, step_dir_name
from dckpt.root.manifest import read_manifest
from dckpt.root.retention import BestMode
from dckpt.root.verify import verify_checkpoint
from dckpt.save.handle import Fate


def _state(model: nn.Linear | None = None, **extra: Any) -> dckpt.TrainState:
    torch.manual_seed(0)
    model = model or nn.Linear(4, 2)
    return dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), extra=extra)


class _Cursor:
    """A stateful whose ``state_dict`` hands out its own live dict, as many user objects do:
    a change made after ``save()`` reaches the saved value unless the save copied it."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {
            "position": 7,
            "seen": [1, 2, 3],
            "tags": {"a": ["x"]},
            "ids": {10, 11},  # a set is one value to DCP and to pytree: only a copy keeps it
        }

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self.state = state_dict


# --- the snapshot of non-tensor values ------------------------------------------------------


def test_a_dict_changed_in_place_after_an_async_save_returned_is_saved_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The background save waits before it makes its tmp dir until the change below is made,
    # so it surely lands before a byte of the checkpoint is written.
    go = tmp_path / "go"
    monkeypatch.setenv("DCKPT_FAULT", f"phase=make_tmp,action=wait,path={go},seconds=300,step=1")
    cursor = _Cursor()
    config = dckpt.CheckpointConfig(root=tmp_path / "ckpt", async_save=True)
    with dckpt.CheckpointManager(config, _state(cursor=cursor)) as mgr:
        handle = mgr.save(1)
        assert not handle.done(), "the save was not held: the change would prove nothing"
        cursor.state["seen"].append(99)
        cursor.state["tags"]["a"].append("y")
        cursor.state["ids"].add(12)
        cursor.state["position"] = 8
        go.touch()
        handle.result()
        mgr.load(step=1)
    assert cursor.state == {"position": 7, "seen": [1, 2, 3], "tags": {"a": ["x"]}, "ids": {10, 11}}


# --- the watchdog and a decided save --------------------------------------------------------


def test_a_committed_save_still_in_retention_past_save_timeout_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = dckpt.CheckpointConfig(
        root=tmp_path, async_save=True, keep_last=2, timeout_s=5.0, save_timeout_s=5.0
    )
    with dckpt.CheckpointManager(config, _state()) as mgr:
        mgr.save(1).result()
        mgr.save(2).result()
        # Save 3 is the first with a retention victim (step 1): after its commit, retention
        # sleeps past save_timeout_s, with the save decided but not yet ended (it starts
        # after the commit, so however slow the save was, it ends past the deadline).
        sleep = config.watchdog_s + 2
        monkeypatch.setenv("DCKPT_FAULT", f"phase=retention,action=sleep,seconds={sleep}")
        started = time.monotonic()
        handle = mgr.save(3)
        result = handle.result()
        assert time.monotonic() - started > config.watchdog_s  # it did outlive the deadline
        monkeypatch.delenv("DCKPT_FAULT")
        assert handle.fate is Fate.COMMITTED
        assert result.step == 3
        assert mgr.wait() is None  # nothing latched
        mgr.save(4).result()  # the manager is still usable: no stuck save, no error
    assert "is stuck" not in caplog.text, caplog.text
    assert committed_steps(tmp_path) == [3, 4]
    assert verify_checkpoint(tmp_path / step_dir_name(3)).ok


# --- best_k over the metric real saves stored -----------------------------------------------

# By min, the best two are 4 and 2, and the third best (3) must go; by max, 1 and 6.
METRICS = {1: 5.0, 2: 1.0, 3: 1.5, 4: 0.5, 5: 3.0, 6: 4.0}


@pytest.mark.parametrize(
    ("mode", "kept"),
    [("min", [2, 4, 5, 6]), ("max", [1, 5, 6])],  # the best two, and the two newest
)
def test_best_k_keeps_the_best_by_the_saved_metric_and_deletes_the_rest(
    tmp_path: Path, mode: BestMode, kept: list[int]
) -> None:
    config = dckpt.CheckpointConfig(
        root=tmp_path, async_save=False, keep_last=2, best_k=2, best_mode=mode
    )
    with dckpt.CheckpointManager(config, _state()) as mgr:
        for step, metric in METRICS.items():
            mgr.save(step, metric=metric)
    assert committed_steps(tmp_path) == kept
    for step in kept:
        assert read_manifest(tmp_path / step_dir_name(step)).metric == {"value": METRICS[step]}
    assert not [p for p in tmp_path.iterdir() if ".trash-" in p.name]


# --- the run lock's lease -------------------------------------------------------------------

# Another host's job, played by a process whose host name is another: on the same host the
# lock goes by whether the owner's pid lives, on another only by the lease.
_OTHER_HOST = """
import socket, sys
socket.gethostname = lambda: "node-elsewhere"
from dckpt.errors import LockError
from dckpt.root.lock import RunLock
lock = RunLock(__import__("pathlib").Path(sys.argv[1]), "other-run", 6.0)
try:
    lock.acquire()
except LockError as exc:
    print("refused:", exc)
    sys.exit(7)
print("took:", lock.took_over)
lock.release()
"""


def _other_host_job(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _OTHER_HOST, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_run_lock_lease_is_renewed_so_another_host_stays_refused(tmp_path: Path) -> None:
    from dckpt.root.lock import RunLock

    # CheckpointConfig asks for a lease of at least 10 s; RunLock itself takes a shorter one
    # (renewed every 2 s: a renewal late by seconds on a loaded machine still keeps it).
    lock = RunLock(tmp_path, "long-run", lease_s=6.0)
    lock.acquire()
    path = tmp_path / ".dckpt-lock"
    try:
        first = json.loads(path.read_text())
        deadline = time.monotonic() + 120  # until a renewal was written (a hang's bound)
        while json.loads(path.read_text()) == first and time.monotonic() < deadline:
            time.sleep(0.05)
        renewed = json.loads(path.read_text())
        assert renewed["token"] == first["token"]  # still this job's record
        assert renewed["lease_until"] > first["lease_until"]
        assert renewed["lease_until"] > time.time()
        refused = _other_host_job(tmp_path)
        assert refused.returncode == 7, refused.stdout + refused.stderr
        assert "in use by run long-run" in refused.stdout
        assert json.loads(path.read_text())["token"] == first["token"]
        # The refusal came from the lease: once renewal stops and it runs out, the same job
        # from the other host is let in.
        lock.abandon()
        taken = _other_host_job(tmp_path)  # watches a whole lease in which nothing renews
        assert taken.returncode == 0, taken.stdout + taken.stderr
        assert "its renewal count stayed at" in taken.stdout
    finally:
        lock.release()


# --- dckpt ls's verified column -------------------------------------------------------------


def _verdicts(root: Path) -> dict[int, str | None]:
    proc = dckpt_cli("ls", str(root), "--json")
    assert proc.returncode == 0, proc.stderr
    return {r["step"]: r["verified"] for r in json.loads(proc.stdout) if r["tier"] == "durable"}


def _table_row(root: Path, step: int) -> list[str]:
    proc = dckpt_cli("ls", str(root))
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.replace("┃", "│").split("│")]
        if len(cells) > 2 and cells[1] == str(step):
            return cells
    raise AssertionError(f"no row for step {step}:\n{proc.stdout}")


def test_ls_shows_the_verify_verdict_and_drops_it_when_the_step_is_saved_again(
    tmp_path: Path,
) -> None:
    model = nn.Linear(4, 2)
    config = dckpt.CheckpointConfig(root=tmp_path, async_save=False)
    with dckpt.CheckpointManager(config, _state(model)) as mgr:

        def resave(step: int) -> None:
            with torch.no_grad():
                model.weight.add_(1.0)  # other bytes: another checkpoint of this step
            mgr.save(step)

        mgr.save(1)
        mgr.save(2)
        assert _verdicts(tmp_path) == {1: None, 2: None}
        assert dckpt_cli("verify", str(tmp_path)).returncode == 0
        assert _verdicts(tmp_path) == {1: "ok", 2: "ok"}
        assert "ok" in _table_row(tmp_path, 2)

        shard = next((tmp_path / step_dir_name(2)).glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        assert dckpt_cli("verify", str(tmp_path)).returncode == 3
        assert _verdicts(tmp_path) == {1: "ok", 2: "failed"}
        assert "failed" in _table_row(tmp_path, 2)

        resave(2)  # the failed verdict was about the copy now replaced
        assert _verdicts(tmp_path) == {1: "ok", 2: None}
        assert dckpt_cli("verify", str(tmp_path), "--step", "2").returncode == 0
        assert _verdicts(tmp_path) == {1: "ok", 2: "ok"}
        resave(2)  # nor may an ok verdict outlive the bytes it vouched for
        assert _verdicts(tmp_path) == {1: "ok", 2: None}
        row = _table_row(tmp_path, 2)
        assert "ok" not in row and "failed" not in row, row


# --- if_busy="skip", agreed by every rank ---------------------------------------------------


def _skip_while_rank0_tidies(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    model, opt = _tiny_model(width=32)
    config = dckpt.CheckpointConfig(
        root=Path(root), if_busy="skip", async_save=True, keep_last=2, timeout_s=10
    )
    taken: list[int] = []
    skipped: list[int] = []
    try:
        with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:

            def save(step: int) -> dckpt.SaveHandle:
                _tiny_step(model, opt, seed=step, width=32)
                handle = mgr.save(step)
                (skipped if handle.skipped else taken).append(step)
                return handle

            save(1).result()
            save(2).result()
            # Save 3 deletes step 1; rank 0's retention then waits, after the commit was
            # announced, until rank 0 saw save 4 decided: rank 1's part of save 3 ends while
            # rank 0's goes on, however fast or slow the machine is.
            gate = Path(root).parent / "tidied"
            os.environ["DCKPT_FAULT"] = f"phase=retention,action=wait,path={gate},seconds=300"
            third = save(3)
            if rank == 0:
                while not (Path(root) / step_dir_name(3)).is_dir():  # committed
                    time.sleep(0.01)
            else:
                third.result()
            dist.barrier()
            # Now rank 0 is busy and rank 1 is idle: both must skip save 4.
            save(4)
            if rank == 0:
                gate.touch()
            mgr.wait()
            os.environ.pop("DCKPT_FAULT")
            save(5).result()
    except Exception as exc:
        return {"taken": taken, "skipped": skipped, "error": f"{type(exc).__name__}: {exc}"}
    return {"taken": taken, "skipped": skipped, "error": None}


@pytest.mark.multiproc
def test_skip_is_decided_by_all_ranks_when_only_one_rank_is_busy(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_world(_skip_while_rank0_tidies, 2, str(root), timeout=300)
    assert [r["error"] for r in results] == [None, None], results
    assert results[0]["skipped"] == results[1]["skipped"] == [4], results
    assert results[0]["taken"] == results[1]["taken"] == [1, 2, 3, 5], results
    assert committed_steps(root) == [3, 5]
    for step in (3, 5):
        step_dir = root / step_dir_name(step)
        assert {f.rank for f in read_manifest(step_dir).files} == {0, 1}
        assert verify_checkpoint(step_dir).ok
    assert not list(root.glob("*.tmp-*"))


class _Counts:
    """A stateful holding one tensor the run may widen (int32 counts that outgrow it)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self.t = state_dict["t"]


def test_a_tensor_whose_dtype_changed_between_saves_is_saved_in_its_new_dtype(
    tmp_path: Path,
) -> None:
    # Staging buffers are kept from save to save; one of the old dtype must not take the new
    # tensor's values (a copy_ would cast them: 2**40 does not fit in int32).
    counts = _Counts(torch.arange(4, dtype=torch.int32))
    with dckpt.CheckpointManager(tmp_path, _state(counts=counts)) as mgr:
        mgr.save(1).result()
        counts.t = torch.tensor([2**40, 1, 2, 3], dtype=torch.int64)
        mgr.save(2).result()
        counts.t = torch.zeros(4, dtype=torch.int64)
        mgr.load(step=2)
    assert counts.t.dtype == torch.int64
    assert counts.t.tolist() == [2**40, 1, 2, 3]
