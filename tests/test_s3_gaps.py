"""s3:// roots, against a real S3 server (moto's, on 127.0.0.1), on promises no other test held
them to:

- a shard in the local mirror damaged after the save (the bucket's copy intact): the resume
  re-verifies the cached copy, fetches it again from the bucket, restores the state bit for
  bit and quarantines nothing (one process: a one-rank manager is a real save and resume);
- the ranged GETs of an object that fail every time (503 SlowDown, a dropped connection, a
  body cut short) are tried exactly ``DCKPT_S3_ATTEMPTS`` times, and the error says how many
  (the store driven in-process, behind a proxy that counts what reaches it);
- a committed step saved again holds the new values, which verify, even for a node whose
  mirror still holds the old copy; a second re-save SIGKILLed halfway through its upload
  leaves that step either uncommitted or whole (never old objects and new ones under one
  manifest): the restart lands on a committed step bit for bit and ``dckpt verify`` passes.
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
from conftest import dckpt_cli
from dist_harness import run_world
from s3_kit import FaultProxy, MotoServer, moto_server
from torch import nn

from dckpt.errors import StorageError
from dckpt.root.layout import step_dir_name

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@pytest.fixture
def s3_env(s3: MotoServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {**s3.env(), "DCKPT_RUN_ID": "s3-gaps"}  # a restart takes its own lock over
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _objects(bucket: str, prefix: str) -> Any:
    from dckpt.tiers.object_root import ObjectRoot
    from dckpt.tiers.s3_store import S3Store
    from dckpt.tiers.url import parse_url

    return ObjectRoot(S3Store(parse_url(f"s3://{bucket}/{prefix}")))


# --- a damaged copy in the mirror -----------------------------------------------------------


def _one_rank(root: str, mirror: Path) -> tuple[Any, nn.Module]:
    import dckpt

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    config = dckpt.CheckpointConfig(root=root, mirror=mirror)
    return dckpt.CheckpointManager(config, dckpt.TrainState(net, opt)), net


def test_a_shard_damaged_in_the_mirror_is_fetched_again_and_nothing_is_quarantined(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    bucket = s3.bucket()
    root, mirror = f"s3://{bucket}/cached", tmp_path / "mirror"
    mgr, net = _one_rank(root, mirror)
    with mgr:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
        mgr.save(1).result()
        want = {k: v.clone() for k, v in net.state_dict().items()}
    shard = mirror / step_dir_name(1) / "__0_0.distcp"
    stored = s3.client().get_object(Bucket=bucket, Key="cached/step-00000001/__0_0.distcp")
    intact = stored["Body"].read()
    assert shard.read_bytes() == intact  # the saving node's mirror keeps its copy
    damaged = bytearray(intact)
    damaged[len(damaged) // 2] ^= 0x01  # one bit, in a tensor's bytes, of the local copy only
    shard.write_bytes(bytes(damaged))

    mgr, net = _one_rank(root, mirror)
    with mgr:
        report = mgr.resume()
    text = report.format()
    assert report.step == 1, text
    assert all(torch.equal(want[k], v) for k, v in net.state_dict().items())
    # The shard the load reads was re-verified in the mirror, refused, and fetched again.
    assert "fetch: 1 file (" in text and "downloaded from s3://" in text, text
    assert shard.read_bytes() == intact
    keys = s3.keys(bucket, "cached/")
    assert "cached/step-00000001/manifest.json" in keys
    assert not [k for k in keys if "quarantine" in k], keys


def test_a_mirror_file_the_local_disk_cannot_read_sets_nothing_aside_in_the_bucket(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 56: a read error that persists sets a directory root's step aside, but a read
    error of an s3:// root's mirror is the local disk's: the second read is of a fresh
    download, and once the step before loads, the object behind the file is checked in the
    bucket, matches its digest, and nothing is set aside there; the error says so; the next
    start resumes the newest step."""
    import dckpt

    bucket = s3.bucket()
    root, mirror = f"s3://{bucket}/eio", tmp_path / "mirror"
    mgr, net = _one_rank(root, mirror)
    with mgr:
        mgr.save(1).result()
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
        mgr.save(2).result()
        want = {k: v.clone() for k, v in net.state_dict().items()}
    monkeypatch.setenv("DCKPT_FAULT", "phase=read_shard,action=eio,file=step-00000002")
    mgr, net = _one_rank(root, mirror)
    with mgr, pytest.raises(dckpt.StorageError) as refused:
        mgr.resume()
    words = str(refused.value)
    assert "could not quarantine step 2" in words, words
    assert "the local disk failed, not the checkpoint" in words and "twice" in words, words
    keys = s3.keys(bucket, "eio/")
    assert "eio/step-00000002/manifest.json" in keys
    assert not [k for k in keys if "quarantine" in k], keys
    monkeypatch.delenv("DCKPT_FAULT")
    mgr, net = _one_rank(root, mirror)
    with mgr:
        assert mgr.resume().step == 2
    assert all(torch.equal(want[k], v) for k, v in net.state_dict().items())


