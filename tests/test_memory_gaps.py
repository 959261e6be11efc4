"""The memory tier's promises no other test held it to:

- a memory file whose header points past its end (or records a tensor in a length its shape
  does not have), re-sealed so that its digest matches the root's record: the resume calls
  it damage, names it, quarantines the record and falls back to the durable step, bit for
  bit; it never reads outside the file, crashes, or refuses the whole resume;
- the rollback guard's third case: a memory step whose anchor (``mesh.after``) the root no
  longer holds (deleted, quarantined) is not restored, and the report says why; when the
  anchor was the only durable step, the resume refuses rather than start from scratch;
- a memory save whose replica the partner cannot hold (its memory full: a real tmpfs) leaves
  the partner's replica of the step before whole, and a node that lost its memory gets that
  step back from it, bit for bit.

The first two run in one process (a one-rank world is a real memory save and resume); the
third on two gloo ranks, each its own node (``GROUP_RANK``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import struct
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from dist_harness import run_world
from test_memory_ledger import _manager  # the same one-process memory-tier manager

import dckpt
from dckpt.root.layout import committed_steps, step_dir_name
from dckpt.root.manifest import manifest_bytes, parse_manifest
from dckpt.storage.digest import hash_file

_HEAD = struct.Struct("<8sQ")  # a memory file's magic and header length (storage/memory_file)


def _bump(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    return {k: v.clone() for k, v in net.state_dict().items()}


def _same(want: dict[str, torch.Tensor], net: torch.nn.Module) -> bool:
    return all(torch.equal(want[k], v) for k, v in net.state_dict().items())


# --- a header that points past the end of its file ------------------------------------------


def _header_length_past_end(header: dict[str, Any], size: int) -> tuple[dict[str, Any], int]:
    return header, size + 1  # the u64 length field: one byte more than the whole file


def _tensor_past_end(header: dict[str, Any], size: int) -> tuple[dict[str, Any], int]:
    header["tensors"][0][4] = size  # model.weight's length: from its offset, past the end
    return header, -1


def _objects_past_end(header: dict[str, Any], size: int) -> tuple[dict[str, Any], int]:
    header["objects"][0] = size - 8  # the pickled values start 8 bytes before the end
    return header, -1


def _length_unlike_its_shape(header: dict[str, Any], size: int) -> tuple[dict[str, Any], int]:
    header["tensors"][0][4] -= 4  # inside the file, but not 16 x 16 float32s
    return header, -1


def _reseal(path: Path, record: Path, edit: Callable[..., tuple[dict[str, Any], int]]) -> None:
    """Rewrite ``path``'s header with ``edit`` and record the new bytes' digest in the
    ledger (``record``), as a writer with a bug or other hands with the root would: the
    file then proves against the root, and only its header can give it away."""
    data = bytearray(path.read_bytes())
    magic, length = _HEAD.unpack_from(data, 0)
    header, forced = edit(json.loads(data[_HEAD.size : _HEAD.size + length]), len(data))
    encoded = json.dumps(header).encode()
    data[_HEAD.size : _HEAD.size + length] = bytes(length)
    data[_HEAD.size : _HEAD.size + len(encoded)] = encoded
    _HEAD.pack_into(data, 0, magic, forced if forced >= 0 else len(encoded))
    path.write_bytes(bytes(data))
    manifest = parse_manifest(record.read_bytes(), str(record))
    digest, _ = hash_file(path, manifest.digest_algorithm)
    files = tuple(
        dataclasses.replace(f, digest=digest) if f.path == path.name else f for f in manifest.files
    )
    record.write_bytes(manifest_bytes(dataclasses.replace(manifest, files=files)))


@pytest.mark.parametrize(
    "edit, named",
    [
        (_header_length_past_end, "not a dckpt memory file (bad magic or header)"),
        (_tensor_past_end, "model.weight lies outside the file"),
        (_objects_past_end, "objects lies outside the file"),
        (_length_unlike_its_shape, "model.weight is recorded as 1020 bytes of torch.float32"),
    ],
    ids=["header-length", "tensor-span", "objects-span", "length-unlike-shape"],
)
def test_a_memory_file_whose_header_points_past_its_end_is_damage_and_the_resume_falls_back(
    tmp_path: Path, edit: Callable[..., tuple[dict[str, Any], int]], named: str
) -> None:
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    mgr, net = _manager(root, memory)
    with mgr:
        want = _bump(net)
        mgr.save(1).result()
        _bump(net)
        mgr.save(2, tier="memory").result()
    own = memory / "node-0" / "own" / step_dir_name(2) / "rank-00000.mem"
    _reseal(own, root / "memory" / f"{step_dir_name(2)}.json", edit)

    mgr, net = _manager(root, memory)
    with mgr:
        report = mgr.resume()  # never a crash, never the whole resume refused
    assert report.step == 1 and "memory tier" not in report.origin, report.format()
    assert _same(want, net)  # the durable step, bit for bit: nothing of step 2 copied in
    text = report.format()
    assert "skipped step 2 (quarantined): ManifestError" in text, text
    assert named in text and "its header does not describe them" in text, text
    reason = root / "memory" / "quarantine" / f"{step_dir_name(2)}.json"
    assert reason.is_file(), sorted(p.name for p in (root / "memory").rglob("*"))


# --- the rollback guard: an anchor the root no longer holds ---------------------------------


def _delete(root: Path, step: int) -> None:
    from dckpt.root.upkeep import delete_checkpoints

    delete_checkpoints(root, [step])  # what `dckpt gc` and retention do


def _quarantine(root: Path, step: int) -> None:
    from dckpt.root.upkeep import quarantine

    quarantine(root, root / step_dir_name(step), "found damaged by a test")


@pytest.mark.parametrize("remove", [_delete, _quarantine], ids=["deleted", "quarantined"])
def test_a_memory_step_whose_anchor_the_root_no_longer_holds_is_not_restored(
    tmp_path: Path, remove: Callable[[Path, int], None]
) -> None:
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    mgr, net = _manager(root, memory)
    with mgr:
        want = _bump(net)
        mgr.save(1).result()
        _bump(net)
        mgr.save(2).result()
        _bump(net)
        mgr.save(3, tier="memory").result()  # follows durable 2
    assert json.loads((root / "memory" / "step-00000003.json").read_text())["mesh"]["after"] == 2
    remove(root, 2)
    assert (memory / "node-0" / "own" / step_dir_name(3) / "rank-00000.mem").is_file()

    mgr, net = _manager(root, memory)
    with mgr:
        report = mgr.resume()
    assert report.step == 1, report.format()
    assert _same(want, net)
    note = next(w for w in report.warnings if w.startswith("memory tier: step 3 not used"))
    assert "it follows durable step 2, but the newest durable step at or before it is 1" in note


def test_a_memory_step_whose_only_durable_anchor_was_deleted_refuses_rather_than_start_over(
    tmp_path: Path,
) -> None:
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    mgr, net = _manager(root, memory)
    with mgr:
        _bump(net)
        mgr.save(2).result()
        _bump(net)
        mgr.save(3, tier="memory").result()
    _delete(root, 2)
    mgr, net = _manager(root, memory)
    with mgr, pytest.raises(dckpt.CheckpointError) as caught:
        mgr.resume()
    text = str(caught.value)
    assert "none of it could be restored" in text and "has no durable checkpoint" in text, text
    assert "it follows durable step 2, but the newest durable step at or before it is None" in text


# --- a replica the partner could not hold ---------------------------------------------------


def _replica_world(rank: int, world: int, base: str, resume: bool) -> dict[str, Any]:
    """Durable 1, memory 2, memory 3 on two "nodes" (or, with ``resume``, a restart)."""
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("dckpt").addHandler(Keep())
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = dckpt.CheckpointConfig(
        root=Path(base) / "root", memory=True, memory_dir=Path(base) / "mem", timeout_s=15.0
    )
    out: dict[str, Any] = {"log": lines, "saved": {}}
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, opt)) as mgr:
        if resume:
            report = mgr.resume()
            out.update(step=report.step, origin=report.origin, report=report.format())
            out["weights"] = [p.detach().tolist() for p in model.parameters()]
            return out
        tiers: tuple[tuple[int, Literal["durable", "memory"]], ...] = (
            (1, "durable"),
            (2, "memory"),
            (3, "memory"),
        )
        for step, tier in tiers:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(float(step))
            mgr.save(step, tier=tier).result()
            out["saved"][step] = [p.detach().tolist() for p in model.parameters()]
    return out


def test_a_replica_the_partner_cannot_hold_leaves_its_previous_replica_restorable(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a private tmpfs (a partner's full memory)")
    base = tmp_path
    # Node 1's place for node 0's replica of step 3 is a 16 KiB tmpfs: full for any file of
    # it, while its own files and the replica of step 2 fit beside (another file system).
    full = base / "mem" / "node-1" / "replica" / "node-0" / step_dir_name(3)
    full.mkdir(parents=True)
    mounted = subprocess.run(
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            "size=16k,mode=0700",
            f"dckpt-{uuid.uuid4().hex[:6]}",
            str(full),
        ],
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        saved = run_world(_replica_world, 2, str(base), False)
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)
    log = "\n".join(saved[0]["log"])
    assert "node 0 -> node 1 FAILED" in log and "cannot hold rank-00000.mem" in log, log
    ledger = base / "root" / "memory"
    assert sorted(p.name for p in ledger.glob("step-*.json")) == [
        "step-00000002.json",
        "step-00000003.json",
    ]  # step 3 committed all the same
    # The replica node 1 kept of step 2 stands, whole: it hashes to the writer's digest.
    kept = base / "mem" / "node-1" / "replica" / "node-0" / step_dir_name(2) / "rank-00000.mem"
    record = parse_manifest((ledger / "step-00000002.json").read_bytes(), "step 2")
    assert kept.is_file(), sorted(str(p) for p in (base / "mem").rglob("*.mem*"))
    assert hash_file(kept, record.digest_algorithm)[0] == record.file_map()[kept.name].digest

    shutil.rmtree(base / "mem" / "node-0")  # node 0 lost its memory: it needs the replica
    resumed = run_world(_replica_world, 2, str(base), True)
    for rank, got in enumerate(resumed):
        assert got["step"] == 2, got["report"]
        assert "memory tier" in got["origin"], got["report"]
        assert got["weights"] == saved[rank]["saved"][2]
    text = resumed[0]["report"]
    assert "memory tier: step 3 not used: no node holds rank-00000.mem" in text, text
    assert "rank 0: from node 1 (" in text, text  # node 0's file came from node 1's replica


def _lost_then_save(rank: int, world: int, base: str) -> dict[str, Any]:
    """Memory step 2's replicas stall on rank 1 (its save thread waits at the first chunk,
    past timeout_s, until rank 0 has its answer), so dckpt's group is lost under it;
    ``save(3)`` comes at once, while that save is still in flight on both ranks."""
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = dckpt.CheckpointConfig(
        root=Path(base) / "root", memory=True, memory_dir=Path(base) / "mem", timeout_s=5.0
    )
    answered = Path(base) / "rank-0-answered"
    out: dict[str, Any] = {}
    mgr = dckpt.CheckpointManager(config, dckpt.TrainState(model, opt))
    try:
        mgr.save(1).result()
        os.environ["DCKPT_FAULT"] = (
            f"phase=replicate,rank=1,action=wait,path={answered},seconds=300,step=2"
        )
        mgr.save(2, tier="memory")  # returns at once: the copy in save() is the snapshot
        try:
            mgr.save(3)
            out["next"] = "saved"
        except dckpt.CheckpointError as exc:
            out["next"] = f"{type(exc).__name__}: {exc}"
        if rank == 0:
            answered.touch()
    finally:
        if rank == 0:
            answered.touch()
        os.environ.pop("DCKPT_FAULT", None)
        with contextlib.suppress(Exception):
            mgr.close()
    return out


def test_a_save_after_a_memory_save_lost_the_group_refuses_instead_of_using_it(
    tmp_path: Path,
) -> None:
    """Whether the group is usable is checked once the save in flight has ended, not before
    (the issue: the next save ran its collectives on the broken group and gloo aborted the
    process, or the final durable save was lost). Both ranks refuse, in words, and live."""
    got = run_world(_lost_then_save, 2, str(tmp_path), expect_failure=True, timeout=300)
    for rank, result in enumerate(got):
        assert isinstance(result, dict), f"rank {rank} did not return: {result}"
        assert result["next"].startswith("WorldError:"), result
        assert "Restart the job" in result["next"], result
    assert committed_steps(tmp_path / "root") == [1]


def test_a_memory_dir_of_an_earlier_root_at_the_same_path_says_what_to_do(
    tmp_path: Path,
) -> None:
    """A root removed and made again at the same path has a new memory identity: its old
    memory directory is refused with words that tell the two apart (the message read "of X,
    not of X") and a remedy that works (``dckpt memory clear`` refuses it too)."""
    from dckpt.owned import NotOwnedError
    from dckpt.tiers.memory_layout import claim_memory_dir

    memory = tmp_path / "mem"
    claim_memory_dir(memory, memory, "id-old", "/runs/a")
    with pytest.raises(NotOwnedError) as refused:
        claim_memory_dir(memory, memory, "id-new", "/runs/a")
    words = str(refused.value)
    assert "an earlier root at /runs/a (memory identity id-old; this root's is id-new" in words
    assert f"rm -r {memory.resolve()}" in words and "dckpt memory clear" not in words
    with pytest.raises(NotOwnedError, match="dckpt memory clear /runs/a --memory-dir"):
        claim_memory_dir(memory, memory, "id-other", "/runs/b")
