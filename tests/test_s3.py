"""s3:// roots against a real S3 server (moto's, on 127.0.0.1, started here): the client's
verified transfers, the manifest-last commit on 2 ranks, fallback past a damaged object, the
run lock as a conditional put, retention, recovery and the errors a user meets first."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from s3_kit import MotoServer, moto_server
from torch import nn

from dckpt.errors import IntegrityError, LockError, StorageError
from dckpt.storage.digest import hash_file

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@pytest.fixture
def s3_env(s3: MotoServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = s3.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _store(bucket: str, prefix: str = "run", **kwargs: Any) -> Any:
    from dckpt.tiers.s3_store import S3Store
    from dckpt.tiers.url import parse_url

    return S3Store(parse_url(f"s3://{bucket}/{prefix}"), **kwargs)


def test_multipart_upload_and_ranged_download_hash_the_bytes_that_move(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    bucket = s3.bucket()
    store = _store(bucket, part_bytes=5 << 20, concurrency=3)
    src = tmp_path / "shard"
    src.write_bytes(os.urandom((12 << 20) + 123))  # three parts, the last one short
    want, _ = hash_file(src, "xxh3_128")
    digest, sent = store.upload_file(src, "run/shard", "xxh3_128")
    assert (digest, sent) == (want, src.stat().st_size)
    assert s3.open_uploads(bucket) == []  # completed, none left open
    dest = tmp_path / "back"
    assert store.download_file("run/shard", dest, sent, "xxh3_128") == want
    assert dest.read_bytes() == src.read_bytes()
    assert not list(tmp_path.glob(".back.part-*"))  # written beside, renamed into place

    # One part in flight: each part buffer is filled again once its upload completed; what
    # arrives is still every byte, in order (a buffer reused too soon would mix two parts).
    serial = _store(bucket, part_bytes=5 << 20, concurrency=1)
    many = tmp_path / "many"
    many.write_bytes(os.urandom((15 << 20) + 77))  # parts in buffers A, B, A again, a tail
    many_want, _ = hash_file(many, "xxh3_128")
    assert serial.upload_file(many, "run/many", "xxh3_128") == (many_want, many.stat().st_size)
    assert s3.client().get_object(Bucket=bucket, Key="run/many")["Body"].read() == (
        many.read_bytes()
    )

    # The stream the hashing writer tees into: odd-sized writes, parts sent as they fill.
    stream = store.open_upload("run/streamed")
    data = src.read_bytes()
    for i in range(0, len(data), 3 << 20 | 7):
        stream.write(memoryview(data)[i : i + (3 << 20 | 7)])
    stream.close()
    assert stream.sent == len(data)
    assert store.download_file("run/streamed", dest, sent, "xxh3_128") == want
    small = store.open_upload("run/small")  # never fills a part: one PUT
    small.write(b"abc")
    small.close()
    assert s3.client().get_object(Bucket=bucket, Key="run/small")["Body"].read() == b"abc"
    aborted = store.open_upload("run/aborted")
    aborted.write(data[: 6 << 20])  # one part sent: the multipart upload is open
    assert s3.open_uploads(bucket) == ["run/aborted"]
    aborted.abort()
    assert s3.open_uploads(bucket) == [] and "run/aborted" not in s3.keys(bucket)

    # One byte changed in the store: the download's digest differs (the caller refuses it).
    data = bytearray(src.read_bytes())
    data[7 << 20] ^= 0x01
    s3.client().put_object(Bucket=bucket, Key="run/shard", Body=bytes(data))
    assert store.download_file("run/shard", dest, sent, "xxh3_128") != want
    # A shorter object than the manifest says is a size mismatch, not a short file.
    s3.client().put_object(Bucket=bucket, Key="run/shard", Body=bytes(data[:-1]))
    with pytest.raises(IntegrityError, match="size mismatch"):
        store.download_file("run/shard", dest, sent, "xxh3_128")
    with pytest.raises(IntegrityError, match="object missing"):
        store.download_file("run/absent", dest, 10, "xxh3_128")


def test_a_missing_bucket_and_an_unreachable_endpoint_say_what_to_fix(
    s3: MotoServer, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store("no-such-bucket-here")
    with pytest.raises(StorageError, match="the bucket 'no-such-bucket-here' does not exist"):
        store.list("run/")
    from s3_kit import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    store = _store("some-bucket", attempts=2)
    with pytest.raises(StorageError, match=r"cannot reach the store at http://127\.0\.0\.1"):
        store.list("run/")


def test_the_lock_is_a_conditional_put_and_a_second_job_is_refused(
    s3: MotoServer, s3_env: dict[str, str]
) -> None:
    from dckpt.tiers.object_lock import ObjectLock

    bucket = s3.bucket()
    first = ObjectLock(_store(bucket), "run-a", lease_s=30)
    first.acquire()
    second = ObjectLock(_store(bucket), "run-b", lease_s=30)
    with pytest.raises(LockError, match="is in use by run run-a"):
        second.acquire()
    again = ObjectLock(_store(bucket), "run-a", lease_s=30)  # the same run, restarted
    again.acquire()
    assert again.took_over and "the same run restarted" in again.took_over
    first.release()  # no longer its lock: leaves it in place
    assert "run/.dckpt-lock" in s3.keys(bucket)
    again.release()
    assert "run/.dckpt-lock" not in s3.keys(bucket)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _flat(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _save_steps(rank: int, world: int, root: str, mirror: str, steps: list[int]) -> Any:
    import dckpt

    model, opt = _model()
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(root=root, mirror=Path(mirror) / f"node{rank}", keep_last=2)
    with dckpt.CheckpointManager(config, state) as mgr:
        for step in steps:
            state.step = step
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(float(step))
            mgr.save(step).result()
    return [t.tolist() for t in _flat(model)]


def _resume(rank: int, world: int, root: str, mirror: str) -> Any:
    import dckpt

    model, opt = _model()
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(root=root, mirror=Path(mirror) / f"node{rank}")
    with dckpt.CheckpointManager(config, state) as mgr:
        report = mgr.resume()
    return state.step, [t.tolist() for t in _flat(model)], report.format()


def test_two_ranks_commit_by_manifest_last_and_resume_verified_from_the_bucket(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    bucket = s3.bucket()
    root = f"s3://{bucket}/jobs/a"
    # Each rank its own mirror: as on two nodes, no local file is shared.
    saved = run_world(_save_steps, 2, root, str(tmp_path), [1, 2, 3], env=s3_env)
    keys = s3.keys(bucket)
    steps = sorted({k.split("/")[2] for k in keys if k.startswith("jobs/a/step-")})
    assert steps == ["step-00000002", "step-00000003"]  # keep_last=2, deleted in the bucket
    for step in steps:
        names = {k.rsplit("/", 1)[1] for k in keys if f"/{step}/" in k}
        shards = {"__0_0.distcp", "__1_0.distcp"}
        assert names == {"manifest.json", ".metadata"} | shards | {f"{s}.items" for s in shards}
    assert s3.client().get_object(Bucket=bucket, Key="jobs/a/latest")["Body"].read() == (
        b"step-00000003"
    )
    assert s3.open_uploads(bucket) == []
    # The saving node's mirror keeps its newest copy only; the other rank's tmp copy is gone.
    mirror = tmp_path / "node0"  # (beside rank 0's replay journal, .dckpt-replay/)
    assert sorted(p.name for p in mirror.iterdir() if p.name.startswith("step-")) == [
        "step-00000003"
    ]
    assert not [p for p in (tmp_path / "node1").iterdir() if p.name.startswith("step-")]

    # Resume on fresh mirrors: everything comes from the bucket, verified as it arrives.
    fresh = tmp_path / "fresh"
    results = run_world(_resume, 2, root, str(fresh), env=s3_env)
    for rank, (step, weights, report) in enumerate(results):
        assert step == 3
        assert weights == saved[rank]
        assert "downloaded from s3://" in report
        assert "digests" in report
    # Resume where the files are already in the mirror: re-verified, nothing downloaded.
    results = run_world(_resume, 2, root, str(fresh), env=s3_env)
    assert "0 files (0 B) downloaded" in results[0][2] and "cached in the mirror" in results[0][2]


def test_peek_reads_one_manifest_from_the_bucket(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    import dckpt

    bucket = s3.bucket()
    root = f"s3://{bucket}/peeked"
    with pytest.raises(dckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        dckpt.peek(root)
    run_world(_save_steps, 2, root, str(tmp_path), [4, 5], env=s3_env)
    info = dckpt.peek(root)
    assert (info.step, info.world_size, info.path) == (5, 2, f"{root}/step-00000005")
    assert dckpt.peek(root, step=4).step == 4
    assert dckpt.read_config(root) == {}


def test_a_fresh_start_names_foreign_objects_and_the_cli_refuses_a_prefix_that_is_no_root(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Both sides for an s3:// root, as for a directory (tests/test_replay.py): what the
    prefix holds that dckpt did not write is listed by a fresh start's report, dckpt's own
    objects never; ``dckpt ls`` refuses a prefix that holds nothing of dckpt's, in words."""
    import subprocess
    import sys

    import dckpt

    bucket = s3.bucket()
    client = s3.client()
    for key in ("run/model.pt", "run/other-run/step_100/x.distcp"):
        client.put_object(Bucket=bucket, Key=key, Body=b"not dckpt's")
    model = nn.Linear(2, 2)
    config = dckpt.CheckpointConfig(root=f"s3://{bucket}/run", mirror=tmp_path / "mirror")
    with dckpt.CheckpointManager(config, dckpt.TrainState(model)) as mgr:
        report = mgr.resume()
        mgr.save(1).result()
    assert not report.resumed
    assert report.foreign == [f"s3://{bucket}/run/model.pt", f"s3://{bucket}/run/other-run"]
    env = {**os.environ, **s3_env}
    listed = subprocess.run(
        [sys.executable, "-m", "dckpt.cli", "ls", f"s3://{bucket}/nothing-here"],
        check=False, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 2, listed
    assert "is not a dckpt checkpoint root" in listed.stderr, listed.stderr
    # the run's prefix holds its step now: a root, listed
    listed = subprocess.run(
        [sys.executable, "-m", "dckpt.cli", "ls", f"s3://{bucket}/run"],
        check=False, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr


@pytest.mark.faults
def test_a_damaged_object_is_named_and_resume_falls_back_to_the_previous_step(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, fault_trials: Any
) -> None:
    bucket = s3.bucket()
    root = f"s3://{bucket}/r"
    run_world(_save_steps, 2, root, str(tmp_path / "save"), [1, 2], env=s3_env)
    key = "r/step-00000002/__1_0.distcp"
    body = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0x10  # one flipped bit, in the store
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(body))
    results = run_world(_resume, 2, root, str(tmp_path / "load"), env=s3_env)
    assert [r[0] for r in results] == [1, 1]
    report = results[0][2]
    # Named by its URL in the bucket: caught as it was downloaded, before anything read it.
    assert "skipped step 2 (quarantined): IntegrityError: the object's bytes differ" in report
    assert f"s3://{bucket}/r/step-00000002/__1_0.distcp" in report
    keys = s3.keys(bucket)
    assert "r/step-00000002/manifest.json" not in keys  # uncommitted in the bucket
    assert any(k.startswith("r/quarantine/step-00000002/") for k in keys)
    assert any(k.endswith("step-00000002.reason.txt") for k in keys)
    fault_trials.record("s3: a byte changed in the bucket", "resume falls back", survived=True)


def _save_expecting_failure(rank: int, world: int, root: str, mirror: str, step: int) -> str:
    import dckpt

    model, opt = _model()
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(root=root, mirror=Path(mirror) / f"node{rank}")
    try:
        with dckpt.CheckpointManager(config, state) as mgr:
            state.step = step
            mgr.save(step).result()
    except dckpt.SaveError as exc:
        return str(exc)
    return "saved"


@pytest.mark.faults
def test_throttling_and_dropped_connections_are_retried_and_a_failing_store_fails_cleanly(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, fault_trials: Any
) -> None:
    from s3_kit import FaultProxy

    bucket = s3.bucket()
    root = f"s3://{bucket}/p"
    proxy = FaultProxy(s3.port)
    broken = {"503": 0, "drop": 0}

    def flaky(method: str, path: str) -> str | None:
        if method == "PUT" and ".distcp" in path and broken["503"] < 3:
            broken["503"] += 1
            return "503"
        if method == "GET" and ".distcp" in path and broken["drop"] < 2:
            broken["drop"] += 1
            return "drop"
        return None

    proxy.rule = flaky
    env = {**s3_env, "AWS_ENDPOINT_URL": proxy.endpoint}
    try:
        saved = run_world(_save_steps, 2, root, str(tmp_path / "save"), [1], env=env)
        loaded = run_world(_resume, 2, root, str(tmp_path / "load"), env=env)
        assert broken == {"503": 3, "drop": 2}  # each one really happened, and was retried
        assert [r[0] for r in loaded] == [1, 1]
        assert [r[1] for r in loaded] == saved

        # The manifest's PUT answered 503 every time: the save fails on every rank, saying
        # so, and nothing is committed; step 1 stays the newest.
        def manifest_refused(method: str, path: str) -> str | None:
            if method == "PUT" and "step-00000002/manifest.json" in path:
                return "503"
            return None

        proxy.rule = manifest_refused
        env["DCKPT_S3_ATTEMPTS"] = "2"
        errors = run_world(_save_expecting_failure, 2, root, str(tmp_path / "s2"), 2, env=env)
        for error in errors:
            assert "save of step 2 failed, nothing was committed" in error
            assert "kept answering 503 SlowDown through 2 attempts" in error
            assert "step-00000002/manifest.json" in error
        keys = s3.keys(bucket, "p/")
        assert "p/step-00000002/manifest.json" not in keys
        assert "p/step-00000002/__0_0.distcp" in keys  # debris, never listed as committed
        proxy.rule = lambda method, path: None
        loaded = run_world(_resume, 2, root, str(tmp_path / "load2"), env=env)
        assert [r[0] for r in loaded] == [1, 1]
        assert not [k for k in s3.keys(bucket, "p/step-00000002/")]  # removed at the start

        # The manifest's PUT applied, every answer lost (503 on the way back): the step IS
        # committed, and the save says so instead of failing (it reads the manifest back).
        lost: list[str] = []

        def applied_then_lost(method: str, path: str, status: int, body: bytes) -> Any:
            if method == "PUT" and "step-00000003/manifest.json" in path and status == 200:
                lost.append(path)
                return 503, b"<Error><Code>SlowDown</Code><Message>reduce</Message></Error>"
            return body

        proxy.mangle = applied_then_lost
        run_world(_save_steps, 2, root, str(tmp_path / "s3"), [3], env=env)
        proxy.mangle = None
        assert lost, "the manifest PUT was never answered wrongly: nothing was tested"
        assert "p/step-00000003/manifest.json" in s3.keys(bucket, "p/")
        loaded = run_world(_resume, 2, root, str(tmp_path / "load3"), env=env)
        assert [r[0] for r in loaded] == [3, 3], loaded
        fault_trials.record("s3: 503 SlowDown and dropped connections", "retried", survived=True)
        fault_trials.record("s3: 503 SlowDown and dropped connections", "manifest PUT refused",
                            survived=True)  # fmt: skip
        fault_trials.record("s3: 503 SlowDown and dropped connections",
                            "manifest PUT applied, answer lost", survived=True)  # fmt: skip
    finally:
        proxy.close()


def test_refused_credentials_name_the_bucket_and_what_to_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A second server that checks signatures against its own users (it has none).
    with moto_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as strict:
        for k, v in strict.env().items():
            monkeypatch.setenv(k, v)
        with pytest.raises(StorageError) as caught:
            _store("secured-bucket").list("run/")
    text = str(caught.value)
    assert "refused the credentials (InvalidAccessKeyId)" in text
    assert "s3://secured-bucket/run/" in text and "AWS_ACCESS_KEY_ID" in text


def _resume_local_share(rank: int, world: int, root: str, mirror: str) -> Any:
    # As under torchrun, but each rank with its own mirror (mirrors that are not shared).
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)
    return _resume(rank, world, root, mirror)


