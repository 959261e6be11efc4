"""Guards that never take a healthy run down (issue 41): I/O errors in words, a lost commit
reply, a frozen rank at save and at resume, a NaN metric on one rank, and the memory tier's
leftovers of failed saves. Each trial joins ``make faults``' table; the network loss of a
whole node is in tests/test_two_node.py, the clock skew in tests/test_lock_fencing.py and the
superlinear loss in tests/test_restart_loop.py (marked ``faults`` too).

Real gloo ranks (tests/dist_harness.py) and the fault hook: ``eio`` raises the storage's
``OSError(EIO)`` inside the very read (a manifest's, ``.metadata``'s, a shard's, rank 0's
listing), so the error takes the path a real one would; ``sigstop`` stops a rank's whole
process (every thread, its sockets open), as a host that hangs.

Every wait in these tests is bounded by dckpt's own deadline (``TIMEOUT_S``) and the trial
says how long the survivors took; the bound asserted is twice the deadline plus 30 s (a
frozen rank must be named by then), not a figure of this machine's speed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world
from fault_kit import Trials, build, fresh_root, manager, resume_world, saving_world, train_step

from dckpt.root.layout import committed_steps, list_checkpoints

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

TIMEOUT_S = 8.0
BOUND_S = 2 * TIMEOUT_S + 30


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 of the fault kit's 2-rank job (copy to change)."""
    root = tmp_path_factory.mktemp("guards") / "root"
    results = run_world(saving_world, 2, str(root), [1, 2], None, None, {"timeout_s": TIMEOUT_S})
    assert results == ["ok", "ok"], results
    return root


def _pids(root: str, rank: int) -> Path:
    """Each rank's pid, so rank 0 can end a rank a trial froze once it has its answer."""
    mine = Path(root).parent / f"pid-{rank}"
    mine.write_text(str(os.getpid()))
    return mine


def _end_the_frozen(root: str) -> None:
    """Rank 0, its answer in hand: kill rank 1, which SIGSTOP left frozen (else the harness
    waits for it until its timeout)."""
    import signal

    with contextlib.suppress(OSError, ValueError):
        os.kill(int((Path(root).parent / "pid-1").read_text()), signal.SIGKILL)


def _resume(
    rank: int, world: int, root: str, fault: str | None, fallback: bool = True
) -> dict[str, Any]:
    """One start: resume ``root`` with ``fault`` armed; what this rank raised or loaded."""
    import dckpt

    _pids(root, rank)
    if fault is not None:
        os.environ["DCKPT_FAULT"] = fault
    model, opt, sched = build(rank)
    t0 = time.monotonic()
    try:
        with manager(root, model, opt, sched, timeout_s=TIMEOUT_S, fallback=fallback) as mgr:
            report = mgr.resume()
            return {
                "step": report.step,
                "seconds": time.monotonic() - t0,
                "report": report.format(),
            }
    except dckpt.CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    finally:
        os.environ.pop("DCKPT_FAULT", None)
        if rank == 0 and fault is not None and "sigstop" in fault:
            _end_the_frozen(root)


TRANSIENT_CASES = [
    ("read_manifest", 1, "manifest.json"),
    ("read_manifest", 0, "manifest.json"),
    ("read_metadata", 1, ".metadata"),
    ("read_shard", 1, ".distcp"),
    ("read_shard", 0, ".distcp"),
]


def _errors(got: list[Any]) -> list[str]:
    return [r.get("error") or "" if isinstance(r, dict) else str(r) for r in got]


