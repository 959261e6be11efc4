"""bench/gpu.py, which measures the GPU path, still runs: its whole code path on the CPU with a
small state (the figures mean nothing there), and without CUDA it says so and exits 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=REPO,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_0(tmp_path: Path) -> None:
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device here" in proc.stdout
    assert not list(tmp_path.iterdir())


def test_every_method_and_figure_runs_on_the_cpu(tmp_path: Path) -> None:
    proc = _run("--device", "cpu", "--saves", "1", "--baseline-steps", "5", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gpu_cpu_smoke.json").read_text())
    methods = doc["results"]["methods"]
    assert set(methods) == {
        "dckpt",
        "dcp_save",
        "dcp_async_thread",
        "dcp_async_process",
        "torch_save",
    }
    for name, m in methods.items():
        assert "error" in m or m["commit_s"] > 0, (name, m)
    dckpt = methods["dckpt"]
    assert "error" not in dckpt, dckpt
    assert dckpt["timings"]["staged_host_bytes"] > 0 and dckpt["reported_stall_s"] > 0
    assert doc["results"]["loads"]["verified_over_dcp_load"] > 0
    assert doc["results"]["disk"]["gb_per_s"] > 0
    assert doc["results"]["fingerprint"]["host_gbps"] > 0  # the capture check's, per GB
    names = [t["name"] for t in doc["results"]["targets"]]
    assert "verified load / dcp.load" in names and "stall per save (s)" in names
    assert "| dckpt |" in (tmp_path / "gpu_cpu_smoke.md").read_text()
    assert "Capture check fingerprint:" in (tmp_path / "gpu_cpu_smoke.md").read_text()
