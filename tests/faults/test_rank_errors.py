"""A rank that raises mid-save, at every phase (fault 7), and a disk that reports ENOSPC.

One 2-rank world runs every case in turn: it arms ``action=raise`` (or ``enospc``) for one
phase on one rank for one step, saves, and then saves the next step with no fault. Expected:

- before the commit point, every rank raises a SaveError that carries the failing rank's
  error, nothing of that step is committed and no tmp dir is left behind; the next save works;
- after the commit point (``fsync_parent``, ``publish_latest``, ``retention``), the error is
  logged, not raised: the step is committed and ``recover`` finishes the tidying up.

After every case rank 0 runs the invariant check (fault_kit.check) while rank 1 waits at a
barrier; a restart at the end resumes the newest step exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world
from fault_kit import Trials, build, capture, check, manager, resume_world, train_step

from dckpt.faults import COORDINATOR_PHASES, RANK_PHASES

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

FAULT = "rank raises mid-save"
AFTER_COMMIT = {"rename_reply", "fsync_parent", "publish_latest", "retention"}
CASES = [(p, r, "raise") for r in (0, 1) for p in RANK_PHASES]
CASES += [(p, 0, "raise") for p in COORDINATOR_PHASES]
CASES += [("write_shards", 1, "enospc"), ("write_manifest", 0, "enospc")]


def raising_world(rank: int, world: int, root: str, cases: list[tuple[str, int, str]]) -> Any:
    import torch.distributed as dist

    import dckpt
    from dckpt.root.layout import committed_steps

    model, opt, sched = build(rank)
    mgr = manager(root, model, opt, sched, keep_last=3)

    def save(step: int) -> str:
        train_step(model, opt, sched, step, rank)
        try:
            mgr.save(step)
            mgr.wait()
        except dckpt.SaveError as exc:
            return str(exc)
        return "ok"

    step = 1
    assert save(step) == "ok"
    out: list[dict[str, Any]] = []
    for phase, who, action in cases:
        baseline = capture(Path(root)) if rank == 0 else {}
        step += 1
        os.environ["DCKPT_FAULT"] = f"phase={phase},rank={who},action={action},step={step}"
        faulted = save(step)
        os.environ.pop("DCKPT_FAULT")
        entry: dict[str, Any] = {"step": step, "result": faulted}
        if rank == 0:
            steps = committed_steps(Path(root))
            entry["committed"] = step in steps
            entry["tmp_left"] = [p.name for p in Path(root).glob("*.tmp-*")]
            # retention (keep_last=3) may delete only the oldest of the steps before the fault
            drop = frozenset(sorted(baseline)[:-2]) if step in steps else frozenset()
            outcome = check(Path(root), baseline, may_drop=drop)
            entry["problems"], entry["lost"] = outcome.problems, outcome.lost
        dist.barrier()  # rank 1 touches the root again only after rank 0's check
        step += 1
        entry["next"] = save(step)
        out.append(entry)
    mgr.close()
    return out


def test_a_rank_raising_at_every_phase_fails_the_save_everywhere_and_loses_nothing(
    tmp_path: Path, fault_trials: Trials
) -> None:
    root = tmp_path / "root"
    results = run_world(raising_world, 2, str(root), CASES, timeout=240)
    all_ok = True
    for i, (phase, who, action) in enumerate(CASES):
        why: list[str] = []
        entry = results[0][i]
        expect_commit = phase in AFTER_COMMIT
        text = "no space left" if action == "enospc" else f"injected fault at phase {phase}"
        for r in (0, 1):
            got = results[r][i]["result"]
            if expect_commit and got != "ok":
                why.append(f"rank {r}: the save was committed but reported {got!r}")
            if not expect_commit and text not in got:
                why.append(f"rank {r}'s error lacks {text!r}: {got!r}")
            if results[r][i]["next"] != "ok":
                why.append(f"rank {r}: the next save failed: {results[r][i]['next']!r}")
        if entry["committed"] != expect_commit:
            why.append(f"committed={entry['committed']}, expected {expect_commit}")
        if entry["tmp_left"]:
            why.append(f"tmp dirs left behind: {entry['tmp_left']}")
        why += entry["problems"]
        all_ok &= not why
        fault_trials.record(
            FAULT if action == "raise" else "ENOSPC reported by the disk",
            f"{action} at {phase} on rank {who}",
            survived=not why,
            lost=entry["lost"],
            detail="; ".join(why),
        )
    resumed = run_world(resume_world, 2, [str(root)], timeout=120)
    last = results[0][-1]["step"] + 1
    for r in (0, 1):
        assert resumed[r][0].get("step") == last and resumed[r][0].get("exact"), resumed[r]
    assert all_ok, "some trials failed; see the fault table"
