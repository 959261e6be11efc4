"""A verified resume whose work per rank is its share, not the world's.

- A file no rank reads for its load is still hashed: by the rank whose share it is (the
  rank that wrote it), and a flipped bit in it is raised on every rank, the same error.
- ``Manifest.share`` puts every file in exactly one part, and ``check_layout(part=...)``
  checks that part's files alone.
- ``check_metadata``'s overlap check sweeps the chunks instead of comparing every pair:
  chunks that meet at an edge fit, chunks that share an element are refused, in one, two
  and three dimensions, and thousands of chunks per tensor are checked in one pass.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dckpt.errors import IntegrityError, ManifestError
from dckpt.root.manifest import Manifest, check_layout, read_manifest, write_manifest
from dckpt.storage.digest import hash_file
from dckpt.storage.records import FileRecord
from dckpt.storage.verifying_reader import _overlapping, check_metadata

pytestmark = pytest.mark.multiproc

# --- a file only its owner hashes, on real ranks -----------------------------------------------


def _manager(root: str) -> tuple[Any, nn.Module]:
    import dckpt

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = dckpt.CheckpointConfig(root=Path(root), timeout_s=60)
    return dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt)), model


def _save(rank: int, world: int, root: str) -> None:
    mgr, _ = _manager(root)
    with mgr:
        mgr.save(1).result()


def _stale_view(path: Path) -> None:
    """This rank's thread alone (a mount namespace of its own) sees ``path`` one byte longer:
    a node whose view of a shared file system is stale, while every other rank sees it right."""
    import ctypes
    import subprocess

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    fake = path.parent.parent / f"stale-{path.name}"
    fake.write_bytes(path.read_bytes() + b"x")
    subprocess.run(["mount", "--bind", str(fake), str(path)], check=True)


def _load(rank: int, world: int, root: str, stale: str | None = None) -> dict[str, Any]:
    import dckpt

    if stale is not None and rank == 1:
        _stale_view(Path(root) / "step-00000001" / stale)
    mgr, model = _manager(root)
    with torch.no_grad():
        model.module.weight.fill_(7.0)
    with mgr:
        try:
            mgr.load()
        except dckpt.CheckpointError as exc:
            return {
                "type": type(exc).__name__,
                "message": str(exc),
                "divergent": getattr(exc, "divergent", False),
                "notes": list(getattr(exc, "__notes__", [])),
            }
    return {"type": None}


def test_a_flipped_bit_in_a_file_no_rank_reads_is_found_by_its_owner(tmp_path: Path) -> None:
    run_world(_save, 2, str(tmp_path))
    step = tmp_path / "step-00000001"
    # A file the manifest lists (written by rank 1) that DCP's metadata never refers to: no
    # rank's load reads it, so only the share it is in gets it hashed.
    data = bytearray(bytes(range(256)) * 64)
    (step / "notes.bin").write_bytes(bytes(data))
    manifest = read_manifest(step)
    digest, size = hash_file(step / "notes.bin", manifest.digest_algorithm)
    extra = FileRecord(path="notes.bin", bytes=size, digest=digest, rank=1)
    files = tuple(sorted((*manifest.files, extra)))
    write_manifest(step, dataclasses.replace(manifest, files=files))
    assert [f.path for f in read_manifest(step).share(1, 2)].count("notes.bin") == 1
    data[1000] ^= 0x10
    (step / "notes.bin").write_bytes(bytes(data))

    results = run_world(_load, 2, str(tmp_path))
    for r in results:
        assert r["type"] == "IntegrityError" and not r["divergent"], r
        assert "digest mismatch" in r["message"] and "notes.bin" in r["message"], r
    assert results[0]["message"] == results[1]["message"]  # one error, every rank
    assert "(raised on rank 1)" in results[0]["notes"], results[0]  # the owner found it
    assert "(raised on rank 1)" not in results[1]["notes"]


def test_a_file_one_rank_alone_sees_damaged_is_divergence_not_damage(tmp_path: Path) -> None:
    """Each rank stats only its share of the files, so a share that fails is one rank's view:
    rank 0 stats it again before it counts as damage. Here rank 1's node sees its own file a
    byte longer (a bind mount in its own mount namespace; every other view is right): every
    rank raises the same divergent error naming both views, and the step is not quarantined
    (a stale cache on one node must not walk the run back past a good checkpoint)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a mount namespace")
    run_world(_save, 2, str(tmp_path))
    mine = [f.path for f in read_manifest(tmp_path / "step-00000001").share(1, 2)]
    assert mine, "rank 1 wrote no file: nothing to see differently"
    results = run_world(_load, 2, str(tmp_path), mine[0])
    for r in results:
        assert r["type"] == "IntegrityError" and r["divergent"], r
        assert "ranks see different checkpoints" in r["message"], r
        assert "rank 0 finds rank 1's share of the files laid out" in r["message"], r
        assert "size mismatch" in r["message"] or "bytes" in r["message"], r
    assert (tmp_path / "step-00000001" / "manifest.json").exists()
    assert not (tmp_path / "quarantine").exists()


