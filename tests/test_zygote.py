"""The test launcher (tests/zygote.py) keeps torchrun's contract for what the tests use it for:
the same job, once under ``python -m torch.distributed.run`` and once forked from the zygote,
logs the same losses bit for bit (the RNGs, torch's threads and the environment are a fresh
process's), commits the same steps, and a rank that fails ends the job non-zero on both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import zygote
from conftest import REPO, losses

from dckpt.root.layout import committed_steps

ARGS = ["--steps", "4", "--save-every", "2", "--dropout", "0.1"]


def _torchrun(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(REPO / "launch" / "train.py"), "--ckpt-dir", str(root), *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)


def _forked(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = REPO / "launch" / "train.py"
    return zygote.client().run(script, ["--ckpt-dir", str(root), *args], env=env, timeout=240)


def test_a_job_forked_from_the_zygote_is_the_job_torchrun_runs(tmp_path: Path) -> None:
    real = _torchrun(tmp_path / "real", *ARGS, "--loss-log", str(tmp_path / "real.jsonl"))
    forked = _forked(tmp_path / "forked", *ARGS, "--loss-log", str(tmp_path / "forked.jsonl"))
    assert real.returncode == 0, real.stderr[-3000:]
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert losses(tmp_path / "forked.jsonl") == losses(tmp_path / "real.jsonl")
    assert committed_steps(tmp_path / "forked") == committed_steps(tmp_path / "real") == [2, 4]
    assert "dckpt: saved step 4" in forked.stderr and "train: 2 ranks" in forked.stdout

    crashed = _forked(tmp_path / "crash", *ARGS, "--no-async", "--crash-at-step", "3")
    assert crashed.returncode != 0 and committed_steps(tmp_path / "crash") == [2]
    assert "Signal 9 (SIGKILL) received by PID" in crashed.stderr, crashed.stderr[-2000:]
