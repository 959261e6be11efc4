"""A checkpoint from another torch or a newer dckpt: a clear refusal, never damage.

torch 2.15 pickles DCP's ``TensorProperties`` with a sixth field (``strides``); torch 2.13's
``__setstate__`` unpacks five, so its unpickler fails inside DCP with a bare ``ValueError``.
Here a real 2-rank checkpoint's ``.metadata`` is rewritten that way and its manifest re-sealed
with ``versions.torch = "2.15.0"``, as a 2.15 run would have left it:

- ``resume()`` and ``load()`` raise ``IncompatibleCheckpointError`` on every rank, naming
  2.15.0, this torch's version, the step and the way out; nothing is loaded, nothing is
  quarantined, the resume does not fall back past it; ``load(step=1)`` (the way out) works;
- the same bytes under a manifest that names this torch are damage, as before: quarantined,
  and the resume falls back to step 1;
- a manifest of a newer format (``schema_version`` 2) is refused the same way, naming the
  dckpt that wrote it;
- a checkpoint an older torch wrote (its metadata this torch reads) loads, with a warning
  in the report.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from torch import nn
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from dckpt.errors import IncompatibleCheckpointError, ManifestError
from dckpt.root.layout import committed_steps
from dckpt.root.manifest import read_manifest, write_manifest
from dckpt.storage.digest import hash_file
from dckpt.storage.safe_unpickle import incompatible_torch, load_dcp_metadata, torch_release

THIS_TORCH = str(torch.__version__)
NEWER = "2.15.0"


# --- crafting what a newer torch leaves ------------------------------------------------------


@contextmanager
def _pickled_as_torch_2_15() -> Iterator[None]:
    """While active, TensorProperties pickles as torch 2.15 does: its five fields, then the
    tensor's strides (a sixth, which 2.13's ``__setstate__`` cannot unpack)."""
    five = TensorProperties.__getstate__

    def six(self: TensorProperties) -> tuple[Any, ...]:
        return (*five(self), self.__dict__.get("_strides", ()))

    TensorProperties.__getstate__ = six  # type: ignore[method-assign]
    try:
        yield
    finally:
        TensorProperties.__getstate__ = five  # type: ignore[method-assign]


def metadata_of_torch_2_15(data: bytes) -> bytes:
    meta = load_dcp_metadata(data, "template")
    for entry in meta.state_dict_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            size, strides, acc = list(entry.size), [], 1
            for dim in reversed(size):
                strides.insert(0, acc)
                acc *= dim
            entry.properties.__dict__["_strides"] = tuple(strides)
    with _pickled_as_torch_2_15():
        return pickle.dumps(meta)


def reseal(step: Path, **changes: Any) -> None:
    """Re-hash the step's files and write its manifest back, sealed, with ``changes``."""
    manifest = read_manifest(step)
    records = []
    for rec in manifest.files:
        digest, size = hash_file(step / rec.path, manifest.digest_algorithm)
        records.append(dataclasses.replace(rec, bytes=size, digest=digest))
    write_manifest(step, dataclasses.replace(manifest, files=tuple(records), **changes))


def as_written_by_torch_2_15(step: Path, versions_torch: str | None = NEWER) -> None:
    meta = step / ".metadata"
    meta.write_bytes(metadata_of_torch_2_15(meta.read_bytes()))
    versions = dict(read_manifest(step).versions)
    if versions_torch is not None:
        versions["torch"] = versions_torch
    reseal(step, versions=versions)


# --- without ranks ---------------------------------------------------------------------------


