"""The `dckpt` command on real checkpoints from a 2-rank run: output contract and exit codes."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import dckpt_cli, dckpt_cli_here


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
    # each save compared what it wrote with the state at save() (the capture check)
    assert ok.stdout.count("tensors compared at save() with the bytes written") == 3
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
    shards = {"__0_0.distcp", "__1_0.distcp"}
    assert paths == {".metadata"} | shards | {f"{s}.items" for s in shards}
    step_dir = trained_root / "step-00000012"
    for f in obj["files"]:
        assert f["bytes"] == (step_dir / f["path"]).stat().st_size
        assert f["digest"].startswith("xxh3_128:")
    assert obj["config"]["steps"] == 12
    older = json.loads(dckpt_cli("inspect", str(trained_root), "--step", "4", "--json").stdout)
    assert older["step"] == 4
    assert obj["capture"]["items"] > 0 and "uncompared" not in obj["capture"]
    human = dckpt_cli("inspect", str(trained_root))
    assert human.returncode == 0 and "__1_0.distcp" in human.stdout
    captured = f"{obj['capture']['items']} tensors compared at save() with the bytes written"
    assert captured in human.stdout


def test_inspect_prints_the_config_one_key_per_line(trained_root: Path) -> None:
    proc = dckpt_cli("inspect", str(trained_root), "--step", "8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("  config "))
    config = json.loads(dckpt_cli("inspect", str(trained_root), "--json").stdout)["config"]
    shown = [line.strip().removeprefix("config").strip() for line in lines[first:][: len(config)]]
    assert shown == [f"{k} = {json.dumps(config[k])}" for k in sorted(config)]
    assert "steps = 12" in shown and 'parallel = "ddp"' in shown


def test_inspect_config_lines_flatten_nested_dicts() -> None:
    from dckpt.cli.common import plural
    from dckpt.cli.reading import _config_lines

    nested = {"opt": {"betas": [0.9, 0.95], "sched": {"kind": "cos"}}, "lr": 0.1, "tags": {}}
    assert sorted(_config_lines(nested)) == [
        ("lr", "0.1"),
        ("opt.betas", "[0.9, 0.95]"),
        ("opt.sched.kind", '"cos"'),
        ("tags", "{}"),
    ]
    assert [plural(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]


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


def test_every_command_is_listed(trained_root: Path) -> None:
    helptext = dckpt_cli("--help").stdout
    for cmd in ("ls", "verify", "inspect", "diff", "gc", "plan", "export", "pin", "unpin"):
        assert cmd in helptext
    verify_help = dckpt_cli("verify", "--help").stdout
    assert "ROOT [--step N | --all]; default: every committed step" in verify_help
    not_root = trained_root.parent / "not-a-root"
    not_root.mkdir(exist_ok=True)
    proc = dckpt_cli("ls", str(not_root))
    assert proc.returncode == 2 and "is not a dckpt checkpoint root" in proc.stderr


def test_diff_reports_config_and_tensor_differences(trained_root: Path) -> None:
    root = str(trained_root)
    # The first as the installed command (a process that imports torch: 2 to 3 CPU-seconds),
    # the others in this process (dckpt_cli_here: the same code, torch loaded once) meanwhile.
    with ThreadPoolExecutor(1) as pool:
        command = pool.submit(dckpt_cli, "diff", root, "4", "12", "--json")
        runs = [
            dckpt_cli_here("diff", root, "8", "8", "--json"),
            dckpt_cli_here("diff", root, "4", "8", "--top", "3"),
            dckpt_cli_here("diff", root, "4", "5"),
        ]
    proc = command.result()
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert obj["config"] == []  # one run: the same config
    by_name = {r["name"]: r for r in obj["differences"]}
    weight = by_name["model.head.weight"]
    assert weight["status"] == "changed" and weight["max_abs_diff"] > 0
    assert by_name["progress.step"]["status"] == "4 -> 12"
    # Ranked: model weights (largest first), then optimizer moments, then counters and
    # scalars, though an optimizer step counter (4 -> 12: max |a-b| 8) dwarfs any weight's.
    names = [r["name"] for r in obj["differences"]]
    tiers = [0 if n.startswith("model.") else 1 if _is_moment(n) else 2 for n in names]
    assert tiers == sorted(tiers) and tiers[0] == 0 and 1 in tiers, names
    model = [r["max_abs_diff"] for r in obj["differences"] if r["name"].startswith("model.")]
    assert model == sorted(model, reverse=True)
    counter = by_name["optimizer.state.head.weight.step"]
    assert counter["max_abs_diff"] == 8.0 and names.index(counter["name"]) > len(model)
    same = json.loads(runs[0].stdout)
    assert same["differences"] == [] and same["tensors_compared"] > 10
    human = runs[1].stdout
    assert "largest differences first" in human and "more rows not shown" in human
    shown = [line.split("│")[1].strip() for line in human.splitlines() if "│ changed" in line]
    assert len(shown) == 3 and all(n.startswith("model.") for n in shown), human
    assert runs[2].returncode == 2


def _is_moment(name: str) -> bool:
    return name.startswith("optimizer.state.") and not name.endswith(".step")


def test_diff_ranks_structural_changes_first_within_each_tier() -> None:
    from dckpt.cli.tensors import rank_rows

    rows: list[dict[str, Any]] = [
        {"name": "progress.step", "status": "4 -> 12", "max_abs_diff": None},
        {"name": "optimizer.state.w.step", "status": "changed", "max_abs_diff": 8.0},
        {"name": "optimizer.state.w.exp_avg", "status": "changed", "max_abs_diff": 0.1},
        {"name": "model.b", "status": "changed", "max_abs_diff": 0.01},
        {"name": "model.w", "status": "changed", "max_abs_diff": 0.02},
        {"name": "model.new", "status": "only in B", "max_abs_diff": None},
        {"name": "rng.rank_0.torch", "status": "changed", "max_abs_diff": 1.0},
    ]
    assert [r["name"] for r in rank_rows(rows)] == [
        "model.new",
        "model.w",
        "model.b",
        "optimizer.state.w.exp_avg",
        "progress.step",
        "optimizer.state.w.step",
        "rng.rank_0.torch",
    ]


def test_export_writes_the_model_alone_and_loads_back(trained_root: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    out_file = tmp_path / "model.safetensors"
    bf16 = tmp_path / "model.pt"
    # The plain export as the installed command (a process that imports torch), the bf16
    # one in this process meanwhile (dckpt_cli_here: torch is loaded once); different files.
    with ThreadPoolExecutor(1) as pool:
        plain = pool.submit(
            dckpt_cli, "export", str(trained_root), "--step", "12", "--out", str(out_file)
        )
        small_export = dckpt_cli_here(
            "export", str(trained_root), "--out", str(bf16), "--dtype", "bf16"
        )
    proc = plain.result()
    assert proc.returncode == 0, proc.stderr
    tensors = load_file(str(out_file))
    assert "head.weight" in tensors and not any(k.startswith("optimizer") for k in tensors)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert small_export.returncode == 0, small_export.stderr
    small = torch.load(bf16, weights_only=True)
    assert small["head.weight"].dtype == torch.bfloat16
    assert torch.equal(small["head.weight"], tensors["head.weight"].to(torch.bfloat16))
    assert dckpt_cli_here("export", str(trained_root), "--out", str(bf16)).returncode == 2  # exists


def test_export_with_config_stores_the_run_config_and_step(
    trained_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (torch is loaded already): the plain export runs as a command above."""
    import torch
    from safetensors import safe_open

    from dckpt.cli import main

    config = json.loads(dckpt_cli("inspect", str(trained_root), "--json").stdout)["config"]
    st = tmp_path / "model.safetensors"
    args = ["export", str(trained_root), "--step", "8", "--with-config", "--out"]
    assert main([*args, str(st)]) == 0
    with safe_open(str(st), "pt") as f:
        meta = f.metadata()
        head = f.get_tensor("head.weight")
    assert meta["dckpt_step"] == "8" and json.loads(meta["dckpt_config"]) == config
    assert meta["dckpt_config"] == json.dumps(config, sort_keys=True)
    pt = tmp_path / "model.pt"
    assert main([*args, str(pt)]) == 0
    saved = torch.load(pt, weights_only=True)
    assert set(saved) == {"model", "config", "step"}
    assert saved["step"] == 8 and saved["config"] == config
    assert torch.equal(saved["model"]["head.weight"], head)
    assert "with the run config" in capsys.readouterr().out
    assert not list(tmp_path.glob(".*.tmp-*"))  # written beside, then renamed into place


