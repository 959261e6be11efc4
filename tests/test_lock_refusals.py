"""The run lock's refusals, as a user meets them at a real start (CheckpointManager, and the
example trainer under torchrun), for a directory root and an s3:// root on a real S3 server
(moto's, on 127.0.0.1, behind ``s3_kit.FaultProxy`` where a store must misbehave):

- a lock record that is not dckpt's (not JSON, a list, a field of the wrong type or out of
  range) is a LockError naming the file or URL, the field, and how to remove a stale lock; the
  record is left as it was, never taken over; an empty or zero-filled file (what a power cut
  leaves) still is taken over;
- a missing bucket says so, and nothing about releasing a lock that was never taken;
- a second job on one s3:// root, refused by its local mirror's lock, names the s3:// root;
- the s3:// root's lock judges a pid only where the directory lock does: a record of another
  pid namespace on this host is watched for its lease, and ``dckpt gc`` names it as a holder;
- a store that cannot list open multipart uploads (501) starts with one warning naming the
  lifecycle rule to set instead;
- ``dckpt gc`` on a directory root refuses while its lock record is unreadable, and runs
  once the record names a job that is gone;
- ``DCKPT_LOCK`` is ``CheckpointConfig.lock``'s default; launch/train.py has ``--no-lock``,
  and prints a refused lock as one block on rank 0 and exits 2, with no traceback per rank.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import torchrun_train
from lock_kit import gone, renewing
from s3_kit import FaultProxy, MotoServer, moto_server
from torch import nn

import dckpt
from dckpt.errors import LockError

pytestmark = pytest.mark.multiproc

LOCK = ".dckpt-lock"


def _record(**changes: object) -> dict[str, object]:
    """A live-looking lock record of another host's job (its lease far from over)."""
    record: dict[str, object] = {
        "host": "node-17",
        "pid": 4242,
        "started": time.time() - 100,
        "run_id": "other-run",
        "token": "t0ken",
        "lease_until": time.time() + 3600,
    }
    record.update(changes)
    return record


# (what is in the lock file, what the error must say about it)
MALFORMED: dict[str, tuple[bytes, str]] = {
    "lease is a word": (
        json.dumps(_record(lease_until="soon")).encode(),
        "field 'lease_until' is the string \"soon\", not a time in seconds since the epoch",
    ),
    "pid is a string": (
        json.dumps(_record(pid="4242")).encode(),
        "field 'pid' is the string \"4242\", not a process id",
    ),
    "pid is negative": (json.dumps(_record(pid=-3)).encode(), "field 'pid' is the whole number -3"),
    "pid is a boolean": (json.dumps(_record(pid=True)).encode(), "field 'pid' is a boolean true"),
    "started is NaN": (
        json.dumps(_record(started=float("nan"))).encode(),
        "field 'started' is the number NaN",
    ),
    "host is a dict": (json.dumps(_record(host={"a": 1})).encode(), "field 'host' is an object"),
    "a list, not an object": (b'[{"pid": 1}]', 'it is a list [{"pid": 1}], not a JSON object'),
    "not JSON": (b"pid=4242 host=node-17", "it is not JSON"),
    "pid namespace as readlink shows it": (
        json.dumps(_record(pid_ns="pid:[4026531836]")).encode(),
        "field 'pid_ns' is the string \"pid:[4026531836]\", not a pid namespace (the inode "
        "number of /proc/self/ns/pid)",
    ),
    "pid namespace is null": (
        json.dumps(_record(pid_ns=None)).encode(),
        "field 'pid_ns' is null, not a pid namespace",
    ),
    "boot id is not a UUID": (
        json.dumps(_record(boot_id="last tuesday")).encode(),
        "field 'boot_id' is the string \"last tuesday\", not a boot id (a UUID, as "
        "/proc/sys/kernel/random/boot_id holds)",
    ),
    "a field missing": (
        json.dumps({k: v for k, v in _record().items() if k != "token"}).encode(),
        "it has no field 'token'",
    ),
}


