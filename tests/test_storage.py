"""Storage layer on real DCP saves: hashing writer, verified reads, safe unpickling; and a
single-process CheckpointManager round trip with a real flipped byte."""

from __future__ import annotations

import copy
import fcntl
import os
import pickle
import random
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.utils.serialization import config as serialization_config

import dckpt
from dckpt.errors import CheckpointNotFoundError, IntegrityError, ManifestError
from dckpt.root.manifest import MANIFEST_FILE, read_manifest
from dckpt.storage import (
    FileRecord,
    HashingWriter,
    SafeLoadPlanner,
    VerifyingReader,
    hash_file,
    read_verified,
)
from dckpt.storage.direct_file import DirectFile, open_for_write
from dckpt.storage.safe_unpickle import load_dcp_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD = "__0_0.distcp"


# --- helpers ----------------------------------------------------------------------------------


def sample_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=gen),
            "b": torch.arange(16, dtype=torch.float64),
            "i": torch.randint(0, 1000, (7,), generator=gen),
            "h": torch.randn(5, generator=gen).to(torch.bfloat16),
        },
        "extra": {"step": 3, "name": "run", "lrs": [0.1, 0.2]},
    }


def blank_like(state: Mapping[str, Any]) -> dict[str, Any]:
    """The load target: same structure, tensors zeroed, plain values replaced."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            out[key] = blank_like(value)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = None
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of nested state (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(as_bytes(a), as_bytes(b)), where
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def save_dcp(
    state: dict[str, Any], directory: Path, *, algorithm: str = "xxh3_128", threads: int = 1
) -> list[FileRecord]:
    writer = HashingWriter(directory, algorithm=algorithm, rank=0, thread_count=threads)
    dcp.save(state, storage_writer=writer, no_dist=True)
    records: list[FileRecord] = writer.records()
    return records


def load_dcp(
    target: dict[str, Any],
    directory: Path,
    expected: Mapping[str, FileRecord] | list[FileRecord],
    planner: DefaultLoadPlanner | None = None,
) -> VerifyingReader:
    if not isinstance(expected, Mapping):
        expected = {r.path: r for r in expected}
    reader = VerifyingReader(directory, expected)
    dcp.load(target, storage_reader=reader, planner=planner or SafeLoadPlanner(), no_dist=True)
    return reader


@contextmanager
def raises_inner(kind: type[BaseException] | tuple[type[BaseException], ...]) -> Iterator[Any]:
    """Like pytest.raises, but also looks inside DCP's CheckpointException wrapper."""
    box: dict[str, BaseException] = {}

    class Handle:
        @property
        def value(self) -> BaseException:
            return box["exc"]

    try:
        yield Handle()
    except CheckpointException as exc:
        inner = [e for e, _tb in exc.failures.values() if isinstance(e, kind)]
        assert inner, f"expected {kind} inside {exc!r}"
        box["exc"] = inner[0]
    except kind as exc:
        box["exc"] = exc
    else:
        pytest.fail(f"did not raise {kind}")


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ (1 << bit)]), offset)
    finally:
        os.close(fd)


def record_for(path: Path, algorithm: str = "xxh3_128") -> FileRecord:
    digest, size = hash_file(path, algorithm)
    return FileRecord(path=path.name, bytes=size, digest=digest, rank=0)


# --- HashingWriter ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algorithm", "threads"), [("xxh3_128", 1), ("sha256", 1), ("xxh3_128", 3)]
)
def test_records_list_every_file_with_true_size_and_digest(
    tmp_path: Path, algorithm: str, threads: int
) -> None:
    ckpt = tmp_path / "ckpt"
    records = save_dcp(sample_state(), ckpt, algorithm=algorithm, threads=threads)

    on_disk = sorted(os.listdir(ckpt))
    assert sorted(r.path for r in records) == on_disk
    assert ".metadata" in on_disk
    assert ".metadata.tmp" not in on_disk
    assert SHARD in on_disk
    if threads > 1:
        assert len([n for n in on_disk if n.endswith(".distcp")]) > 1
    assert len({r.path for r in records}) == len(records)
    for rec in records:
        assert rec.rank == 0
        assert rec.bytes == os.stat(ckpt / rec.path).st_size > 0
        assert hash_file(ckpt / rec.path, algorithm) == (rec.digest, rec.bytes)


