"""The checks that make a resume "verified", each broken on purpose on real gloo ranks.

- Ranks that read different roots (each checkpoint whole and valid on its own): ``load()`` and
  ``resume()`` refuse on every rank, naming the rank, quarantine nothing and load nothing.
- A rank whose newest checkpoint is missing from its view of the root: the same.
- A warmup all-reduce that returns a wrong sum on one rank: every rank refuses, naming it.
- A rank whose digests of the files it read differ from the manifest: every rank names it.
- Every rank gets back its own Python, NumPy and torch RNG streams.
- The report's lines carry the values the checks computed.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_harness import run_world
from torch import nn

from dckpt.root.layout import committed_steps, list_checkpoints

pytestmark = pytest.mark.multiproc


def _manager(root: str, seed: int = 0, **config: Any) -> tuple[Any, nn.Module]:
    import dckpt

    torch.manual_seed(seed)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = dckpt.CheckpointConfig(root=Path(root), timeout_s=60, **config)
    return dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt)), model


def _save(rank: int, world: int, root: str, seed: int, steps: list[int]) -> None:
    mgr, model = _manager(root, seed)
    with mgr:
        for step in steps:
            with torch.no_grad():
                model.module.weight.add_(step)
            mgr.save(step).result()


def _load_from_own_root(rank: int, world: int, roots: list[str], how: str) -> dict[str, Any]:
    """Rank r uses roots[r]: what a job whose nodes do not share one directory does."""
    import dckpt

    mgr, model = _manager(roots[rank], seed=99, lock=False)
    before = model.module.weight.detach().clone()
    with mgr:
        try:
            mgr.load() if how == "load" else mgr.resume()
        except dckpt.CheckpointError as exc:
            return {
                "type": type(exc).__name__,
                "divergent": getattr(exc, "divergent", False),
                "message": str(exc),
                "untouched": torch.equal(model.module.weight, before),
            }
    return {"type": None}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two roots, each with steps 1 and 2, from two runs (different weights): read-only."""
    base = tmp_path_factory.mktemp("saved")
    run_world(_save, 2, str(base / "a"), 0, [1, 2])
    run_world(_save, 2, str(base / "b"), 1, [1, 2])
    return base / "a", base / "b"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _two_roots(saved: tuple[Path, Path], tmp_path: Path, drop_b: int | None = None) -> list[str]:
    """Private copies of both roots; ``drop_b`` removes that step from the second."""
    a, b = _copy(saved[0], tmp_path / "a"), _copy(saved[1], tmp_path / "b")
    if drop_b is not None:
        shutil.rmtree(b / f"step-{drop_b:08d}")
    return [str(a), str(b)]


@pytest.mark.parametrize("how", ["load", "resume"])
def test_ranks_that_read_different_roots_refuse_and_name_the_rank(
    saved: tuple[Path, Path], tmp_path: Path, how: str
) -> None:
    roots = _two_roots(saved, tmp_path)
    results = run_world(_load_from_own_root, 2, roots, how)
    for r in results:
        assert r["type"] == "IntegrityError" and r["divergent"], r
        assert "ranks read different manifests" in r["message"], r["message"]
        assert "got rank 1: xxh3_128:" in r["message"], r["message"]
        assert r["untouched"], "a refused load changed the model"
    for root in roots:  # nothing quarantined, nothing lost: the checkpoints are not damaged
        assert committed_steps(Path(root)) == [1, 2]
        assert not (Path(root) / "quarantine").exists()