def _state() -> dckpt.TrainState:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_malformed_directory_lock_is_refused_naming_the_file_the_field_and_the_remedy(
    tmp_path: Path,
) -> None:
    for i, (case, (raw, says)) in enumerate(MALFORMED.items()):
        root = tmp_path / f"root-{i}"
        root.mkdir()
        (root / LOCK).write_bytes(raw)
        with pytest.raises(LockError) as refused:
            dckpt.CheckpointManager(dckpt.CheckpointConfig(root=root), _state())
        text = str(refused.value)
        assert f"the run lock {root / LOCK} is not a lock record dckpt can read" in text, case
        assert says in text, (case, text)
        assert f"If no job runs on this root, remove the lock (rm {root / LOCK})" in text, case
        assert (root / LOCK).read_bytes() == raw, case  # not taken over, not removed
    # `dckpt gc` reads the lock by the same rules: it refuses while the lock is unreadable,
    # and goes ahead once the record names a job that is gone.
    from conftest import dckpt_cli

    root = tmp_path / "root-0"
    gc = dckpt_cli("gc", str(root), "--keep-last", "2")
    assert gc.returncode == 2 and "is held by a lock dckpt cannot read" in gc.stderr, gc.stderr
    gone = _record(host=socket.gethostname(), pid=4_000_000)  # no such process here
    (root / LOCK).write_text(json.dumps(gone))
    gc = dckpt_cli("gc", str(root), "--keep-last", "2")
    assert gc.returncode == 0, gc.stderr


@pytest.mark.parametrize("torn", [b"", b"\0" * 180])
def test_an_empty_or_zero_filled_lock_file_is_taken_over(
    tmp_path: Path, torn: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / LOCK).write_bytes(torn)  # a power cut before the record reached the disk
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        mgr = dckpt.CheckpointManager(dckpt.CheckpointConfig(root=tmp_path), _state())
    with mgr:
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert "it is empty or zero-filled (a write cut short by a crash)" in caplog.text


