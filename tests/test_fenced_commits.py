"""A job fenced just before each of its commit points leaves nothing of itself in the root
(issue 58, item 2: "for every commit point, a job fenced just before it").

Fenced: another job's run-lock record put in place of this job's (a takeover, right or
wrong), by a hook run exactly before the commit point (the fault point there, or the step
right before it), so only a check made *at* the commit point can stop the job; a check made
earlier, or after, lets it through. Each case one one-rank manager, in this process, in a
root of its own, the lock on:

- a directory root: a new step (the rename), and a re-save of a committed step after a
  rollback (the swap, then the newer branch set aside): nothing committed, the re-saved
  step's old copy and the newer branch as they were, ``latest`` unchanged, the save fails
  saying the job commits nothing more; retention (keep the newest 2): with the lock taken
  after retention planned and before it deletes, no step is deleted, and the job says why;
  the memory ledger's retention (keep ``memory_keep + 1`` records) likewise removes no
  record (the ledger's own commit point: tests/test_memory_survivors.py);
- an s3:// root (moto's server, one for the module): a new step (the manifest PUT), a
  re-save of a committed step (its old manifest is deleted first, an object store cannot
  swap: a fenced job deleted it, and the step the other job may be reading, before this
  check), retention: no manifest put, none deleted, ``latest`` as it was.

Not covered here (no fence to check): resume records, verification records, pins and the
replay journal are written without reading the lock back; see the report of issue 58.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_kit import MotoServer, moto_server

import dckpt
from dckpt.phases import Phase
from dckpt.root.layout import committed_steps, list_checkpoints
from dckpt.root.memory_ledger import DirectoryLedger

THEIRS = {"host": "node-9", "pid": 77, "started": 1.0, "run_id": "job-z",
          "token": "theirs", "lease_until": 2.0}  # fmt: skip
"""Another job's lock record, on another host: this job is fenced."""


def _manager(root: str, **extra: Any) -> tuple[dckpt.CheckpointManager, torch.nn.Module]:
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    config = dckpt.CheckpointConfig(root=root, loss_watch="off", **extra)  # the lock on
    return dckpt.CheckpointManager(config, dckpt.TrainState(net, opt)), net


def _bump(net: torch.nn.Module) -> None:
    with torch.no_grad():
        net.weight.add_(1.0)


def _at(
    monkeypatch: pytest.MonkeyPatch, module: Any, phase: Phase, step: int, take: Callable[[], None]
) -> None:
    """``take`` runs at ``module``'s fault point ``phase`` of ``step``, before the real one."""
    real = module.fault_point

    def hook(at: Any, rank: int, at_step: int | None = None, path: str = "") -> bool:
        if at == phase and at_step == step:
            take()
        return bool(real(at, rank, at_step, path))

    monkeypatch.setattr(module, "fault_point", hook)


def _close(mgr: dckpt.CheckpointManager) -> None:
    with contextlib.suppress(dckpt.CheckpointError):
        mgr.close()


# --- a directory root ---------------------------------------------------------------------------


def _take(root: Path) -> Callable[[], None]:
    return lambda: (root / ".dckpt-lock").write_text(json.dumps(THEIRS))


def _manifests(root: Path) -> dict[str, bytes]:
    return {p.parent.name: p.read_bytes() for p in sorted(root.glob("step-*/manifest.json"))}


def test_a_directory_job_fenced_right_before_the_rename_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dckpt.root import commit

    # a new step
    root = tmp_path / "new"
    mgr, net = _manager(str(root))
    try:
        for step in (1, 2):
            _bump(net)
            mgr.save(step).result()
        before = _manifests(root)
        _at(monkeypatch, commit, Phase.RENAME, 3, _take(root))
        with pytest.raises(dckpt.SaveError, match="commits nothing more"):
            mgr.save(3).result()
    finally:
        _close(mgr)
    assert committed_steps(root) == [1, 2] and _manifests(root) == before
    assert (root / "latest").read_text().strip() == "step-00000002"
    assert not list(root.glob("step-00000003*"))  # no tmp dir left either

    # a rollback's re-save of a committed step: the swap, then the newer branch set aside
    root = tmp_path / "resave"
    mgr, net = _manager(str(root))
    try:
        for step in (1, 2, 3):
            _bump(net)
            mgr.save(step).result()
        before = _manifests(root)
        mgr.load(1)
        _bump(net)
        _at(monkeypatch, commit, Phase.RENAME, 2, _take(root))
        with pytest.raises(dckpt.SaveError, match="commits nothing more"):
            mgr.save(2).result()
    finally:
        _close(mgr)
    assert _manifests(root) == before  # step 2's copy is the first save's; 3 not set aside
    assert {e.status for e in list_checkpoints(root)} == {"committed"}
    assert (root / "latest").read_text().strip() == "step-00000003"
    assert not [p for p in root.iterdir() if ".replaced-" in p.name or ".tmp-" in p.name]


