"""The tier contract: one set of protocol checks run against every kind of root.

Each check runs once per kind, on a root opened by ``open_root`` and driven by a real
one-rank ``CheckpointManager`` (real DCP saves, real digests): a directory, and an s3://
prefix on moto's S3 server. A new kind of root is added to ``KINDS`` and must pass them all:

- a commit is all or nothing: a save that fails before its commit point leaves no step;
- a step without its manifest is never listed as committed, and ``recover`` removes it (and
  a multipart upload left open) while every committed step stays;
- a damaged byte is named by ``verify``; a resume quarantines its step only once the store
  itself proves the damage (a damaged local copy of an object store's step is fetched again,
  never quarantined) and falls back to the step before;
- a rollback (a save below the newest step) sets the branch it left aside, so a resume
  follows the run as it goes on;
- retention never deletes the newest or a pinned step;
- the run lock refuses a second job while the first holds it, and frees on release.

The memory tier is not a root: its ledger lives in a root of these kinds (a directory's
``memory/``, a bucket's ``memory/``) and its checks are tests/test_memory_*.py.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_kit import MotoServer, moto_server
from torch import nn

import dckpt
from dckpt.errors import LockError
from dckpt.root.layout import step_dir_name
from dckpt.root.protocol import Root
from dckpt.root.retention import RetentionPolicy
from dckpt.tiers.roots import open_root

KINDS = ["directory", "s3"]


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@dataclass
class Kind:
    """One root of one kind, and how a test reaches its stored bytes behind dckpt's back."""

    name: str
    where: str  # what a user passes as the root
    mirror: Path | None
    s3: MotoServer | None
    bucket: str = ""

    def root(self) -> Root:
        return open_root(self.where)

    def manager(self, net: nn.Module) -> dckpt.CheckpointManager:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        config = dckpt.CheckpointConfig(root=self.where, mirror=self.mirror, keep_last=10)
        return dckpt.CheckpointManager(config, dckpt.TrainState(net, opt))

    def stored(self, step: int, name: str) -> bytes:
        if self.s3 is None:
            return (Path(self.where) / step_dir_name(step) / name).read_bytes()
        key = f"p/{step_dir_name(step)}/{name}"
        return bytes(self.s3.client().get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def store(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` under the root, as a crash or bit rot would."""
        if self.s3 is None:
            path = Path(self.where) / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        else:
            self.s3.client().put_object(Bucket=self.bucket, Key=f"p/{key}", Body=data)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Kind:
    monkeypatch.setenv("DCKPT_RUN_ID", f"contract-{uuid.uuid4().hex[:8]}")
    if request.param == "directory":
        return Kind("directory", str(tmp_path / "root"), None, None)
    server: MotoServer = request.getfixturevalue("s3")
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    bucket = server.bucket()
    return Kind("s3", f"s3://{bucket}/p", tmp_path / "mirror", server, bucket)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _saved(kind: Kind, steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps`` (the weights change between them); each step's weights."""
    net = _net()
    weights: dict[int, dict[str, torch.Tensor]] = {}
    with kind.manager(net) as mgr:
        for step in steps:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.5)
            mgr.save(step).result()
            weights[step] = {k: v.clone() for k, v in net.state_dict().items()}
    return weights


def test_a_save_that_fails_before_its_commit_point_leaves_no_step(
    kind: Kind, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(kind, [1])
    net = _net()
    monkeypatch.setenv("DCKPT_FAULT", "phase=rename,rank=0,action=raise,step=2")
    with kind.manager(net) as mgr:
        handle = mgr.save(2)
        with pytest.raises(dckpt.SaveError):
            handle.result()
        monkeypatch.delenv("DCKPT_FAULT")
        with pytest.raises(dckpt.SaveError):  # the failure is raised again, then cleared
            mgr.wait()
    root = kind.root()
    assert root.committed_steps() == [1]
    assert [e.step for e in root.entries() if e.status == "committed"] == [1]
    assert root.read_manifest(1).step == 1


def test_a_step_without_its_manifest_is_never_listed_and_recovery_removes_it(
    kind: Kind,
) -> None:
    _saved(kind, [1])
    shard = kind.stored(1, "__0_0.distcp")
    # What a crash leaves: every shard of step 3 written, its manifest never.
    kind.store(f"{step_dir_name(3)}/__0_0.distcp", shard)
    kind.store(f"{step_dir_name(3)}/.metadata", kind.stored(1, ".metadata"))
    if kind.s3 is None:  # and a directory's save in flight, manifest and all
        tmp = f"{step_dir_name(4)}.tmp-{uuid.uuid4().hex}"
        kind.store(f"{tmp}/manifest.json", kind.stored(1, "manifest.json"))
    root = kind.root()
    assert root.committed_steps() == [1]
    debris = [e for e in root.entries() if e.status == "incomplete"]
    assert {e.step for e in debris} == ({3} if kind.s3 else {3, 4})
    assert all(root.measure(e) > 0 for e in debris)
    with pytest.raises(dckpt.CheckpointNotFoundError):
        dckpt.peek(kind.where, step=3)

    # A job's start recovers: under its lock, the step without a manifest goes, the
    # committed one stays, and the next resume loads it.
    net = _net()
    with kind.manager(net) as mgr:
        assert mgr.resume().step == 1
    root = kind.root()
    assert {e.step for e in root.entries()} - {1} == (set() if kind.s3 else {3})
    if kind.s3 is None:
        # A directory's step-N/ without a manifest is not dckpt's debris to delete: it may
        # be a user's; it stays listed as incomplete, never committed.
        assert [e.status for e in root.entries() if e.step == 3] == ["incomplete"]
    assert root.committed_steps() == [1]


def test_a_damaged_byte_is_named_and_its_step_quarantined_when_the_store_proves_it(
    kind: Kind,
) -> None:
    weights = _saved(kind, [1, 2])
    damaged = bytearray(kind.stored(2, "__0_0.distcp"))
    damaged[len(damaged) // 2] ^= 0x10
    kind.store(f"{step_dir_name(2)}/__0_0.distcp", bytes(damaged))
    if kind.mirror is not None:  # a node that never saved: what it loads comes from the store
        shutil.rmtree(kind.mirror / step_dir_name(2))
    root = kind.root()
    result = root.verify(2, threads=2, deep=False, progress=lambda _n: None)
    assert not result.ok
    assert [p.path.rsplit("/", 1)[-1] for p in result.problems] == ["__0_0.distcp"]
    assert root.verify(1, threads=2, deep=False, progress=lambda _n: None).ok

    net = _net()
    with kind.manager(net) as mgr:
        report = mgr.resume()
    assert report.step == 1, report.format()
    assert all(torch.equal(weights[1][k], v) for k, v in net.state_dict().items())
    root = kind.root()
    assert root.committed_steps() == [1]
    assert [e.step for e in root.entries() if e.status == "quarantined"] == [2]


# Only the kinds that keep a local copy apart from the root itself.
@pytest.mark.parametrize("kind", ["s3"], indirect=True)
def test_a_damaged_local_copy_is_not_proof_and_quarantines_nothing(kind: Kind) -> None:
    assert kind.mirror is not None
    weights = _saved(kind, [1])
    shard = kind.mirror / step_dir_name(1) / "__0_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    shard.write_bytes(bytes(damaged))
    net = _net()
    with kind.manager(net) as mgr:
        assert mgr.resume().step == 1
    assert all(torch.equal(weights[1][k], v) for k, v in net.state_dict().items())
    assert not [e for e in kind.root().entries() if e.status == "quarantined"]


def test_a_rollback_sets_the_abandoned_newer_steps_aside(kind: Kind) -> None:
    # The run goes back to step 1 and saves step 2 again, below its step 3: 3 is of the
    # branch it left, and a resume must not pick it (it goes to quarantine, superseded).
    _saved(kind, [1, 2, 3])
    net = _net()
    with kind.manager(net) as mgr:
        mgr.load(1)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(-1.0)
        mgr.save(2).result()
        want = {k: v.clone() for k, v in net.state_dict().items()}
    root = kind.root()
    assert root.committed_steps() == [1, 2]
    assert [e.step for e in root.entries() if e.status == "quarantined"] == [3]
    net = _net()
    with kind.manager(net) as mgr:
        assert mgr.resume().step == 2
    assert all(torch.equal(want[k], v) for k, v in net.state_dict().items())


def test_retention_never_deletes_the_newest_or_a_pinned_step(kind: Kind) -> None:
    _saved(kind, [1, 2, 3, 4, 5])
    root = kind.root()
    root.pin(1)
    with pytest.raises(FileNotFoundError):
        root.pin(9)
    assert root.pinned_steps() == {1}
    decisions, deleted = root.apply_retention(RetentionPolicy(keep_last=2))
    assert sorted(deleted) == [step_dir_name(2), step_dir_name(3)]
    assert root.committed_steps() == [1, 4, 5]
    assert {d.step for d in decisions if d.keep} == {1, 4, 5}
    assert root.unpin(1) and not root.unpin(1)
    root.apply_retention(RetentionPolicy(keep_last=2))
    assert root.committed_steps() == [4, 5]
    assert dckpt.peek(kind.where).step == 5  # `latest` and the listing agree on the newest


def test_the_lock_refuses_a_second_job_and_frees_on_release(
    kind: Kind, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(kind, [1])
    first: Any = kind.root() if kind.mirror is None else open_root(kind.where, mirror=kind.mirror)
    locks = first.locks("job-a", 60.0)
    for lock in locks:
        lock.acquire()
    try:
        assert first.lock_holder() is not None and "job-a" in first.lock_holder()
        monkeypatch.setenv("DCKPT_RUN_ID", "job-b")
        with pytest.raises(LockError, match="job-a"):
            kind.manager(_net())
        # the refused job removed nothing of the first one's
        assert first.lock_holder() is not None
    finally:
        for lock in reversed(locks):
            lock.release()
    assert first.lock_holder() is None
    with kind.manager(_net()) as mgr:
        assert mgr.resume().step == 1


def test_a_job_whose_lock_was_taken_commits_nothing_more(kind: Kind) -> None:
    """Fencing: another job's record put in place of this job's lock (a takeover, right or
    wrong): the next save fails at its commit point, naming the lock, and commits nothing;
    every later save is refused at once."""
    net = _net()
    with kind.manager(net) as mgr:
        mgr.save(1).result()
        theirs = {"host": "node-9", "pid": 77, "started": 1.0, "run_id": "job-z",
                  "token": "theirs", "lease_until": 2.0}  # fmt: skip
        kind.store(".dckpt-lock", json.dumps(theirs).encode())
        if kind.s3 is not None:  # the local mirror's lock goes too (it was taken with it)
            Path(kind.mirror or "", ".dckpt-lock").write_text(json.dumps(theirs))
        with pytest.raises(dckpt.SaveError, match="commits nothing more"):
            mgr.save(2).result()
        with pytest.raises(LockError, match="this job commits nothing more"):
            mgr.save(3)
        with contextlib.suppress(dckpt.CheckpointError):
            mgr.close()
    assert kind.root().committed_steps() == [1]


def test_the_memory_identity_is_made_once_and_stays_with_the_root(kind: Kind) -> None:
    """A memory directory names the root it serves by this id (tests/faults/
    test_shared_host.py): none until the first memory start makes it, the same at every
    later start and for every opener of the root, and another root's is another."""
    if kind.s3 is None:
        Path(kind.where).mkdir()  # as every job's start does
    ledger = kind.root().memory_ledger()
    assert ledger.identity(create=False) is None
    made = ledger.identity(create=True)
    assert made is not None and len(made) == 32
    assert ledger.identity(create=True) == made
    assert kind.root().memory_ledger().identity(create=False) == made
    if kind.s3 is None:
        Path(kind.where + "-other").mkdir()
    other = open_root(kind.where + "-other").memory_ledger()
    assert other.identity(create=True) not in (None, made)
