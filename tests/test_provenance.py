"""A checkpoint is the job's own (issue 54, items 1 and 2): a root proven at every start, a
step another user owns passed over and named, and, with a key, only signed steps resumed.

"Another user" is uid ``OTHER``: the tests run as root (as CI does) and ``os.chown`` makes a
file exactly what that user's copy would be (the kernel keeps no other record of who made
it). The roots are written by real ``CheckpointManager`` s (one rank in this process; two
real ranks on gloo for a file in the second rank's share), and the CLI runs in-process.

Both sides of each rule: the job's own step resumes and another user's does not; a signed
step resumes and an unsigned one, or one signed with another key, does not, on a directory
and on an s3:// root (moto's S3 server); a private root starts and a squatted one, a
squatted parent or a root others may write does not, unless the group is trusted on purpose.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from s3_kit import MotoServer, moto_server
from torch import nn

import dckpt
from dckpt.cli import main
from dckpt.errors import CheckpointError
from dckpt.owned import NotOwnedError
from dckpt.root.layout import step_dir_name
from dckpt.root.manifest import MANIFEST_FILE, manifest_bytes, parse_manifest
from dckpt.root.provenance import ManifestKey

OTHER = 4242  # a uid that is not this process's (no passwd entry needed)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@pytest.fixture(autouse=True)
def _run_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCKPT_RUN_ID", f"prov-{uuid.uuid4().hex[:8]}")
    monkeypatch.delenv("DCKPT_KEY_FILE", raising=False)
    monkeypatch.delenv("DCKPT_ROOT_ACCESS", raising=False)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _manager(net: nn.Module, **config: Any) -> dckpt.CheckpointManager:
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return dckpt.CheckpointManager(dckpt.CheckpointConfig(**config), dckpt.TrainState(net, opt))


def _save(steps: list[int], **config: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Save ``steps`` (the weights change between them); each step's weights."""
    net, weights = _net(), {}
    with _manager(net, **config) as mgr:
        for step in steps:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.5)
            mgr.save(step).result()
            weights[step] = {k: v.clone() for k, v in net.state_dict().items()}
    return weights


def _resume(**config: Any) -> tuple[dckpt.ResumeReport, dict[str, torch.Tensor]]:
    net = _net()
    with _manager(net, **config) as mgr:
        report = mgr.resume()
    return report, net.state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _chown_tree(path: Path, uid: int) -> None:
    os.lchown(path, uid, uid)
    for p in path.rglob("*"):
        os.lchown(p, uid, uid)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


# --- the owner: another user's step is passed over, named, never moved ---------------------


def test_a_step_another_user_owns_is_passed_over_named_and_never_moved(tmp_path: Path) -> None:
    root = tmp_path / "root"
    weights = _save([2, 4, 6], root=root)
    step4, step6 = root / step_dir_name(4), root / step_dir_name(6)
    _chown_tree(step6, OTHER)  # the newest: as if another user had copied it in
    os.lchown(step4 / MANIFEST_FILE, OTHER, OTHER)  # only the manifest of the next
    report, state = _resume(root=root)
    assert report.step == 2 and _same(state, weights[2])
    said = "\n".join(report.warnings)
    assert f"step 6 is not this job's: {step6} belongs to uid {OTHER}" in said, said
    assert f"{step4 / MANIFEST_FILE} belongs to uid {OTHER}" in said, said
    assert report.skipped == []  # not damage: nothing quarantined
    assert step6.is_dir() and step4.is_dir() and not (root / "quarantine").exists()
    # Retention never deletes another user's step, and it takes no place among those kept.
    _save([8, 10], root=root, keep_last=2)
    assert sorted(p.name for p in root.glob("step-*")) == [
        step_dir_name(s) for s in (4, 6, 8, 10)
    ]  # step 2 (the job's, superseded) deleted; 4 and 6 kept as another user's