# --- how many times a ranged GET is tried -----------------------------------------------------


def _cut_short(method: str, path: str, status: int, body: bytes) -> bytes:
    """Every answer for the object arrives one byte short (a body that broke off)."""
    return body[:-1] if method == "GET" and "run/obj" in path and status == 206 else body


@pytest.mark.parametrize("attempts", [2, 3])
@pytest.mark.parametrize(
    "failure, said",
    [
        ("503", "kept answering 503 SlowDown through {k} attempts"),
        ("drop", "cannot reach the store at http://127.0.0.1:{port} after {k} attempts"),
        ("short", "cannot reach the store at http://127.0.0.1:{port} after {k} attempts"),
    ],
    ids=["503", "dropped-connection", "body-cut-short"],
)
def test_a_ranged_get_that_always_fails_is_tried_exactly_dckpt_s3_attempts_times(
    s3: MotoServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
    said: str,
    attempts: int,
) -> None:
    from dckpt.tiers.s3_store import S3Store
    from dckpt.tiers.url import parse_url

    bucket = s3.bucket()
    s3.client().put_object(Bucket=bucket, Key="run/obj", Body=os.urandom(4096))
    proxy = FaultProxy(s3.port)
    try:
        for k, v in s3.env(proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("DCKPT_S3_ATTEMPTS", str(attempts))
        store = S3Store(parse_url(f"s3://{bucket}/run"))
        if failure == "short":
            proxy.mangle = _cut_short
        else:
            proxy.rule = lambda method, path: (
                failure if method == "GET" and "run/obj" in path else None
            )
        with pytest.raises(StorageError) as caught:
            store.download_file("run/obj", tmp_path / "obj", 4096, "xxh3_128")
        asked = [p for m, p, _ in proxy.seen if m == "GET" and "run/obj" in p]
    finally:
        proxy.close()
    assert len(asked) == attempts, proxy.seen
    assert said.format(k=attempts, port=proxy.port) in str(caught.value), caught.value
    assert f"s3://{bucket}/run/obj" in str(caught.value)
    assert not (tmp_path / "obj").exists() and not list(tmp_path.iterdir())  # no part left


# --- a committed step saved again, and a crash in the middle of that ---------------------------


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _weights(model: nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _manager(rank: int, root: str, mirror: Path, state: Any) -> Any:
    import dckpt

    config = dckpt.CheckpointConfig(root=root, mirror=mirror, timeout_s=20.0)
    return dckpt.CheckpointManager(config, state)


def _saves(rank: int, world: int, root: str, base: str) -> dict[int | str, Any]:
    """Step 1, step 2, step 2 again with other values; rank 0 keeps its mirror's copy of the
    first step 2 aside (as another node's mirror would still hold it)."""
    import dckpt

    model, opt = _model()
    state = dckpt.TrainState(model, opt)
    mirror = Path(base) / f"mirror{rank}"
    saved: dict[int | str, Any] = {}
    with _manager(rank, root, mirror, state) as mgr:
        for step, bump in ((1, 1.0), (2, 2.0), ("2 again", 3.0)):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(bump)
            state.step = 2 if step == "2 again" else int(step)
            mgr.save(state.step).result()
            saved[step] = _weights(model)
            if step == 2 and rank == 0:
                shutil.copytree(mirror, Path(base) / "stale-mirror0")
    return saved


def _resume_then_crash(rank: int, world: int, root: str, base: str, mirrors: list[str]) -> Any:
    """Resume (rank 0 through the stale mirror), then save step 2 a third time with the
    fault armed: rank 1 is SIGKILLed as its shard's upload starts."""
    import dckpt

    model, opt = _model()
    state = dckpt.TrainState(model, opt)
    mgr = _manager(rank, root, Path(base) / mirrors[rank], state)
    report = mgr.resume()
    got: dict[str, Any] = {"step": report.step, "weights": _weights(model)}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(4.0)
    got["third"] = _weights(model)
    state.step = 2
    os.environ["DCKPT_FAULT"] = "phase=upload,rank=1,action=sigkill,step=2"
    try:
        mgr.save(2).result()
        mgr.close()
        got["crash"] = "saved"
    except dckpt.SaveError as exc:  # rank 0: its peer died in the middle of the save
        got["crash"] = str(exc)
    return got


def _restart(rank: int, world: int, root: str, base: str) -> Any:
    import dckpt

    model, opt = _model()
    state = dckpt.TrainState(model, opt)
    with _manager(rank, root, Path(base) / f"restart{rank}", state) as mgr:
        report = mgr.resume()
    return report.step, _weights(model), report.format()


_shards = ("again/step-00000002/__0_0.distcp", "again/step-00000002/__1_0.distcp")


def _etag(s3: MotoServer, bucket: str, key: str) -> str | None:
    try:
        return str(s3.client().head_object(Bucket=bucket, Key=key)["ETag"])
    except Exception:  # no such object
        return None


@pytest.mark.faults
def test_a_resave_replaces_the_step_and_a_crash_halfway_never_commits_a_mix(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, fault_trials: Any
) -> None:
    bucket = s3.bucket()
    root = f"s3://{bucket}/again"
    saved = run_world(_saves, 2, root, str(tmp_path), env=s3_env)
    assert saved[0][2] != saved[0]["2 again"]
    objects = _objects(bucket, "again")
    verified, problems = objects.check_objects(2)
    assert problems == [], problems
    assert verified

    etags = {k: _etag(s3, bucket, k) for k in _shards}

    # The re-saved step holds the new values: a node whose mirror holds the first copy of
    # step 2 gets the second (its cached files are re-verified against the new manifest).
    resumed = run_world(
        _resume_then_crash, 2, root, str(tmp_path), ["stale-mirror0", "fresh1"], env=s3_env,
        expect_failure=True,
    )  # fmt: skip
    assert "produced no result (exit code -9)" in str(resumed[1]), resumed[1]  # killed, really
    assert isinstance(resumed[0], dict), resumed[0]
    assert resumed[0]["step"] == 2 and resumed[0]["weights"] == saved[0]["2 again"]
    assert resumed[0]["crash"] != "saved"  # the third save of step 2 failed with its rank

    # Halfway, really: rank 0's shard of the third save went up whole, rank 1's never did.
    assert _etag(s3, bucket, _shards[0]) not in (None, etags[_shards[0]])
    assert _etag(s3, bucket, _shards[1]) == etags[_shards[1]]
    # After the crash, step 2 is either uncommitted or one whole save: its objects verify.
    committed = objects.committed_steps()
    if 2 in committed:
        verified, problems = objects.check_objects(2)
        assert problems == [], f"step 2 is committed with objects of two saves: {problems}"
    restarted = run_world(_restart, 2, root, str(tmp_path), env=s3_env)
    for rank, (step, weights, report) in enumerate(restarted):
        assert step in committed, report
        # Bit for bit what that step holds: step 1, or step 2 as one of its two saves (the
        # third's values from rank 0: DDP holds the same weights on every rank).
        held = [saved[rank][1]] if step == 1 else [saved[rank]["2 again"], resumed[0]["third"]]
        assert weights in held, report
    if 2 not in committed:  # the restart removed what the crashed save left
        assert not s3.keys(bucket, "again/step-00000002/"), s3.keys(bucket, "again/")
    assert "quarantine" not in " ".join(s3.keys(bucket, "again/")), s3.keys(bucket, "again/")
    checked = dckpt_cli("verify", root, "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["ok"] is True
    fault_trials.record("s3: SIGKILL halfway through a re-save", "rank 1, upload", survived=True)


# --- the run lock in a bucket: renewal and loss -----------------------------------------------


def test_the_s3_lock_survives_a_changed_etag_of_its_own_record_and_notices_a_lost_one(
    s3: MotoServer, s3_env: dict[str, str]
) -> None:
    """A renewal whose If-Match fails reads the lock back: a record still ours (a lost reply
    to our own retried PUT changes the ETag) keeps the lock; someone else's, or none, loses
    it, and the job must not commit again (``check_held`` raises, naming who holds it)."""
    import time

    from dckpt.errors import LockError
    from dckpt.tiers.object_lock import ObjectLock
    from dckpt.tiers.s3_store import S3Store
    from dckpt.tiers.url import parse_url

    bucket = s3.bucket()
    store = S3Store(parse_url(f"s3://{bucket}/locked"))
    lock = ObjectLock(store, "lock-run", lease_s=0.6)  # renewed every 0.2 s
    lock.acquire()
    try:
        key = "locked/.dckpt-lock"

        def record() -> dict[str, Any]:
            body = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
            parsed: dict[str, Any] = json.loads(body)
            return parsed

        ours = record()
        # the same owner, another ETag: what a PUT we retried after losing its reply leaves
        s3.client().put_object(Bucket=bucket, Key=key, Body=json.dumps({**ours, "pid": 1}))
        # until a renewal went through after the change (bounded only to end a hang: a
        # loaded machine and a Python S3 server take what they take)
        deadline = time.monotonic() + 60
        while record().get("pid") == 1 and lock.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.lost is None, lock.lost
        lock.check_held()
        renewed = record()
        assert renewed["token"] == ours["token"] and renewed["lease_until"] > ours["lease_until"]
        # deleted by hand: the next renewal finds no one holds it; this job stops committing
        s3.client().delete_object(Bucket=bucket, Key=key)
        deadline = time.monotonic() + 60
        while lock.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.lost is not None and "taken by no one (it was deleted)" in lock.lost
        with pytest.raises(LockError, match="it was deleted"):
            lock.check_held()
    finally:
        lock.release()
    # check_held reads the store itself (a lease long enough that no renewal runs first)
    slow = ObjectLock(store, "lock-run", lease_s=600.0)
    slow.acquire()
    try:
        s3.client().delete_object(Bucket=bucket, Key=key)
        with pytest.raises(LockError, match="held by no one"):
            slow.check_held()
    finally:
        slow.release()


def test_a_memory_record_is_never_put_by_a_job_that_lost_the_bucket_s_lock(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The memory ledger's commit point is one PUT, made only while the job holds the run
    lock: with the lock lost it raises and the bucket gets no record; with it held (or with
    no lock to check, as the CLI's ledger) the record is there to be read."""
    from dckpt.errors import LockError
    from dckpt.tiers.object_ledger import ObjectLedger

    def lost() -> None:
        raise LockError("the run lock is held by another job")

    manifest = tmp_path / "manifest.json"
    manifest.write_bytes(b'{"step": 4}')
    refused = ObjectLedger(_objects(s3.bucket(), "ledger"), held=lost)
    with pytest.raises(LockError, match="another job"):
        refused.commit(4, manifest)
    assert refused.steps() == [] and manifest.exists()
    held: list[int] = []
    ledger = ObjectLedger(refused.objects, held=lambda: held.append(1))
    ledger.commit(4, manifest)
    assert held == [1] and ledger.steps() == [4] and ledger.read(4) == b'{"step": 4}'
    manifest.write_bytes(b'{"step": 5}')
    ObjectLedger(refused.objects).commit(5, manifest)  # no lock to check
    assert ledger.steps() == [4, 5]


def test_ls_of_a_bucket_shows_what_verify_recorded(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dckpt verify s3://…` records each step's verdict in the bucket; `dckpt ls --json`
    reads every record back (one listing), for each step it names."""
    from dckpt.cli import main

    bucket = s3.bucket()
    root = f"s3://{bucket}/listed"
    mgr, _ = _one_rank(root, tmp_path / "mirror")
    with mgr:
        mgr.save(1).result()
        mgr.save(2).result()
    capsys.readouterr()
    assert main(["ls", root, "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["verified"]) for c in before] == [(1, None), (2, None)]
    assert main(["verify", root, "--all"]) == 0
    capsys.readouterr()
    assert main(["ls", root, "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["verified"]) for c in after] == [(1, "ok"), (2, "ok")]


def test_a_start_logs_each_piece_of_mirror_debris_once(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A save cut short leaves a tmp dir in the node's mirror; the next start removes it and
    says so in one line, not once for the mirror's tidy-up and again for the bucket's."""
    import logging

    root = f"s3://{s3.bucket()}/debris"
    mirror = tmp_path / "mirror"
    mgr, _ = _one_rank(root, mirror)
    with mgr:
        mgr.save(1).result()
    debris = mirror / f"{step_dir_name(2)}.tmp-{'ab' * 16}"
    debris.mkdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        mgr, _ = _one_rank(root, mirror)
        mgr.close()
    lines = [r.getMessage() for r in caplog.records if debris.name in r.getMessage()]
    assert lines == [f"dckpt recover: removed abandoned save {debris.name}"]
    assert not debris.exists()


def test_a_job_whose_bucket_lock_was_taken_commits_no_more_steps(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """The lock is read back right before the manifest PUT (the commit point): once another
    job holds it, a save fails and its step's manifest never reaches the bucket."""
    import dckpt.errors as dckpt_errors

    bucket = s3.bucket()
    mgr, _ = _one_rank(f"s3://{bucket}/taken", tmp_path / "mirror")
    client = s3.client()
    # the save's error is raised by result() and again by close(), which ends the block
    with pytest.raises(dckpt_errors.SaveError, match="did not commit: the run lock"), mgr:
        mgr.save(1).result()
        key = "taken/.dckpt-lock"
        record = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        client.put_object(Bucket=bucket, Key=key, Body=json.dumps({**record, "token": "f" * 32}))
        mgr.save(2).result()
    listed = client.list_objects_v2(Bucket=bucket, Prefix="taken/step-00000002/")
    assert "taken/step-00000002/manifest.json" not in [o["Key"] for o in listed.get("Contents", [])]
    assert "taken/step-00000001/manifest.json" in [
        o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="taken/")["Contents"]
    ]
