"""An item that cannot be deserialized (issue 54, item 5), and the order of proof and use.

A step re-sealed by someone who can write the root: one tensor item of step 2 (the newest)
replaced by bytes that do not load as the tensor DCP's metadata records, the data file, its
item digests (``<file>.items``, written with dckpt's own ``ItemHasher``), the metadata
(offsets shifted) and the manifest all re-sealed (tests/faults/test_hostile.py's
``rewrite_metadata``, which re-seals with ``reseal``), so every digest matches. Each trial's
restart must quarantine step 2, the reason naming the step, the file, the item and what
failed, and resume step 1 on both ranks, the whole state (model, optimizer, scheduler,
progress, this rank's generators) step 1's, never a mix, then save the next step;
``fault_kit.check`` holds. Before, every restart was refused (``CheckpointError ...
CheckpointException``, or a ``StateMismatchError`` saying the checkpoint is not damaged),
with no fallback.

What is no proof of damage stays a refusal that moves nothing: the same item in a step
another torch release wrote (``IncompatibleCheckpointError``), an allocation this host
cannot make, and a value (not a tensor) that ``weights_only`` refuses, which dckpt's own
save can seal (a numpy scalar in a ``state_dict``).

A last test flips a bit inside a tensor item of rank 1's file that rank 0 reads through the
item digests: rank 0 must prove the item's segment before any of its bytes reaches the state
(the target tensor holds what it held before the load, on both ranks, after the failure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_harness import run_world
from fault_kit import (
    SEED,
    Trials,
    build,
    capture,
    check,
    failed,
    fresh_root,
    manager,
    saving_world,
    train_step,
)
from test_hostile import RunsShell, rewrite_metadata
from torch.distributed.checkpoint.metadata import Metadata

from dckpt.errors import (
    CheckpointError,
    IncompatibleCheckpointError,
    IntegrityError,
    UnloadableItemError,
)
from dckpt.load.offline import load_flat
from dckpt.root.layout import QUARANTINE_DIR, committed_steps, step_dir_name
from dckpt.root.manifest import read_manifest, write_manifest
from dckpt.storage.item_digests import ItemHasher, items_name
from dckpt.storage.one_pass import DIRECT_MIN
from dckpt.storage.safe_unpickle import load_dcp_metadata

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

FAULT = "an item that cannot be deserialized"
STEP = 2


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unloadable") / "root"
    results = run_world(saving_world, 2, str(root), [1, 2])
    assert results == ["ok", "ok"], results
    assert committed_steps(root) == [1, STEP]
    return root


# --- crafting, as someone who can write the root ------------------------------------------


def _span(step: Path, fqn: str) -> tuple[str, int, int]:
    """The file, offset and length of ``fqn``'s one stored item in ``step``."""
    meta = load_dcp_metadata((step / ".metadata").read_bytes(), "template")
    (found,) = [info for index, info in meta.storage_data.items() if index.fqn == fqn]
    return found.relative_path, found.offset, found.length


def replace_item(step: Path, fqn: str, new: bytes) -> None:
    """Put ``new`` where ``fqn``'s item was: the data file, its item digests, the metadata
    (later items of the file moved) and the manifest re-sealed, every digest matching."""
    name, offset, length = _span(step, fqn)
    data = (step / name).read_bytes()
    data = data[:offset] + new + data[offset + length :]
    (step / name).write_bytes(data)
    sidecar = step / items_name(name)
    segments = json.loads(sidecar.read_bytes())
    lengths, at, pos = list(segments["lengths"]), 0, 0
    for i, n in enumerate(lengths):  # DCP's items are the segments: one starts at ``offset``
        if at == offset:
            assert n == length, (fqn, n, length)
            lengths[i] = len(new)
        at += n
    hasher = ItemHasher(segments["algorithm"])
    for n in lengths:
        hasher.update(data[pos : pos + n])
        hasher.cut()
        pos += n
    sidecar.write_bytes(hasher.encode(name))
    delta = len(new) - length

    def edit(meta: Metadata) -> None:
        for info in meta.storage_data.values():
            if info.relative_path == name and info.offset > offset:
                info.offset += delta
            elif info.relative_path == name and info.offset == offset:
                info.length = len(new)

    rewrite_metadata(step, edit)  # re-pickles .metadata, then re-seals the manifest


def saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def storage_claims(tensor: torch.Tensor, elements: int) -> bytes:
    """``torch.save`` of ``tensor`` whose pickle says its storage holds ``elements`` (the
    storage record unchanged; the zip's CRCs fixed, as torch.load checks them)."""
    raw = bytearray(saved(tensor))
    archive = zipfile.ZipFile(io.BytesIO(bytes(raw)))
    name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
    pkl = archive.read(name)
    old = tensor.untyped_storage().nbytes() // tensor.element_size()

    def count(n: int) -> bytes:  # as pickle writes it (BININT2, or BININT)
        return b"M" + struct.pack("<H", n) if n < 1 << 16 else b"J" + struct.pack("<i", n)

    assert old < elements < 1 << 31 and len(count(old)) == len(count(elements))
    before = b"cpuq\x04" + count(old)  # the storage's persistent id ends with its size
    assert pkl.count(before) == 1, pkl
    new = pkl.replace(before, b"cpuq\x04" + count(elements))
    at = raw.index(pkl)
    raw[at : at + len(pkl)] = new
    crc, fixed = struct.pack("<I", zlib.crc32(pkl)), struct.pack("<I", zlib.crc32(new))
    assert raw.count(crc) == 2  # the local header's and the central directory's
    return bytes(raw.replace(crc, fixed))


@dataclass(frozen=True)
class Unloadable:
    case: str
    fqn: str
    file: str
    """The data file ``fqn`` is in (the errors must name it)."""
    bytes_of: Callable[[Path], bytes]
    """The item's new bytes (given the trial's directory, for a marker)."""
    says: str
    """What the reason must say failed."""


def _payload(where: Path) -> bytes:
    # As long as the tensor it replaces (5056 bytes), or the metadata check refuses the step
    # first (a chunk stored in fewer bytes than it needs): a shell comment fills it out.
    return saved(RunsShell(f"touch {where / 'pwned'} #{'x' * 6000}"))


def _oversized(_: Path) -> bytes:
    # A storage of 300000 floats (a view of its first 8 x 48 is the tensor): an item of
    # 1.2 MB, over DIRECT_MIN, so its archive is read first for where its bytes lie, and
    # not into memory; its pickle then says 400000, more than the item holds.
    raw = storage_claims(torch.zeros(300_000)[: 8 * 48].view(8, 48), 400_000)
    assert len(raw) >= DIRECT_MIN
    return raw


UNLOADABLE = [
    Unloadable(
        "a weights-only refusal (os.system) in a tensor item only rank 1 reads",
        "rng.rank_1.torch",
        "__1_0.distcp",
        _payload,
        "refused it (Trying to load unsupported GLOBAL posix.system",
    ),
    Unloadable(
        "a storage larger than its span, in a 1.2 MB tensor item both ranks read",
        "model.2.weight",
        "__1_0.distcp",
        _oversized,
        "its tensor's storage claims 1600000 bytes",
    ),
    Unloadable(
        "a storage larger than its record, in a small tensor item",
        "model.2.weight",
        "__1_0.distcp",
        lambda _: storage_claims(torch.randn(8, 48), 60_000),
        "RuntimeError: record size",
    ),
    Unloadable(
        "a dict where a tensor is stored (rank 0 reads it by item digest)",
        "model.2.bias",
        "__1_0.distcp",
        lambda _: saved({"a": 1}),
        "it holds a dict, not a tensor",
    ),
    Unloadable(
        "a float64 tensor where the metadata records float32 (rank 1 reads it by item digest)",
        "optimizer.state.2.weight.exp_avg_sq",
        "__0_0.distcp",
        lambda _: saved(torch.zeros(8, 48, dtype=torch.float64)),
        "it holds a (8, 48) torch.float64 tensor",
    ),
]


# --- the restart ------------------------------------------------------------------------------


