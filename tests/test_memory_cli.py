"""The memory tier as the command line shows it: ``dckpt ls`` lists it next to the durable
tier (table and ``--json``), ``dckpt plan`` plans it from its measured save and restore costs,
``dckpt memory clear`` frees it.

One process, no process group: a manager with the memory tier saves to both tiers, resumes
from memory (which records the restore's cost), then the real ``dckpt`` command reads it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import dckpt
from tests.conftest import dckpt_cli


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("memory_cli")
    root, memory = tmp / "ckpt", tmp / "mem"
    net = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(net.parameters())
    state = dckpt.TrainState(net, opt)
    config = dckpt.CheckpointConfig(root=root, memory=True, memory_dir=memory)
    logging.getLogger("dckpt").setLevel(logging.WARNING)
    with dckpt.CheckpointManager(config, state) as mgr:
        mgr.save(2).result()
        mgr.save(3, tier="memory").result()
    with dckpt.CheckpointManager(config, state) as mgr:
        report = mgr.resume()
        assert report.step == 3 and "memory tier" in report.origin, report.format()
    return root, memory


def test_ls_lists_the_memory_tier_next_to_the_durable_one(saved: tuple[Path, Path]) -> None:
    root, memory = saved
    proc = dckpt_cli("ls", str(root), "--memory-dir", str(memory), "--json")
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)
    durable = [r for r in records if r["tier"] == "durable"]
    kept = [r for r in records if r["tier"] == "memory"]
    assert [r["step"] for r in durable] == [2], records
    assert [(r["step"], r["node"], r["copy"], r["recorded"]) for r in kept] == [
        (3, 0, "own", True)
    ], records
    assert kept[0]["files"] == 1 and kept[0]["bytes"] > 64 * 64 * 4, kept
    assert kept[0]["error"] is None and kept[0]["age_s"] >= 0, kept
    table = dckpt_cli("ls", str(root), "--memory-dir", str(memory))
    assert table.returncode == 0, table.stderr
    assert "memory tier" in table.stdout and "own" in table.stdout, table.stdout


def test_plan_uses_the_measured_memory_costs(saved: tuple[Path, Path]) -> None:
    root, memory = saved
    proc = dckpt_cli("plan", str(root), "--memory-dir", str(memory), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    restore = json.loads((memory / "node-0" / "last-restore.json").read_text())
    assert restore["step"] == 3 and restore["seconds"] > 0, restore
    assert doc["memory"]["inputs"]["restore_s"] == pytest.approx(restore["seconds"])
    rto = doc["memory"]["plan"]["rto_s"]
    assert rto == pytest.approx(restore["seconds"] + doc["memory"]["inputs"]["restart_s"])
    assert doc["memory"]["inputs"]["commit_s"] > 0, doc
    text = dckpt_cli("plan", str(root), "--memory-dir", str(memory)).stdout
    assert "memory tier (measured on this host" in text and "restore measured" in text, text


def test_memory_clear_frees_this_hosts_memory_and_the_records(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    """Runs last in this module (it empties what the others read): the memory directory goes,
    and with ``--records`` the root's ledger too, after which ``ls`` shows no memory tier."""
    root, memory = saved
    held = sum(p.stat().st_size for p in memory.rglob("*") if p.is_file())
    proc = dckpt_cli("memory", "clear", str(root), "--memory-dir", str(memory), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["freed_bytes"] == held and doc["records_removed"] == [], doc
    assert not memory.exists()
    listed = json.loads(dckpt_cli("ls", str(root), "--memory-dir", str(memory), "--json").stdout)
    kept = [r for r in listed if r["tier"] == "memory"]
    assert [(r["step"], r["copy"]) for r in kept] == [(3, "not on this host")], kept
    proc = dckpt_cli("memory", "clear", str(root), "--memory-dir", str(memory), "--records")
    assert proc.returncode == 0, proc.stderr
    assert "removed the records of memory steps [3]" in proc.stdout, proc.stdout
    listed = json.loads(dckpt_cli("ls", str(root), "--memory-dir", str(memory), "--json").stdout)
    assert [r for r in listed if r["tier"] == "memory"] == [], listed
