"""A real full disk (fault 5): the checkpoint root on a size-limited tmpfs.

Two trials, each on its own tmpfs mounted for the test (root only; skipped where mounting is
not permitted): one with room for one checkpoint but not two, one with room for none. Every
rank must raise a SaveError that says the device is full; nothing is committed, the failed
save's tmp dir is removed (the space comes back), the earlier checkpoint is intact, and the
free-space check warned before the failing save was staged. Once space is freed (the tmpfs is
grown), a restart resumes and saves again.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world
from fault_kit import Trials, build, capture, check, manager, resume_world, train_step

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

FAULT = "full disk (real tmpfs)"
WIDTH = 4096  # about 1.2 MB per checkpoint (weights and two AdamW moments)


def _mount(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    cmd = [
        "mount",
        "-t",
        "tmpfs",
        "-o",
        f"size={size},mode=0700",
        f"dckpt-test-{uuid.uuid4().hex[:6]}",
    ]
    return subprocess.run([*cmd, str(path)], capture_output=True, check=False).returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Any]:
    mounted: list[Path] = []

    def make(name: str, size: str) -> Path:
        path = tmp_path / name
        if not _mount(path, size):
            pytest.skip("cannot mount a tmpfs here (needs root): the full-disk test needs one")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def filling_world(rank: int, world: int, root: str, steps: list[int]) -> dict[str, Any]:
    import dckpt

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("dckpt").addHandler(Keep())
    model, opt, sched = build(rank, WIDTH, frozen=False)  # the tmpfs is sized to all of it
    mgr = manager(root, model, opt, sched)
    results = []
    for step in steps:
        train_step(model, opt, sched, step, rank)
        try:
            mgr.save(step)
            mgr.wait()
            results.append("ok")
        except dckpt.SaveError as exc:
            results.append(str(exc))
    mgr.close()
    return {"results": results, "warnings": warnings}


@pytest.mark.parametrize(("size", "fits"), [("2m", 1), ("1m", 0)])
def test_a_full_disk_fails_the_save_on_every_rank_and_loses_nothing(
    small_disk: Any, size: str, fits: int, fault_trials: Trials
) -> None:
    from dckpt.root.layout import committed_steps

    root = small_disk("disk", size) / "root"
    out = run_world(filling_world, 2, str(root), [1, 2], timeout=120)
    why: list[str] = []
    for r in (0, 1):
        results = out[r]["results"]
        if results[:fits] != ["ok"] * fits:
            why.append(f"rank {r}: the save that fits failed: {results[:fits]}")
        failing = results[fits]
        if any(x not in failing for x in ("no space left", "free space", "nothing was committed")):
            why.append(f"rank {r}: unclear error for a full disk: {failing!r}")
    if committed_steps(root) != list(range(1, fits + 1)):
        why.append(f"committed {committed_steps(root)}, expected steps 1..{fits}")
    if list(root.glob("*.tmp-*")):
        why.append("the failed save's tmp dir was left on the full disk")
    if not any("free on" in w for w in out[0]["warnings"]) and fits:
        why.append(f"no early free-space warning on rank 0: {out[0]['warnings']}")
    baseline = capture(root) if fits else {}
    free = shutil.disk_usage(root).free
    if fits and free < 700_000:
        why.append(f"the space of the failed save did not come back ({free} bytes free)")
    outcome = check(root, baseline)

    # The user frees space (the tmpfs grows); the restart resumes and saves again.
    subprocess.run(["mount", "-o", "remount,size=16m", str(root.parent)], check=True)
    resumed = run_world(resume_world, 2, [str(root)], WIDTH, False, timeout=120)
    for r in (0, 1):
        got = resumed[r][0]
        if got.get("error") or got.get("step") != (fits or None):
            why.append(f"restart on rank {r}: {got}")
    fault_trials.record_check(
        FAULT, f"tmpfs {size}, room for {fits}", outcome, detail="; ".join(why)
    )
    assert not why and outcome.ok, why + outcome.problems