def test_a_step_missing_from_one_ranks_root_is_refused_not_fallen_back_past(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    roots = _two_roots(saved, tmp_path, drop_b=2)
    results = run_world(_load_from_own_root, 2, roots, "resume")
    for r in results:
        assert r["type"] == "IntegrityError" and r["divergent"], r
        assert "ranks see different checkpoints" in r["message"], r["message"]
        assert "rank(s) [1]" in r["message"] and "rank(s) [0] read it" in r["message"]
        assert r["untouched"]
    assert committed_steps(Path(roots[0])) == [1, 2]
    assert [e.status for e in list_checkpoints(Path(roots[0]))] == ["committed", "committed"]


def _resume(rank: int, world: int, root: str) -> dict[str, Any]:
    import dckpt

    mgr, _ = _manager(root)
    with mgr:
        try:
            report = mgr.resume()
        except dckpt.CheckpointError as exc:
            return {
                "type": type(exc).__name__,
                "message": str(exc),
                "divergent": getattr(exc, "divergent", False),
            }
    return {"type": None, "report": report.format()}


def test_a_warmup_that_sums_wrong_on_one_rank_is_refused_on_every_rank(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    root = _copy(saved[0], tmp_path / "root")
    fault = {"DCKPT_FAULT": "phase=warmup,rank=1,action=corrupt"}
    results = run_world(_resume, 2, str(root), env=fault)
    for r in results:
        assert r["type"] == "WorldError", r
        assert "warmup all-reduce returned 4.0 instead of 3.0 on rank 1" in r["message"], r
    ok = run_world(_resume, 2, str(root))  # the same root, a healthy backend
    for r in ok:
        assert (
            "[ok  ] warmup all-reduce: 2 ranks answered, sum 3 = 3 on every rank" in (r["report"])
        ), r


def test_a_rank_whose_digests_differ_is_named_by_every_rank(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    root = _copy(saved[0], tmp_path / "root")
    fault = {"DCKPT_FAULT": "phase=verify,rank=1,action=corrupt"}
    results = run_world(_resume, 2, str(root), env=fault)
    for r in results:
        assert r["type"] == "IntegrityError", r
        assert "rank 1 hashed different bytes" in r["message"] and r["divergent"], r
    assert committed_steps(root) == [1, 2]
    assert not (root / "quarantine").exists()


def test_the_report_carries_what_each_check_computed(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    root = _copy(saved[0], tmp_path / "root")
    shards = len(list((root / "step-00000002").glob("*.distcp")))
    files = 2 * shards + 1  # each shard with its item digests, + .metadata
    (r0, _) = run_world(_resume, 2, str(root))
    report = r0["report"]
    assert f"[ok  ] digests: {files} of {files} files hashed and matched (xxh3_128)" in report
    assert "split over all 2 ranks, each matching what it hashed against the one" in report
    assert f"{files} of {files} files laid out at their recorded sizes" in report
    assert "[ok  ] one manifest: all 2 ranks read xxh3_128:" in report
    assert "[ok  ] state: model, optimizer, progress" in report


# --- RNG, per rank ---------------------------------------------------------------------------


def _draw(rank: int, n: int) -> list[float]:
    """Draws from every generator; rank-dependent amounts keep the ranks' streams apart."""
    out: list[float] = []
    for _ in range(n * (rank + 1)):
        out += [random.random(), float(np.random.rand()), float(torch.rand(1))]
    return out


def _rng_roundtrip(rank: int, world: int, root: str, phase: str) -> list[float]:
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)
    mgr, _ = _manager(root)
    with mgr:
        if phase == "save":
            _draw(rank, 3)  # each rank moves its generators a different distance
            mgr.save(1).result()
            return _draw(rank, 2)  # what must come next after a resume
        mgr.resume()
        return _draw(rank, 2)


def test_each_rank_gets_back_its_own_python_numpy_and_torch_rng(tmp_path: Path) -> None:
    expected = run_world(_rng_roundtrip, 2, str(tmp_path), "save")
    assert expected[0] != expected[1][: len(expected[0])]  # the ranks' streams differ
    resumed = run_world(_rng_roundtrip, 2, str(tmp_path), "resume")
    assert resumed == expected


# --- what the loader itself never reads, and damage found before anything is loaded ----------


def _add_listed_file(step: Path, name: str, data: bytes) -> None:
    """A file the manifest lists but DCP's metadata never refers to (so no rank reads it for
    the load), re-sealed the way dckpt seals a manifest."""
    import dataclasses

    from dckpt.root.manifest import read_manifest, write_manifest
    from dckpt.storage.digest import hash_file
    from dckpt.storage.records import FileRecord

    (step / name).write_bytes(data)
    manifest = read_manifest(step)
    digest, size = hash_file(step / name, manifest.digest_algorithm)
    files = (*manifest.files, FileRecord(path=name, bytes=size, digest=digest, rank=0))
    write_manifest(step, dataclasses.replace(manifest, files=tuple(sorted(files))))


def test_a_damaged_file_no_rank_reads_is_still_caught(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    root = _copy(saved[0], tmp_path / "root")
    step2 = root / "step-00000002"
    _add_listed_file(step2, "notes.bin", bytes(range(256)) * 64)
    (ok,) = run_world(_resume, 2, str(root))[:1]
    files = 2 * len(list(step2.glob("*.distcp"))) + 2  # + items, .metadata, notes.bin
    assert f"[ok  ] digests: {files} of {files} files hashed and matched" in ok["report"], ok
    data = bytearray((step2 / "notes.bin").read_bytes())
    data[1000] ^= 0x10
    (step2 / "notes.bin").write_bytes(bytes(data))
    (r0, _) = run_world(_resume, 2, str(root))
    assert "dckpt resume: step 1" in r0["report"], r0
    assert "skipped step 2 (quarantined): IntegrityError: digest mismatch" in r0["report"]
    assert "notes.bin" in r0["report"]


def _load_damaged(rank: int, world: int, root: str) -> dict[str, Any]:
    import dckpt

    mgr, model = _manager(root, seed=99)
    before = model.module.weight.detach().clone()
    with mgr:
        try:
            mgr.load()
        except dckpt.IntegrityError as exc:
            return {"error": str(exc), "untouched": torch.equal(model.module.weight, before)}
    return {"error": None}


def test_a_truncated_file_is_refused_before_any_tensor_is_filled(
    saved: tuple[Path, Path], tmp_path: Path
) -> None:
    """The layout check (every file there, at its recorded size) runs before DCP loads
    anything: a truncated shard leaves the model as it was, whichever file holds what."""
    from torch.distributed.checkpoint import FileSystemReader

    root = _copy(saved[0], tmp_path / "root")
    step = root / "step-00000002"  # the newest: what load() takes
    where = {
        index.fqn: info.relative_path
        for index, info in FileSystemReader(step).read_metadata().storage_data.items()
    }
    first = where["model.weight"]  # read first; damage another file, read after it
    victim = next(p for p in sorted(step.glob("*.distcp")) if p.name != first)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size - 7)
    for r in run_world(_load_damaged, 2, str(root)):
        assert r["error"] is not None and "size mismatch" in r["error"], r
        assert r["untouched"], "tensors were filled before the damage was found"