def test_a_directory_job_fenced_right_before_its_retention_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from dckpt.root import upkeep
    from dckpt.tiers.memory_commit import MemoryCommit

    root = tmp_path / "durable"
    real_plan = upkeep.plan_retention

    def planned_then_taken(at: Any, policy: Any) -> Any:
        decisions = real_plan(at, policy)
        if committed_steps(root) == [1, 2, 3]:  # the save of step 3 committed: fenced now
            _take(root)()
        return decisions

    monkeypatch.setattr(upkeep, "plan_retention", planned_then_taken)
    mgr, net = _manager(str(root), keep_last=2)
    try:
        with caplog.at_level(logging.ERROR, logger="dckpt"):
            for step in (1, 2, 3):
                _bump(net)
                mgr.save(step).result()  # committed: its retention is what is fenced
    finally:
        _close(mgr)
    assert committed_steps(root) == [1, 2, 3]
    said = [r.getMessage() for r in caplog.records if "retention failed" in r.getMessage()]
    assert said and "commits nothing more" in said[0], said

    # the memory ledger's retention (keep memory_keep + 1 = 2 records)
    root = tmp_path / "memory"
    real_retain = MemoryCommit.retain

    def taken_then_retained(self: MemoryCommit, at: Path, policy: Any) -> None:
        if DirectoryLedger(root).steps() == [1, 2, 3]:
            _take(root)()
        real_retain(self, at, policy)

    monkeypatch.setattr(MemoryCommit, "retain", taken_then_retained)
    mgr, net = _manager(str(root), memory=True, memory_dir=tmp_path / "mem")
    try:
        for step in (1, 2, 3):
            _bump(net)
            with contextlib.suppress(dckpt.CheckpointError):  # retention's failure is logged
                mgr.save(step, tier="memory").result()
    finally:
        _close(mgr)
    assert DirectoryLedger(root).steps() == [1, 2, 3]


# --- an s3:// root ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@pytest.fixture
def s3_env(s3: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {**s3.env(), "DCKPT_RUN_ID": "fenced"}.items():
        monkeypatch.setenv(k, v)


@pytest.mark.multiproc
def test_an_s3_job_fenced_right_before_its_manifest_put_or_a_delete_changes_nothing(
    s3: MotoServer, s3_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dckpt.tiers import object_commit
    from dckpt.tiers.object_root import ObjectRoot

    bucket, client = s3.bucket(), s3.client()

    def take(prefix: str) -> Callable[[], None]:
        def put() -> None:
            body = json.dumps(THEIRS)
            client.put_object(Bucket=bucket, Key=f"{prefix}/.dckpt-lock", Body=body)

        return put

    def manifests(prefix: str) -> dict[str, bytes]:
        found = {}
        for key in sorted(s3.keys(bucket, f"{prefix}/")):
            if key.endswith("/manifest.json") and key.count("/") == 2:
                found[key] = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        return found

    def latest(prefix: str) -> str:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/latest")["Body"].read()
        return str(body.decode().strip())

    # a new step: fenced right before the manifest PUT
    mgr, net = _manager(f"s3://{bucket}/new", mirror=tmp_path / "m-new")
    try:
        for step in (1, 2):
            _bump(net)
            mgr.save(step).result()
        before = manifests("new")
        _at(monkeypatch, object_commit, Phase.RENAME, 3, take("new"))
        with pytest.raises(dckpt.SaveError, match="commits nothing more"):
            mgr.save(3).result()
    finally:
        _close(mgr)
    assert manifests("new") == before and latest("new") == "step-00000002"

    # a re-save of a committed step: fenced before its old manifest is deleted
    mgr, net = _manager(f"s3://{bucket}/resave", mirror=tmp_path / "m-resave")
    try:
        for step in (1, 2):
            _bump(net)
            mgr.save(step).result()
        before = manifests("resave")
        take("resave")()
        _bump(net)
        with pytest.raises(dckpt.SaveError, match="commits nothing more"):
            mgr.save(2).result()
    finally:
        _close(mgr)
    assert manifests("resave") == before and latest("resave") == "step-00000002"

    # retention (keep the newest 2): fenced after it planned, before it deletes
    real_plan = ObjectRoot.plan_retention

    def planned_then_taken(self: ObjectRoot, policy: Any) -> Any:
        decisions = real_plan(self, policy)
        if len(manifests("kept")) == 3:
            take("kept")()
        return decisions

    monkeypatch.setattr(ObjectRoot, "plan_retention", planned_then_taken)
    mgr, net = _manager(f"s3://{bucket}/kept", mirror=tmp_path / "m-kept", keep_last=2)
    try:
        for step in (1, 2, 3):
            _bump(net)
            mgr.save(step).result()
    finally:
        _close(mgr)
    assert len(manifests("kept")) == 3 and latest("kept") == "step-00000003"