# --- s3:// roots ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@pytest.fixture
def s3_env(s3: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    env = {**s3.env(), "DCKPT_CACHE_DIR": str(tmp_path / "cache")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def test_a_malformed_s3_lock_is_refused_naming_the_url_the_field_and_the_remedy(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    from conftest import dckpt_cli

    bucket = s3.bucket()
    for case in ("lease is a word", "pid is a string", "a list, not an object", "not JSON"):
        raw, says = MALFORMED[case]
        s3.client().put_object(Bucket=bucket, Key="run/.dckpt-lock", Body=raw)
        mirror = tmp_path / f"mirror-{len(case)}"
        config = dckpt.CheckpointConfig(root=f"s3://{bucket}/run", mirror=mirror)
        with pytest.raises(LockError) as refused:
            dckpt.CheckpointManager(config, _state())
        text = str(refused.value)
        url = f"s3://{bucket}/run/.dckpt-lock"
        assert f"the run lock {url} is not a lock record dckpt can read" in text, case
        assert says in text, (case, text)
        assert f"remove the lock (aws s3 rm {url}" in text, case
        body = s3.client().get_object(Bucket=bucket, Key="run/.dckpt-lock")["Body"].read()
        assert body == raw, case  # not taken over
        assert not (mirror / LOCK).exists(), case  # the mirror's lock was released
    # `dckpt gc` cannot tell whether a job holds the root: it refuses, and says why.
    gc = dckpt_cli("gc", f"s3://{bucket}/run", "--keep-last", "2")
    assert gc.returncode == 2, gc.stdout + gc.stderr
    assert "is held by a lock dckpt cannot read" in gc.stderr and "Traceback" not in gc.stderr


def test_an_s3_lock_of_another_pid_namespace_on_this_host_is_watched_not_judged_by_pid(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The s3:// root's lock follows the directory lock's rule (dckpt.root.lock.apart): a
    record of a container beside this one names a pid that means nothing here (dead here)."""
    from conftest import dckpt_cli

    bucket = s3.bucket()
    record = gone("boxed-run", 3.0, pid_ns=1)  # its pid: dead here, maybe alive in its own
    s3.client().put_object(Bucket=bucket, Key="run/.dckpt-lock", Body=json.dumps(record))
    gc = dckpt_cli("gc", f"s3://{bucket}/run", "--keep-last", "2")
    assert gc.returncode == 2, gc.stdout + gc.stderr
    assert "is held by run boxed-run" in gc.stderr, gc.stderr
    assert "in another pid namespace on this host (a container)" in gc.stderr, gc.stderr
    config = dckpt.CheckpointConfig(root=f"s3://{bucket}/run", mirror=tmp_path / "m")
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dckpt"):
        dckpt.CheckpointManager(config, _state()).close()
    assert time.monotonic() - t0 >= 3.0  # its lease, not at once
    said = "held by run boxed-run (pid {} on {}".format(record["pid"], socket.gethostname())
    assert said in caplog.text and "in another pid namespace on this host" in caplog.text
    assert "took over the lock of run boxed-run" in caplog.text
    assert "its renewal count stayed at 0" in caplog.text, caplog.text


def test_a_missing_bucket_says_so_without_a_word_about_releasing_the_lock(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = dckpt.CheckpointConfig(root="s3://no-such-bucket-xyz/run", mirror=tmp_path / "m")
    with caplog.at_level(logging.DEBUG, logger="dckpt"), pytest.raises(LockError) as refused:
        dckpt.CheckpointManager(config, _state())
    assert "the bucket 'no-such-bucket-xyz' does not exist" in str(refused.value)
    assert "release the run lock" not in caplog.text, caplog.text  # never taken: not released
    assert not (tmp_path / "m" / LOCK).exists()


def test_a_second_job_refused_by_the_mirror_lock_names_the_s3_root(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path
) -> None:
    bucket = s3.bucket()
    root, mirror = f"s3://{bucket}/run", tmp_path / "mirror"
    code = (
        "import sys, torch, dckpt\n"
        "m = torch.nn.Linear(2, 2)\n"
        "config = dckpt.CheckpointConfig(root=sys.argv[1], mirror=sys.argv[2])\n"
        "try:\n"
        "    dckpt.CheckpointManager(config, dckpt.TrainState(m))\n"
        "except dckpt.CheckpointError as e:\n"
        "    print(type(e).__name__, e); sys.exit(7)\n"
    )
    config = dckpt.CheckpointConfig(root=root, mirror=mirror)
    with dckpt.CheckpointManager(config, _state()):
        second = subprocess.run(
            [sys.executable, "-c", code, root, str(mirror)],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
    assert second.returncode == 7, second.stdout + second.stderr
    assert second.stdout.startswith(
        f"LockError {root} (its local mirror {mirror}) is in use by run "
    ), second.stdout
    assert f"pid {os.getpid()} on {socket.gethostname()}" in second.stdout


def test_a_store_that_cannot_list_open_uploads_starts_with_one_warning(
    s3: MotoServer,
    s3_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bucket = s3.bucket()
    proxy = FaultProxy(s3.port)  # ListMultipartUploads is GET /bucket?uploads
    proxy.rule = lambda method, path: "501" if method == "GET" and "uploads" in path else None
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        config = dckpt.CheckpointConfig(root=f"s3://{bucket}/run", mirror=tmp_path / "m")
        with caplog.at_level(logging.WARNING, logger="dckpt"):
            for step in (1, 2):  # a start and a save, twice: the second resumes the first's
                with dckpt.CheckpointManager(config, _state()) as mgr:
                    mgr.resume()
                    mgr.save(step).result()
    finally:
        proxy.close()
    warned = [r.getMessage() for r in caplog.records if "open multipart uploads" in r.getMessage()]
    assert len(warned) == 2, warned  # once per start
    assert "the store cannot list open multipart uploads" in warned[0]
    assert "AbortIncompleteMultipartUpload" in warned[0]
    asked = [p for m, p, _ in proxy.seen if m == "GET" and "uploads" in p]
    assert len(asked) == 2, asked  # a missing feature is not retried
    keys = s3.keys(bucket, "run/")
    assert "run/step-00000001/manifest.json" in keys and "run/step-00000002/manifest.json" in keys


# --- DCKPT_LOCK and the example trainer -----------------------------------------------------


def test_dckpt_lock_is_the_lock_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCKPT_LOCK", raising=False)
    assert dckpt.CheckpointConfig(root=tmp_path).lock is True
    for off in ("0", "false", "No", " off "):
        monkeypatch.setenv("DCKPT_LOCK", off)
        assert dckpt.CheckpointConfig(root=tmp_path).lock is False, off
    assert dckpt.CheckpointConfig(root=tmp_path, lock=True).lock is True  # given: it wins
    for on in ("1", "true", "YES", ""):
        monkeypatch.setenv("DCKPT_LOCK", on)
        assert dckpt.CheckpointConfig(root=tmp_path).lock is True, on
    monkeypatch.setenv("DCKPT_LOCK", "maybe")
    with pytest.raises(ValueError, match=r"DCKPT_LOCK='maybe': use 0 \(no run lock\) or 1"):
        dckpt.CheckpointConfig(root=tmp_path)


def _one_block(stderr: str, head: str) -> None:
    """A refusal printed as one block, once, and no rank's traceback through dckpt's code."""
    assert stderr.count(head) == 1, stderr
    for code in ("dckpt/manager.py", "dckpt/root/", "dckpt/tiers/"):
        assert code not in stderr, stderr


TRAIN = ["--steps", "2", "--save-every", "2", "--no-async", "--d-model", "32"]


@pytest.mark.slow
def test_the_trainer_refuses_a_held_root_in_one_block_and_runs_with_no_lock(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    with renewing(root / LOCK, _record()):  # another host's job, renewing its lease
        held = torchrun_train(root, *TRAIN)
    assert held.returncode != 0
    _one_block(held.stderr, "dckpt start: REFUSED (LockError)")
    assert f"{root} is in use by run other-run (pid 4242 on node-17" in held.stderr
    free = torchrun_train(root, *TRAIN, "--no-lock")
    assert free.returncode == 0, free.stderr
    assert json.loads((root / LOCK).read_text())["run_id"] == "other-run"  # never touched


@pytest.mark.slow
def test_the_trainer_on_a_store_without_conditional_writes_names_no_lock_and_dckpt_lock(
    s3: MotoServer, s3_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3.bucket()
    proxy = FaultProxy(s3.port)
    proxy.rule = lambda method, path: "strip-conditions"  # If-None-Match ignored, as s3rver
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    root = f"s3://{bucket}/run"
    try:
        refused = torchrun_train(root, *TRAIN)
        monkeypatch.setenv("DCKPT_LOCK", "0")
        unlocked = torchrun_train(root, *TRAIN)
    finally:
        proxy.close()
    assert refused.returncode != 0
    _one_block(refused.stderr, "dckpt start: REFUSED (LockError)")
    assert "does not honour conditional writes" in refused.stderr
    assert "(--no-lock, or DCKPT_LOCK=0 in the environment)" in refused.stderr, refused.stderr
    assert "CheckpointConfig(lock=False)" not in refused.stderr
    assert unlocked.returncode == 0, unlocked.stderr
    assert "run/step-00000002/manifest.json" in s3.keys(bucket, "run/")
    assert "run/.dckpt-lock" not in s3.keys(bucket, "run/")
