"""No restart loops on a bad checkpoint (issue 26), and no guard that takes a healthy run
down (issue 41): a resume whose replay differs from the run that stopped (its first losses
are NaN where that run's were finite) is recorded in the root; after two such starts in a
row the third quarantines the step, with the reason, and resumes from the step before,
saying so; one failure then a replay that matched quarantines nothing; the same in an s3://
bucket; ``dckpt ls`` shows the records. The other side of the rule: a loss watch that fails
on every start (a judgement, no proof) never quarantines anything, and a loss that falls
faster than linearly (pytorch/examples' 2-D example trains on ``output.sum()``), resumed
from an early step three starts in a row, resumes every time and is never called failed.

The training script is this file's ``_start``, on real gloo ranks: its loss is NaN when it
was resumed from the step ``nan_from`` names (a test-only knob of the script, the way a
checkpoint whose state diverges after a load behaves), and it stops on the
``LossDeviationError`` (``loss_watch="raise"``) as a job stops on a NaN check.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from torch import nn

from dckpt.root.layout import committed_steps, list_checkpoints
from dckpt.root.resume_record import (
    KEEP,
    LOSS_WATCH,
    REPLAY,
    RESUMES_DIR,
    DirectoryRecords,
    ResumeRecord,
    restart_loop,
    summary,
)

pytestmark = pytest.mark.multiproc


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, x @ torch.linspace(-1, 1, 8).unsqueeze(1)


def _start(
    rank: int,
    world: int,
    root: str,
    mirror: str,
    saves: list[int],
    steps: int,
    nan_from: int,
    fallback: bool = True,
    replay: str = "auto",
    superlinear: bool = False,
) -> dict[str, Any]:
    """One start of the job: resume, train ``steps`` steps (observing each loss), saving at
    ``saves``; NaN losses when resumed from ``nan_from``. ``superlinear``: the loss is the
    model's output summed, under SGD with momentum (it falls faster than linearly)."""
    import dckpt

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9 if superlinear else 0.0)
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(
        root=root if root.startswith("s3://") else Path(root),
        mirror=Path(mirror) / f"node{rank}" if root.startswith("s3://") else None,
        timeout_s=60,
        loss_watch="raise",
        loss_watch_steps=3,
        keep_last=4,
        fallback=fallback,
        replay_check=replay,  # type: ignore[arg-type]
    )
    out: dict[str, Any] = {"raised": None}
    with dckpt.CheckpointManager(config, state) as mgr:
        try:
            report = mgr.resume()
        except dckpt.CheckpointError as exc:
            return {"refused": str(exc)}
        out["step"], out["report"] = report.step, report.format()
        nan = report.step == nan_from
        try:
            for _ in range(steps):
                state.step += 1
                x, y = _batch(state.step)
                loss = model(x).sum() if superlinear else nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                mgr.observe(float("nan") if nan else float(loss.detach()))
                if state.step in saves:
                    mgr.save(state.step).result()
        except dckpt.LossDeviationError as exc:  # the job stops, as on a NaN check
            out["raised"] = str(exc)
    out["end"] = state.step
    return out


def _world(root: str, *, attempt: int, nan_from: int = 8, steps: int = 3, **kw: Any) -> Any:
    env = {"TORCHELASTIC_RESTART_COUNT": str(attempt), **kw.pop("env", {})}
    saves, mirror, fallback = kw.pop("saves", []), kw.pop("mirror", ""), kw.pop("fallback", True)
    replay, superlinear = kw.pop("replay", "auto"), kw.pop("superlinear", False)
    args = (root, mirror, saves, steps, nan_from, fallback, replay, superlinear)
    return run_world(_start, 2, *args, env=env, **kw)


def _replays(records: list[ResumeRecord]) -> list[ResumeRecord]:
    return [r for r in records if r.kind == REPLAY]


