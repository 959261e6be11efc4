"""The memory tier's ledger and lineage, in one process: what makes a memory step restorable.

A memory step is restored only from its manifest in the root's ledger (``ROOT/memory/``), and
only while it belongs to the run's history:

- a rollback (the run goes back to durable step 2 and saves durable step 4 on, below memory
  step 5 of the branch it left) makes memory step 5 unusable: its anchor (``mesh.after`` = 2)
  is not the newest durable step at or before it (4), and the resume says so and uses 4;
- a memory save below the newest recorded memory step (a rollback of the memory tier itself)
  removes the records above it, so the abandoned branch is never resumed;
- a record whose manifest lacks the anchor is refused;
- the ledger keeps ``memory_keep + 1`` records;
- a failed save of a step saved before leaves the committed copy as it was.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

import dckpt
from dckpt.root.manifest import Manifest, manifest_bytes, parse_manifest
from dckpt.root.memory_ledger import DirectoryLedger


def _manager(root: Path, memory: Path) -> tuple[dckpt.CheckpointManager, torch.nn.Module]:
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    config = dckpt.CheckpointConfig(root=root, memory=True, memory_dir=memory, lock=False)
    logging.getLogger("dckpt").setLevel(logging.WARNING)
    return dckpt.CheckpointManager(config, dckpt.TrainState(net, opt)), net


def _bump(net: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)


def _branch_then_crash(rank: int, world: int, root: str, memory: str) -> None:
    mgr, net = _manager(Path(root), Path(memory))
    mgr.save(2).result()
    _bump(net)
    mgr.save(5, tier="memory").result()  # follows durable 2
    mgr.load(2)  # the run goes back to step 2 ...
    _bump(net)
    mgr.save(4).result()  # ... and on from there: durable 4, below memory 5
    os._exit(0)  # a crash: no close(), so memory step 5's bytes stay in the node's memory


def test_a_memory_step_of_a_branch_the_run_left_is_not_resumed(tmp_path: Path) -> None:
    from dist_harness import run_world

    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    [crashed] = run_world(_branch_then_crash, 1, str(root), str(memory), expect_failure=True)
    assert "produced no result (exit code 0)" in crashed
    assert json.loads((root / "memory" / "step-00000005.json").read_text())["mesh"]["after"] == 2
    assert any(memory.rglob("*.mem")), "the crash should have left memory step 5's file"
    mgr, net = _manager(root, memory)
    want = {k: v + 1.0 for k, v in net.state_dict().items()}  # step 4: step 2, bumped once
    with mgr:
        report = mgr.resume()
    assert report.step == 4, report.format()
    assert all(torch.equal(want[k], v) for k, v in net.state_dict().items())
    note = next(w for w in report.warnings if w.startswith("memory tier: step 5 not used"))
    assert "it follows durable step 2, but the newest durable step at or before it is 4" in note


def test_a_run_resumed_from_a_memory_step_saves_memory_steps_a_resume_can_use(
    tmp_path: Path,
) -> None:
    # Resumed from memory step 5 (which follows durable 2), the run's next memory save follows
    # durable 2 as well: 5 is no durable anchor, and a record naming it would be refused.
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    mgr, net = _manager(root, memory)
    with mgr:
        mgr.save(2).result()
        _bump(net)
        mgr.save(5, tier="memory").result()
    mgr, net = _manager(root, memory)
    with mgr:
        assert mgr.resume().step == 5
        _bump(net)
        mgr.save(7, tier="memory").result()
        want = {k: v.clone() for k, v in net.state_dict().items()}
    assert json.loads((root / "memory" / "step-00000007.json").read_text())["mesh"]["after"] == 2
    mgr, net = _manager(root, memory)
    with mgr:
        report = mgr.resume()
    assert report.step == 7 and not report.warnings, report.format()
    assert all(torch.equal(want[k], v) for k, v in net.state_dict().items())


def test_a_memory_save_below_the_newest_removes_the_branch_above_it(tmp_path: Path) -> None:
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    mgr, net = _manager(root, memory)
    with mgr:
        mgr.save(1).result()
        for step in (3, 5):
            _bump(net)
            mgr.save(step, tier="memory").result()
        assert DirectoryLedger(root).steps() == [3, 5]
        _bump(net)
        mgr.save(4, tier="memory").result()  # a rollback in memory: 5 is the branch left
        want = {k: v.clone() for k, v in net.state_dict().items()}
    assert DirectoryLedger(root).steps() == [3, 4]
    mgr, net = _manager(root, memory)
    with mgr:
        assert mgr.resume().step == 4
    assert all(torch.equal(want[k], v) for k, v in net.state_dict().items())


def test_a_record_without_its_anchor_is_refused(tmp_path: Path) -> None:
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    mgr, net = _manager(root, memory)
    with mgr:
        mgr.save(1).result()
        _bump(net)
        mgr.save(2, tier="memory").result()
    record = root / "memory" / "step-00000002.json"
    manifest: Manifest = parse_manifest(record.read_bytes(), str(record))
    mesh = {k: v for k, v in manifest.mesh.items() if k != "after"}
    import dataclasses

    record.write_bytes(manifest_bytes(dataclasses.replace(manifest, mesh=mesh)))
    mgr, net = _manager(root, memory)
    with mgr:
        report = mgr.resume()
    assert report.step == 1, report.format()
    assert any("names no durable anchor" in w for w in report.warnings), report.warnings


def test_the_ledger_keeps_one_record_more_than_the_nodes_keep(tmp_path: Path) -> None:
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    mgr, _net = _manager(root, memory)
    with mgr:
        for step in range(1, 6):
            mgr.save(step, tier="memory").result()
    assert DirectoryLedger(root).steps() == [4, 5]  # memory_keep=1: this one and the last
    held = sorted(p.parent.name for p in (memory / "node-0" / "own").glob("*/rank-*.mem"))
    assert held == ["step-00000005"], held


def test_a_failed_save_of_a_step_saved_before_keeps_its_committed_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory step 3 is committed; saving step 3 again fails at its commit: the first copy,
    set aside while the second was written, is back in place, and a resume restores it."""
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    mgr, net = _manager(root, memory)
    with mgr:
        mgr.save(1).result()
        _bump(net)
        mgr.save(3, tier="memory").result()
        want = {k: v.clone() for k, v in net.state_dict().items()}
        _bump(net)
        monkeypatch.setenv("DCKPT_FAULT", "phase=memory_commit,rank=0,action=raise")
        with pytest.raises(dckpt.SaveError, match="injected fault at phase memory_commit"):
            mgr.save(3, tier="memory").result()
        monkeypatch.delenv("DCKPT_FAULT")
    mgr, net = _manager(root, memory)
    with mgr:
        report = mgr.resume()
    assert report.step == 3 and "memory tier" in report.origin, report.format()
    assert all(torch.equal(want[k], v) for k, v in net.state_dict().items())
    assert not list(memory.rglob(".rank-*")), list(memory.rglob(".rank-*"))  # nothing aside
