"""The `dckpt` command on real checkpoints from a 2-rank run: output contract and exit codes."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import dckpt_cli


def flip_bit(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_ls_json_lists_committed_checkpoints(trained_root: Path) -> None:
    proc = dckpt_cli("ls", str(trained_root), "--json")
    assert proc.returncode == 0, proc.stderr
    records = json.loads(proc.stdout)
    assert [r["step"] for r in records] == [4, 8, 12]
    for r in records:
        assert r["status"] == "committed"
        assert isinstance(r["step"], int) and isinstance(r["bytes"], int) and r["bytes"] > 0
        assert r["milestone"] is False
        assert Path(r["path"]).name == f"step-{r['step']:08d}"


def test_ls_reports_incomplete_and_quarantined(trained_copy: Path) -> None:
    (trained_copy / f"step-00000016.tmp-{'a' * 32}").mkdir()
    (trained_copy / "quarantine").mkdir()
    os.rename(trained_copy / "step-00000004", trained_copy / "quarantine" / "step-00000004")
    records = json.loads(dckpt_cli("ls", str(trained_copy), "--json").stdout)
    assert [(r["step"], r["status"]) for r in records] == [
        (4, "quarantined"),
        (8, "committed"),
        (12, "committed"),
        (16, "incomplete"),
    ]
    human = dckpt_cli("ls", str(trained_copy))
    assert human.returncode == 0 and "incomplete" in human.stdout


def test_verify_ok_then_bitflip_names_the_file(trained_copy: Path) -> None:
    ok = dckpt_cli("verify", str(trained_copy))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("OK") == 3
    shard = trained_copy / "step-00000008" / "__1_0.distcp"
    flip_bit(shard)
    bad = dckpt_cli("verify", str(trained_copy))
    assert bad.returncode == 3
    assert str(shard) in bad.stdout and "digest mismatch" in bad.stdout
    assert dckpt_cli("verify", str(trained_copy), "--step", "12").returncode == 0
    js = json.loads(dckpt_cli("verify", str(trained_copy), "--json").stdout)
    assert js["ok"] is False
    failed = [c for c in js["checkpoints"] if not c["ok"]]
    assert [c["step"] for c in failed] == [8]
    assert failed[0]["problems"][0]["path"] == str(shard)


def test_verify_catches_truncation_missing_file_and_bad_manifest(trained_copy: Path) -> None:
    shard = trained_copy / "step-00000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    (trained_copy / "step-00000008" / ".metadata").unlink()
    (trained_copy / "step-00000012" / "manifest.json").write_text("{not json")
    proc = dckpt_cli("verify", str(trained_copy), "--json")
    assert proc.returncode == 3
    by_path = {c["path"]: c for c in json.loads(proc.stdout)["checkpoints"]}
    assert "size mismatch" in by_path[str(trained_copy / "step-00000004")]["problems"][0]["error"]
    assert "missing" in by_path[str(trained_copy / "step-00000008")]["problems"][0]["error"]
    assert "not valid JSON" in by_path[str(trained_copy / "step-00000012")]["problems"][0]["error"]
    # ls still lists the damaged one, flagged; inspect refuses it with exit 3.
    ls = json.loads(dckpt_cli("ls", str(trained_copy), "--json").stdout)
    assert ls[-1]["status"] == "committed" and "not valid JSON" in ls[-1]["error"]
    assert dckpt_cli("inspect", str(trained_copy), "--step", "12").returncode == 3


def test_inspect_json_has_contract_fields(trained_root: Path) -> None:
    proc = dckpt_cli("inspect", str(trained_root), "--json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["step"] == 12 and obj["world_size"] == 2
    assert set(obj["state"]) == {"model", "optimizer", "scheduler", "data", "progress", "rng"}
    assert obj["precision"]["mode"] == "bf16" and obj["loss"]["n"] > 0
    paths = {f["path"] for f in obj["files"]}
    assert paths == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    step_dir = trained_root / "step-00000012"
    for f in obj["files"]:
        assert f["bytes"] == (step_dir / f["path"]).stat().st_size
        assert f["digest"].startswith("xxh3_128:")
    assert obj["config"]["steps"] == 12
    older = json.loads(dckpt_cli("inspect", str(trained_root), "--step", "4", "--json").stdout)
    assert older["step"] == 4
    human = dckpt_cli("inspect", str(trained_root))
    assert human.returncode == 0 and "__1_0.distcp" in human.stdout


def test_usage_errors_exit_2_with_a_reason(trained_root: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    for cmd in ("ls", "verify", "inspect"):
        proc = dckpt_cli(cmd, str(missing))
        assert proc.returncode == 2 and "does not exist" in proc.stderr
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert dckpt_cli("ls", str(a_file)).returncode == 2
    proc = dckpt_cli("verify", str(trained_root), "--step", "5")
    assert proc.returncode == 2 and "no committed checkpoint for step 5" in proc.stderr
    assert dckpt_cli("inspect", str(tmp_path)).returncode == 2  # a dir with no checkpoints
    assert dckpt_cli("verify").returncode == 2  # argparse usage error
    assert dckpt_cli("frobnicate", str(trained_root)).returncode == 2