def _restart(rank: int, world: int, roots: list[str]) -> list[dict[str, Any]]:
    """Resume each root; say which step, and whether the whole state is that step's: every
    value of the state and this rank's generators against the checkpoint, then save on."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    import dckpt
    from dckpt.train import rng

    out: list[dict[str, Any]] = []
    for root in roots:
        model, opt, sched = build(rank)
        state = dckpt.TrainState(model, opt, scheduler=sched, seed=SEED)
        config = dckpt.CheckpointConfig(root=Path(root), timeout_s=15.0)  # as fault_kit's
        mgr = dckpt.CheckpointManager(config, state)
        try:
            report = mgr.resume()
            generators = rng.capture()  # before anything draws from them
            result: dict[str, Any] = {"step": report.step, "error": None, "differs": []}
            if report.step is not None:
                saved = load_flat(Path(report.path))
                live, _ = flatten_state_dict(state.state_dict())
                mine = {f"rng.rank_{rank}.{k}": v for k, v in generators.items()}
                for key, value in {**live, **mine}.items():
                    were = saved.get(key)
                    same = (
                        torch.equal(value, were)
                        if isinstance(value, torch.Tensor) and isinstance(were, torch.Tensor)
                        else value == were
                    )
                    if not same:
                        result["differs"].append(key)
                train_step(model, opt, sched, report.step + 1, rank)
                mgr.save(report.step + 1)
                mgr.wait()
                result["saved_next"] = True
            mgr.close()
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(Exception):
                mgr.close()
        out.append(result)
    return out


def test_a_resealed_item_that_cannot_be_deserialized_is_quarantined_and_both_ranks_fall_back(
    template: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    baseline = capture(template)
    roots = []
    for i, u in enumerate(UNLOADABLE):
        trial = tmp_path / f"trial-{i}"
        trial.mkdir()
        root = fresh_root(template, trial / "root")
        replace_item(root / step_dir_name(STEP), u.fqn, u.bytes_of(trial))
        roots.append(root)
    resumed = run_world(_restart, 2, [str(r) for r in roots], timeout=300, expect_failure=True)

    ok = True
    for i, (u, root) in enumerate(zip(UNLOADABLE, roots, strict=True)):
        why = []
        for rank in range(2):
            got = resumed[rank][i] if isinstance(resumed[rank], list) else resumed[rank]
            if not isinstance(got, dict) or got.get("error") or got.get("step") != 1:
                why.append(f"restart on rank {rank}: {str(got)[:600]} (expected step 1)")
            elif got["differs"] or not got.get("saved_next"):
                why.append(f"rank {rank}: not step 1's state ({got['differs']}) or no save")
        reason = root / QUARANTINE_DIR / f"{step_dir_name(STEP)}.reason.txt"
        text = reason.read_text() if reason.is_file() else ""
        if not text:
            why.append(f"step {STEP} was not quarantined")
        named = str(root / step_dir_name(STEP) / u.file)
        for part in ("UnloadableItemError", f"step {STEP}: tensor item {u.fqn}", named, u.says):
            if text and part not in text:
                why.append(f"the quarantine reason does not say {part!r}: {text[:700]}")
        if (tmp_path / f"trial-{i}" / "pwned").exists():
            why.append("the pickle payload ran")
        outcome = check(root, baseline, may_drop=frozenset({STEP}))
        fault_trials.record_check(FAULT, u.case, outcome, survived=not why, detail="; ".join(why))
        ok = ok and not why and outcome.ok
    assert ok, failed(fault_trials._sink)


# --- proof before use, for an item of another rank's file ---------------------------------


def _load_flipped(rank: int, world: int, root: str, fqn: str) -> dict[str, Any]:
    """Load step 2 explicitly (no fallback): what it raised, and whether ``fqn`` still holds
    what it held before the load."""
    model, opt, sched = build(rank)
    mgr = manager(root, model, opt, sched)
    before = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    try:
        mgr.load(STEP)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        mgr.close()
    key = fqn.removeprefix("model.")
    return {"error": error, "kept": torch.equal(model.module.state_dict()[key], before[key])}


def test_an_item_of_another_ranks_file_reaches_the_state_only_once_its_segment_matched(
    template: Path, tmp_path: Path, fault_trials: Trials
) -> None:
    """Rank 0 reads ``model.2.weight`` from rank 1's file by its item digest; rank 1 (the
    owner) hashes that file whole. One bit of the tensor's bytes flipped (not re-sealed):
    both ranks fail, and neither one's ``model.2.weight`` holds the flipped bytes, nor any
    of step 2's: an item is deserialized only after the segments holding it matched."""
    fqn = "model.2.weight"
    root = fresh_root(template, tmp_path / "root")
    step = root / step_dir_name(STEP)
    name, offset, length = _span(step, fqn)
    assert length <= 256 << 10 and name == "__1_0.distcp"  # small: it has an item digest
    data = bytearray((step / name).read_bytes())
    flat = load_flat(template / step_dir_name(STEP), fqn)[fqn]
    at = bytes(data).index(flat.numpy().tobytes(), offset, offset + length)
    data[at + 17] ^= 0x10  # inside the tensor's own bytes: the item still deserializes
    (step / name).write_bytes(bytes(data))
    got = run_world(_load_flipped, 2, str(root), fqn, timeout=120)
    with fault_trials.trial(FAULT, "a flipped bit in an item of another rank's file"):
        for rank in range(2):
            assert got[rank]["error"] and "IntegrityError" in got[rank]["error"], got
            # rank 0's words (the lowest rank's, on every rank): it read the item by digest
            assert "digest mismatch in bytes" in got[rank]["error"], got
            assert "(an item this rank read)" in got[rank]["error"], got
            assert got[rank]["kept"], f"rank {rank}: {fqn} holds step 2's bytes: {got}"
        assert not (root / QUARANTINE_DIR).exists()  # load() names it, moves nothing


