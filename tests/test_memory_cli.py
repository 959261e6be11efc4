"""The memory tier as the command line shows it: ``dckpt ls`` lists it next to the durable
tier (table and ``--json``), ``dckpt plan`` plans it from its measured save and restore costs.

One process, no process group: a manager with the memory tier saves to both tiers, resumes
from memory (which records the restore's cost), then the real ``dckpt`` command reads it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dckpt
from dckpt.tiers.keeper_client import KeeperClient, read_keeper_file
from tests.conftest import dckpt_cli


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    tmp = tmp_path_factory.mktemp("memory_cli")
    root, memory = tmp / "ckpt", tmp / "mem"
    net = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(net.parameters())
    state = dckpt.TrainState(net, opt)
    config = dckpt.CheckpointConfig(root=root, memory=True, memory_dir=memory)
    logging.getLogger("dckpt").setLevel(logging.WARNING)
    try:
        with dckpt.CheckpointManager(config, state) as mgr:
            mgr.save(2).result()
            mgr.save(3, tier="memory").result()
        with dckpt.CheckpointManager(config, state) as mgr:
            report = mgr.resume()
            assert report.step == 3 and "memory tier" in report.origin, report.format()
        yield root, memory
    finally:
        found = read_keeper_file(memory / "node-0")
        if found is not None:
            KeeperClient(f"{found['host']}:{found['port']}").stop(drop=True)


def test_ls_lists_the_memory_tier_next_to_the_durable_one(saved: tuple[Path, Path]) -> None:
    root, memory = saved
    proc = dckpt_cli("ls", str(root), "--memory-dir", str(memory), "--json")
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)
    durable = [r for r in records if r["tier"] == "durable"]
    kept = [r for r in records if r["tier"] == "memory"]
    assert [r["step"] for r in durable] == [2], records
    assert [(r["step"], r["node"], r["copy"]) for r in kept] == [(3, 0, "own")], records
    assert kept[0]["files"] == 1 and kept[0]["bytes"] > 64 * 64 * 4, kept
    assert kept[0]["keeper"].startswith("keeper pid") and kept[0]["keeper"].endswith(" up")
    table = dckpt_cli("ls", str(root), "--memory-dir", str(memory))
    assert table.returncode == 0, table.stderr
    assert "memory tier on this host" in table.stdout and "own" in table.stdout, table.stdout


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