def test_a_shard_file_another_user_owns_in_the_second_ranks_share_is_foreign_on_both_ranks(
    tmp_path: Path,
) -> None:
    """The layout is checked by shares (each rank stats the files of its own writer rank):
    a file of rank 1's share owned by another user makes both ranks pass the step over alike
    and load the older one; neither rank loads a byte of it."""
    root = tmp_path / "root"
    run_world(_two_rank_save, 2, str(root))
    step4 = root / step_dir_name(4)
    theirs = step4 / "__1_0.distcp"
    assert theirs.is_file()
    os.lchown(theirs, OTHER, OTHER)
    got = run_world(_two_rank_resume, 2, str(root))
    assert [g[0] for g in got] == [2, 2], got
    for rank, (_, said, weight) in enumerate(got):
        assert f"step 4 is not this job's: {theirs} belongs to uid {OTHER}" in said, (rank, said)
        assert weight == pytest.approx(1.0), rank  # step 2's weights, on every rank
    assert step4.is_dir() and not (root / "quarantine").exists()


def _two_rank_state() -> tuple[nn.Module, dckpt.TrainState]:
    net = nn.Linear(64, 64)
    return net, dckpt.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))


def _two_rank_save(rank: int, world: int, root: str) -> None:
    net, state = _two_rank_state()
    with dckpt.CheckpointManager(dckpt.CheckpointConfig(root=root, timeout_s=60), state) as mgr:
        for step in (2, 4):
            with torch.no_grad():
                net.weight.fill_(step / 2)
            mgr.save(step).result()


def _two_rank_resume(rank: int, world: int, root: str) -> tuple[int | None, str, float]:
    net, state = _two_rank_state()
    with dckpt.CheckpointManager(dckpt.CheckpointConfig(root=root, timeout_s=60), state) as mgr:
        report = mgr.resume()
    return report.step, "\n".join(report.warnings), float(net.weight[0, 0])