# --- the split itself, no processes -----------------------------------------------------------


def _manifest(ranks: list[int]) -> Manifest:
    files = tuple(
        FileRecord(path=f"f{i}", bytes=i, digest="xxh3_128:00", rank=r) for i, r in enumerate(ranks)
    )
    return Manifest(step=1, world_size=8, files=files, run_id="r", save_id="s", created_at=0.0)


@pytest.mark.parametrize("parts", [1, 2, 3, 8, 11])
def test_every_file_is_in_exactly_one_share(parts: int) -> None:
    manifest = _manifest([0, 0, 1, 2, 3, 4, 5, 6, 7, 7])
    shares = [manifest.share(p, parts) for p in range(parts)]
    assert sorted(f.path for s in shares for f in s) == sorted(f.path for f in manifest.files)
    if parts <= 8:  # the same world or a smaller one: a rank's own files are in its share
        assert all(f.rank % parts == p for p, s in enumerate(shares) for f in s)
    with pytest.raises(ValueError):
        manifest.share(parts, parts)


def test_a_layout_part_checks_its_files_alone(tmp_path: Path) -> None:
    manifest = _manifest([0, 1, 0, 1])
    for f in manifest.files:
        (tmp_path / f.path).write_bytes(b"x" * f.bytes)
    (tmp_path / "f3").unlink()  # rank 1's
    assert check_layout(tmp_path, manifest, part=(0, 2)) == 2
    with pytest.raises(IntegrityError, match="file missing"):
        check_layout(tmp_path, manifest, part=(1, 2))
    with pytest.raises(IntegrityError, match="file missing"):
        check_layout(tmp_path, manifest)


# --- check_metadata's sweep ---------------------------------------------------------------------


def _metadata(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...]
) -> tuple[Metadata, dict[str, FileRecord]]:
    """One float32 tensor of ``shape`` in ``boxes`` (offsets, sizes), each chunk stored in
    its own span of one file."""
    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in boxes]
    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    storage, at = {}, 0
    for c in chunks:
        length = 4 * int(torch.Size(c.sizes).numel())
        storage[MetadataIndex("w", c.offsets)] = _StorageInfo("__0_0.distcp", at, length)
        at += length
    metadata = Metadata(state_dict_metadata={"w": meta}, storage_data=storage)
    return metadata, {
        "__0_0.distcp": FileRecord(path="__0_0.distcp", bytes=at, digest="xxh3_128:00", rank=0)
    }