def test_plan_matches_a_hand_computation_of_young_daly() -> None:
    import math

    args = ["plan", "--bytes", str(10**11), "--write-gbps", "2", "--read-gbps", "4",
            "--stall-s", "3", "--restart-s", "120", "--mtbf-hours", "1000", "--nodes", "50",
            "--keep-last", "3", "--milestones", "2", "--host-mem-gb", "512", "--json"]  # fmt: skip
    proc = dckpt_cli(*args)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)["plan"]
    mtbf = 1000 * 3600 / 50  # 72 000 s for the job
    tau = math.sqrt(2 * 3 * mtbf)  # Young-Daly: sqrt(2 * delta * M) = 657.3 s
    commit = 10**11 / 2e9  # 50 s to write the checkpoint
    rto = 10**11 / 4e9 + 120  # 145 s
    assert math.isclose(got["job_mtbf_s"], mtbf)
    assert math.isclose(got["interval_s"], tau) and round(tau, 1) == 657.3
    assert math.isclose(got["expected_work_lost_s"], tau / 2 + commit)
    assert math.isclose(got["rto_s"], rto)
    assert math.isclose(got["overhead_fraction"], 3 / tau + (tau / 2 + commit + rto) / mtbf)
    assert got["storage_bytes"] == 10**11 * 6
    assert got["staging_bytes_per_node"] == 2 * 10**9 and got["staging_fits"]
    assert dckpt_cli("plan").returncode == 2  # nothing to plan from