def test_a_root_whose_every_step_is_another_users_refuses_to_start_fresh_beside_them(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    _save([2], root=root)
    _chown_tree(root / step_dir_name(2), OTHER)
    with pytest.raises(CheckpointError, match="another user's or not signed by this job") as e:
        _resume(root=root)
    assert "a root of its own" in str(e.value) and "remove step(s) 2" in str(e.value)


# --- the root, proven at every start ----------------------------------------------------------


@pytest.fixture
def sticky(tmp_path: Path) -> Path:
    """A directory like /tmp: root's, world-writable and sticky."""
    d = tmp_path / "tmp"
    d.mkdir()
    d.chmod(0o1777)
    return d


def _forged_step(source: Path, target: Path) -> None:
    """Another user's copy of a step (the same public config), re-sealed as hers: one
    tensor file's bytes changed and the manifest's digests made to match (what the review's
    attacker did: every digest of it checks)."""
    shutil.copytree(source, target)
    manifest = parse_manifest((target / MANIFEST_FILE).read_bytes(), str(target))
    (target / MANIFEST_FILE).write_bytes(manifest_bytes(manifest))
    _chown_tree(target, OTHER)


def test_a_squatted_root_with_a_planted_step_never_starts(tmp_path: Path, sticky: Path) -> None:
    """The review's High finding: the victim's --ckpt-dir made first by another user, mode
    0777, in a sticky world-writable directory, holding a step of hers. The start is refused
    in words naming the owner; nothing of the step is loaded."""
    mine = tmp_path / "mine"
    _save([12], root=mine)
    squat = sticky / "exp1"
    squat.mkdir()
    _forged_step(mine / step_dir_name(12), squat / step_dir_name(12))
    squat.chmod(0o777)
    os.chown(squat, OTHER, OTHER)
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(NotOwnedError, match=rf"{squat} belongs to uid {OTHER}.*own"):
        _manager(net, root=squat)
    assert _same(net.state_dict(), before)
    assert sorted(p.name for p in squat.iterdir()) == [step_dir_name(12)]  # nothing written


def test_a_root_under_a_squatted_parent_never_starts(sticky: Path) -> None:
    parent = sticky / "team"
    parent.mkdir(mode=0o755)
    os.chown(parent, OTHER, OTHER)
    with pytest.raises(NotOwnedError, match=rf"{parent} belongs to uid {OTHER}"):
        _manager(_net(), root=parent / "exp1")
    assert not (parent / "exp1").exists()


def test_a_group_writable_root_starts_only_with_the_group_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "shared-root"
    root.mkdir()
    root.chmod(0o2770)
    with pytest.raises(NotOwnedError, match=r"its group \(mode 2770\).*DCKPT_ROOT_ACCESS=group"):
        _manager(_net(), root=root)
    monkeypatch.setenv("DCKPT_ROOT_ACCESS", "group")
    _save([1], root=root)
    report, _ = _resume(root=root)
    assert report.step == 1
    assert any(w.startswith("root_access=group") for w in report.warnings), report.warnings
    assert (root.stat().st_mode & 0o7777) == 0o2770  # never chmod-ed


# --- the key: a keyed run resumes only what its key signs --------------------------------


def _key(path: Path, text: str = "k" * 32) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


@dataclasses.dataclass
class Where:
    """A root of one kind, and how a test rewrites a step's manifest where it is stored."""

    root: str
    mirror: Path | None
    s3: MotoServer | None = None
    bucket: str = ""

    def config(self, **more: Any) -> dict[str, Any]:
        return {"root": self.root, "mirror": self.mirror, "digest": "sha256", **more}

    def manifest(self, step: int) -> bytes:
        if self.s3 is None:
            return (Path(self.root) / step_dir_name(step) / MANIFEST_FILE).read_bytes()
        key = f"p/{step_dir_name(step)}/{MANIFEST_FILE}"
        return bytes(self.s3.client().get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def put_manifest(self, step: int, data: bytes) -> None:
        if self.s3 is None:
            path = Path(self.root) / step_dir_name(step) / MANIFEST_FILE
            path.unlink()
            path.write_bytes(data)
        else:
            key = f"p/{step_dir_name(step)}/{MANIFEST_FILE}"
            self.s3.client().put_object(Bucket=self.bucket, Key=key, Body=data)
            if self.mirror is not None:  # the job's local copy goes: the bucket is the truth
                shutil.rmtree(self.mirror / step_dir_name(step), ignore_errors=True)


@pytest.fixture(params=["directory", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Where:
    if request.param == "directory":
        return Where(str(tmp_path / "root"), None)
    server: MotoServer = request.getfixturevalue("s3")
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    bucket = server.bucket()
    return Where(f"s3://{bucket}/p", tmp_path / "mirror", server, bucket)


def test_a_keyed_run_resumes_only_the_steps_its_key_signs(
    where: Where, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = _key(tmp_path / "run.key")
    weights = _save([2, 4, 6], **where.config(key_file=key_file))
    key = ManifestKey.load(key_file)
    signed = parse_manifest(where.manifest(6), "m")
    assert signed.signature["key"] == key.key_id and key.refusal(signed) is None
    code, out, err = _cli(capsys, "verify", where.root, "--key-file", str(key_file))
    assert code == 0 and out.count("signed by the key") == 3, out + err

    # Step 6 re-sealed without a signature (every digest still right), step 4 signed with
    # another key: both foreign to the keyed run, passed over, named, left where they are.
    where.put_manifest(6, manifest_bytes(dataclasses.replace(signed, signature={})))
    other = ManifestKey(b"o" * 32, "other")
    four = parse_manifest(where.manifest(4), "m")
    where.put_manifest(4, manifest_bytes(other.sign(dataclasses.replace(four, signature={}))))
    report, state = _resume(**where.config(key_file=key_file))
    assert report.step == 2 and _same(state, weights[2])
    said = "\n".join(report.warnings)
    assert "step 6" in said and "its manifest is not signed" in said, said
    assert f"signed with another key ('{other.key_id}'" in said, said
    assert report.skipped == []

    code, out, err = _cli(capsys, "verify", where.root, "--key-file", str(key_file))
    assert code == 6, out + err
    assert "UNSIGNED step-00000006: every byte hashed right, but its manifest is not" in out
    assert "UNSIGNED step-00000004" in out and "OK      step-00000002" in out, out
    code, out, err = _cli(capsys, "ls", where.root, "--key-file", str(key_file), "--json")
    assert code == 0, err
    rows = {r["step"]: r for r in json.loads(out) if r.get("tier") == "durable"}
    assert {s: rows[s]["signed"] for s in (2, 4, 6)} == {2: True, 4: False, 6: False}
    assert rows[4]["signed_by"] == other.key_id and rows[6]["signed_by"] is None
    # The job's key id with a mac that is not the key's, and a field changed under the
    # signature of the step as saved (its epoch): the signature covers every field.
    two = parse_manifest(where.manifest(2), "m")
    where.put_manifest(2, manifest_bytes(dataclasses.replace(two, epoch=two.epoch + 7)))
    with pytest.raises(CheckpointError, match="another user's or not signed") as refused:
        _resume(**where.config(key_file=key_file))  # no step left that the key signs
    said = str(refused.value)
    assert "step 2" in said and "signature does not match its contents" in said, said
    forged = {**two.signature, "mac": "0" * 64}
    where.put_manifest(2, manifest_bytes(dataclasses.replace(two, signature=forged)))
    assert key.refusal(parse_manifest(where.manifest(2), "m")) is not None
    where.put_manifest(2, manifest_bytes(two))  # as it was: signed
    # A run without a key takes every step whose bytes hash right (signatures are opt-in).
    report, state = _resume(**where.config())
    assert report.step == 6


def test_a_key_file_others_could_read_or_swap_is_refused_in_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = _key(tmp_path / "run.key")
    key_file.chmod(0o644)
    root = tmp_path / "root"
    with pytest.raises(NotOwnedError, match=rf"can be read by others.*chmod 600 {key_file}"):
        _manager(_net(), root=root, digest="sha256", key_file=key_file)
    key_file.chmod(0o600)
    os.chown(key_file, OTHER, OTHER)
    monkeypatch.setenv("DCKPT_KEY_FILE", str(key_file))  # the environment names it too
    with pytest.raises(NotOwnedError, match=f"belongs to uid {OTHER}"):
        _manager(_net(), root=root, digest="sha256")
    key_file.chmod(0o640)  # the group may read it: the group could sign as the job
    os.chown(key_file, 0, 0)
    with pytest.raises(NotOwnedError, match="can be read by others"):
        ManifestKey.load(key_file)
    key_file.chmod(0o600)
    with pytest.raises(ValueError, match="digest='sha256' with a key"):
        dckpt.CheckpointConfig(root=root, key_file=_key(tmp_path / "k2"))
    with pytest.raises(CheckpointError, match="too short"):
        ManifestKey(b"short", "k")


def test_a_keyed_run_takes_a_memory_step_only_when_its_key_signs_it(tmp_path: Path) -> None:
    """The memory tier's side: its manifest (ROOT/memory/step-N.json) is signed as a root's,
    and one re-sealed unsigned is passed over for the durable step before it."""
    key_file = _key(tmp_path / "run.key")
    root, memory = tmp_path / "root", tmp_path / "mem"
    config = {"root": root, "memory": True, "memory_dir": memory, "digest": "sha256"}
    net = _net()
    with _manager(net, **config, key_file=key_file) as mgr:
        mgr.save(2).result()
        durable = {k: v.clone() for k, v in net.state_dict().items()}
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
        mgr.save(3, tier="memory").result()
    record = root / "memory" / f"{step_dir_name(3)}.json"
    signed = parse_manifest(record.read_bytes(), str(record))
    assert signed.signature["key"] == ManifestKey.load(key_file).key_id
    report, _ = _resume(**config, key_file=key_file)
    assert report.step == 3 and "memory tier" in report.origin  # signed: taken
    record.unlink()
    record.write_bytes(manifest_bytes(dataclasses.replace(signed, signature={})))
    report, state = _resume(**config, key_file=key_file)
    assert report.step == 2 and _same(state, durable), report.format()
    said = "\n".join(report.warnings)
    assert "step 3" in said and "its manifest is not signed" in said, said


def test_a_journal_or_resume_record_another_user_owns_is_no_evidence(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A replay journal and resume records decide verdicts (a replay that differs, the
    restart-loop rule that quarantines a step): one another user wrote into the root (a
    group-shared one) is read as absent and named, never counted."""
    from dckpt.root.replay_journal import JournalWriter, journal_path, read_journal
    from dckpt.root.resume_record import LOSS_WATCH, DirectoryRecords, ResumeRecord

    root = tmp_path / "root"
    root.mkdir()
    writer = JournalWriter(root)
    writer.start(4, "save-4", "run", [(5, "0x1.0p+0")])
    writer.close()
    records = DirectoryRecords(root)
    record = ResumeRecord(
        step=4, tier="durable", save_id="save-4", ok=False, verdict="loss 9 > bound 3",
        run_id="run", attempt=None, job="", start="h/1/n", time=0.0, kind=LOSS_WATCH,
    )  # fmt: skip
    records.add(record)
    assert read_journal(root, 4) is not None and records.read(4) == [record]  # the job's own

    os.lchown(journal_path(root, 4), OTHER, OTHER)
    os.lchown(Path(records.where(4)), OTHER, OTHER)
    with caplog.at_level("WARNING", logger="dckpt"):
        assert read_journal(root, 4) is None
        assert records.read(4) == []
    said = caplog.text
    assert f"ignored {journal_path(root, 4)}: it belongs to uid {OTHER}" in said, said
    assert f"ignored {records.where(4)}: it belongs to uid {OTHER}" in said, said


def test_another_users_file_of_the_wrong_size_is_foreign_not_damage(tmp_path: Path) -> None:
    """Whose a file is comes before what it holds: another user's file that is also cut short
    (or a link) makes the step foreign, passed over and left where it is, never quarantined as
    damage (which would move it)."""
    root = tmp_path / "root"
    weights = _save([2, 4], root=root)
    shard = next((root / step_dir_name(4)).glob("*.distcp"))
    with shard.open("ab") as f:
        f.write(b"x")
    os.lchown(shard, OTHER, OTHER)
    report, state = _resume(root=root)
    assert report.step == 2 and _same(state, weights[2])
    assert report.skipped == [] and not (root / "quarantine").exists()
    assert "step 4 is not this job's" in "\n".join(report.warnings)
    assert (root / step_dir_name(4)).is_dir()


def _start_with_key(rank: int, world: int, root: str, keys: list[str]) -> str:
    net = nn.Linear(4, 4)
    config = dckpt.CheckpointConfig(
        root=root, digest="sha256", key_file=Path(keys[rank]), timeout_s=60
    )
    try:
        with dckpt.CheckpointManager(config, dckpt.TrainState(net)):
            return "started"
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_a_node_given_another_key_is_refused_at_the_start_on_every_rank(tmp_path: Path) -> None:
    """Every rank checks what it reads with its own copy of the key: a node handed another
    key file would pass over the steps the others take. The start compares the keys' ids (one
    all-reduce) and every rank refuses, naming the rank and both ids."""
    same = [str(_key(tmp_path / "a.key")), str(_key(tmp_path / "b.key"))]
    assert run_world(_start_with_key, 2, str(tmp_path / "one"), same) == ["started"] * 2
    other = [same[0], str(_key(tmp_path / "c.key", "c" * 32))]
    got = run_world(_start_with_key, 2, str(tmp_path / "two"), other)
    for said in got:
        assert "rank 1's key file" in said and "holds another key" in said, got
