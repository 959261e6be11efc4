"""Incremental saves (issue 30): a frozen backbone is written once and linked by later saves,
and every step still verifies, resumes bit-exact and fails loudly when the shared bytes rot.

The job is the issue's: 2 DDP ranks, 4 x Linear(512, 512) frozen, a Linear(512, 8) head under
AdamW, a save at every step. The writer-level tests run DCP in this process (no ranks)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import run_world

from dckpt.cli import main
from dckpt.errors import ManifestError
from dckpt.root.directory import disk_bytes
from dckpt.root.manifest import Manifest, parse_manifest, read_manifest
from dckpt.storage import HashingWriter
from dckpt.storage.direct_file import open_for_write
from dckpt.storage.item_digests import parse_items
from dckpt.storage.records import FileRecord
from dckpt.storage.stable_file import StableBase, prehash, stable_name

STEPS = 4
FROZEN = 4 * (512 * 512 + 512) * 4
"""The frozen backbone's bytes."""
TRAINABLE = (512 * 8 + 8) * 4
"""The head's bytes; AdamW keeps two moments of each."""
BOUND = 1.25 * 3 * TRAINABLE + (256 << 10)
"""The issue's bound on what a save adds once the backbone is written."""


def _job(rank: int, world: int, root: str, phase: str, config: dict[str, Any]) -> dict[str, Any]:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import dckpt

    torch.manual_seed(0)
    body = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)], nn.Linear(512, 8))
    for layer in list(body)[:4]:
        layer.requires_grad_(False)
    model = DistributedDataParallel(body)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = dckpt.CheckpointConfig(root=Path(root), async_save=True, timeout_s=60, **config)
    state = dckpt.TrainState(model, opt)
    added: list[int] = []
    with dckpt.CheckpointManager(cfg, state) as mgr:
        if phase == "resume":
            report = mgr.resume()
            return {"step": report.step, "state": _digests(model, opt)}
        steps = [10, 20, 30] if phase == "rollback" else range(1, STEPS + 1)
        for step in steps:
            gen = torch.Generator().manual_seed(step * 10 + rank)
            model(torch.randn(16, 512, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            before = disk_bytes(Path(root))
            mgr.save(step)
            mgr.wait()
            added.append(disk_bytes(Path(root)) - before)
        if phase == "rollback":  # back to 10, on from there: 20 and 30 are a dropped branch
            mgr.load(10)
            mgr.save(11)
            mgr.wait()
    return {"added": added, "state": _digests(model, opt)}


def _digests(model: Any, opt: Any) -> dict[str, str]:
    from dckpt.storage.digest import new_hasher

    out = {}
    tensors = {**dict(model.named_parameters()), **{
        f"opt.{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()
    }}  # fmt: skip
    for name, t in tensors.items():
        h = new_hasher("xxh3_128")
        h.update(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def _inode(path: Path) -> int:
    return path.stat().st_ino


def test_a_frozen_backbone_is_written_once_and_every_step_verifies_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    saved = run_world(_job, 2, str(root), "save", {"incremental_copies": 1})  # one shared copy
    step = {s: root / f"step-{s:08d}" for s in range(1, STEPS + 1)}
    stable = sorted(p.name for p in step[1].glob("*stable.distcp"))
    assert stable, sorted(os.listdir(step[1]))  # DDP: DCP put the backbone in some rank's file
    # From the second save on, each adds at most 1.25 x (the head and its two moments) + 256 KiB
    assert saved[0]["added"][0] > FROZEN  # the first save wrote the backbone
    assert all(a <= BOUND for a in saved[0]["added"][1:]), (saved[0]["added"], BOUND)
    for s in range(2, STEPS + 1):
        for name in stable:  # the same inode: linked, not copied
            assert _inode(step[s] / name) == _inode(step[1] / name)
        assert read_manifest(step[s]).incremental["reused"] == {
            f: 1 for f in (*stable, *(n + ".items" for n in stable))
        }
    assert "model.4.weight" in read_manifest(step[STEPS]).incremental["trainable"]
    assert "model.0.weight" not in read_manifest(step[STEPS]).incremental["trainable"]
    # ls shows the shared bytes; gc deletes the step that first wrote them; all still verify
    assert main(["ls", str(root)]) == 0
    assert "shared" in capsys.readouterr().out
    assert main(["gc", str(root), "--keep-last", "2"]) == 0
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert main(["verify", str(root)]) == 0
    # inspect says what was linked; export --trainable writes the head alone, by name
    capsys.readouterr()
    assert main(["inspect", str(root), "--step", "4"]) == 0
    assert "linked, not written" in capsys.readouterr().out
    adapter = tmp_path / "adapter.pt"
    assert main(["export", str(root), "--trainable", "--out", str(adapter)]) == 0
    head = torch.load(adapter, weights_only=True)
    assert sorted(head) == ["4.bias", "4.weight"]
    fixture = Path(__file__).parent / "fixtures" / "format1" / "ddp-fp32"
    refused = main(["export", str(fixture), "--trainable", "--out", str(tmp_path / "x.pt")])
    assert refused == 2 and "without --trainable" in capsys.readouterr().err
    # The resume is bit-exact: every parameter and moment, on both ranks
    resumed = run_world(_job, 2, str(root), "resume", {"incremental_copies": 1})
    for r, s in zip(resumed, saved, strict=True):
        assert r["step"] == STEPS and r["state"] == s["state"]
    # and resharded, 2 ranks to 1: the linked files read like any other
    alone = run_world(_job, 1, str(root), "resume", {"incremental_copies": 1})
    assert alone[0]["step"] == STEPS and alone[0]["state"] == saved[0]["state"]
    # A flipped bit in the shared backbone fails every step that links it, naming the file
    data = bytearray((step[STEPS] / stable[0]).read_bytes())
    data[len(data) // 2] ^= 0x10
    with open(step[STEPS] / stable[0], "r+b") as f:  # in place: the one inode both steps share
        f.write(data)
    capsys.readouterr()
    for s in (3, 4):
        assert main(["verify", str(root), "--step", str(s)]) == 3
        said = capsys.readouterr()
        assert f"step-{s:08d}" in said.out and stable[0] in said.out + said.err


def _inodes(root: Path) -> list[int]:
    name = next(root.glob("step-00000001/*stable.distcp")).name
    return [_inode(root / f"step-{s:08d}" / name) for s in range(1, STEPS + 1)]


def test_by_default_two_copies_alternate_and_a_bad_one_leaves_the_step_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``incremental_copies=2`` (the default): consecutive steps never share the frozen
    file, so a flipped bit in one copy fails every other step and the one before the newest
    still verifies; ``full_every`` bounds how many steps one copy serves."""
    root = tmp_path / "root"
    run_world(_job, 2, str(root), "save", {})
    a, b, a2, b2 = _inodes(root)
    assert a == a2 != b == b2, (a, b, a2, b2)
    name = next(root.glob("step-00000001/*stable.distcp")).name
    with open(root / "step-00000003" / name, "r+b") as f:  # in place: steps 1 and 3's copy
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    for s, rc in ((1, 3), (2, 0), (3, 3), (4, 0)):
        assert main(["verify", str(root), "--step", str(s)]) == rc, s
    capsys.readouterr()
    # After a rollback to 10, the dropped branch (20, 30) is not linked from: step 11 writes
    # afresh (linking 20's copy recorded an origin after the step: a manifest no reader took)
    back = tmp_path / "rollback"
    run_world(_job, 2, str(back), "rollback", {})
    eleven = back / "step-00000011"
    assert "reused" not in read_manifest(eleven).incremental
    assert _inode(eleven / name) != _inode(back / "step-00000010" / name)
    assert main(["verify", str(back)]) == 0
    other = tmp_path / "every"
    run_world(_job, 2, str(other), "save", {"incremental_copies": 1, "full_every": 2})
    a, a2, c, c2 = _inodes(other)
    assert a == a2 != c == c2, (a, a2, c, c2)  # two steps per copy, then a fresh one


# --- the writer, in this process ------------------------------------------------------------


def _state() -> dict[str, Any]:
    torch.manual_seed(1)
    # a view of a larger storage (parameters carved from one flat buffer): the writer saves
    # a clone of its own bytes, and so must the pre-hash
    frozen = torch.randn(128, 64)[:64]
    return {"model": {"frozen": frozen, "head": torch.randn(8)}, "n": 3}


KEYS = frozenset({"model.frozen"})


def _save(directory: Path, sd: dict[str, Any], base: StableBase | None = None) -> HashingWriter:
    writer = HashingWriter(directory, stable_keys=KEYS, base=base, direct=False)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    return writer


def _base(writer: HashingWriter, directory: Path) -> StableBase:
    assert writer.stable is not None
    path = directory / writer.stable.name
    st = path.stat()
    return StableBase(writer.stable, path, (st.st_dev, st.st_ino), st.st_size, st.st_mtime_ns)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_writer_links_an_unchanged_stable_file_and_writes_a_changed_one(
    tmp_path: Path,
) -> None:
    sd = _state()
    first = _save(tmp_path / "a", sd)
    base = _base(first, tmp_path / "a")
    assert first.stable is not None and not first.stable.reused
    # The pre-hash is the writer's own segment digest (a small item: the sidecar has it)
    items = parse_items(
        (tmp_path / "a" / f"{stable_name('__0_')}.items").read_bytes(),
        stable_name("__0_"), base.size, "test",
    )  # fmt: skip
    from torch.utils.serialization import config as serialization_config

    with serialization_config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
        digest, length = prehash(sd["model"]["frozen"], "xxh3_128").split("/")
    assert items.digests == (digest.removeprefix("xxh3_128:"),) and int(length) == base.size
    sd["model"]["head"] += 1
    second = _save(tmp_path / "b", sd, base)
    assert second.stable is not None and second.stable.reused
    assert _inode(tmp_path / "b" / base.file.name) == base.inode[1]
    back = {"model": {"frozen": torch.zeros(64, 64), "head": torch.zeros(8)}, "n": 0}
    dcp.load(back, checkpoint_id=tmp_path / "b", no_dist=True)  # a plain DCP load reads it
    assert torch.equal(back["model"]["frozen"], sd["model"]["frozen"])
    assert torch.equal(back["model"]["head"], sd["model"]["head"]) and back["n"] == 3
    assert {r.path: r for r in second.records()}[base.file.name] == base.file.records[0]
    sd["model"]["frozen"][3, 3] += 1  # one changed element: written afresh
    third = _save(tmp_path / "c", sd, base)
    assert third.stable is not None and not third.stable.reused
    assert _inode(tmp_path / "c" / base.file.name) != base.inode[1]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_base_that_is_gone_or_replaced_is_written_afresh_leaving_no_link(
    tmp_path: Path,
) -> None:
    sd = _state()
    base = _base(_save(tmp_path / "a", sd), tmp_path / "a")
    os.rename(tmp_path / "a", tmp_path / "moved")  # quarantined, or deleted by gc
    gone = _save(tmp_path / "b", sd, base)
    assert gone.stable is not None and not gone.stable.reused
    (tmp_path / "moved").rename(tmp_path / "a")
    other = tmp_path / "a" / "other"  # the same name now holds another file of the same size
    other.write_bytes(base.path.read_bytes())
    os.replace(other, base.path)
    replaced = _save(tmp_path / "c", sd, base)
    assert replaced.stable is not None and not replaced.stable.reused
    assert _inode(tmp_path / "c" / base.file.name) != _inode(base.path)
    back = {"model": {"frozen": torch.zeros(64, 64), "head": torch.zeros(8)}, "n": 0}
    dcp.load(back, checkpoint_id=tmp_path / "c", no_dist=True)
    assert torch.equal(back["model"]["frozen"], sd["model"]["frozen"])


@pytest.mark.parametrize("direct", [True, False])
def test_the_writer_never_opens_an_existing_name(tmp_path: Path, direct: bool) -> None:
    path = tmp_path / "shared"
    path.write_bytes(b"a committed step's bytes")
    with pytest.raises(FileExistsError):
        open_for_write(path, direct=direct)
    assert path.read_bytes() == b"a committed step's bytes"


def _manifest(**incremental: Any) -> bytes:
    from dckpt.root.manifest import manifest_bytes

    rec = FileRecord(path="__0_stable.distcp", bytes=1, digest="xxh3_128:" + "0" * 32, rank=0)
    m = Manifest(
        step=5, world_size=1, files=(rec,), run_id="r", save_id="s", created_at=0.0,
        incremental=incremental,
    )  # fmt: skip
    return manifest_bytes(m)


def test_the_manifest_keeps_what_an_incremental_save_records_and_refuses_lies() -> None:
    good = {"trainable": ["model.head"], "reused": {"__0_stable.distcp": 2}}
    assert parse_manifest(_manifest(**good), "m").incremental == good
    assert b"incremental" not in _manifest()  # a save that records nothing: as before
    for bad, why in (
        ({"reused": {"elsewhere.distcp": 2}}, "not a listed file"),
        ({"reused": {"__0_stable.distcp": 6}}, "the step 6"),
        ({"trainable": "model.head"}, "list of strings"),
    ):
        with pytest.raises(ManifestError, match=why):
            parse_manifest(_manifest(**bad), "m")


def test_a_file_system_that_refuses_o_direct_after_creating_the_file_still_gets_it(
    tmp_path: Path,
) -> None:
    """ramfs (like FUSE, or tmpfs before Linux 6.6) creates the file, then refuses O_DIRECT
    with EINVAL: the buffered fallback must not then find its own file in the way (O_EXCL)."""
    import subprocess

    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], check=False).returncode:
        pytest.skip("cannot mount a ramfs here (needs root)")
    try:
        with open_for_write(mnt / "f", direct=True) as f:
            f.write(b"written buffered")
        assert (mnt / "f").read_bytes() == b"written buffered"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
