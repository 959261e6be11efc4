"""Faults around the life of a root (faults 8, 9 and 10).

- Stale state at start: a job SIGKILLed mid-save leaves its lock (held by a dead pid) and its
  tmp dir; on top of that a ``latest.tmp-*`` file, a trash dir and a replaced copy without a
  manifest. The next start takes the lock over, removes the debris and resumes exactly.
- Two jobs on one root: a second torchrun job started while the first runs is refused at once,
  naming the owner, and the first one finishes untouched.
- The same step saved twice, with a crash in the second save at each phase: before its commit
  the first copy stays whole (bit-exact); after it, the new copy is committed whole.
- A crash during retention (victims renamed to trash, not yet removed): the newest
  checkpoints and the milestones are whole, the next start finishes the deletion.
- Two jobs on one node in different pid namespaces (containers sharing the node's host name,
  issue 56): the second, started under ``unshare --pid``, found the first's pid gone in its own
  namespace and took the live job's lock; now it watches the lock for its lease (10 s here),
  sees it renewed, and is refused naming the first, which finishes untouched.
- A relaunch from another host after the whole job died (issue 56): the dead job's lock names
  another host, so rank 0 watches it for a lease (10 s) before taking it over, longer than
  ``timeout_s`` (3 s); rank 1 waits with it, says so once, and the job resumes exactly. It
  used to die in gloo after ``timeout_s``, and every relaunch began the watch again.

Every trial ends with the invariant check; the restarts of all trials run in one spawn.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, torchrun_start, torchrun_train, torchrun_workers
from dist_harness import run_world
from fault_kit import (
    Baseline,
    Trials,
    capture,
    check,
    fresh_root,
    resume_world,
    saving_world,
)
from lock_kit import unshare_or_skip

from dckpt.root.layout import committed_steps, read_latest, step_dir_name

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

DEBRIS = re.compile(r"\.(tmp|trash|replaced)-")


@dataclass
class Case:
    """One trial: its root, the step a restart must land on, what must still be whole."""

    fault: str
    case: str
    root: Path
    expect: int
    baseline: Baseline
    why: list[str]
    may_drop: frozenset[int] = frozenset()


RESAVE_PHASES = [("write_shards", 1), ("write_manifest", 0), ("rename", 0), ("publish_latest", 0)]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("start") / "root"
    assert run_world(saving_world, 2, str(root), [1, 2]) == ["ok", "ok"]
    return root


def test_stale_state_resaves_and_retention_crashes_leave_every_checkpoint_whole(
    template: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    baseline = capture(template)
    trials: list[Case] = []

    # 8. A job killed mid-save (its lock and tmp dir stay behind), plus more debris.
    root = fresh_root(template, tmp_path / "stale")
    kill = "phase=write_shards,rank=0,action=sigkill"
    run_world(saving_world, 2, str(root), [3], kill, 3, expect_failure=True, timeout=120)
    why = [] if (root / ".dckpt-lock").exists() else ["the killed job left no lock to take over"]
    if not list(root.glob("*.tmp-*")):
        why.append("the killed job left no tmp dir")
    (root / f"latest.tmp-{uuid.uuid4().hex}").write_text("step-00000009\n")
    (root / f"step-00000001.trash-{uuid.uuid4().hex}").mkdir()
    replaced = root / f"step-00000004.replaced-{uuid.uuid4().hex}"
    replaced.mkdir()
    (replaced / "__0_0.distcp").write_bytes(b"half a file")
    trials.append(Case("stale tmp dirs and lock", "killed job + debris", root, 2, baseline, why))

    # 9. The same step saved again by a later job, killed at each phase of that save.
    for phase, rank in RESAVE_PHASES:
        root = fresh_root(template, tmp_path / f"resave-{phase}")
        fault = f"phase={phase},rank={rank},action=sigkill"
        run_world(saving_world, 2, str(root), [2], fault, 2, expect_failure=True, timeout=120)
        why = []
        swapped = phase == "publish_latest"  # killed after the atomic swap: the new copy won
        if committed_steps(root) != [1, 2]:
            why.append(f"committed {committed_steps(root)} right after the crash, expected [1, 2]")
        may_drop = frozenset({2}) if swapped else frozenset()
        name = "same step saved twice, crash in the 2nd"
        trials.append(Case(name, f"{phase} rank {rank}", root, 2, baseline, why, may_drop))

    # 10. A crash during retention: steps 1-4 (2 and 4 milestones), then keep_last=2 at step 5.
    root = tmp_path / "retention"
    run_world(saving_world, 2, str(root), [1, 2, 3, 4], None, None, {"milestone_every": 2})
    before = capture(root)
    config = {"milestone_every": 2, "keep_last": 2}
    fault = "phase=retention,rank=0,action=sigkill"
    run_world(saving_world, 2, str(root), [5], fault, 5, config, expect_failure=True, timeout=120)
    why = []
    if committed_steps(root) != [2, 4, 5]:
        why.append(f"after the crash committed {committed_steps(root)}, expected [2, 4, 5]")
    if read_latest(root) != step_dir_name(5):
        why.append(f"latest is {read_latest(root)}")
    case = "sigkill after rename to trash"
    trials.append(Case("crash during retention", case, root, 5, before, why, frozenset({1, 3})))

    checks = [check(t.root, t.baseline, may_drop=t.may_drop) for t in trials]
    resumed = run_world(resume_world, 2, [str(t.root) for t in trials], timeout=240)
    failures = []
    for i, t in enumerate(trials):
        for r in (0, 1):
            got = resumed[r][i]
            if got.get("error") or got.get("step") != t.expect or not got.get("exact"):
                t.why.append(f"restart on rank {r}: {got} (expected step {t.expect})")
        debris = [p.name for p in t.root.iterdir() if DEBRIS.search(p.name)]
        if debris:
            t.why.append(f"debris left after the restart: {debris}")
        t.why.extend(check(t.root, t.baseline, may_drop=t.may_drop).problems)
        detail = "; ".join(t.why)
        fault_trials.record_check(t.fault, t.case, checks[i], detail=detail, survived=not t.why)
        if t.why or not checks[i].ok:
            failures.append(f"{t.fault} / {t.case}: {t.why + checks[i].problems}")
    assert not failures, failures


def _first_job_finishes(first: subprocess.Popen[str], root: Path) -> list[str]:
    """The first job, refused nothing, outlived the second one's attempt: stopped now with a
    SIGTERM, it saves the step its ranks agree on and ends cleanly; what went wrong, if any."""
    why = []
    if first.poll() is not None:
        why.append("the first job did not survive the second one's attempt")
    else:
        torchrun_workers(first)[0].send_signal(signal.SIGTERM)  # done: stop, with a save
    first_out, _ = first.communicate(timeout=120)
    if first.returncode != 0:
        why.append(f"the first job failed: {first_out[-800:]}")
    agreed = re.search(r"the ranks agreed on step (\d+)", first_out)
    if agreed is None or committed_steps(root)[-1:] != [int(agreed.group(1))]:
        why.append(f"the first job's final checkpoint is missing: {committed_steps(root)}")
    return why


def test_a_second_job_on_the_same_root_is_refused_and_the_first_finishes(
    tmp_path: Path, fault_trials: Trials
) -> None:
    """The first job runs until told to stop (SIGTERM, so it ends with a final save): the
    second is started while it surely runs, however fast this machine is."""
    root = tmp_path / "ckpt"
    # It sleeps after each step: it runs, holding the lock, without taking the cores that
    # the second job's start needs (at full speed it trained for the whole of that start).
    args = ["--steps", "1000000", "--save-every", "50", "--step-sleep", "0.1"]
    first = torchrun_start(root, *args)
    why: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not (root.exists() and committed_steps(root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        # The first job never ends by itself: a refusal that comes while it still runs did
        # not wait for the lock to be free (no bound on how fast this machine refuses; the
        # timeout only ends a hang).
        second = torchrun_train(root, *args, timeout=300)
        out = second.stdout + second.stderr
        if second.returncode == 0:
            why.append("the second job ran")
        if "lock" not in out.lower() or "pid" not in out:
            why.append(f"the second job's error does not name the owner: {out[-600:]}")
        why += _first_job_finishes(first, root)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    outcome = check(root, {})
    fault_trials.record_check(
        "two jobs on one root", "torchrun while another runs", outcome, detail="; ".join(why)
    )
    assert not why and outcome.ok, why + outcome.problems


_LEASED = """
import functools, os, runpy, sys
import dckpt
# launch/train.py has no flag for the run lock's lease: its CheckpointConfig gets this one
dckpt.CheckpointConfig = functools.partial(
    dckpt.CheckpointConfig, lock_lease_s=float(sys.argv.pop(1))
)
sys.argv[0] = {train!r}
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _leased_train(tmp: Path, root: Path, lease_s: float, args: list[str]) -> list[str]:
    """torchrun of launch/train.py (2 ranks, gloo) whose run lock has a lease of ``lease_s``."""
    script = tmp / "leased_train.py"
    script.write_text(_LEASED.format(train=str(REPO / "launch" / "train.py")))
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(script), str(lease_s), "--ckpt-dir", str(root), *args,
    ]  # fmt: skip