def test_records_carry_the_writer_rank(tmp_path: Path) -> None:
    writer = HashingWriter(tmp_path / "c", rank=3)
    dcp.save({"t": torch.ones(3)}, storage_writer=writer, no_dist=True)
    assert {r.rank for r in writer.records()} == {3}


def test_writer_rejects_unknown_algorithm(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        HashingWriter(tmp_path / "c", algorithm="md5")


def test_writer_never_overwrites_a_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save_dcp(sample_state(), ckpt)
    before = {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt)}
    with pytest.raises((RuntimeError, CheckpointException), match="already exists"):
        save_dcp({"other": torch.ones(2)}, ckpt)
    assert {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt)} == before


# --- direct I/O ---------------------------------------------------------------------------------


def test_direct_file_writes_the_exact_bytes_whatever_the_write_pattern(tmp_path: Path) -> None:
    data = os.urandom(9_000_017)
    rng = random.Random(5)
    path = tmp_path / "f"
    f = open_for_write(path, direct=True)
    assert isinstance(f, DirectFile)  # tmp_path is ext4 here: the page cache is bypassed
    assert fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT
    done = 0
    while done < len(data):
        n = rng.choice([1, 63, 4096, 5000, 1 << 20, 5 << 20])
        f.write(data[done : done + n])
        done = min(done + n, len(data))
        assert f.tell() == done
        if rng.random() < 0.3:  # a tail written and cut mid-file, then overwritten by more
            os.fsync(f.fileno())
            assert path.stat().st_size == done
    f.close()
    assert path.read_bytes() == data


def test_direct_and_buffered_shards_are_identical_and_crc_is_restored(tmp_path: Path) -> None:
    state = sample_state()
    digests = {}
    for direct in (True, False):
        writer = HashingWriter(tmp_path / str(direct), direct=direct)
        dcp.save(state, storage_writer=writer, no_dist=True)
        digests[direct] = {r.path: r.digest for r in writer.records() if r.path.endswith("distcp")}
    assert digests[True] == digests[False] and digests[True]
    assert (tmp_path / "True" / SHARD).read_bytes() == (tmp_path / "False" / SHARD).read_bytes()
    assert serialization_config.save.compute_crc32 is True  # only off while dckpt writes


# --- read_verified ----------------------------------------------------------------------------


@pytest.fixture
def shard(tmp_path: Path) -> tuple[Path, FileRecord]:
    ckpt = tmp_path / "ckpt"
    records = {r.path: r for r in save_dcp(sample_state(), ckpt)}
    return ckpt / SHARD, records[SHARD]


def test_read_verified_returns_the_bytes(shard: tuple[Path, FileRecord]) -> None:
    path, rec = shard
    assert bytes(read_verified(str(path), rec)) == path.read_bytes()


def test_read_verified_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    assert read_verified(str(tmp_path / "empty"), record_for(tmp_path / "empty")) == bytearray()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bit", [0, 7])
def test_read_verified_detects_one_flipped_bit(
    shard: tuple[Path, FileRecord], where: str, bit: int
) -> None:
    path, rec = shard
    offset = {"first": 0, "middle": rec.bytes // 2, "last": rec.bytes - 1}[where]
    flip_bit(path, offset, bit)
    with pytest.raises(IntegrityError, match="digest mismatch") as info:
        read_verified(str(path), rec)
    assert info.value.path == str(path)
    assert str(path) in str(info.value)
    assert info.value.expected == rec.digest
    assert info.value.actual == hash_file(path, "xxh3_128")[0]


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_read_verified_sha256_and_xxh3(tmp_path: Path, algorithm: str) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(5000))
    rec = record_for(path, algorithm)
    assert bytes(read_verified(str(path), rec)) == path.read_bytes()
    flip_bit(path, 4321)
    with pytest.raises(IntegrityError):
        read_verified(str(path), rec)


def test_read_verified_detects_truncation_and_growth(shard: tuple[Path, FileRecord]) -> None:
    path, rec = shard
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(IntegrityError, match="size mismatch") as info:
        read_verified(str(path), rec)
    assert info.value.path == str(path)
    path.write_bytes(data + b"\0")
    with pytest.raises(IntegrityError, match="size mismatch"):
        read_verified(str(path), rec)
    path.write_bytes(data)
    read_verified(str(path), rec)


