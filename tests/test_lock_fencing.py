"""The run lock without clocks, and fencing (issue 41): a second job is refused while the first
lives whatever the clocks of the two hosts say, and a job that lost its lock (a takeover that
was wrong) commits nothing more and moves nothing it did not find or write.

- Another host is a process whose ``socket.gethostname`` says so (the lock record names the
  host; the kernel's is not consulted); its clock is ``time.time`` shifted by an hour either
  way, in that process only. The old rule compared the record's lease with the taker's wall
  clock: an hour ahead took a live job's lock over at once.
- The holder renews its lease (``beat``) every third of it; a taker on another host watches
  the record on its own monotonic clock and takes over only after a whole lease without a
  renewal. A lock of a job that is gone is taken over after that lease, whatever the clocks.
- Another pid namespace on this host (a container or pod sharing the node's host name, made
  here by ``unshare --pid --fork --mount-proc``) is watched like another host: pid 5 there is
  not pid 5 here, and the old rule took a live job's lock over because pid 5 here was another
  process. Where the record names this host, boot and pid namespace, or is an older dckpt's
  record without them, a dead pid is taken over at once, as before.
- Fencing on both root kinds is in tests/tiers/test_root_contract.py; here, on a directory:
  a step another job committed while this one held the root is never moved aside as
  "superseded" by this job's rollback, nor deleted by its retention.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from lock_kit import gone, unshare_or_skip
from torch import nn

import dckpt
from dckpt.root.layout import committed_steps, list_checkpoints

_OTHER_HOST = """
import socket, sys, time
socket.gethostname = lambda: "node-elsewhere"
_wall = time.time
time.time = lambda: _wall() + float(sys.argv[2])  # this host's clock, off by that much
from dckpt.errors import LockError
from dckpt.root.lock import RunLock
lock = RunLock(__import__("pathlib").Path(sys.argv[1]), "other-run", float(sys.argv[3]))
t0 = time.monotonic()
try:
    lock.acquire()
except LockError as exc:
    print("refused after %.1f s:" % (time.monotonic() - t0), exc)
    sys.exit(7)