# --- what is not proof of damage ------------------------------------------------------------


def test_an_item_another_torch_wrote_is_incompatible_not_damage(
    template: Path, tmp_path: Path
) -> None:
    """The same crafted item: damage when this torch wrote the step, but a step another
    torch release wrote may hold what this one cannot read (never quarantined)."""
    steps = []
    for name, torch_version in (("same", torch.__version__), ("newer", "2.99.0")):
        step = fresh_root(template, tmp_path / name) / step_dir_name(STEP)
        replace_item(step, "model.2.bias", saved({"a": 1}))
        manifest = read_manifest(step)
        versions = {**manifest.versions, "torch": torch_version}
        write_manifest(step, dataclasses.replace(manifest, versions=versions))
        steps.append(step)
    with pytest.raises(UnloadableItemError, match="it holds a dict, not a tensor") as damage:
        load_flat(steps[0])
    assert damage.value.path == str(steps[0] / "__1_0.distcp") and not damage.value.divergent
    with pytest.raises(IncompatibleCheckpointError, match=r"torch 2\.99\.0.*not damage"):
        load_flat(steps[1])


def test_an_allocation_that_fails_is_not_damage(
    template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor item whose storage this host cannot allocate says nothing of its bytes."""
    real = torch.load

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("map_location") == "cpu":  # a tensor item, read into memory
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                "allocate memory: you tried to allocate 1536 bytes. Error code 12"
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", no_memory)
    with pytest.raises(CheckpointError, match="can't allocate memory") as refused:
        load_flat(template / step_dir_name(STEP))
    assert not isinstance(refused.value, IntegrityError), refused.value


class _Holds:
    """A state object whose ``state_dict`` holds a value of any type."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_a_value_weights_only_refuses_that_dckpt_saved_is_refused_not_quarantined(
    tmp_path: Path,
) -> None:
    """A numpy scalar in a state_dict: the save seals it, ``weights_only`` refuses it at the
    resume. The refusal is no proof that the step was damaged (every step of the run holds
    one): the resume stops, naming it, and moves nothing."""
    import dckpt

    def state(value: Any) -> Any:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return dckpt.TrainState(
            model, torch.optim.SGD(model.parameters(), lr=0.1), extra={"best": _Holds(value)}
        )

    with dckpt.CheckpointManager(tmp_path, state(np.float64(0.5))) as mgr:
        mgr.save(1).result()
        mgr.save(2).result()
    with (
        dckpt.CheckpointManager(tmp_path, state(None)) as mgr,
        pytest.raises(CheckpointError, match="Weights only load failed") as refused,
    ):
        mgr.resume()
    assert not isinstance(refused.value, IntegrityError), refused.value
    assert committed_steps(tmp_path) == [1, 2]
    assert not (tmp_path / QUARANTINE_DIR).exists()
