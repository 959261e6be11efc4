"""The example trainer on an s3:// root, against a real S3 server: a rank SIGKILLed halfway
through a multipart upload, the restart that cleans up and resumes loss for loss (the steps
run twice, before the crash and after the resume, log the same losses bit for bit), and the
``dckpt`` commands on the bucket."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import dckpt_cli, dckpt_cli_here, losses, torchrun_train
from s3_kit import MotoServer, moto_server

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

# FSDP halves the state between the ranks; with 5 MiB parts each rank's shard is several parts.
ARGS = ["--parallel", "fsdp", "--d-model", "256", "--steps", "6", "--save-every", "2"]


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@pytest.mark.faults
def test_a_rank_killed_mid_upload_commits_nothing_and_the_restart_cleans_up_and_resumes(
    s3: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault_trials: Any
) -> None:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DCKPT_S3_PART_MB", "5")
    monkeypatch.setenv("DCKPT_CACHE_DIR", str(tmp_path / "cache"))
    bucket = s3.bucket()
    root = f"s3://{bucket}/runs/lm"

    log = tmp_path / "run.jsonl"
    monkeypatch.setenv("DCKPT_FAULT", "phase=upload,rank=1,action=sigkill,step=4")
    crashed = torchrun_train(root, *ARGS, "--loss-log", str(log), "--no-async")
    monkeypatch.delenv("DCKPT_FAULT")
    assert crashed.returncode != 0
    keys = s3.keys(bucket, "runs/lm/")
    assert "runs/lm/step-00000002/manifest.json" in keys, crashed.stderr[-3000:]
    assert "runs/lm/step-00000004/manifest.json" not in keys  # nothing became visible
    half_done = s3.open_uploads(bucket)
    assert "runs/lm/step-00000004/__1_0.distcp" in half_done  # killed mid-upload, really
    listed = json.loads(dckpt_cli("ls", root, "--json").stdout)
    assert [(r["step"], r["status"]) for r in listed] == [(2, "committed"), (4, "incomplete")]

    before = losses(log)  # steps 1-4: the save of step 4 was cut short, step 2 committed
    assert sorted(before) == [1, 2, 3, 4]
    log = tmp_path / "resumed.jsonl"
    resumed = torchrun_train(root, *ARGS, "--loss-log", str(log))
    assert resumed.returncode == 0, resumed.stderr
    assert "aborted the unfinished upload of runs/lm/step-00000004/__1_0.distcp" in resumed.stderr
    assert re.search(r"removed \d+ object\(s\) of the uncommitted s3://\S+/step-00000004", (
        resumed.stderr
    ))  # fmt: skip
    assert f"dckpt resume: step 2 from s3://{bucket}/runs/lm/step-00000002" in resumed.stderr
    assert "downloaded from s3://" in resumed.stderr or "cached in the mirror" in resumed.stderr
    assert s3.open_uploads(bucket) == []
    after = losses(log)
    assert sorted(after) == [3, 4, 5, 6]
    # Steps 3 and 4 ran twice: before the crash and after the resume from step 2. Bit for
    # bit the same losses (dropout included): the state came back from the bucket exactly.
    assert [after[s] for s in (3, 4)] == [before[s] for s in (3, 4)]
    fault_trials.record("s3: SIGKILL mid-upload, then restart", "rank 1, step 4", survived=True)

    # The commands on the bucket, in this process (dckpt.cli.main: the command's own code;
    # the `ls` above was the installed command): each one a process of its own cost 0.5 to 5
    # CPU-seconds of imports (boto3, torch), most of this test's time on a loaded machine.
    listed = json.loads(dckpt_cli_here("ls", root, "--json").stdout)
    assert [(r["step"], r["status"]) for r in listed] == [
        (2, "committed"),
        (4, "committed"),
        (6, "committed"),
    ]
    assert all(r["path"].startswith(f"s3://{bucket}/runs/lm/step-") for r in listed)
    checked = dckpt_cli_here("verify", root, "--json")
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["ok"] is True
    listed = json.loads(
        dckpt_cli_here("ls", root, "--json").stdout
    )  # the outcome, kept in the bucket
    assert [r["verified"] for r in listed] == ["ok", "ok", "ok"], listed
    shown = dckpt_cli_here("inspect", root, "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["step"] == 6, shown.stderr
    assert json.loads(shown.stdout)["path"] == f"{root}/step-00000006"  # not the temp copy
    assert "downloaded from s3://" not in shown.stderr  # the manifest alone, as on a directory
    titled = dckpt_cli_here("inspect", root, "--step", "4")
    assert titled.stdout.splitlines()[0] == f"{root}/step-00000004", titled.stdout
    diff = dckpt_cli_here("diff", root, "4", "6", "--json")
    assert diff.returncode == 0, diff.stderr
    assert "downloaded from s3://" in diff.stderr  # fetched, each object hashed on arrival
    compared = json.loads(diff.stdout)
    assert (compared["a"], compared["b"], compared["config"]) == (4, 6, [])
    assert compared["differences"]  # the weights moved between steps 4 and 6
    planned = dckpt_cli_here("plan", root, "--json")
    assert planned.returncode == 0, planned.stderr
    assert dckpt_cli_here("pin", root, "2").returncode == 0
    gc = dckpt_cli_here("gc", root, "--keep-last", "2", "--json")
    assert gc.returncode == 0, gc.stderr + gc.stdout
    assert json.loads(gc.stdout)["deleted"] == []  # 2 pinned, 4 and 6 the newest two
    assert dckpt_cli_here("unpin", root, "2").returncode == 0
    gc = dckpt_cli_here("gc", root, "--keep-last", "2", "--json")
    assert json.loads(gc.stdout)["deleted"] == ["step-00000002"]
    assert not [k for k in s3.keys(bucket, "runs/lm/step-00000002/")]
    assert "runs/lm/.dckpt-verified/step-00000002.json" not in s3.keys(bucket)  # gone with it

    # One byte changed in the bucket: verify names the object and exits 3.
    key = "runs/lm/step-00000006/__0_0.distcp"
    body = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[1000] ^= 0x01
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(body))
    bad = dckpt_cli_here("verify", root, "--step", "6")
    assert bad.returncode == 3
    assert "FAILED  step-00000006: __0_0.distcp: digest mismatch" in bad.stdout
    listed = json.loads(dckpt_cli_here("ls", root, "--json").stdout)
    assert [(r["step"], r["verified"]) for r in listed] == [(4, "ok"), (6, "failed")], listed
    fault_trials.record("s3: a byte changed in the bucket", "dckpt verify", survived=True)
    export = dckpt_cli_here("export", root, "--step", "4", "--out", str(tmp_path / "m.safetensors"))
    assert export.returncode == 0, export.stderr
    assert (tmp_path / "m.safetensors").stat().st_size > 0