def test_read_verified_rejects_absurd_size_before_allocating(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"tiny")
    rec = FileRecord(path="f", bytes=1 << 44, digest=record_for(path).digest, rank=0)
    with pytest.raises(IntegrityError, match="size mismatch"):
        read_verified(str(path), rec)


def test_read_verified_refuses_symlink_even_to_identical_bytes(
    shard: tuple[Path, FileRecord], tmp_path: Path
) -> None:
    path, rec = shard
    twin = tmp_path / "twin.distcp"
    shutil.copyfile(path, twin)
    path.unlink()
    os.symlink(twin, path)
    with pytest.raises(IntegrityError) as info:
        read_verified(str(path), rec)
    assert info.value.path == str(path)
    assert str(path) in str(info.value)


def test_read_verified_missing_file(shard: tuple[Path, FileRecord]) -> None:
    path, rec = shard
    path.unlink()
    with pytest.raises(IntegrityError, match="file missing") as info:
        read_verified(str(path), rec)
    assert info.value.path == str(path)


@pytest.mark.timeout(10)
def test_read_verified_refuses_fifo_without_blocking(shard: tuple[Path, FileRecord]) -> None:
    path, rec = shard
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(IntegrityError, match="wrong file type"):
        read_verified(str(path), rec)


def test_read_verified_refuses_symlinked_parent(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_bytes(b"outside bytes")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside, ckpt / "sub")
    rec = FileRecord(path="sub/x", bytes=13, digest=record_for(outside / "x").digest, rank=0)
    reader = VerifyingReader(ckpt, {rec.path: rec})
    with pytest.raises(IntegrityError):
        reader._read("sub/x")


# --- VerifyingReader and SafeLoadPlanner -------------------------------------------------------


def test_verified_load_round_trip(tmp_path: Path) -> None:
    state = sample_state()
    ckpt = tmp_path / "ckpt"
    records = save_dcp(state, ckpt)
    target = blank_like(state)
    reader = load_dcp(target, ckpt, records)
    assert_same(target, state)
    # every file a load reads, hashed whole (the items sidecar is for readers of part of a
    # file another rank owns: none here)
    assert reader.verified == {r.path: r.digest for r in records if r.path != "__0_0.distcp.items"}
    assert {r.path for r in records} == {".metadata", "__0_0.distcp", "__0_0.distcp.items"}


def test_reader_refuses_unlisted_shard(tmp_path: Path) -> None:
    state = sample_state()
    ckpt = tmp_path / "ckpt"
    records = {r.path: r for r in save_dcp(state, ckpt)}
    del records[SHARD]
    target = blank_like(state)
    with raises_inner(IntegrityError) as info:
        load_dcp(target, ckpt, records)
    assert info.value.path == str(ckpt / SHARD)
    assert "unlisted" in str(info.value)
    assert_same(target, blank_like(state))  # nothing was filled in


