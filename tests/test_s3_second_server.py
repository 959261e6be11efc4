"""The example trainer on an s3:// root served by ministack (PyPI), a second S3 implementation
beside moto, started here without Docker (``s3_kit.MinistackServer``): what moto is lenient
about must not be all that dckpt is tested against.

One 2-rank job with a rank SIGKILLed halfway through a multipart upload, then the ``dckpt``
commands on the bucket, then a restart with an empty mirror (another node, as far as the
bucket can tell) that aborts the upload left open, removes the uncommitted step, fetches and
verifies the newest committed one from the bucket and resumes loss for loss: the steps run
twice, before the crash and after the resume, log the same losses bit for bit, and every step
after the resume logs what an uninterrupted run logs. The run lock is on (ministack honours
conditional writes), and a second job is refused while one holds it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import dckpt_cli, losses, torchrun_train, torchrun_train_beside
from s3_kit import MinistackServer, ministack_server

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

# FSDP halves the state between the ranks; with 5 MiB parts each rank's shard is several parts.
ARGS = ["--parallel", "fsdp", "--d-model", "256", "--steps", "6", "--save-every", "2"]


@pytest.fixture(scope="module")
def ministack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MinistackServer]:
    with ministack_server(tmp_path_factory.mktemp("ministack")) as server:
        yield server


def test_train_crash_mid_upload_list_verify_and_resume_from_the_bucket_on_ministack(
    ministack: MinistackServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in ministack.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DCKPT_S3_PART_MB", "5")
    monkeypatch.setenv("DCKPT_CACHE_DIR", str(tmp_path / "node-a"))
    bucket = ministack.bucket()
    root = f"s3://{bucket}/runs/lm"

    log = tmp_path / "run.jsonl"
    monkeypatch.setenv("DCKPT_FAULT", "phase=upload,rank=1,action=sigkill,step=4")
    crashed = torchrun_train(root, *ARGS, "--loss-log", str(log), "--no-async")
    monkeypatch.delenv("DCKPT_FAULT")
    assert crashed.returncode != 0
    keys = ministack.keys(bucket, "runs/lm/")
    assert "runs/lm/step-00000002/manifest.json" in keys, crashed.stderr[-3000:]
    assert "runs/lm/step-00000004/manifest.json" not in keys  # nothing became visible
    assert "runs/lm/step-00000004/__1_0.distcp" in ministack.open_uploads(bucket)
    before = losses(log)
    assert sorted(before) == [1, 2, 3, 4]

    listed = dckpt_cli("ls", root, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["step"], r["status"]) for r in rows] == [(2, "committed"), (4, "incomplete")]
    checked = dckpt_cli("verify", root, "--all", "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["ok"] is True

    # Another node: an empty mirror, so every object comes from the bucket, hashed on arrival.
    monkeypatch.setenv("DCKPT_CACHE_DIR", str(tmp_path / "node-b"))
    log, ref_log = tmp_path / "resumed.jsonl", tmp_path / "ref.jsonl"
    # An uninterrupted run on a directory root, beside (it shares nothing with this one)
    with torchrun_train_beside(tmp_path / "ref", *ARGS, "--loss-log", str(ref_log)) as ref:
        resumed = torchrun_train(root, *ARGS, "--loss-log", str(log))
    assert resumed.returncode == 0, resumed.stderr
    assert ref.result().returncode == 0, ref.result().stderr
    assert "aborted the unfinished upload of runs/lm/step-00000004/__1_0.distcp" in resumed.stderr
    assert re.search(r"removed \d+ object\(s\) of the uncommitted s3://\S+/step-00000004", (
        resumed.stderr
    ))  # fmt: skip
    assert f"dckpt resume: step 2 from s3://{bucket}/runs/lm/step-00000002" in resumed.stderr
    assert "downloaded from s3://" in resumed.stderr
    assert ministack.open_uploads(bucket) == []
    after = losses(log)
    assert sorted(after) == [3, 4, 5, 6]
    assert [after[s] for s in (3, 4)] == [before[s] for s in (3, 4)]  # bit for bit
    want = losses(ref_log)
    assert [after[s] for s in range(3, 7)] == [want[s] for s in range(3, 7)]

    rows = json.loads(dckpt_cli("ls", root, "--json").stdout)
    assert [(r["step"], r["status"]) for r in rows] == [(s, "committed") for s in (2, 4, 6)]
    checked = dckpt_cli("verify", root, "--all", "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout)["ok"] is True
    assert "runs/lm/.dckpt-lock" not in ministack.keys(bucket, "runs/lm/")  # released


def test_a_second_job_is_refused_by_the_lock_in_the_bucket_on_ministack(
    ministack: MinistackServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock is a conditional PUT (If-None-Match: *): ministack refuses the second one."""
    from dckpt.errors import LockError
    from dckpt.tiers.object_lock import ObjectLock
    from dckpt.tiers.s3_store import S3Store
    from dckpt.tiers.url import parse_url

    for k, v in ministack.env().items():
        monkeypatch.setenv(k, v)
    bucket = ministack.bucket()
    first = ObjectLock(S3Store(parse_url(f"s3://{bucket}/run")), "run-a", lease_s=30)
    first.acquire()
    try:
        second = ObjectLock(S3Store(parse_url(f"s3://{bucket}/run")), "run-b", lease_s=30)
        with pytest.raises(LockError, match=f"s3://{bucket}/run is in use by run run-a"):
            second.acquire()
        first.check_held()
    finally:
        first.release()
    assert "run/.dckpt-lock" not in ministack.keys(bucket)
