"""SIGKILL at every named phase of a save, on rank 0 and on rank 1 (faults 1 and 2).

Each trial starts from a root with steps 1 and 2 committed by 2 real ranks, arms
``DCKPT_FAULT=phase=P,rank=R,action=sigkill`` for the save of step 3 (keep_last=2, so the save
also runs retention), and then checks: the killed rank died, every survivor raised an error
naming it within the timeout (no hang), nothing partial is visible, and the invariants hold.
One restart then resumes every trial's root (one spawn for all, to keep the suite fast): it
must land on step 3 exactly when the commit rename happened before the kill, else on step 2,
load it bit-exact, and save the next step.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from dist_harness import run_world
from fault_kit import Trials, capture, check, failed, fresh_root, resume_world, saving_world

from dckpt.faults import COORDINATOR_PHASES, RANK_PHASES
from dckpt.root.layout import committed_steps, list_checkpoints, step_dir_name

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

FAULT = "SIGKILL at a save phase"
CASES = [(p, 0) for p in RANK_PHASES] + [(p, 1) for p in RANK_PHASES]
CASES += [(p, 0) for p in COORDINATOR_PHASES]
AFTER_RENAME = {"rename_reply", "fsync_parent", "publish_latest", "retention"}
CONFIG = {"keep_last": 2, "timeout_s": 10.0}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kill") / "root"
    results = run_world(saving_world, 2, str(root), [1, 2], None, None, CONFIG)
    assert results == ["ok", "ok"], results
    assert committed_steps(root) == [1, 2]
    return root


def _names(text: str, rank: int) -> bool:
    return re.search(rf"rank(\(s\))? {rank}\b", text) is not None


def test_sigkill_at_every_phase_on_rank_0_and_rank_1(
    template: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    baseline = capture(template)
    roots: dict[tuple[str, int], Path] = {}
    survived: dict[tuple[str, int], list[str]] = {}
    for phase, rank in CASES:
        root = fresh_root(template, tmp_path / f"{phase}-rank{rank}")
        roots[phase, rank] = root
        why: list[str] = []
        fault = f"phase={phase},rank={rank},action=sigkill"
        t0 = time.monotonic()
        results = run_world(
            saving_world, 2, str(root), [3], fault, 3, CONFIG, expect_failure=True, timeout=120
        )
        elapsed = time.monotonic() - t0
        committed = phase in AFTER_RENAME
        if "produced no result" not in results[rank]:
            why.append(f"rank {rank} was not killed: {results[rank]!r}")
        other = 1 - rank
        if phase == "retention":  # the outcome was broadcast before retention ran
            if results[other] != "ok":
                why.append(f"rank {other} should have succeeded: {results[other]!r}")
        elif not (isinstance(results[other], str) and _names(results[other], rank)):
            why.append(f"rank {other}'s error does not name rank {rank}: {results[other]!r}")
        if (
            phase in ("rename_reply", "fsync_parent", "publish_latest")
            and "cannot tell" not in results[other]
        ):
            why.append(f"rank {other} claims to know the outcome: {results[other]!r}")
        if elapsed > 60:
            why.append(f"the world took {elapsed:.0f} s to end: a survivor hung")
        if (3 in committed_steps(root)) != committed:
            why.append(f"step 3 committed={not committed}, expected {committed}")
        visible = [e for e in list_checkpoints(root) if e.status not in ("committed", "incomplete")]
        if visible:
            why.append(f"partial checkpoints visible: {visible}")
        if (root / step_dir_name(3)).exists() and not committed:
            why.append("a step-00000003 directory exists without a commit")
        outcome = check(root, baseline, may_drop=frozenset({1}) if committed else frozenset())
        survived[phase, rank] = why + outcome.problems
        if outcome.lost:
            fault_trials.record_check(FAULT, f"{phase} rank {rank}", outcome, detail="; ".join(why))
            survived.pop((phase, rank))

    # The restart: every root resumes, exactly, and the run goes on.
    order = list(survived)
    resumed = run_world(resume_world, 2, [str(roots[k]) for k in order], timeout=240)
    for i, (phase, rank) in enumerate(order):
        why = survived[phase, rank]
        expect = 3 if phase in AFTER_RENAME else 2
        for r in range(2):
            got = resumed[r][i]
            if got.get("error") or got.get("step") != expect or not got.get("exact"):
                why.append(f"restart on rank {r}: {got} (expected step {expect}, exact)")
        root = roots[phase, rank]
        if list(root.glob("*.tmp-*")):
            why.append("the restart left an abandoned tmp dir")
        after = check(root, capture_committed_before(baseline, phase))
        fault_trials.record(
            FAULT,
            f"{phase} rank {rank}",
            survived=not why and after.ok,
            lost=after.lost,
            detail="; ".join(why + after.problems),
        )
    assert not [k for k in order if survived[k]], failed_text(fault_trials)


def capture_committed_before(baseline: dict[int, dict[str, object]], phase: str) -> dict:
    """After the restart, the steps that must still be whole (step 1 may be a retention
    victim once step 3 committed)."""
    return {s: v for s, v in baseline.items() if not (phase in AFTER_RENAME and s == 1)}


def failed_text(trials: Trials) -> str:
    return failed(trials._sink)
