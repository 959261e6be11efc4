"""read_config and peek: what a checkpoint says about itself, from its manifest alone, without
torch, and errors that say what there is instead.

One process, a tiny model: a root with steps 1 and 2, saved with different run configs, built
once per module.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dckpt.errors import CheckpointNotFoundError, IntegrityError, ManifestError
from dckpt.root.manifest import read_manifest
from dckpt.root.peek import CheckpointInfo, peek, read_config

CONFIG_1 = {"lr": 0.1, "model": {"width": 3, "depth": 1}, "name": "tiny"}
CONFIG_2 = {"lr": 0.05, "model": {"width": 3, "depth": 1}, "name": "tiny"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step 1 (config 1, epoch 0), step 2 (config 2, epoch 1, milestone, metric 0.25)."""
    import torch
    from torch import nn

    import dckpt

    base = tmp_path_factory.mktemp("peek") / "ckpt"
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    state = dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with dckpt.CheckpointManager(base, state, run_config=CONFIG_1) as mgr:
        mgr.save(1).result()
    with dckpt.CheckpointManager(base, state, run_config=CONFIG_2) as mgr:
        mgr.observe(2.5)
        mgr.save(2, epoch=1, milestone=True, metric=0.25).result()
    return base


@pytest.fixture
def root_copy(root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(root, dst)
    return dst


def test_read_config_is_the_newest_steps_or_the_one_asked_for(root: Path) -> None:
    assert read_config(root) == CONFIG_2
    assert read_config(str(root), step=1) == CONFIG_1
    assert read_config(root, 2) == CONFIG_2


def test_peek_reports_the_manifest(root: Path) -> None:
    info = peek(root)
    assert isinstance(info, CheckpointInfo)
    step_dir = root / "step-00000002"
    manifest = read_manifest(step_dir)
    listed = [p for p in step_dir.iterdir() if p.name != "manifest.json"]
    assert (info.step, info.epoch, info.world_size, info.path) == (2, 1, 1, step_dir)
    assert info.files == len(listed) >= 2  # .metadata and a shard
    assert info.bytes == sum(p.stat().st_size for p in listed)
    assert info.config == CONFIG_2 and info.milestone is True
    assert info.metric == manifest.metric and 0.25 in info.metric.values()
    assert info.loss == manifest.loss and info.loss  # observed before the save
    assert {"model", "optimizer", "progress", "rng"} <= set(info.state)
    assert info.run_id == manifest.run_id != ""
    assert "torch" in info.versions and "dckpt" in info.versions
    assert info.precision == manifest.precision
    assert abs(time.time() - info.created_at) < 3600
    older = peek(root, step=1)
    assert (older.step, older.epoch, older.milestone, older.config) == (1, 0, False, CONFIG_1)
    with pytest.raises(AttributeError):
        info.step = 3  # type: ignore[misc]  # frozen


def test_a_missing_root_or_an_empty_one_is_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as exc:
        read_config(missing)
    assert str(missing) in str(exc.value) and "dckpt ls" in str(exc.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint") as exc:
        peek(tmp_path / "empty")
    assert "dckpt ls" in str(exc.value)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="is not a directory"):
        peek(tmp_path / "a-file")
    # A save in flight is not committed: its config is not read.
    (tmp_path / "empty" / f"step-00000003.tmp-{'a' * 32}").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        peek(tmp_path / "empty")


def test_a_step_not_committed_names_the_committed_ones(root: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError) as exc:
        read_config(root, step=5)
    assert "step 5" in str(exc.value) and "committed: 1, 2" in str(exc.value)
    # Many steps: the first and last few, and how many (the manifests are never read here).
    many = tmp_path / "many"
    for step in range(1, 21):
        (many / f"step-{step:08d}").mkdir(parents=True)
        (many / f"step-{step:08d}" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError) as exc:
        peek(many, step=99)
    assert "committed: 1, 2, 3, 4, ..., 17, 18, 19, 20; 20 in all" in str(exc.value)


def test_a_damaged_manifest_raises_and_never_falls_back(root_copy: Path) -> None:
    manifest = root_copy / "step-00000002" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"lr": 0.05', '"lr": 0.06'))  # parses; self-digest fails
    with pytest.raises(IntegrityError, match="self-digest"):
        read_config(root_copy)
    manifest.write_text(text[:-20])
    with pytest.raises(ManifestError, match="not valid JSON"):
        peek(root_copy)
    assert read_config(root_copy, step=1) == CONFIG_1  # the older one, when asked for


def test_a_manifest_in_another_steps_directory_is_refused(root_copy: Path) -> None:
    moved = root_copy / "step-00000007"
    moved.mkdir()
    shutil.copy(root_copy / "step-00000001" / "manifest.json", moved / "manifest.json")
    with pytest.raises(ManifestError, match="says step 1, its directory says 7"):
        read_config(root_copy)


def test_only_the_manifest_is_read_not_the_shards(root_copy: Path) -> None:
    step_dir = root_copy / "step-00000002"
    for shard in step_dir.glob("*.distcp"):
        shard.write_bytes(b"not a shard")  # `dckpt verify` and every load would refuse these
    assert peek(root_copy).config == CONFIG_2


def test_peek_runs_without_importing_torch(root: Path) -> None:
    code = (
        "import sys\n"
        "from dckpt.root.peek import peek, read_config\n"
        f"info = peek({str(root)!r})\n"
        f"assert read_config({str(root)!r}, step=1)['lr'] == 0.1\n"
        "print(info.step, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(" ", 1) == ["2", "[]\n"], proc.stdout
