"""Shared fixtures: real checkpoints written by a real 2-rank torchrun of launch/train.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def torchrun_train(
    ckpt: Path, *args: str, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run launch/train.py under torchrun on gloo; returns the finished process."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), str(REPO / "launch" / "train.py"),
        "--ckpt-dir", str(ckpt), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def dckpt_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the installed `dckpt` command as a user would."""
    cmd = [sys.executable, "-m", "dckpt.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="session")
def trained_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with checkpoints at steps 4, 8, 12 from a 2-rank run (read-only: copy to change)."""
    root = tmp_path_factory.mktemp("trained") / "ckpt"
    proc = torchrun_train(root, "--steps", "12", "--save-every", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


@pytest.fixture
def trained_copy(trained_root: Path, tmp_path: Path) -> Path:
    """A private copy of ``trained_root`` that a test may damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(trained_root, dst)
    return dst