def _ls(root: str, *args: str, capsys: pytest.CaptureFixture[str]) -> str:
    from dckpt.cli import main

    capsys.readouterr()
    assert main(["ls", root, *args]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with steps 4 and 8 of one run, every loss finite, that trained on to step 11
    before it stopped (steps 9-11 in step 8's replay journal: what a resume of 8 replays
    against); read-only: copy to change."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    (first,) = {r["end"] for r in _world(str(root), attempt=0, saves=[4, 8], steps=11)}
    assert first == 11 and committed_steps(root) == [4, 8]
    return root


def test_a_step_that_fails_twice_is_quarantined_and_the_step_before_used(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    for attempt in (1, 2):  # two starts, each resumes step 8 and meets a NaN at once
        results = _world(str(root), attempt=attempt)
        for r in results:
            assert r["step"] == 8 and "restart loop" not in r["report"], r["report"]
            assert "is not finite" in (r["raised"] or ""), r
        records = DirectoryRecords(root).read(8)
        # each start: its replay's difference (proof) and its loss watch's verdict
        assert [(x.kind, x.ok, x.attempt) for x in records] == [
            (kind, False, a) for a in range(1, attempt + 1) for kind in (REPLAY, LOSS_WATCH)
        ]
        shown = {e["step"]: e for e in json.loads(_ls(str(root), "--json", capsys=capsys))}
        assert shown[8]["resumed"] == f"{attempt} replays differed"
        assert len(shown[8]["resumes"]) == 2 * attempt
        assert shown[4]["resumes"] == [] and shown[4]["resumed"] is None
    first, second = _replays(records)
    assert (first.step, first.tier) == (8, "durable")  # the tier's one name
    assert len(first.run_id) == 32 and first.run_id != second.run_id  # each start's own
    assert first.verdict.startswith("step 9 differs from the run that stopped: nan now")
    for r in _world(str(root), attempt=3, fallback=False):  # neither a third try nor a fallback
        assert "step 8 (root) is a restart loop: resumed twice (attempts 1, 2)" in r["refused"]
    assert committed_steps(root) == [4, 8] and not (root / "quarantine").exists()

    # The next start (with fallback, the default): step 8 is set aside before it is read,
    # step 4 resumed, and the report says why.
    results = _world(str(root), attempt=4, steps=4, saves=[8])
    for r in results:
        assert r["step"] == 4 and r["raised"] is None, r
        assert r["end"] == 8  # trained on from step 4 and saved step 8 again
        line = next(x for x in r["report"].splitlines() if "restart loop" in x)
        assert line.startswith("  restart loop: step 8 quarantined, resumed twice (attempts 1, 2)")
        assert "its replay differed from the run that stopped both times: step 9 differs" in line
        assert line.endswith("; resumed from step 4 instead")
    reason = (root / "quarantine" / "step-00000008.reason.txt").read_text()
    assert reason.startswith("restart loop: resumed twice (attempts 1, 2) and its replay")
    assert f"{RESUMES_DIR}/step-00000008.json" in reason  # how to try it again
    assert {(e.step, e.status) for e in list_checkpoints(root)} == {
        (4, "committed"),
        (8, "committed"),  # the new save of step 8: another checkpoint, no records of its own
        (8, "quarantined"),
    }
    assert [x.ok for x in DirectoryRecords(root).read(4)] == [True, True]  # step 4 passed
    shown = json.loads(_ls(str(root), "--json", capsys=capsys))
    by = {(e["step"], e["status"]): e for e in shown}
    assert by[(8, "quarantined")]["resumed"] == "2 replays differed"
    assert by[(8, "committed")]["resumes"] == []
    assert by[(4, "committed")]["resumed"] == "replay ok"
    table = _ls(str(root), capsys=capsys)
    assert "resumes" in table and "2 replays differed" in table and "replay ok" in table


def test_one_failure_then_a_pass_quarantines_nothing(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    _world(str(root), attempt=0)  # NaN: failed
    passed = _world(str(root), attempt=1, nan_from=-1)  # the same step, finite: passed
    assert {r["step"] for r in passed} == {8} and not any(r["raised"] for r in passed)
    again = _world(str(root), attempt=2)  # NaN again: one failure since the pass, not two
    for r in again:
        assert r["step"] == 8 and "restart loop" not in r["report"] and r["raised"], r
    assert not (root / "quarantine").exists()
    # a run that ends 1 step after its resume (of 3 watched): its verdict is not recorded
    # a run that ends 1 step after its resume (of 3 watched): its loss watch's verdict is not
    # recorded; its replay (step 9 matched) is, and breaks the row
    _world(str(root), attempt=3, nan_from=-1, steps=1)
    kept = DirectoryRecords(root).read(8)
    assert [(x.kind, x.ok) for x in kept if x.attempt == 3] == [(REPLAY, True)]
    assert [x.ok for x in _replays(kept)] == [False, True, False, True]
    (step8,) = [e for e in json.loads(_ls(str(root), "--json", capsys=capsys)) if e["step"] == 8]
    assert step8["resumed"] == "replay ok"
    assert [r["attempt"] for r in step8["resumes"] if r["kind"] == REPLAY] == [0, 1, 2, 3]


# --- the rule and the file, without ranks -----------------------------------------------------


def _record(start: str, ok: bool, t: float, **kw: Any) -> ResumeRecord:
    fields: dict[str, Any] = {
        "step": 8,
        "tier": "durable",
        "save_id": "a",
        "ok": ok,
        "verdict": "loss nan",
        "run_id": "r",
        "attempt": None,
        "job": "",
        "start": start,
        "time": t,
        "kind": REPLAY,
    }
    return ResumeRecord(**{**fields, **kw})


def test_the_rule_counts_starts_and_a_pass_breaks_the_row(tmp_path: Path) -> None:
    fail_a, fail_b = _record("a", False, 1.0), _record("b", False, 2.0)
    assert restart_loop([fail_a]) is None
    assert restart_loop([fail_a, _record("a", False, 1.5)]) is None  # one start, twice
    reason = restart_loop([fail_a, fail_b])
    assert reason is not None and reason.startswith("resumed twice (the start at ")
    assert reason.endswith("its replay differed from the run that stopped both times: loss nan")
    assert restart_loop([fail_a, _record("p", True, 1.5), fail_b]) is None
    assert summary([fail_a, _record("p", True, 1.5)]) == "replay ok" and summary([]) == ""
    # A loss watch's verdict is no proof: it never counts, and never breaks a row either.
    watched = [_record(s, False, t, kind=LOSS_WATCH) for s, t in (("a", 1.0), ("b", 2.0))]
    assert restart_loop(watched) is None and summary(watched) == "loss watch warned"
    assert restart_loop([fail_a, _record("p", True, 1.5, kind=LOSS_WATCH), fail_b]) is not None
    assert summary([*watched, _record("c", True, 3.0, kind=LOSS_WATCH)]) == "ok"
    old = _record("a", False, 1.0).to_json()
    del old["kind"]  # a record from before the replay counted: a loss watch's
    assert ResumeRecord.from_json(old) == _record("a", False, 1.0, kind=LOSS_WATCH)
    # an older dckpt stored the report's words as the tier: read with the tier's one name
    for words, name in (("root", "durable"), ("memory tier", "memory")):
        got = ResumeRecord.from_json({**old, "tier": words})
        assert got is not None and got.tier == name, got
    numbered = [_record("a", False, 1.0, attempt=3), _record("b", False, 2.0, attempt=4)]
    assert (restart_loop(numbered) or "").startswith("resumed twice (attempts 3, 4) and")
    two_jobs = [_record("a", False, 1.0, attempt=0), _record("b", False, 2.0, attempt=0)]
    assert (restart_loop(two_jobs) or "").startswith("resumed twice (attempt 0 at ")

    records = DirectoryRecords(tmp_path)
    (tmp_path / RESUMES_DIR).mkdir()
    (tmp_path / RESUMES_DIR / ".step-00000008.json.tmp-dead").write_text("cut short")
    for i in range(KEEP + 3):
        kept = records.add(_record(f"s{i}", i % 2 == 0, float(i)))
    assert len(kept) == KEEP and [r.start for r in records.read(8)] == [
        f"s{i}" for i in range(3, KEEP + 3)
    ]
    assert records.steps() == [8] and not list((tmp_path / RESUMES_DIR).glob(".*tmp-*"))
    assert committed_steps(tmp_path) == []  # never mistaken for a checkpoint
    (tmp_path / RESUMES_DIR / "step-00000008.json").write_text("{not json")
    assert records.read(8) == []  # a damaged file costs the history, never a resume
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(elsewhere, linked / RESUMES_DIR)
    with pytest.raises(OSError):
        DirectoryRecords(linked).add(_record("x", False, 1.0))
    assert list(elsewhere.iterdir()) == []  # nothing written through the link


# --- an s3:// root ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    from s3_kit import moto_server

    with moto_server() as server:
        yield server


def test_an_s3_root_records_and_quarantines_in_the_bucket(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = s3.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bucket = s3.bucket()
    root = f"s3://{bucket}/job"
    mirror = str(tmp_path / "mirror")
    _world(root, attempt=0, saves=[4, 8], steps=11, nan_from=-1, env=env, mirror=mirror)
    for attempt in (1, 2):
        for r in _world(root, attempt=attempt, env=env, mirror=mirror):
            assert r["step"] == 8 and r["raised"], r
    record = json.loads(
        s3.client()
        .get_object(Bucket=bucket, Key=f"job/{RESUMES_DIR}/step-00000008.json")["Body"]
        .read()
    )
    # attempt 0 saved and never resumed: the records are the two failed resumes' replays
    replays = [x for x in record["records"] if x["kind"] == REPLAY]
    assert [(x["ok"], x["attempt"]) for x in replays] == [(False, 1), (False, 2)]
    results = _world(root, attempt=3, env=env, mirror=mirror)
    for r in results:
        assert r["step"] == 4 and r["raised"] is None, r
        assert "restart loop: step 8 quarantined, resumed twice (attempts 1, 2)" in r["report"]
    keys = s3.keys(bucket)
    assert "job/step-00000008/manifest.json" not in keys
    reason = s3.client().get_object(Bucket=bucket, Key="job/quarantine/step-00000008.reason.txt")
    assert reason["Body"].read().decode().startswith("restart loop: resumed twice")
    shown = {(e["step"], e["status"]): e for e in json.loads(_ls(root, "--json", capsys=capsys))}
    assert shown[(8, "quarantined")]["resumed"] == "2 replays differed"
    assert shown[(4, "committed")]["resumed"] == "replay ok"


def test_a_loop_right_after_another_is_refused_not_walked_back(saved: Path, tmp_path: Path) -> None:
    """Step 8 loops and is set aside; step 4 then differs from the run that stopped on two
    starts too, no replay matching in between: the next start refuses (a cause outside the
    checkpoints), quarantining nothing more. Once a replay matched, a later loop is set
    aside as usual."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    for attempt in (1, 2):
        _world(str(root), attempt=attempt)  # 8: NaN twice, its replay differs twice
    for attempt in (3, 4):  # 8 set aside at 3; 4 differs at 3 and at 4
        for r in _world(str(root), attempt=attempt, nan_from=4):
            assert r["step"] == 4 and "is not finite" in (r["raised"] or ""), r
    for r in _world(str(root), attempt=5, nan_from=4):
        refused = r["refused"]
        assert "step 4 (root) is a restart loop too (resumed twice (attempts 3, 4)" in refused
        assert "right after step 8 was set aside as one" in refused
        assert f"{RESUMES_DIR}/step-00000004.json" in refused
    assert committed_steps(root) == [4]  # 4 stays where it is
    assert [e.step for e in list_checkpoints(root) if e.status == "quarantined"] == [8]
    # The cause fixed and 4's records removed: it resumes, its replay matches, and the run
    # saves step 6; a later loop of 6 then follows a pass, and is set aside as usual.
    (root / RESUMES_DIR / "step-00000004.json").unlink()
    for r in _world(str(root), attempt=6, nan_from=-1, steps=3, saves=[6]):
        assert r["step"] == 4 and r["raised"] is None and r["end"] == 7, r
    for attempt in (7, 8):
        _world(str(root), attempt=attempt, nan_from=6)
    for r in _world(str(root), attempt=9, nan_from=-1):
        assert r["step"] == 4 and "restart loop: step 6 quarantined" in r["report"], r


def test_a_loss_watch_that_fails_every_start_quarantines_nothing(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other side of the rule: with no replay (``replay_check="off"``), NaN after every
    resume fails the loss watch three starts in a row. That is a judgement, not proof: each
    start resumes step 8 again (warned), nothing is quarantined, ``ls`` says "warned"."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    for attempt in (1, 2, 3):
        for r in _world(str(root), attempt=attempt, replay="off"):
            assert r["step"] == 8 and "restart loop" not in r["report"], r["report"]
            assert "is not finite" in (r["raised"] or ""), r
    assert committed_steps(root) == [4, 8] and not (root / "quarantine").exists()
    kept = DirectoryRecords(root).read(8)
    assert [(x.kind, x.ok) for x in kept] == [(LOSS_WATCH, False)] * 3
    (step8,) = [e for e in json.loads(_ls(str(root), "--json", capsys=capsys)) if e["step"] == 8]
    assert step8["resumed"] == "loss watch warned"


@pytest.mark.faults
def test_a_loss_falling_faster_than_linearly_resumes_three_starts_in_a_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fault_trials: Any
) -> None:
    with fault_trials.trial("a loss falling faster than linearly", "three starts in a row"):
        _superlinear_three_starts(tmp_path, capsys)


def _superlinear_three_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41's case: the loss is ``output.sum()`` under momentum (it falls faster than
    linearly), saved at step 5 (5 losses of history), the job killed twice more before its
    next save. Every start resumes step 5; its replay matches the run that stopped, and the
    loss watch defers to it; nothing is quarantined, and ``ls`` calls nothing failed."""
    root = tmp_path / "ckpt"
    for r in _world(str(root), attempt=0, saves=[5], steps=8, nan_from=-1, superlinear=True):
        assert r["end"] == 8 and r["raised"] is None, r
    for attempt in (1, 2, 3):
        for r in _world(str(root), attempt=attempt, nan_from=-1, superlinear=True):
            assert r["step"] == 5 and r["raised"] is None, r
            assert "restart loop" not in r["report"] and "quarantine" not in r["report"]
    assert committed_steps(root) == [5] and not (root / "quarantine").exists()
    kept = DirectoryRecords(root).read(5)
    assert [(x.kind, x.ok) for x in kept] == [(REPLAY, True), (LOSS_WATCH, True)] * 3
    assert "the replay found steps 6..8 identical" in kept[1].verdict
    (step5,) = [e for e in json.loads(_ls(str(root), "--json", capsys=capsys))]
    assert step5["resumed"] == "replay ok"
