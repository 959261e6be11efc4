"""The frozen fixture checkpoints (tests/fixtures/format1/) load bit for bit.

Written once by dckpt 0.1.0 with torch 2.13 (tests/fixtures/make_fixtures.py says how and
what they hold): DDP and FSDP2, fp32, bf16 autocast, and fp16 with a GradScaler (a
ShardedGradScaler under FSDP2). Each is resumed through ``CheckpointManager.resume`` on the
two gloo ranks that wrote it (one world for all of them), and every tensor of the model and
optimizer (gathered whole), the scheduler, the scaler, the data position, the counters, each
rank's ``PerRank`` value and the next draws of each rank's generators must equal the record
made at save time. A later format change must keep reading them, or bump
``schema_version`` and refuse them clearly (never regenerate them to make this pass).
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch
from dist_harness import run_world
from fixtures import make_fixtures as fx

from dckpt.root.manifest import SCHEMA_VERSION, read_manifest

pytestmark = pytest.mark.multiproc

NAMES = sorted(fx.KINDS)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every fixture resumed from a private copy (a resume writes into its root), on 2 ranks
    in one world: per rank, {name: outcome}."""
    copy = tmp_path_factory.mktemp("fixtures") / "format1"
    shutil.copytree(fx.FORMAT_DIR, copy)
    results: list[dict[str, Any]] = run_world(
        fx.check_world, fx.WORLD_SIZE, str(copy), NAMES, timeout=240
    )
    return results


def test_every_fixture_is_committed_small_and_of_format_1() -> None:
    assert fx.fixture_names(fx.FORMAT_DIR) == NAMES
    total = 0
    for name in NAMES:
        root = fx.FORMAT_DIR / name
        steps = sorted(p.name for p in root.iterdir() if p.is_dir())
        assert steps == [f"step-{fx.STEP:08d}"], steps
        manifest = read_manifest(root / steps[0])
        assert manifest.schema_version == SCHEMA_VERSION == 1
        assert manifest.world_size == fx.WORLD_SIZE
        assert manifest.versions["torch"].startswith("2.13."), manifest.versions
        size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        assert size < 400_000, f"{name} is {size} bytes: keep fixtures small"
        total += size
        expected = json.loads((fx.FORMAT_DIR / f"{name}.expected.json").read_text())
        assert expected["written_by"]["torch"] == manifest.versions["torch"]
        assert len(expected["tensors"]) >= 20 and len(expected["ranks"]) == fx.WORLD_SIZE
    assert total < 3_000_000


@pytest.mark.parametrize("name", NAMES)
def test_fixture_resumes_bit_for_bit(loaded: list[dict[str, Any]], name: str) -> None:
    for rank, per_rank in enumerate(loaded):
        outcome = per_rank[name]
        assert outcome["error"] is None, f"rank {rank}: {outcome['error']}"
        assert outcome["ok"], f"rank {rank}: " + "\n".join(outcome["mismatches"])
        assert outcome["tensors"] >= 20
    report = loaded[0][name]["report"]
    assert f"dckpt resume: step {fx.STEP} from" in report
    assert "rng           restored on every rank (python, numpy, torch)" in report
    written = json.loads((fx.FORMAT_DIR / f"{name}.expected.json").read_text())["written_by"]
    same = written["torch"].partition("+")[0] == str(torch.__version__).partition("+")[0]
    # The same release is quiet; another one (make compat runs this under torch 2.14) warns.
    assert ("warning: written by torch" in report) is not same, report
    if name.endswith("scaler"):
        assert "[ok  ] grad scaler: scale 8192" in report


def test_the_comparison_names_every_difference() -> None:
    """What the bit-for-bit test rests on: a changed digest, a missing tensor, an extra one,
    and a changed value are each named; an optimizer default a later torch adds is not."""
    want = {"a": {"sha256": "1"}, "b": {"sha256": "2"}, "v": [1, {"lr": 0.5}]}
    got = {"a": {"sha256": "x"}, "c": {"sha256": "3"}, "v": [1, {"lr": 0.25}]}
    out: list[str] = []
    fx._compare("t", want, got, out)
    assert out == [
        "t.a.sha256: expected '1', got 'x'",
        "t.b: missing after the load",
        "t.c: not in the fixture's record",
        "t.v[1].lr: expected 0.5, got 0.25",
    ]
    lenient: list[str] = []
    fx._compare("v", {"g": [{"lr": 1}]}, {"g": [{"lr": 1, "new_default": False}]}, lenient, True)
    assert lenient == []
