"""The example trainer under torchrun: saves, crash and verified resume, loss for loss."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import torchrun_train

from dckpt.layout import committed_steps


def _losses(log: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        assert set(rec) == {"step", "loss", "lr", "time"}
        out[rec["step"]] = rec["loss"]
    return out


def test_crashed_and_resumed_run_equals_uninterrupted_run(tmp_path: Path) -> None:
    args = ["--steps", "10", "--save-every", "3"]
    ref = torchrun_train(tmp_path / "ref", *args, "--loss-log", str(tmp_path / "ref.jsonl"))
    assert ref.returncode == 0, ref.stderr

    log = tmp_path / "run.jsonl"
    crashed = torchrun_train(
        tmp_path / "run", *args, "--loss-log", str(log), "--crash-at-step", "8"
    )
    assert crashed.returncode != 0  # it really died (SIGKILL)
    # Saves are asynchronous: step 6's may still have been writing when step 8 crashed. Either
    # it committed, or its tmp dir is left and nothing under a final name is partial.
    committed = sorted(committed_steps(tmp_path / "run"))
    assert committed in ([3], [3, 6])
    resumed = torchrun_train(tmp_path / "run", *args, "--loss-log", str(log))
    assert resumed.returncode == 0, resumed.stderr
    assert f"loaded step {committed[-1]}" in resumed.stderr and "verified" in resumed.stderr
    want, got = _losses(tmp_path / "ref.jsonl"), _losses(log)
    assert sorted(got) == list(range(1, 11))
    after = range(committed[-1] + 1, 11)
    assert [got[s] for s in after] == [want[s] for s in after]  # bit-identical
    assert committed_steps(tmp_path / "run") == [3, 6, 9, 10]
