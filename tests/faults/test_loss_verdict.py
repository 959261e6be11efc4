"""One loss verdict for all ranks (issue 56): with ``loss_watch="raise"`` every rank raises,
or none does.

Each rank judges its own losses, and only rank 0 holds the replay, whose proof outranks the
loss watch. Before, a loss that falls faster than linearly after the save (the run that
stopped saw the same) was passed by rank 0, whose replay proved it, and raised on rank 1,
which had no proof: the job died in the next collective at every start. Now the ranks agree
on dckpt's control group before anything is raised or recorded (dckpt.load.watch).

The losses are a formula of the step, the same bits in the run that stopped and in the
resumed one (so the replay matches), linear up to the save at step 5 and superlinear after
it (so the loss watch's band, from the linear tail, says BELOW). The cases, all in one spawn
of two gloo ranks, each on its own copy of the saved root:

- the replay vouches: no rank raises; rank 0 records the loss watch as passed, by the replay;
- no journal (no proof): every rank raises the loss watch's BELOW, rank 0 records it failed;
- a NaN on rank 1 only, no journal: every rank raises, naming rank 1's losses;
- rank 0's loss differs from the run that stopped at step 7: every rank raises the replay's
  FAIL line, at that step.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from fault_kit import Trials
from torch import nn

from dckpt.root.resume_record import LOSS_WATCH, REPLAY, DirectoryRecords

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

SAVED = 5
WINDOW = 3


def _loss(step: int) -> float:
    """Linear up to the save, then falling faster (the same bits on every run)."""
    after = max(0, step - SAVED)
    return 10.0 - 0.1 * step - 0.5 * after * after


def _run(rank: int, root: str, end: int, changes: dict[str, Any]) -> dict[str, Any]:
    """One start on ``root``: resume (if anything is saved), observe the losses of each step
    up to ``end`` with ``changes`` applied to this rank's, save at ``SAVED``; what it raised
    and at which step."""
    import dckpt

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(
        root=Path(root), timeout_s=30, loss_watch="raise", loss_watch_steps=WINDOW
    )
    out: dict[str, Any] = {"raised": None, "at": None}
    with dckpt.CheckpointManager(config, state) as mgr:
        out["step"] = mgr.resume(allow_fresh=True).step
        try:
            while state.step < end:
                state.step += 1
                loss = _loss(state.step)
                if changes.get("nan") == (rank, state.step):
                    loss = math.nan
                if changes.get("nudge") == (rank, state.step):
                    loss += 1e-3
                mgr.observe(loss)
                if state.step == SAVED:
                    mgr.save(state.step).result()
        except dckpt.LossDeviationError as exc:
            out["raised"], out["at"] = str(exc), state.step
    return out


def _starts(rank: int, world: int, runs: list[tuple[str, int, dict[str, Any]]]) -> list[Any]:
    return [_run(rank, root, end, changes) for root, end, changes in runs]


CASES: dict[str, dict[str, Any]] = {
    "the replay vouches": {},
    "no journal": {"journal": False},
    "a NaN on rank 1 only": {"journal": False, "nan": (1, 7)},
    "rank 0's replay differs": {"nudge": (0, 7)},
}


def test_the_ranks_raise_together_or_not_at_all(tmp_path: Path, fault_trials: Trials) -> None:
    saved = tmp_path / "saved"
    first = run_world(_starts, 2, [(str(saved), 8, {})])
    assert [r[0]["raised"] for r in first] == [None, None], first
    roots = {}
    for name, case in CASES.items():
        roots[name] = tmp_path / name.replace(" ", "-").replace("'", "")
        shutil.copytree(saved, roots[name])
        if case.get("journal") is False:
            shutil.rmtree(roots[name] / ".dckpt-replay")
    runs = [
        (str(roots[n]), 10, {k: v for k, v in c.items() if k != "journal"})
        for n, c in CASES.items()
    ]
    got = run_world(_starts, 2, runs, timeout=240)
    for i, name in enumerate(CASES):
        with fault_trials.trial('loss_watch="raise", two ranks, one verdict', name):
            r0, r1 = got[0][i], got[1][i]
            assert r0["step"] == r1["step"] == SAVED, (r0, r1)
            records = [(r.kind, r.ok) for r in DirectoryRecords(roots[name]).read(SAVED)]
            if name == "the replay vouches":
                assert r0["raised"] is None and r1["raised"] is None, (r0, r1)
                assert records == [(REPLAY, True), (LOSS_WATCH, True)], records
                (watch,) = [
                    r for r in DirectoryRecords(roots[name]).read(SAVED) if r.kind == LOSS_WATCH
                ]
                assert "the replay found steps 6..8 identical" in watch.verdict, watch
            elif name == "rank 0's replay differs":
                assert r0["raised"] == r1["raised"] and "[FAIL] replay: step 7" in r0["raised"]
                assert r0["at"] == r1["at"] == 7, (r0, r1)  # seen at the 2nd observe: agreed
                assert records == [(REPLAY, False)], records
            else:
                assert r0["raised"] == r1["raised"] and r0["raised"], (r0, r1)
                assert r0["at"] == r1["at"], (r0, r1)
                assert records == [(LOSS_WATCH, False)], records
                word = "is not finite" if "NaN" in name else "BELOW"
                assert word in r0["raised"], r0
                if "NaN" in name:
                    assert "the losses of rank 1" in r0["raised"], r0


def _silent_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Resume ``root`` with ``raise``; rank 1 never calls observe() (a script that observes
    on rank 0 only), rank 0 does: what rank 0 raised."""
    import time

    import dckpt

    model = nn.Linear(4, 1)
    state = dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01))
    config = dckpt.CheckpointConfig(
        root=Path(root), timeout_s=4, loss_watch="raise", loss_watch_steps=WINDOW
    )
    mgr = dckpt.CheckpointManager(config, state)
    mgr.resume()
    done = Path(root).parent / "rank-0-answered"
    if rank == 1:  # alive, elsewhere in its loop, until rank 0 has its answer (60 s at most)
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return {}
    try:
        mgr.observe(_loss(SAVED + 1))
        return {"raised": None}
    except dckpt.CheckpointError as exc:
        return {"raised": f"{type(exc).__name__}: {exc}"}
    finally:
        done.touch()


def test_a_rank_that_does_not_come_to_the_agreement_is_named(tmp_path: Path) -> None:
    """With ``raise`` every rank must observe() every step: one that does not is named, in
    words that say what to change, after ``timeout_s`` (never a raw gloo timeout)."""
    root = tmp_path / "root"
    run_world(_starts, 2, [(str(root), 8, {})])
    got = run_world(_silent_rank, 2, str(root), expect_failure=True, timeout=120)
    raised = got[0]["raised"] if isinstance(got[0], dict) else str(got[0])
    assert raised.startswith("WorldError: the agreement on the loss watch's verdict"), raised
    assert "rank 1" in raised and "call it on every rank" in raised, raised