def test_a_transient_eio_at_each_resume_read_is_read_again_and_resumes(
    saved: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    """The storage fails one read of one rank, once (``times=1``): every rank reads the step
    again, afresh, and resumes it; the report says which file on which rank was read again;
    nothing is moved (never a bare OSError, never a quarantine, never a hang)."""
    failed: list[str] = []
    for phase, rank, file_word in TRANSIENT_CASES:
        root = fresh_root(saved, tmp_path / f"{phase}-{rank}")
        fault = f"phase={phase},rank={rank},action=eio,times=1"
        got = run_world(_resume, 2, str(root), fault, expect_failure=True, timeout=120)
        why = [f"rank {r}: {e}" for r, e in enumerate(_errors(got)) if e]
        for r, result in enumerate(got):
            if isinstance(result, dict) and result.get("step") != 2:
                why.append(f"rank {r} did not resume step 2: {str(result)[:300]}")
        report = got[0].get("report", "") if isinstance(got[0], dict) else ""
        if "read again, afresh" not in report or file_word not in report:
            why.append(f"the report does not say what was read again: {report[:600]}")
        if (root / "quarantine").exists() or committed_steps(root) != [1, 2]:
            why.append(f"something moved: {list_checkpoints(root)}")
        case = f"one EIO at {phase} on rank {rank}"
        fault_trials.record("I/O error at a resume", case, survived=not why, detail="; ".join(why))
        if why:
            failed.append(f"{case}: {'; '.join(why)}")
    assert not failed, "\n".join(failed)


def test_eio_listing_the_steps_is_a_storage_error_on_every_rank(
    saved: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    """A listing that fails names no file: every rank raises the same StorageError naming
    the root and rank 0, nothing moves, and the start without the fault resumes step 2."""
    root = fresh_root(saved, tmp_path / "list")
    fault = "phase=list_steps,rank=0,action=eio"
    with fault_trials.trial("I/O error at a resume", "EIO listing the steps on rank 0"):
        got = run_world(_resume, 2, str(root), fault, expect_failure=True, timeout=120)
        for r, error in enumerate(_errors(got)):
            assert error.startswith("StorageError:"), (r, got)
            assert "cannot list" in error and "rank 0" in error, (r, error)
        assert not (root / "quarantine").exists() and committed_steps(root) == [1, 2]
        restart = run_world(resume_world, 2, [str(root)], expect_failure=True, timeout=120)
        assert [r[0].get("step") for r in restart] == [2, 2], restart
        assert all(r[0].get("exact") for r in restart), restart


def _restore(root: Path, step: int) -> None:
    from dckpt.cli import main

    assert main(["restore", str(root), str(step)]) == 0


def test_a_read_error_that_persists_sets_the_step_aside_and_resumes_the_one_before(
    saved: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    """One shard of step 2 cannot be read, every time (a lost sector: ``file=`` names it):
    the resume reads it again, afresh, fails the same way, sets step 2 aside (moved to
    quarantine/, with the reason and the command that restores it) and resumes step 1 on
    every rank. ``dckpt restore`` puts it back once the storage serves it, and the next
    start resumes step 2 exactly."""
    root = fresh_root(saved, tmp_path / "persists")
    fault = "phase=read_shard,rank=1,action=eio,file=step-00000002"
    with fault_trials.trial("a persistent read error", "one file of the newest step (rank 1)"):
        got = run_world(_resume, 2, str(root), fault, expect_failure=True, timeout=120)
        assert _errors(got) == ["", ""], got
        assert [r["step"] for r in got] == [1, 1], got
        assert "skipped step 2" in got[0]["report"], got[0]["report"]
        assert committed_steps(root) == [1], list_checkpoints(root)
        reason = (root / "quarantine" / "step-00000002.reason.txt").read_text()
        assert "twice (the second time afresh" in reason and ".distcp" in reason, reason
        assert "while it served an older step" in reason, reason
        assert f"dckpt restore {root} 2" in reason, reason
        _restore(root, 2)
        assert committed_steps(root) == [1, 2], list_checkpoints(root)
        restart = run_world(resume_world, 2, [str(root)], expect_failure=True, timeout=120)
        assert [r[0].get("step") for r in restart] == [2, 2], restart
        assert all(r[0].get("exact") for r in restart), restart


def test_a_read_error_on_every_step_sets_nothing_aside_and_stops(
    saved: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    """Every shard read of rank 1 fails, on every step (the storage, not a step): the newest
    step fails twice, the one before fails the same way, and every rank raises the same
    UnreadableError naming rank 1 and the file, saying the storage fails beyond one
    checkpoint: nothing is set aside (a step is, only once an older one loads). Without
    fallback nothing is set aside either, and the error says the command that would."""
    root = fresh_root(saved, tmp_path / "everywhere")
    with fault_trials.trial("a persistent read error", "every step's files (rank 1)"):
        fault = "phase=read_shard,rank=1,action=eio"
        got = run_world(_resume, 2, str(root), fault, expect_failure=True, timeout=120)
        for r, error in enumerate(_errors(got)):
            assert error.startswith("UnreadableError: rank 1: cannot read"), (r, error)
            assert "beyond one checkpoint" in error and ".distcp" in error, (r, error)
            assert "nothing was set aside" in error, (r, error)
        assert committed_steps(root) == [1, 2] and not (root / "quarantine").exists()
    root = fresh_root(saved, tmp_path / "no-fallback")
    with fault_trials.trial("a persistent read error", "fallback off"):
        fault = "phase=read_shard,rank=0,action=eio,file=step-00000002"
        got = run_world(_resume, 2, str(root), fault, False, expect_failure=True, timeout=120)
        for r, error in enumerate(_errors(got)):
            assert error.startswith("UnreadableError: rank 0: cannot read"), (r, error)
            assert f"dckpt set-aside {root} 2" in error, (r, error)
        assert committed_steps(root) == [1, 2] and not (root / "quarantine").exists()


def test_a_lost_commit_reply_is_resolved_by_looking(
    saved: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    """The storage performs the commit rename and answers EIO (a reply lost): rank 0 looks,
    finds its manifest under the final name, and every rank is told the step IS committed."""
    root = fresh_root(saved, tmp_path / "reply")
    fault = "phase=rename_reply,rank=0,action=eio"
    got = run_world(saving_world, 2, str(root), [3], fault, 3, {"timeout_s": TIMEOUT_S})
    why = [] if got == ["ok", "ok"] else [f"the save did not report its commit: {got}"]
    if committed_steps(root) != [1, 2, 3]:
        why.append(f"step 3 is not committed: {committed_steps(root)}")
    restart = run_world(resume_world, 2, [str(root)], expect_failure=True, timeout=120)
    if not all(isinstance(r, list) and r[0].get("step") == 3 for r in restart):
        why.append(f"the restart did not resume step 3: {restart}")
    fault_trials.record("I/O error at a commit", "rename performed, reply lost (EIO)",
                        survived=not why, detail="; ".join(why))  # fmt: skip
    assert not why, why


def _frozen_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save step 3 with rank 1 frozen (SIGSTOP) while it writes its shards."""
    import dckpt

    _pids(root, rank)
    model, opt, sched = build(rank)
    mgr = manager(root, model, opt, sched, timeout_s=TIMEOUT_S)
    train_step(model, opt, sched, 3, rank)
    os.environ["DCKPT_FAULT"] = "phase=write_shards,rank=1,action=sigstop,step=3"
    t0 = time.monotonic()
    try:
        mgr.save(3).result()
        return {"end": "saved", "seconds": time.monotonic() - t0}
    except dckpt.CheckpointError as exc:
        return {"end": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    finally:
        if rank == 0:
            _end_the_frozen(root)


@pytest.mark.parametrize("where", ["save", "resume"])
def test_a_frozen_rank_is_named_within_the_deadline(
    saved: Path, tmp_path: Path, fault_trials: Trials, where: str
) -> None:
    """Rank 1 stops (SIGSTOP) in the middle of a save, or of a resume: rank 0 ends with an
    error naming rank 1 as silent (its heartbeat stood still) and what it was doing, within
    dckpt's deadline and a few seconds, not gloo's raw timeout."""
    root = fresh_root(saved, tmp_path / where)
    if where == "save":
        got = run_world(_frozen_save, 2, str(root), expect_failure=True, timeout=BOUND_S + 30)
        first, said = got[0], "end"
    else:
        fault = "phase=verify,rank=1,action=sigstop"
        got = run_world(_resume, 2, str(root), fault, expect_failure=True, timeout=BOUND_S + 30)
        first, said = got[0], "error"
    why = []
    text = first.get(said, "") if isinstance(first, dict) else str(first)
    if "rank 1 (silent: its heartbeat stood still" not in text:
        why.append(f"rank 0 did not name rank 1 as silent: {text[:600]}")
    seconds = first.get("seconds", 1e9) if isinstance(first, dict) else 1e9
    if seconds > BOUND_S:
        why.append(f"rank 0 took {seconds:.0f} s to say so (timeout_s {TIMEOUT_S:.0f} s)")
    if committed_steps(root) != [1, 2]:
        why.append(f"the committed steps changed: {committed_steps(root)}")
    fault_trials.record("a frozen rank", f"SIGSTOP of rank 1 during a {where}",
                        survived=not why, detail="; ".join(why) or f"{seconds:.1f} s")  # fmt: skip
    assert not why, why


def _metric(rank: int, world: int, root: str, nan_on: int) -> str:
    import math

    import dckpt

    model, opt, sched = build(rank)
    with manager(root, model, opt, sched, timeout_s=TIMEOUT_S) as mgr:
        train_step(model, opt, sched, 3, rank)
        try:
            mgr.save(3, metric=math.nan if rank == nan_on else 1.0).result()
            return "saved"
        except (ValueError, dckpt.CheckpointError) as exc:
            return f"{type(exc).__name__}: {exc}"


def test_a_nan_metric_on_one_rank_never_hangs_the_others(
    saved: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    """Rank 0's metric is the one recorded: NaN there refuses the save on every rank at once;
    NaN on another rank is not recorded (a warning), and the save commits."""
    why = []
    for nan_on, want in ((0, "refused"), (1, "saved")):
        root = fresh_root(saved, tmp_path / f"nan-on-{nan_on}")
        got = run_world(_metric, 2, str(root), nan_on, expect_failure=True, timeout=120)
        if want == "saved" and got != ["saved", "saved"]:
            why.append(f"NaN on rank {nan_on}: the save did not commit: {got}")
        if want == "refused" and not all(
            isinstance(g, str) and g.startswith("ValueError: metric must be a finite number")
            for g in got
        ):
            why.append(f"NaN on rank 0: not refused on every rank alike: {got}")
    fault_trials.record("a NaN metric on one rank", "rank 0, then rank 1", survived=not why,
                        detail="; ".join(why))  # fmt: skip
    assert not why, why


def _memory_saves(rank: int, world: int, base: str) -> dict[str, Any]:
    """Durable 1, then five memory saves that node 1 cannot hold (its memory is full)."""
    import logging

    import torch

    import dckpt

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    logging.getLogger("dckpt").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 512))
    opt = torch.optim.AdamW(model.parameters())
    config = dckpt.CheckpointConfig(
        root=Path(base) / "root", memory=True, memory_dir=Path(base) / "mem", timeout_s=TIMEOUT_S
    )
    held: list[int] = []
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        mgr.save(1).result()
        for step in range(2, 7):
            with contextlib.suppress(dckpt.CheckpointError):  # node 1 cannot hold it
                mgr.save(step, tier="memory").result()
            mgr.wait()
            import torch.distributed as dist

            dist.barrier()
            node0 = Path(base) / "mem" / "node-0"
            held.append(sum(p.stat().st_size for p in node0.rglob("*") if p.is_file()))
    return {"held": held}


def test_failed_memory_saves_leave_nothing_on_the_healthy_node(
    tmp_path: Path, fault_trials: Trials
) -> None:
    """Node 1's memory is a 64 KiB tmpfs: every memory save fails there. Node 0, which wrote
    its file each time, keeps one spare of it (not one more file per failed save), and a run
    that ends on its durable step frees even that at close()."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a small tmpfs")
    full = tmp_path / "mem" / "node-1"
    full.mkdir(parents=True)
    name = f"dckpt-{uuid.uuid4().hex[:6]}"
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", name, str(full)]
    if subprocess.run(mount, check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        got = run_world(_memory_saves, 2, str(tmp_path), timeout=180)
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)
    held = got[0]["held"]
    left = [p for p in (tmp_path / "mem" / "node-0").rglob("*") if p.is_file()]
    why = []
    if len(set(held)) != 1:
        why.append(f"node 0's memory grew with each failed save: {held} bytes")
    if left:
        why.append(f"close() left files in node 0's memory: {left}")
    fault_trials.record("memory tier", "failed saves on the other node", survived=not why,
                        detail="; ".join(why))  # fmt: skip
    assert not why, why