def test_a_second_job_in_another_pid_namespace_on_this_node_is_refused(
    tmp_path: Path, fault_trials: Trials
) -> None:
    """Like the trial above, but the second launch runs in a pid namespace of its own, as in a
    second container on the node: the first's pid means nothing there, so it watches the lock
    for its lease (10 s: renewed every 3.3 s) and is refused at the first renewal it sees."""
    unshare = [*unshare_or_skip(), "--kill-child"]  # the namespace dies with its unshare
    root = tmp_path / "ckpt"
    args = ["--steps", "1000000", "--save-every", "5", "--d-model", "32", "--no-async"]
    args += ["--step-sleep", "0.1"]  # running, renewing its lease, not taking the cores
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    first = subprocess.Popen(
        _leased_train(tmp_path, root, 10.0, args), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    why: list[str] = []
    second: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 120
        while not (root.exists() and committed_steps(root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        holder = torchrun_workers(first).get(0)  # rank 0 holds the lock
        if holder is None:
            why.append("the first job has no rank 0 running")
        second = subprocess.Popen(
            [*unshare, *_leased_train(tmp_path, root, 10.0, args)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        try:  # refused within a lease of its start; one that took the lock trains for ever
            out, _ = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGKILL)
            out = second.communicate()[0]
            why.append("the second job did not end within 60 s: it took the lock and trained")
        if second.returncode == 0:
            why.append("the second job ran")
        if (
            "is in use by run " not in out
            or f"(pid {getattr(holder, 'pid', '?')} on {socket.gethostname()}," not in out
        ):
            why.append(f"the second job's error does not name the first: {out[-800:]}")
        elif "in another pid namespace on this host (a container)" not in out:
            why.append(f"the second job's error does not say where the first runs: {out[-800:]}")
        why += _first_job_finishes(first, root)
    finally:
        for job in (first, second):
            if job is not None and job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    outcome = check(root, {})
    fault_trials.record_check(
        "two jobs on one root",
        "torchrun in another pid namespace, same host name",
        outcome,
        detail="; ".join(why),
    )
    assert not why and outcome.ok, why + outcome.problems


def _relaunch(rank: int, world: int, root: str) -> dict[str, object]:
    """A job with a new run id whose dckpt timeout (3 s) is shorter than the lease of the lock
    it finds (10 s): rank 0 must watch that lock for the lease while rank 1 waits."""
    import logging

    from fault_kit import build, manager, train_step

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("dckpt").addHandler(Keep())
    model, opt, sched = build(rank)
    t0 = time.monotonic()
    mgr = manager(root, model, opt, sched, timeout_s=3.0, lock_lease_s=10.0)
    started_s = time.monotonic() - t0
    report = mgr.resume()
    step = report.step
    assert step is not None
    train_step(model, opt, sched, step + 1, rank)
    mgr.save(step + 1)
    mgr.wait()
    took = mgr._locks[0].took_over if rank == 0 else None  # type: ignore[attr-defined]
    mgr.close()
    return {"step": step, "started_s": started_s, "took": took, "said": said}


def test_a_relaunch_from_another_host_waits_one_lease_on_every_rank_and_trains(
    template: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    root = fresh_root(template, tmp_path / "relaunch")
    baseline = capture(root)
    dead = {  # the lock a job on another host left when it was killed whole
        "host": "node-elsewhere", "pid": 4242, "started": time.time() - 600,
        "run_id": "the-dead-run", "token": "t0ken", "lease_until": time.time() - 300,
        "beat": 7, "lease_s": 10.0,
    }  # fmt: skip
    (root / ".dckpt-lock").write_text(json.dumps(dead))
    with fault_trials.trial("relaunch from another host", "lease 10 s > timeout_s 3 s"):
        out = run_world(_relaunch, 2, str(root), timeout=120)
        assert [o["step"] for o in out] == [2, 2], out
        took = str(out[0]["took"])
        assert "run the-dead-run (pid 4242 on node-elsewhere" in took, took
        assert "renewal count stayed at 7" in took, took
        # it did wait the lease out (on its own clock), and rank 1 waited with it
        assert float(out[0]["started_s"]) >= 10.0, out[0]
        waits = [m for m in out[1]["said"] if "rank 1 waits for rank 0" in m]  # type: ignore[union-attr]
        assert len(waits) == 1, out[1]["said"]
        assert "watches the run lock" in waits[0] and "held by run the-dead-run" in waits[0]
        assert committed_steps(root) == [1, 2, 3]
        assert check(root, baseline).ok