def _grid(shape: tuple[int, ...], cuts: tuple[int, ...]) -> list[tuple[tuple[int, ...], ...]]:
    """``shape`` cut into ``cuts[d]`` equal slabs along each dimension d."""
    steps = [s // c for s, c in zip(shape, cuts, strict=True)]
    return [
        (tuple(i * st for i, st in zip(index, steps, strict=True)), tuple(steps))
        for index in itertools.product(*(range(c) for c in cuts))
    ]


@pytest.mark.parametrize(
    ("shape", "cuts"),
    [
        ((4096,), (4096,)),
        ((4096, 2), (4096, 1)),
        ((2, 4096), (1, 4096)),
        ((128, 128), (64, 64)),
        ((16, 8, 32), (16, 4, 8)),
    ],
    ids=["1-D rows", "FSDP rows", "a column split", "a 64x64 grid", "a 3-D grid"],
)
def test_chunks_that_tile_a_tensor_fit_and_one_moved_into_a_neighbour_is_refused(
    shape: tuple[int, ...], cuts: tuple[int, ...]
) -> None:
    boxes = _grid(shape, cuts)
    check_metadata(*_metadata(boxes, shape), "a sharded save")  # thousands of chunks: one pass
    # One chunk grown by one element along the first dimension it can grow into: it now
    # shares elements with its neighbour (and the coverage no longer adds up, but the
    # overlap is what is named).
    victim = len(boxes) // 2
    offsets, sizes = boxes[victim]
    dim = next(d for d in range(len(shape)) if offsets[d] + sizes[d] < shape[d])
    grown = tuple(n + (d == dim) for d, n in enumerate(sizes))
    crafted = [*boxes[:victim], (offsets, grown), *boxes[victim + 1 :]]
    with pytest.raises(ManifestError, match="overlapping chunks"):
        check_metadata(*_metadata(crafted, shape), "a crafted save")


def _pairwise(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """The rule the sweep implements, pair by pair (what check_metadata once ran)."""
    return any(
        all(a < b + m and b < a + n for a, n, b, m in zip(o1, n1, o2, n2, strict=True))
        for (o1, n1), (o2, n2) in itertools.combinations(boxes, 2)
    )


def test_the_sweep_finds_exactly_the_overlaps_a_pairwise_check_finds() -> None:
    # Small random boxes, empty ones included (a chunk of no rows overlaps a chunk that
    # strictly surrounds where it sits): the sweep and the pairwise rule agree on each, and
    # a pair the sweep names does overlap.
    rng = random.Random(29)
    for _ in range(3000):
        dims, span = rng.choice([1, 2, 2, 3]), rng.randint(1, 5)
        boxes = []
        for _ in range(rng.randint(0, 6)):
            o = tuple(rng.randint(0, span) for _ in range(dims))
            boxes.append((o, tuple(rng.randint(0, span - x) for x in o)))
        pair = _overlapping(boxes)
        assert (pair is not None) == _pairwise(boxes), boxes
        assert pair is None or {pair[0], pair[1]} <= {o for o, _ in boxes}


# --- the memory tier: one flag when every rank proved its own file ----------------------------


def test_a_damaged_memory_copy_no_node_can_replace_is_not_used(tmp_path: Path) -> None:
    # One rank, one node: its memory file is the only copy. Damaged, the flag that every
    # rank proved its own file is down, the exchange finds no intact copy, and the resume
    # quarantines the memory step and falls back to the durable one, bit for bit.
    import dckpt
    from dckpt.root.layout import step_dir_name
    from dckpt.tiers import memory_layout

    root, memory = tmp_path / "ckpt", tmp_path / "mem"

    def manager() -> tuple[dckpt.CheckpointManager, nn.Module]:
        torch.manual_seed(0)
        net = nn.Linear(16, 16)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        config = dckpt.CheckpointConfig(root=root, memory=True, memory_dir=memory, lock=False)
        return dckpt.CheckpointManager(config, dckpt.TrainState(net, opt)), net

    mgr, net = manager()
    with mgr:
        mgr.save(1).result()
        want = {k: v.clone() for k, v in net.state_dict().items()}
        with torch.no_grad():
            net.weight.add_(1.0)
        mgr.save(2, tier="memory").result()
    own = memory_layout.own_dir(memory_layout.node_dir(memory, 0))
    victim = own / step_dir_name(2) / memory_layout.file_name(0)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    mgr, net = manager()
    with mgr:
        report = mgr.resume()
    assert report.step == 1, report.format()
    assert "skipped step 2 (quarantined): IntegrityError" in report.format()
    assert all(torch.equal(want[k], v) for k, v in net.state_dict().items())