def test_reader_refuses_unlisted_metadata(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    records = {r.path: r for r in save_dcp(sample_state(), ckpt)}
    del records[".metadata"]
    with pytest.raises(IntegrityError, match="unlisted") as info:
        VerifyingReader(ckpt, records).read_metadata()
    assert info.value.path == str(ckpt / ".metadata")
    target = blank_like(sample_state())
    # through DCP the load fails too (DCP 2.13 re-raises read_metadata errors as text)
    with pytest.raises(CheckpointException, match="unlisted"):
        load_dcp(target, ckpt, records)
    assert_same(target, blank_like(sample_state()))


def test_reader_detects_flipped_bit_in_shard_before_filling_tensors(tmp_path: Path) -> None:
    state = sample_state()
    ckpt = tmp_path / "ckpt"
    records = save_dcp(state, ckpt)
    flip_bit(ckpt / SHARD, os.stat(ckpt / SHARD).st_size // 2)
    target = blank_like(state)
    with raises_inner(IntegrityError) as info:
        load_dcp(target, ckpt, records)
    assert info.value.path == str(ckpt / SHARD)
    assert SHARD in str(info.value)
    assert_same(target, blank_like(state))


def test_reader_detects_flipped_bit_in_metadata(tmp_path: Path) -> None:
    state = sample_state()
    ckpt = tmp_path / "ckpt"
    records = {r.path: r for r in save_dcp(state, ckpt)}
    flip_bit(ckpt / ".metadata", os.stat(ckpt / ".metadata").st_size // 2)
    with pytest.raises(IntegrityError, match="digest mismatch") as info:
        VerifyingReader(ckpt, records).read_metadata()
    assert info.value.path == str(ckpt / ".metadata")
    target = blank_like(state)
    with pytest.raises(CheckpointException, match="digest mismatch"):
        load_dcp(target, ckpt, records)
    assert_same(target, blank_like(state))


def test_reader_rejects_metadata_that_is_not_dcp_metadata(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    records = {r.path: r for r in save_dcp(sample_state(), ckpt)}
    (ckpt / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    records[".metadata"] = record_for(ckpt / ".metadata")  # a forger re-hashed it too
    with pytest.raises(ManifestError, match="does not hold DCP metadata"):
        VerifyingReader(ckpt, records).read_metadata()


def test_reader_rejects_hostile_metadata_with_valid_digest(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    records = {r.path: r for r in save_dcp(sample_state(), ckpt)}
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsShell(f"echo pwned > {marker}")))
    records[".metadata"] = record_for(ckpt / ".metadata")
    with pytest.raises(ManifestError, match="hostile"):
        VerifyingReader(ckpt, records).read_metadata()
    assert not marker.exists()


def test_load_dcp_metadata_loads_real_metadata(tmp_path: Path) -> None:
    state = sample_state()
    ckpt = tmp_path / "ckpt"
    save_dcp(state, ckpt)
    meta = load_dcp_metadata((ckpt / ".metadata").read_bytes(), str(ckpt / ".metadata"))
    assert isinstance(meta, Metadata)
    assert set(meta.state_dict_metadata) == {
        "model.w",
        "model.b",
        "model.i",
        "model.h",
        "extra.step",
        "extra.name",
        "extra.lrs",
    }
    w, h = meta.state_dict_metadata["model.w"], meta.state_dict_metadata["model.h"]
    assert isinstance(w, TensorStorageMetadata) and isinstance(h, TensorStorageMetadata)
    assert w.size == torch.Size([64, 32])
    assert h.properties.dtype == torch.bfloat16
    assert isinstance(meta.state_dict_metadata["extra.name"], BytesStorageMetadata)


class RunsShell:
    """Unpickling this runs a shell command (the classic pickle exploit)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def test_load_dcp_metadata_rejects_hostile_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(RunsShell(f"echo pwned > {marker}"))
    with pytest.raises(ManifestError, match="hostile") as info:
        load_dcp_metadata(payload, "ckpt/.metadata")
    assert "system" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [("builtins", "eval"), ("builtins", "getattr"), ("torch", "load"), ("subprocess", "Popen")],
)
def test_load_dcp_metadata_rejects_globals_outside_allow_list(module: str, name: str) -> None:
    payload = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
    with pytest.raises(ManifestError, match="hostile"):
        load_dcp_metadata(payload, "x")


def _short_unicode(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def test_load_dcp_metadata_rejects_dotted_name_escape(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = (
        b"\x80\x04"
        + _short_unicode("torch.distributed.checkpoint.metadata")
        + _short_unicode("os.system")
        + b"\x93"  # STACK_GLOBAL
        + _short_unicode(f"echo pwned > {marker}")
        + b"\x85R."  # TUPLE1, REDUCE, STOP
    )
    try:
        with pytest.raises(ManifestError):
            load_dcp_metadata(payload, "x")
    finally:
        assert not marker.exists(), "the hostile .metadata ran a shell command"


def test_load_dcp_metadata_rejects_module_objects() -> None:
    payload = (
        b"\x80\x04"
        + _short_unicode("torch.distributed.checkpoint.metadata")
        + _short_unicode("os")
        + b"\x93}"  # STACK_GLOBAL, EMPTY_DICT
        + _short_unicode("dckpt_test_marker")
        + b"K\x01sb."  # BININT1 1, SETITEM, BUILD, STOP
    )
    try:
        with pytest.raises(ManifestError):
            load_dcp_metadata(payload, "x")
    finally:
        injected = hasattr(os, "dckpt_test_marker")
        if injected:
            delattr(os, "dckpt_test_marker")
        assert not injected, "the hostile .metadata set os.dckpt_test_marker"


@pytest.mark.parametrize("data", [b"", b"garbage", b"\x80\x04\x95"])
def test_load_dcp_metadata_rejects_garbage(data: bytes) -> None:
    with pytest.raises(ManifestError, match="cannot parse DCP metadata"):
        load_dcp_metadata(data, "ckpt/.metadata")


def touch(path: str) -> str:
    """Called only if an unpickler constructs a ``Constructed``: leaves a trace on disk."""
    Path(path).write_text("constructed")
    return path


class Constructed:
    """An arbitrary object whose unpickling calls ``touch`` (any side effect would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (touch, (self.marker,))


def test_safe_planner_loads_plain_values(tmp_path: Path) -> None:
    state = {"t": torch.ones(3), "meta": {"epoch": 2, "name": "x", "lrs": [0.5], "none": None}}
    ckpt = tmp_path / "ckpt"
    records = save_dcp(state, ckpt)
    target = blank_like(state)
    load_dcp(target, ckpt, records)
    assert_same(target, state)


@pytest.mark.parametrize("planner", ["safe", "default"])
def test_safe_planner_never_constructs_arbitrary_objects(tmp_path: Path, planner: str) -> None:
    marker = tmp_path / "constructed"
    state = {"t": torch.ones(3), "obj": Constructed(str(marker))}
    ckpt = tmp_path / "ckpt"
    records = save_dcp(state, ckpt)
    assert not marker.exists()  # saving only recorded the call
    target: dict[str, Any] = {"t": torch.zeros(3), "obj": None}
    if planner == "default":
        # control: DCP's own planner (weights_only=False) does run it, so the payload is live
        load_dcp(target, ckpt, records, planner=DefaultLoadPlanner())
        assert marker.read_text() == "constructed"
        return
    with raises_inner(pickle.UnpicklingError) as info:
        load_dcp(target, ckpt, records)
    assert "weights_only" in str(info.value) or "Unsupported global" in str(info.value)
    assert not marker.exists()
    assert target["obj"] is None


# --- CheckpointManager, one process -----------------------------------------------------------


def make_training() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 6, generator=gen)
    y = torch.randn(8, 3, generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})


@pytest.fixture
def trained(tmp_path: Path) -> Iterator[tuple[dckpt.CheckpointManager, dict[int, dict[str, Any]]]]:
    """A manager with steps 1 and 2 saved, and the exact state at each save."""
    model, optimizer = make_training()
    state = dckpt.TrainState(model, optimizer)
    snaps: dict[int, dict[str, Any]] = {}
    with dckpt.CheckpointManager(tmp_path / "ckpt", state, run_config={"lr": 1e-2}) as manager:
        for step in (1, 2):
            train_step(model, optimizer, seed=step)
            result = manager.save(step).result()
            assert result.path == tmp_path / "ckpt" / f"step-{step:08d}"
            snaps[step] = snapshot(model, optimizer)
        # move on, so that a load has something to undo
        train_step(model, optimizer, seed=3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        yield manager, snaps


def current(manager: dckpt.CheckpointManager) -> dict[str, Any]:
    assert manager.state.optimizer is not None
    return snapshot(manager.state.model, manager.state.optimizer)


def test_manager_round_trip_bit_exact(
    trained: tuple[dckpt.CheckpointManager, dict[int, dict[str, Any]]],
) -> None:
    manager, snaps = trained
    assert manager.latest_step() == 2

    result = manager.load()
    assert result.step == 2
    assert manager.state.step == 2
    assert_same(current(manager), snaps[2])
    assert result.files_verified == len(result.manifest.files) >= 2  # .metadata and shards

    result = manager.load(step=1)
    assert result.step == 1
    assert manager.state.step == 1
    assert_same(current(manager), snaps[1])

    with pytest.raises(CheckpointNotFoundError):
        manager.load(step=99)
    assert_same(current(manager), snaps[1])  # a failed lookup changes nothing


def test_manager_manifest_describes_the_directory(
    trained: tuple[dckpt.CheckpointManager, dict[int, dict[str, Any]]],
) -> None:
    manager, _ = trained
    path = manager.root / "step-00000002"
    manifest = read_manifest(path)
    assert manifest.step == 2
    assert manifest.config == {"lr": 1e-2}
    assert manifest.state == ("model", "optimizer", "progress", "rng")
    listed = {f.path: f for f in manifest.files}
    assert sorted(listed) == sorted(n for n in os.listdir(path) if n != MANIFEST_FILE)
    for name, rec in listed.items():
        assert hash_file(path / name, manifest.digest_algorithm) == (rec.digest, rec.bytes)


def test_manager_load_detects_one_flipped_byte(
    trained: tuple[dckpt.CheckpointManager, dict[int, dict[str, Any]]],
) -> None:
    manager, snaps = trained
    shard_path = manager.root / "step-00000002" / SHARD
    flip_bit(shard_path, os.stat(shard_path).st_size // 2, bit=3)
    before = current(manager)

    with pytest.raises(IntegrityError) as info:
        manager.load()

    assert SHARD in str(info.value)
    assert info.value.path == str(shard_path)
    assert_same(current(manager), before)  # nothing was loaded from the damaged file
    # the older checkpoint is untouched and still loads
    assert manager.load(step=1).step == 1
    assert_same(current(manager), snaps[1])


def test_manager_load_rejects_truncated_shard(
    trained: tuple[dckpt.CheckpointManager, dict[int, dict[str, Any]]],
) -> None:
    manager, _ = trained
    shard_path = manager.root / "step-00000002" / SHARD
    data = shard_path.read_bytes()
    shard_path.write_bytes(data[: len(data) // 2])
    with pytest.raises((IntegrityError, ManifestError), match="size mismatch") as info:
        manager.load()
    assert SHARD in str(info.value)


def test_manager_sha256_round_trip(tmp_path: Path) -> None:
    model, optimizer = make_training()
    train_step(model, optimizer, seed=1)
    config = dckpt.CheckpointConfig(root=tmp_path / "ckpt", digest="sha256")
    with dckpt.CheckpointManager(config, dckpt.TrainState(model, optimizer)) as manager:
        manager.save(7)
        saved = snapshot(model, optimizer)
        train_step(model, optimizer, seed=2)
        result = manager.load()
    assert result.manifest.digest_algorithm == "sha256"
    assert all(f.digest.startswith("sha256:") for f in result.manifest.files)
    assert_same(snapshot(model, optimizer), saved)


def test_manager_load_with_nothing_saved(tmp_path: Path) -> None:
    model, optimizer = make_training()
    with dckpt.CheckpointManager(tmp_path / "ckpt", dckpt.TrainState(model, optimizer)) as m:
        assert m.latest_step() is None
        with pytest.raises(CheckpointNotFoundError):
            m.load()


def test_manager_load_detects_flipped_bit_in_metadata(
    trained: tuple[dckpt.CheckpointManager, dict[int, dict[str, Any]]],
) -> None:
    # DCP itself turns read_metadata errors into text; the manager must still raise the
    # typed IntegrityError naming .metadata (it verifies .metadata before calling DCP).
    manager, _ = trained
    meta = manager.root / "step-00000002" / ".metadata"
    flip_bit(meta, os.stat(meta).st_size // 2)
    before = current(manager)
    with pytest.raises(IntegrityError) as info:
        manager.load()
    assert info.value.path == str(meta)
    assert ".metadata" in str(info.value)
    assert_same(current(manager), before)


def test_a_file_asked_for_without_direct_io_is_buffered(tmp_path: Path) -> None:
    # direct=False is how a root on a file system that refuses O_DIRECT is written; asking for
    # it must never hand back an O_DIRECT descriptor (on ext4 that would still "work").
    f = open_for_write(tmp_path / "f", direct=False)
    try:
        assert not isinstance(f, DirectFile)
        assert not fcntl.fcntl(f.fileno(), fcntl.F_GETFL) & os.O_DIRECT
        f.write(b"abc")
    finally:
        f.close()
    assert (tmp_path / "f").read_bytes() == b"abc"


class _RecordingSink:
    """A tee that keeps what it was told: the bytes, and whether it was closed or aborted."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.calls: list[str] = []

    def write(self, data: bytes | bytearray | memoryview, /) -> None:
        self.data += bytes(data)

    def close(self) -> None:
        self.calls.append("close")

    def abort(self) -> None:
        self.calls.append("abort")


@pytest.mark.parametrize("tee", [True, False], ids=["with a tee", "directory only"])
def test_a_write_that_fails_raises_its_own_error_and_aborts_the_tee(
    tmp_path: Path, tee: bool
) -> None:
    from dckpt.storage.hashing_writer import HashingFileSystem

    sinks: list[_RecordingSink] = []

    names: list[str] = []

    def make(name: str) -> _RecordingSink:
        names.append(name)
        sinks.append(_RecordingSink())
        return sinks[-1]

    fs = HashingFileSystem(tmp_path, "xxh3_128", 0, direct=False, tee=make if tee else None)
    failing = fs.create_stream(tmp_path / "a.distcp", "wb")
    with pytest.raises(RuntimeError, match="the disk went away"), failing as stream:
        stream.write(b"x" * 1000)
        raise RuntimeError("the disk went away")
    with fs.create_stream(tmp_path / "b.distcp", "wb") as stream:
        stream.write(b"y" * 1000)
    if tee:
        # the failed file's object is given up, never completed (and gets no item digests);
        # the good one is completed, then its item digests beside it
        assert names == ["a.distcp", "b.distcp", "b.distcp.items"]
        assert [s.calls for s in sinks] == [["abort"], ["close"], ["close"]]
        assert bytes(sinks[1].data) == b"y" * 1000
        assert bytes(sinks[2].data) == (tmp_path / "b.distcp.items").read_bytes()
    assert (tmp_path / "b.distcp").read_bytes() == b"y" * 1000


def _two_chunk_metadata(
    second_row: int, *, reverse: bool
) -> tuple[Metadata, dict[str, FileRecord]]:
    """A (4, 3) float32 tensor in two chunks of 2 rows, the second starting at ``second_row``
    (2: side by side, as FSDP shards a tensor; 1: overlapping), each stored in 48 bytes,
    listed in that order or the other."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )

    chunks = [
        ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3])),
        ChunkStorageMetadata(offsets=torch.Size([second_row, 0]), sizes=torch.Size([2, 3])),
    ]
    chunks = chunks[::-1] if reverse else chunks
    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]), chunks)
    storage = {
        MetadataIndex("w", c.offsets): _StorageInfo("__0_0.distcp", 48 * i, 48)
        for i, c in enumerate(chunks)
    }
    metadata = Metadata(state_dict_metadata={"w": meta}, storage_data=storage)
    record = FileRecord(path="__0_0.distcp", bytes=96, digest="xxh3_128:00", rank=0)
    return metadata, {"__0_0.distcp": record}


@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "last first"])
def test_chunks_side_by_side_fit_and_overlapping_chunks_are_refused(reverse: bool) -> None:
    # A sharded tensor's chunks meet at their edges: that is a fit, not an overlap (every
    # FSDP checkpoint has it); one row shared by two chunks is a crafted or broken file.
    from dckpt.storage.verifying_reader import check_metadata

    check_metadata(*_two_chunk_metadata(2, reverse=reverse), "a sharded save")
    with pytest.raises(ManifestError, match="overlapping chunks"):
        check_metadata(*_two_chunk_metadata(1, reverse=reverse), "a crafted save")


def test_a_storage_span_running_past_its_file_is_refused() -> None:
    # The second chunk's 48 bytes start inside the 60-byte file and end past it: a reader
    # would read beyond the bytes the digest covers (or short), so the metadata is refused.
    from dataclasses import replace

    from dckpt.storage.verifying_reader import check_metadata

    metadata, records = _two_chunk_metadata(2, reverse=False)
    short = {name: replace(r, bytes=60) for name, r in records.items()}
    with pytest.raises(ManifestError, match=r"spans bytes \[48, \+48\) of __0_0.distcp"):
        check_metadata(metadata, short, "a crafted save")