def test_ranks_of_one_node_with_separate_mirrors_fetch_what_they_lack_and_quarantine_nothing(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    bucket = s3.bucket()
    root = f"s3://{bucket}/sep"
    saved = run_world(_save_steps, 2, root, str(tmp_path / "save"), [1, 2], env=s3_env)
    results = run_world(_resume_local_share, 2, root, str(tmp_path / "load"), env=s3_env)
    assert [r[0] for r in results] == [2, 2]
    assert [r[1] for r in results] == saved
    assert not [k for k in s3.keys(bucket) if "/quarantine/" in k]


def test_damage_found_only_in_the_mirror_is_not_blamed_on_the_bucket(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    from dckpt.errors import IntegrityError
    from dckpt.tiers.object_root import ObjectRoot
    from dckpt.tiers.object_source import ObjectSource

    bucket = s3.bucket()
    root = f"s3://{bucket}/m"
    run_world(_save_steps, 2, root, str(tmp_path / "save"), [3], env=s3_env)
    source = ObjectSource(ObjectRoot(_store(bucket, "m")), tmp_path / "mirror", (0, 1))
    source.fetch(3)
    local = tmp_path / "mirror" / "step-00000003" / "__0_0.distcp"
    local_damage = IntegrityError(str(local), "xxh3_128:aa", "xxh3_128:bb")
    with pytest.raises(StorageError, match="matches its digest: the local copy was damaged"):
        source.confirm_damage(3, local_damage)
    assert not local.exists()  # the mirror's copy is dropped, the bucket's kept
    assert "m/step-00000003/manifest.json" in s3.keys(bucket)
    # the resume's way: a quarantine with that damage as its proof refuses the same
    with pytest.raises(StorageError, match="matches its digest: the local copy was damaged"):
        source.quarantine(3, "a digest mismatch in the mirror", local_damage)
    assert "m/step-00000003/manifest.json" in s3.keys(bucket)  # nothing moved aside
    assert not [k for k in s3.keys(bucket) if "/quarantine/" in k]
    # Damage found while downloading is the bucket's: confirmed, so it is quarantined.
    source.confirm_damage(3, IntegrityError(f"{root}/step-00000003/x", "a", "b"))
    key = "m/step-00000003/__1_0.distcp"
    body = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[5] ^= 1
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(body))
    source.confirm_damage(3, local_damage)  # the bucket's copy is bad too: no objection
    # An object no rank read is hashed in the store: its damage is named by its URL (not a
    # disagreement between ranks), so the step is quarantined and the resume falls back.
    with pytest.raises(IntegrityError, match="differ from the digest") as caught:
        source.digest_remote(3, "__1_0.distcp")
    assert caught.value.path == f"{root}/step-00000003/__1_0.distcp"
    assert source.digest_remote(3, "__0_0.distcp").startswith("xxh3_128:")


@pytest.mark.faults
@pytest.mark.parametrize("change", ["deleted", "truncated"])
def test_the_commit_refuses_when_an_uploaded_object_is_gone_or_cut_short(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, fault_trials: Any, change: str
) -> None:
    import threading
    import time

    bucket = s3.bucket()
    root = f"s3://{bucket}/gone"
    key = "gone/step-00000001/__1_0.distcp"
    go = tmp_path / "go"
    sizes: dict[str, int] = {}

    def change_when_uploaded() -> None:  # while rank 0 waits right before the commit point
        deadline = time.monotonic() + 300  # a hang's bound only: the save waits for `go`
        try:
            while time.monotonic() < deadline and "gone/step-00000001/.metadata" not in s3.keys(
                bucket, "gone/"
            ):
                time.sleep(0.05)
            client = s3.client()
            if change == "deleted":
                client.delete_object(Bucket=bucket, Key=key)
            else:  # a shorter object under the same key: it exists, at the wrong size
                body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
                client.put_object(Bucket=bucket, Key=key, Body=body[:-1])
                sizes["uploaded"], sizes["now"] = len(body), len(body) - 1
        finally:
            go.touch()

    thread = threading.Thread(target=change_when_uploaded, daemon=True)
    thread.start()
    env = {**s3_env, "DCKPT_FAULT": f"phase=rename,rank=0,action=wait,path={go},seconds=300"}
    errors = run_world(_save_expecting_failure, 2, root, str(tmp_path), 1, env=env, timeout=360)
    thread.join(timeout=60)
    found = "got no object" if change == "deleted" else f"got {sizes['now']} bytes"
    for error in errors:
        assert "an uploaded object is gone or changed before the commit" in error, error
        assert f"s3://{bucket}/{key}" in error and found in error, error
    assert "gone/step-00000001/manifest.json" not in s3.keys(bucket)
    fault_trials.record(
        f"s3: an uploaded object {change} before the commit", "rank 0", survived=True
    )


def test_a_lock_taken_away_is_noticed_before_the_next_commit(
    s3: MotoServer, s3_env: dict[str, str]
) -> None:
    from dckpt.tiers.object_lock import ObjectLock

    bucket = s3.bucket()
    mine = ObjectLock(_store(bucket), "run-a", lease_s=30)
    mine.acquire()
    mine.check_held()
    s3.client().put_object(Bucket=bucket, Key="run/.dckpt-lock", Body=b'{"not": "mine"}')
    with pytest.raises(LockError, match="this job commits nothing more"):
        mine.check_held()
    mine.release()


def test_a_store_that_ignores_conditional_writes_is_refused_a_lock(
    s3: MotoServer, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from s3_kit import FaultProxy

    from dckpt.tiers.object_lock import ObjectLock

    bucket = s3.bucket()
    proxy = FaultProxy(s3.port)
    proxy.rule = lambda method, path: "strip-conditions"
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        with pytest.raises(LockError, match="does not honour conditional writes"):
            ObjectLock(_store(bucket), "run-a", lease_s=30).acquire()
    finally:
        proxy.close()
    assert "run/.dckpt-lock" not in s3.keys(bucket)


def _memory_on_s3(
    rank: int, world: int, root: str, base: str, resume: bool
) -> tuple[int | None, list[list[float]], str]:
    import dckpt

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    model, opt = _model()
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(
        root=root, mirror=Path(base) / f"mirror{rank}", memory=True, memory_dir=Path(base) / "mem"
    )
    with dckpt.CheckpointManager(config, state) as mgr:
        if resume:
            report = mgr.resume()
            return report.step, [t.tolist() for t in _flat(model)], report.format()
        for step, tier in ((1, "durable"), (2, "memory")):
            state.step = step
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(float(step))
            mgr.save(step, tier=tier).result()
    return None, [t.tolist() for t in _flat(model)], ""


def test_the_memory_tier_records_its_manifests_in_the_bucket(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Under an s3:// root a memory save's commit is one PUT of its manifest, in the bucket
    (``memory/step-N.json``); a resume on two "nodes" reads it there and restores the step
    from memory, every file proven against it."""
    bucket = s3.bucket()
    root = f"s3://{bucket}/jobs/m"
    saved = run_world(_memory_on_s3, 2, root, str(tmp_path), False, env=s3_env)
    keys = s3.keys(bucket)
    assert "jobs/m/memory/step-00000002.json" in keys, keys
    assert not [k for k in keys if k.startswith("jobs/m/step-00000002")], keys
    resumed = run_world(_memory_on_s3, 2, root, str(tmp_path), True, env=s3_env)
    for rank, (step, weights, report) in enumerate(resumed):
        assert step == 2, report
        assert weights == saved[rank][1]
        assert "from the memory tier (local memory" in report, report
        assert f"against the manifest in s3://{bucket}/jobs/m/memory/step-00000002.json" in report


# --- incremental saves: the frozen file is copied in the bucket, not uploaded again ----------


def _frozen_job(rank: int, world: int, root: str, mirror: str) -> list[int]:
    from torch.nn.parallel import DistributedDataParallel

    import dckpt

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 4))
    body[0].requires_grad_(False)
    body[1].requires_grad_(False)
    model = DistributedDataParallel(body)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = dckpt.CheckpointConfig(root=root, mirror=Path(mirror), async_save=False, timeout_s=60)
    with dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt)) as mgr:
        for step in (1, 2, 3):
            model(torch.randn(4, 256)).square().mean().backward()
            opt.step()
            mgr.save(step)
    return [step]


def test_an_incremental_save_copies_the_frozen_file_in_the_bucket_and_every_step_verifies(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 30 on an s3:// root: a save after the first links the frozen layers' file from
    the mirror and copies its object inside the bucket (CopyObject, seen at a proxy) instead
    of uploading it; each step still holds every object, and every step verifies."""
    from s3_kit import FaultProxy

    from dckpt.cli import main

    proxy = FaultProxy(s3.port)
    try:
        bucket = s3.bucket()
        root = f"s3://{bucket}/run"
        run_world(_frozen_job, 1, root, str(tmp_path / "mirror"), env=s3.env(proxy.endpoint))
    finally:
        proxy.close()
    keys = s3.keys(bucket, "run/")
    assert main(["verify", root]) == 0  # every step, each object hashed in the bucket
    stable = {s: f"run/step-{s:08d}/__0_stable.distcp" for s in (1, 2, 3)}
    assert len({keys[k] for k in stable.values()}) == 1  # each step holds the whole file
    sent = [(m, p) for m, p, _ in proxy.seen if "__0_stable.distcp" in p and m in ("PUT", "POST")]
    # step 1 uploaded it; steps 2 and 3 copied it from the step before (no byte sent again)
    assert [p for m, p in sent if "step-00000001/" in p]
    for s in (2, 3):
        mine = [p for _, p in sent if f"step-{s:08d}/__0_stable.distcp" in p]
        assert mine and all(p in proxy.copied for p in mine), (s, mine, proxy.copied)