print("took after %.1f s:" % (time.monotonic() - t0), lock.took_over)
lock.release()
"""


def _other_host(root: Path, skew_s: float, lease_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _OTHER_HOST, str(root), str(skew_s), str(lease_s)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.faults
@pytest.mark.parametrize("skew_s", [3600.0, -3600.0], ids=["an-hour-ahead", "an-hour-behind"])
def test_a_live_job_keeps_its_lock_whatever_the_other_hosts_clock_says(
    tmp_path: Path, skew_s: float, fault_trials: Any
) -> None:
    with fault_trials.trial("a skewed clock", f"another host's clock {skew_s:+.0f} s"):
        _live_lock_against_a_skewed_clock(tmp_path, skew_s)


def _live_lock_against_a_skewed_clock(tmp_path: Path, skew_s: float) -> None:
    from dckpt.root.lock import RunLock

    # renews every 2 s: a renewal late by seconds on a loaded machine still keeps the lock
    lock = RunLock(tmp_path, "long-run", lease_s=6.0)
    lock.acquire()
    try:
        refused = _other_host(tmp_path, skew_s, 6.0)
        assert refused.returncode == 7, refused.stdout + refused.stderr
        assert "in use by run long-run" in refused.stdout and "renewed" in refused.stdout
        assert json.loads((tmp_path / ".dckpt-lock").read_text())["run_id"] == "long-run"
        lock.check_held()  # still this job's: it may commit
        # The job dies (its renewals stop): the other host takes over once a whole lease
        # passed without one, on its own clock, however far off its wall clock is.
        lock.abandon()
        taken = _other_host(tmp_path, skew_s, 6.0)
        assert taken.returncode == 0, taken.stdout + taken.stderr
        assert "its renewal count stayed at" in taken.stdout
        with pytest.raises(dckpt.LockError, match="commits nothing more"):
            lock.check_held()  # the old owner, fenced
    finally:
        lock.release()


# --- pid namespaces --------------------------------------------------------------------------

_ATTEMPT = """
import os, sys, time
from dckpt.errors import LockError
from dckpt.root.lock import RunLock
lock = RunLock(__import__("pathlib").Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
t0 = time.monotonic()
try:
    lock.acquire()
except LockError as exc:
    print("refused after %.1f s:" % (time.monotonic() - t0), exc)
    sys.exit(7)
print("took after %.1f s:" % (time.monotonic() - t0), lock.took_over, flush=True)
if sys.argv[4] == "die":
    os._exit(0)  # dies holding it: the record stays, and is never renewed again
lock.release()
"""


def _attempt(
    root: Path, run_id: str, lease_s: float, prefix: list[str], then: str = "release"
) -> subprocess.CompletedProcess[str]:
    """A RunLock.acquire by a new process (``prefix``: in a new pid namespace); 7 if refused."""
    cmd = [*prefix, sys.executable, "-c", _ATTEMPT, str(root), run_id, str(lease_s), then]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_a_live_job_in_another_pid_namespace_keeps_its_lock(tmp_path: Path) -> None:
    """The bug: a second launch in a container on the same node found the holder's pid gone
    (or another process) in its own namespace, took the live job's lock and trained."""
    from dckpt.root.lock import RunLock

    prefix = unshare_or_skip()
    lock = RunLock(tmp_path, "long-run", lease_s=6.0)  # renews every 2 s
    lock.acquire()
    try:
        refused = _attempt(tmp_path, "second-run", 6.0, prefix)
        out = refused.stdout + refused.stderr
        assert refused.returncode == 7, out
        assert f"in use by run long-run (pid {os.getpid()} on {socket.gethostname()}," in out
        assert "in another pid namespace on this host (a container): it was renewed" in out
        assert json.loads((tmp_path / ".dckpt-lock").read_text())["run_id"] == "long-run"
        lock.check_held()  # still this job's: it may commit
    finally:
        lock.release()


def test_a_dead_job_in_another_pid_namespace_is_taken_over_after_one_lease(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its pid there (1) is a live process here (init): judged here, it looked like "another
    process now", and was taken at once. Watched, it is taken once a lease passed unrenewed."""
    from conftest import dckpt_cli

    from dckpt.root.lock import RunLock

    prefix = unshare_or_skip()
    left = _attempt(tmp_path, "dead-run", 3.0, prefix, then="die")
    assert left.returncode == 0, left.stdout + left.stderr
    record = json.loads((tmp_path / ".dckpt-lock").read_text())
    assert record["pid"] == 1, record  # the first process of its namespace; here, init
    # `dckpt gc` cannot watch a lease: it names the holder, and where it is, and refuses.
    gc = dckpt_cli("gc", str(tmp_path), "--keep-last", "2")
    assert gc.returncode == 2, gc.stdout + gc.stderr
    held = f"is held by run dead-run (pid {record['pid']} on {socket.gethostname()},"
    assert held in gc.stderr and "in another pid namespace on this host" in gc.stderr
    lock = RunLock(tmp_path, "next-run", lease_s=3.0)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        lock.acquire()
    waited = time.monotonic() - t0
    try:
        assert waited >= 3.0, (waited, lock.took_over)  # its lease, not at once
        assert "run dead-run" in str(lock.took_over), lock.took_over
        assert "its renewal count stayed at 0" in str(lock.took_over), lock.took_over
        assert (
            "in another pid namespace on this host (a container); waiting up to 3 s (its lease)"
        ) in caplog.text
    finally:
        lock.release()


# The record a dead job of this host name left, changed: (fields, watched, what the log says)
_DEAD_HERE: dict[str, tuple[dict[str, object], bool, str]] = {
    "same boot and namespace": ({}, False, "is no longer running"),
    "older dckpt, no boot id or namespace": (
        {"boot_id": None, "pid_ns": None},
        False,
        "is no longer running",
    ),
    "another boot id": (
        {"boot_id": str(uuid.UUID(int=7))},
        True,
        "on a host of this name in another boot",
    ),
    "another pid namespace": ({"pid_ns": 1}, True, "in another pid namespace on this host"),
}


@pytest.mark.parametrize("case", list(_DEAD_HERE))
def test_a_dead_pid_is_taken_at_once_only_where_this_process_can_see_it(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    from dckpt.root.lock import RunLock

    changes, watched, says = _DEAD_HERE[case]
    record = gone("dead-run", 3.0, **changes)
    (tmp_path / ".dckpt-lock").write_text(json.dumps(record))
    lock = RunLock(tmp_path, "next-run", lease_s=30.0)  # the record's lease (3 s) is watched
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        lock.acquire()
    waited = time.monotonic() - t0
    try:
        took = str(lock.took_over)
        if watched:  # not judged by its pid (a dead one), whatever it is here
            assert waited >= 3.0 and "its renewal count stayed at 0" in took, (waited, took)
            assert says in caplog.text, caplog.text
        else:
            assert f"pid {record['pid']} {says}" in took, took
            assert "waiting up to" not in caplog.text, caplog.text
    finally:
        lock.release()


@pytest.mark.parametrize("older", [False, True], ids=["this-namespace", "older-dckpt"])
def test_a_live_pid_of_this_namespace_is_refused_at_once(tmp_path: Path, older: bool) -> None:
    """An older dckpt's record (no boot id, no namespace, no lease) keeps the host-name rule:
    its live pid here is a live owner, refused at once, never watched."""
    from dckpt.errors import LockError
    from dckpt.root.lock import RunLock

    with subprocess.Popen(["sleep", "60"]) as live:
        try:
            started = psutil.Process(live.pid).create_time()
            record = gone("live-run", 30.0, pid=live.pid, started=started)
            if older:
                for field in ("boot_id", "pid_ns", "lease_s"):
                    del record[field]
            (tmp_path / ".dckpt-lock").write_text(json.dumps(record))
            t0 = time.monotonic()
            with pytest.raises(LockError, match=f"in use by run live-run \\(pid {live.pid} "):
                RunLock(tmp_path, "next-run", lease_s=30.0).acquire()
            assert time.monotonic() - t0 < 10.0  # not watched for a lease (30 s)
        finally:
            live.kill()


def _manager(
    root: Path, run_id: str, **config: object
) -> tuple[dckpt.CheckpointManager, nn.Module]:
    torch.manual_seed(0)
    net = nn.Linear(8, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    cfg = dckpt.CheckpointConfig(root=root, **config)  # type: ignore[arg-type]
    mgr = dckpt.CheckpointManager(cfg, dckpt.TrainState(net, opt), run_id=run_id)
    return mgr, net


def test_a_rollback_never_sets_aside_a_step_another_job_committed_meanwhile(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Job B holds the root and found steps 1-4; job A (a second writer: lock=False, the
    way two jobs meet after a takeover that was wrong) commits step 5 meanwhile. B goes back
    to step 2 and saves step 3: the branch it found (4) goes to quarantine/ as superseded,
    A's 5 stays where it is, said; B saves on (6, 7) and its retention (keep the newest 2)
    deletes what it found (1-3) but never A's 5."""
    root = tmp_path / "ckpt"
    logging.getLogger("dckpt").setLevel(logging.INFO)
    first, _ = _manager(root, "job-a", lock=False)
    with first:
        for step in (1, 2, 3, 4):
            first.save(step).result()
    b, net = _manager(root, "job-b", keep_last=2)
    with b:
        a, _ = _manager(root, "job-a", lock=False)
        with a:
            a.save(5).result()  # another job's step, committed while B holds the root
        b.load(2)
        with torch.no_grad():
            net.weight.add_(1.0)
        for step in (3, 6, 7):
            b.save(step).result()
    steps = {(e.step, e.status) for e in list_checkpoints(root)}
    assert (4, "quarantined") in steps and (5, "quarantined") not in steps, steps
    assert committed_steps(root) == [5, 6, 7]  # keep_last=2 deleted 1-3, not A's 5
    said = [r.getMessage() for r in caplog.records if "another job (run job-a)" in r.getMessage()]
    assert said and "step 5 was committed by another job" in said[0], said


def _flaky_open(monkeypatch: pytest.MonkeyPatch, path: Path, fails: list[int]) -> None:
    """``os.open`` of ``path`` fails with EIO while ``fails[0]`` > 0 (counted down per call;
    a negative count fails for ever), as a storage that fails a read."""
    import errno
    import os

    real = os.open

    def flaky(file: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(os.fsdecode(file)) == path and fails[0] != 0:
            fails[0] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", flaky)


def _until(done: Any, bound_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + bound_s
    while not done():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


@pytest.mark.faults
def test_an_unreadable_lock_is_a_storage_error_never_a_lost_lock(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fault_trials: Any,
) -> None:
    """Issue 56: one EIO on the lock file ended the job, "held by" its own rank 0. A read
    that fails is retried; one that keeps failing fails that commit (StorageError), never
    marks the lock lost; renewals skip a beat and go on once the storage heals."""
    with fault_trials.trial("an EIO on the lock file", "twice, then on every read, then healed"):
        _unreadable_lock(tmp_path, monkeypatch, caplog)


def _unreadable_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dckpt.errors import LockError, StorageError
    from dckpt.root.lock import RunLock

    lock = RunLock(tmp_path, "run-a", lease_s=0.6)  # renews every 0.2 s
    lock.acquire()
    path = tmp_path / ".dckpt-lock"
    fails = [2]
    _flaky_open(monkeypatch, path, fails)
    try:
        lock.check_held()  # two failed reads, then the record: held
        assert fails == [0] and lock.lost is None
        fails[0] = -1  # the storage fails every read now
        with pytest.raises(StorageError) as raised:
            lock.check_held()
        assert not isinstance(raised.value, LockError)
        assert f"cannot read the run lock {path} (Input/output error)" in str(raised.value)
        # renewals come (every 0.2 s) and find the file unreadable: waited for, not timed, so
        # a busy machine only makes this slower (the bound ends a hang)
        _until(lambda: "could not renew the run lock (will retry)" in caplog.text)
        assert lock.lost is None
        fails[0] = 0  # healed
        beat = json.loads(path.read_text())["beat"]
        _until(lambda: json.loads(path.read_text())["beat"] > beat)  # renewing again
        lock.check_held()
        assert lock.lost is None
    finally:
        monkeypatch.undo()
        lock.release()
    assert not path.exists()
