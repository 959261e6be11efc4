"""``dckpt set-aside`` and ``dckpt restore`` (issue 56 item 6), on a directory and on an
s3:// prefix (moto's S3 server), each root written by a real one-rank ``CheckpointManager``
and the commands run in-process (``dckpt.cli.main``):

- a step set aside by hand goes to ``quarantine/`` with a reason naming who and why, a
  resume then picks the step before, and ``restore`` brings it back committed, whole (every
  byte as it was), verified (``dckpt verify`` passes) and named by ``latest`` again;
- ``restore`` refuses while a step of that number is committed (a newer save), needs
  ``--name`` when two quarantined copies of one step are there, and refuses a copy with a
  flipped bit, naming the file and leaving it in quarantine;
- both refuse while a live job holds the root's lock, unless ``--force``;
- a restore that names a restart loop says the next start would set it aside again and
  which records to remove (and removes none);
- a bucket's restore writes the manifest last: cut short before it, nothing is committed,
  the quarantined copy stays, and the restore run again succeeds.
"""

from __future__ import annotations

import errno
import json
import os
import time
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
from dckpt.cli import main
from dckpt.errors import StorageError
from dckpt.root.layout import step_dir_name
from dckpt.root.protocol import Root
from dckpt.root.resume_record import REPLAY, ResumeRecord
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
    where: str
    mirror: Path | None
    s3: MotoServer | None
    bucket: str = ""

    def root(self) -> Root:
        return open_root(self.where)

    def manager(self, net: nn.Module) -> dckpt.CheckpointManager:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        config = dckpt.CheckpointConfig(root=self.where, mirror=self.mirror, keep_last=10)
        return dckpt.CheckpointManager(config, dckpt.TrainState(net, opt))

    def files(self, name: str) -> dict[str, bytes]:
        """Every file (object) under ``name`` (``step-N``, ``quarantine/step-N``), by its
        path inside it."""
        if self.s3 is None:
            top = Path(self.where) / name
            return {p.relative_to(top).as_posix(): p.read_bytes() for p in top.rglob("*")
                    if p.is_file()}  # fmt: skip
        prefix = f"p/{name}/"
        client = self.s3.client()
        return {
            key[len(prefix) :]: client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            for key in self.s3.keys(self.bucket, prefix)
        }

    def text(self, name: str) -> str | None:
        """The file (object) ``name`` under the root, or None."""
        if self.s3 is None:
            path = Path(self.where) / name
            return path.read_text() if path.exists() else None
        if f"p/{name}" not in self.s3.keys(self.bucket, f"p/{name}"):
            return None
        body = self.s3.client().get_object(Bucket=self.bucket, Key=f"p/{name}")["Body"]
        return str(body.read().decode())

    def latest(self) -> str | None:
        text = self.text("latest")
        return None if text is None else text.strip()

    def flip(self, name: str, file: str) -> None:
        """One bit of ``name/file`` flipped where it is stored, as bit rot would."""
        data = bytearray(self.files(name)[file])
        data[len(data) // 2] ^= 0x10
        if self.s3 is None:
            (Path(self.where) / name / file).write_bytes(bytes(data))
        else:
            key = f"p/{name}/{file}"
            self.s3.client().put_object(Bucket=self.bucket, Key=key, Body=bytes(data))


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Kind:
    monkeypatch.setenv("DCKPT_RUN_ID", f"aside-{uuid.uuid4().hex[:8]}")
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


def _saved(kind: Kind, steps: list[int], start: float = 0.0) -> dict[int, dict[str, Any]]:
    """Save ``steps`` (the weights change between them, from ``start`` on); each step's
    weights."""
    net = _net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(start)
    weights: dict[int, dict[str, Any]] = {}
    with kind.manager(net) as mgr:
        for step in steps:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.5)
            mgr.save(step).result()
            weights[step] = {k: v.clone() for k, v in net.state_dict().items()}
    return weights


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``dckpt ARGS`` in this process: the exit code, stdout and stderr."""
    capsys.readouterr()
    code = main(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


def _quarantined(kind: Kind) -> list[str]:
    return [e.name for e in kind.root().entries() if e.status == "quarantined"]


def _shard(files: dict[str, bytes]) -> str:
    return next(name for name in sorted(files) if name.endswith(".distcp"))


STEP3, Q3 = step_dir_name(3), f"quarantine/{step_dir_name(3)}"


def test_set_aside_then_restore_puts_the_step_back_whole_verified_and_latest(
    kind: Kind, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(kind, [1, 2, 3])
    before = kind.files(STEP3)
    assert kind.latest() == STEP3

    code, out, err = _cli(capsys, "set-aside", kind.where, "3", "--reason", "loss spiked")
    assert code == 0, err
    assert Q3 in out and f"to put it back: dckpt restore {kind.where} 3" in out, out
    assert "the newest committed step under" in out and "is now 2" in out, out
    root = kind.root()
    assert root.committed_steps() == [1, 2]
    assert _quarantined(kind) == [Q3]
    assert kind.latest() == step_dir_name(2)
    assert kind.files(Q3) == before
    reason = kind.text(f"{Q3}.reason.txt")
    assert reason is not None and "set aside by hand (dckpt set-aside) by " in reason, reason
    assert reason.rstrip().endswith(": loss spiked"), reason
    code, out, err = _cli(capsys, "ls", kind.where, "--json")
    assert code == 0, err
    assert [(r["step"], r["status"]) for r in json.loads(out) if r["step"] == 3] == [
        (3, "quarantined")
    ]
    # Not committed any more: a second set-aside says where it is.
    code, _, err = _cli(capsys, "set-aside", kind.where, "3")
    assert code == 2 and "it is in quarantine already" in err and "dckpt restore" in err, err

    code, out, err = _cli(capsys, "restore", kind.where, "3")
    assert code == 0, err
    assert f"restored step 3 from {Q3}" in out, out
    assert "re-hashed against its manifest" in out and "the next resume may pick it" in out, out
    assert kind.root().committed_steps() == [1, 2, 3]
    assert _quarantined(kind) == []
    assert kind.text(f"{Q3}.reason.txt") is None
    assert kind.files(STEP3) == before  # every byte as it was
    assert kind.latest() == STEP3
    code, out, err = _cli(capsys, "verify", kind.where)
    assert code == 0, out + err
    code, out, _ = _cli(capsys, "ls", kind.where, "--json")
    assert [r["verified"] for r in json.loads(out) if r["step"] == 3] == ["ok"]  # recorded

    # Nothing to restore, nothing to set aside: said in words.
    code, _, err = _cli(capsys, "restore", kind.where, "3")
    assert code == 2 and "step 3 is not in quarantine" in err and "(it is committed)" in err, err
    code, _, err = _cli(capsys, "restore", kind.where, "2")
    assert code == 2 and "step 2 is not in quarantine" in err, err
    code, _, err = _cli(capsys, "set-aside", kind.where, "9")
    assert code == 2 and "no committed checkpoint for step 9" in err, err


def test_a_resume_after_set_aside_of_the_newest_step_resumes_the_step_before(
    kind: Kind, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = _saved(kind, [1, 2, 3])
    assert _cli(capsys, "set-aside", kind.where, "3")[0] == 0
    net = _net()
    with kind.manager(net) as mgr:
        report = mgr.resume()
    assert report.step == 2, report.format()
    assert all(torch.equal(weights[2][k], v) for k, v in net.state_dict().items())
    assert _quarantined(kind) == [Q3]  # the resume leaves it where it is

    assert _cli(capsys, "restore", kind.where, "3")[0] == 0
    net = _net()
    with kind.manager(net) as mgr:
        assert mgr.resume().step == 3
    assert all(torch.equal(weights[3][k], v) for k, v in net.state_dict().items())


def test_restore_refuses_over_a_newer_save_and_two_copies_need_a_name(
    kind: Kind, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(kind, [1, 2, 3])
    first = kind.files(STEP3)
    assert _cli(capsys, "set-aside", kind.where, "3")[0] == 0
    _saved(kind, [3], start=10.0)  # a newer save of step 3
    second = kind.files(STEP3)
    assert second != first

    code, _, err = _cli(capsys, "restore", kind.where, "3")
    assert code == 2, err
    assert (
        f"step 3 is committed under {kind.where} (a newer save of that step); set it aside "
        f"first: dckpt set-aside {kind.where} 3"
    ) in err, err
    assert _quarantined(kind) == [Q3] and kind.files(STEP3) == second  # nothing moved

    code, out, err = _cli(capsys, "set-aside", kind.where, "3", "--json")
    assert code == 0, err
    said = json.loads(out)
    other = said["name"]
    assert other.startswith(f"{Q3}-") and len(other) == len(Q3) + 9, said
    assert said["restore"] == f"dckpt restore {kind.where} 3 --name {other}", said
    assert sorted(_quarantined(kind)) == [Q3, other]

    code, _, err = _cli(capsys, "restore", kind.where, "3")
    assert code == 2 and "step 3 is in quarantine 2 times" in err, err
    assert Q3 in err and other in err and "--name" in err, err
    assert kind.root().committed_steps() == [1, 2]
    code, _, err = _cli(capsys, "restore", kind.where, "3", "--name", "quarantine/step-00000002")
    assert code == 2 and "holds step 2, not step 3" in err, err

    code, out, err = _cli(capsys, "restore", kind.where, "3", "--name", other, "--json")
    assert code == 0, err
    assert json.loads(out)["from"] == other
    assert kind.files(STEP3) == second  # the copy that was named
    assert _quarantined(kind) == [Q3]
    code, _, err = _cli(capsys, "restore", kind.where, "3", "--name", Q3)
    assert code == 2 and "set it aside first" in err, err


def test_a_restore_of_a_damaged_copy_names_the_file_and_leaves_it_in_quarantine(
    kind: Kind, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(kind, [1, 2, 3])
    assert _cli(capsys, "set-aside", kind.where, "3")[0] == 0
    shard = _shard(kind.files(Q3))
    kind.flip(Q3, shard)
    held = kind.files(Q3)

    code, out, err = _cli(capsys, "restore", kind.where, "3")
    assert code == 3, out + err
    assert "is damaged, so it stays in quarantine and nothing was committed" in err, err
    assert shard in err and "digest mismatch" in err, err
    assert kind.root().committed_steps() == [1, 2]
    assert kind.latest() == step_dir_name(2)
    assert _quarantined(kind) == [Q3] and kind.files(Q3) == held
    assert kind.text(f"{Q3}.reason.txt") is not None
    assert kind.files(STEP3) == {}  # no copy left behind (a bucket copies before it checks)


def test_set_aside_and_restore_refuse_while_a_live_job_holds_the_lock_unless_forced(
    kind: Kind, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(kind, [1, 2])
    # The run lock of a live job: this very process (its pid runs), its lease renewed.
    locks = open_root(kind.where, mirror=kind.mirror).locks("live-run", 30.0)
    for lock in locks:
        lock.acquire()
    try:
        code, _, err = _cli(capsys, "set-aside", kind.where, "2")
        assert code == 2 and "is held by run live-run" in err and "--force" in err, err
        assert kind.root().committed_steps() == [1, 2]
        code, _, err = _cli(capsys, "set-aside", kind.where, "2", "--force")
        assert code == 0, err
        assert kind.root().committed_steps() == [1]
        code, _, err = _cli(capsys, "restore", kind.where, "2")
        assert code == 2 and "is held by run live-run" in err, err
        assert _quarantined(kind) == [f"quarantine/{step_dir_name(2)}"]
        code, _, err = _cli(capsys, "restore", kind.where, "2", "--force")
        assert code == 0, err
        assert kind.root().committed_steps() == [1, 2]
    finally:
        for lock in reversed(locks):
            lock.release()


def test_a_restore_names_the_restart_loop_its_records_would_set_it_aside_for(
    kind: Kind, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(kind, [1, 2])
    assert _cli(capsys, "set-aside", kind.where, "2")[0] == 0
    root = kind.root()
    entry = next(e for e in root.entries() if e.status == "quarantined")
    save_id = root.manifest_of(entry).save_id
    records = root.resume_records()
    for attempt in (1, 2):  # two starts, each resumed it and its replay differed
        records.add(
            ResumeRecord(step=2, tier="durable", save_id=save_id, ok=False,
                         verdict="loss nan at step 3, the run had 0.41", run_id="r",
                         attempt=attempt, job="", start=f"host:{attempt}:x", time=time.time(),
                         kind=REPLAY)
        )  # fmt: skip

    code, out, err = _cli(capsys, "restore", kind.where, "2")
    assert code == 0, err
    assert "its resume records end in a restart loop" in out, out
    assert "the next start that picks it would set it aside again" in out, out
    assert records.where(2) in out and records.forget(2) in out, out
    assert len(records.read(2)) == 2  # said, not removed
    code, out, err = _cli(capsys, "set-aside", kind.where, "2")
    assert code == 0, err
    code, out, err = _cli(capsys, "restore", kind.where, "2", "--json")
    assert code == 0, err
    said = json.loads(out)
    assert said["restart_loop"] and said["resume_records"] == records.where(2), said
    assert said["forget"] == records.forget(2)


@pytest.mark.parametrize("kind", ["s3"], indirect=True)
def test_a_bucket_restore_writes_the_manifest_last_and_one_cut_short_commits_nothing(
    kind: Kind, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dckpt.tiers.s3_store import S3Store

    _saved(kind, [1, 2, 3])
    before = kind.files(STEP3)
    assert _cli(capsys, "set-aside", kind.where, "3")[0] == 0
    put, copy = S3Store.put_small, S3Store.copy
    writes: list[str] = []

    def lost_manifest(self: S3Store, key: str, data: bytes, **kwargs: Any) -> str | None:
        if key == f"p/{STEP3}/manifest.json":  # the store falls over at the commit point
            raise StorageError("the store is gone (a test)")
        return put(self, key, data, **kwargs)

    monkeypatch.setattr(S3Store, "put_small", lost_manifest)
    code, _, err = _cli(capsys, "restore", kind.where, "3")
    assert code == 5 and "step 3 is not restored, its quarantined copy stays" in err, err
    root = kind.root()
    assert root.committed_steps() == [1, 2]  # the copies without their manifest: no step
    assert [e.status for e in root.entries() if e.step == 3] == ["incomplete", "quarantined"]
    assert kind.files(Q3) == before and kind.latest() == step_dir_name(2)

    def put_seen(self: S3Store, key: str, data: bytes, **kwargs: Any) -> str | None:
        writes.append(key)
        return put(self, key, data, **kwargs)

    def copy_seen(self: S3Store, src: str, dst: str) -> None:
        writes.append(dst)
        copy(self, src, dst)

    monkeypatch.setattr(S3Store, "put_small", put_seen)
    monkeypatch.setattr(S3Store, "copy", copy_seen)
    code, _, err = _cli(capsys, "restore", kind.where, "3")  # again: it tidies and commits
    assert code == 0, err
    into = [k for k in writes if k.startswith(f"p/{STEP3}/")]
    assert into[-1] == f"p/{STEP3}/manifest.json" and len(into) == len(before), into
    assert kind.files(STEP3) == before and kind.latest() == STEP3
    assert kind.root().committed_steps() == [1, 2, 3] and _quarantined(kind) == []


@pytest.mark.parametrize("kind", ["directory"], indirect=True)
def test_a_directory_restore_commits_at_its_one_rename(
    kind: Kind, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dckpt.root import upkeep

    _saved(kind, [1, 2, 3])
    before = kind.files(STEP3)
    assert _cli(capsys, "set-aside", kind.where, "3")[0] == 0
    rename = os.rename

    def refused(src: Any, dst: Any, **kwargs: Any) -> None:
        if "src_dir_fd" in kwargs:  # the restore's rename, its commit point
            raise OSError(errno.EIO, "Input/output error")
        rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "rename", refused)
    code, _, err = _cli(capsys, "restore", kind.where, "3")
    assert code == 5 and "nothing was restored" in err, err
    assert kind.root().committed_steps() == [1, 2] and _quarantined(kind) == [Q3]
    monkeypatch.setattr(os, "rename", rename)

    def lost(root: Path) -> None:  # a crash right after the rename, as far as latest knows
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(upkeep, "publish_latest", lost)
    code, _, err = _cli(capsys, "restore", kind.where, "3")
    assert code == 0, err
    assert kind.root().committed_steps() == [1, 2, 3] and kind.files(STEP3) == before
    assert kind.latest() == step_dir_name(2)  # behind; the next start brings it forward
    monkeypatch.undo()
    with kind.manager(_net()) as mgr:
        assert mgr.resume().step == 3
    assert kind.latest() == STEP3


def test_both_commands_are_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out
    assert "set-aside" in listed and "restore" in listed