def test_torch_releases_are_read_from_any_version_string() -> None:
    assert torch_release("2.15.0") == (2, 15)
    assert torch_release("2.13.0+cpu") == (2, 13)
    assert torch_release("2.16.0.dev20260301+cu130") == (2, 16)
    assert torch_release("2.15.0a0+git1234") == (2, 15)
    assert torch_release("10.1") == (10, 1)
    for odd in ("", "v2.15", "two", None, 215):
        assert torch_release(odd) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_of_a_newer_torch_is_incompatible_not_damaged(tmp_path: Path) -> None:
    """The 6-field pickle fails in this torch's own ``__setstate__`` (a bare ValueError);
    with the writer's versions it is IncompatibleCheckpointError naming both."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=tmp_path, no_dist=True)
    data = metadata_of_torch_2_15((tmp_path / ".metadata").read_bytes())
    with pytest.raises(ValueError, match="too many values to unpack"):
        pickle.loads(data)  # what DCP's own reader meets
    source = str(tmp_path / "step-00000007" / ".metadata")
    with pytest.raises(ManifestError) as same:  # no versions, or this torch's: as before
        load_dcp_metadata(data, source, {"torch": THIS_TORCH})
    assert not isinstance(same.value, IncompatibleCheckpointError)
    with pytest.raises(IncompatibleCheckpointError) as newer:
        load_dcp_metadata(data, source, {"torch": NEWER, "dckpt": "0.2.0"})
    text = str(newer.value)
    assert f"written by torch {NEWER} (dckpt 0.2.0)" in text
    assert f"this torch, {THIS_TORCH}, cannot read it" in text
    assert "ValueError: too many values to unpack" in text
    assert "Install torch 2.15 or newer to resume from step 7" in text
    assert "manager.load(step=N)" in text and "nothing was quarantined" in text
    assert isinstance(newer.value.__cause__, ValueError)
    older = incompatible_torch({"torch": "2.6.0"}, source, ValueError("x"))
    assert older is not None and "older torch 2.6.0" in str(older)
    assert incompatible_torch({"torch": THIS_TORCH.partition("+")[0]}, source, ValueError()) is None
    assert incompatible_torch({}, source, ValueError()) is None


# --- on two gloo ranks -----------------------------------------------------------------------


def _manager(root: str, seed: int = 0) -> tuple[Any, nn.Module]:
    import dckpt

    torch.manual_seed(seed)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = dckpt.CheckpointConfig(root=Path(root), timeout_s=60)
    return dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt)), model


def _save(rank: int, world: int, root: str) -> None:
    mgr, model = _manager(root)
    with mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.module.weight.add_(step)
            mgr.save(step).result()


def _attempt(fn: Any) -> dict[str, Any]:
    import dckpt

    try:
        value = fn()
    except dckpt.CheckpointError as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "value": value}


def _scenarios(rank: int, world: int, roots: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mgr, model = _manager(roots["newer_torch"], seed=99)
    before = model.module.weight.detach().clone()
    with mgr:
        out["resume"] = _attempt(lambda: mgr.resume().step)
        out["load"] = _attempt(lambda: mgr.load().step)
        out["untouched"] = torch.equal(model.module.weight, before)
        out["load_older"] = _attempt(lambda: mgr.load(step=1).step)
    for name in ("same_torch", "newer_format", "older_torch"):
        mgr, _ = _manager(roots[name], seed=99)
        with mgr:
            out[name] = _attempt(lambda m=mgr: m.resume().format())  # type: ignore[misc]
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """One saved root (steps 1 and 2, 2 ranks), four copies whose step 2 is rewritten, and
    every scenario run in one world."""
    base = tmp_path_factory.mktemp("cross")
    saved = base / "saved"
    run_world(_save, 2, str(saved))
    roots = {n: base / n for n in ("newer_torch", "same_torch", "newer_format", "older_torch")}
    for root in roots.values():
        shutil.copytree(saved, root)
    step2 = "step-00000002"
    as_written_by_torch_2_15(roots["newer_torch"] / step2)
    as_written_by_torch_2_15(roots["same_torch"] / step2, versions_torch=None)
    manifest = read_manifest(roots["newer_format"] / step2)
    reseal(
        roots["newer_format"] / step2,
        schema_version=2,
        versions={**manifest.versions, "dckpt": "0.3.0"},
    )
    reseal(roots["older_torch"] / step2, versions={**manifest.versions, "torch": "2.12.0"})
    results = run_world(_scenarios, 2, {n: str(p) for n, p in roots.items()})
    return results, base


@pytest.mark.multiproc
def test_a_newer_torchs_checkpoint_is_refused_clearly_and_not_quarantined(
    outcomes: tuple[list[dict[str, Any]], Path],
) -> None:
    results, base = outcomes
    for r in results:
        for how in ("resume", "load"):
            got = r[how]
            assert got["type"] == "IncompatibleCheckpointError", got
            text = got["message"]
            assert f"written by torch {NEWER}" in text, text
            assert f"this torch, {THIS_TORCH}, cannot read it" in text, text
            assert "step-00000002/.metadata" in text and "from step 2" in text, text
            assert "Install torch 2.15 or newer" in text and "manager.load(step=N)" in text
            assert "ValueError" in text and "nothing was quarantined" in text
        assert r["untouched"], "a refused load changed the model"
        assert r["load_older"] == {"type": None, "value": 1}, r["load_older"]
    root = base / "newer_torch"
    assert committed_steps(root) == [1, 2]
    assert not (root / "quarantine").exists()


@pytest.mark.multiproc
def test_the_same_bytes_under_this_torchs_name_are_damage_as_before(
    outcomes: tuple[list[dict[str, Any]], Path],
) -> None:
    results, base = outcomes
    for r in results:
        got = r["same_torch"]
        assert got["type"] is None, got
        assert "dckpt resume: step 1" in got["value"], got["value"]
        assert (
            "skipped step 2 (quarantined): ManifestError: cannot parse DCP metadata"
            in (got["value"])
        )
    assert committed_steps(base / "same_torch") == [1]
    assert (base / "same_torch" / "quarantine" / "step-00000002").is_dir()


@pytest.mark.multiproc
def test_a_newer_format_is_refused_naming_the_dckpt_that_wrote_it(
    outcomes: tuple[list[dict[str, Any]], Path],
) -> None:
    import dckpt

    results, base = outcomes
    for r in results:
        got = r["newer_format"]
        assert got["type"] == "IncompatibleCheckpointError", got
        text = got["message"]
        assert "schema_version 2 is newer than this dckpt supports (1)" in text, text
        assert "upgrade dckpt to read it. Step 2 was written by dckpt 0.3.0 with torch" in text
        assert f"this is dckpt {dckpt.__version__} (format 1) with torch {THIS_TORCH}" in text
        assert "manager.load(step=N)" in text and "nothing was quarantined" in text
    assert committed_steps(base / "newer_format") == [1, 2]
    assert not (base / "newer_format" / "quarantine").exists()


@pytest.mark.multiproc
def test_an_older_torchs_checkpoint_loads_with_a_warning(
    outcomes: tuple[list[dict[str, Any]], Path],
) -> None:
    results, _ = outcomes
    for r in results:
        got = r["older_torch"]
        assert got["type"] is None, got
        report = got["value"]
        assert "dckpt resume: step 2" in report, report
        assert f"warning: written by torch 2.12.0, read by torch {THIS_TORCH} (an older" in (report)


def test_which_failures_under_another_torch_are_called_incompatible() -> None:
    import torch

    from dckpt.errors import IncompatibleCheckpointError
    from dckpt.storage.safe_unpickle import incompatible_torch

    ours = torch.__version__.split("+")[0]
    source = "/r/step-00000007/.metadata"
    broken = ValueError("too many values to unpack (expected 5)")
    # another build of one release (a nightly, a source build): another torch, too
    nightly = incompatible_torch({"torch": ours + ".dev20260301"}, source, broken)
    assert isinstance(nightly, IncompatibleCheckpointError)
    assert "the build that wrote it" in str(nightly) and "step 7" in str(nightly)
    # a local build tag is the same torch: the failure stands (damage, or a crafted file)
    assert incompatible_torch({"torch": ours + "+cu130"}, source, broken) is None
    # DCP's load failing for no format's reason (out of memory, a timeout) stays itself
    oom = RuntimeError("CUDA out of memory")
    assert incompatible_torch({"torch": "2.99.0"}, source, oom, format_errors_only=True) is None
    assert incompatible_torch({"torch": "2.99.0"}, source, broken, format_errors_only=True)
    # a version that names no release (a hand-edited manifest) proves nothing: the failure
    # stands as it is
    assert incompatible_torch({"torch": "unknown"}, source, broken) is None


def test_verify_deep_calls_a_newer_torchs_checkpoint_unreadable_not_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dckpt verify --deep``: every byte of a step another torch wrote hashes right, and
    its metadata is refused as unreadable here (exit 4), not failed as damage (exit 3)."""
    import dckpt
    from dckpt.cli import main
    from dckpt.root.verify import read_verification

    model = nn.Linear(3, 2)
    with dckpt.CheckpointManager(tmp_path, dckpt.TrainState(model)) as mgr:
        mgr.save(7).result()
    step = tmp_path / "step-00000007"
    as_written_by_torch_2_15(step)
    capsys.readouterr()
    assert main(["verify", str(tmp_path), "--deep", "--json"]) == 4
    (checked,) = json.loads(capsys.readouterr().out)["checkpoints"]
    assert checked["ok"] and checked["problems"] == []
    assert f"written by torch {NEWER}" in checked["incompatible"]
    recorded = read_verification(step, read_manifest(step).files_digest)
    assert recorded is not None and recorded["ok"]  # its bytes are intact
    assert main(["verify", str(tmp_path), "--deep"]) == 4
    assert "UNREADABLE BY THIS TORCH  step-00000007" in capsys.readouterr().out
    # without --deep only the bytes are checked: they are intact, and the metadata unread
    assert main(["verify", str(tmp_path)]) == 0
