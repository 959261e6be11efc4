"""manifest.json: round trip, strict validation, self-digest, and check_layout on real files."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dckpt.errors import IntegrityError, ManifestError
from dckpt.root import manifest as manifest_mod
from dckpt.root.manifest import (
    MANIFEST_FILE,
    SCHEMA_VERSION,
    Manifest,
    check_layout,
    fingerprint,
    read_manifest,
    write_manifest,
)
from dckpt.storage.digest import digest_of_digests, hash_file
from dckpt.storage.records import FileRecord

Obj = dict[str, Any]
DIGEST_A = "xxh3_128:" + "a" * 32
DIGEST_B = "xxh3_128:" + "b" * 32


def make_manifest(files: tuple[FileRecord, ...] | None = None, **overrides: Any) -> Manifest:
    """A sealed manifest with every field set to something other than its default."""
    if files is None:
        files = (
            FileRecord(path=".metadata", bytes=120, digest=DIGEST_A, rank=0),
            FileRecord(path="__0_0.distcp", bytes=4096, digest=DIGEST_B, rank=0),
            FileRecord(path="__1_0.distcp", bytes=0, digest=DIGEST_B, rank=1),
        )
    fields: dict[str, Any] = {
        "step": 1200,
        "epoch": 3,
        "world_size": 2,
        "files": files,
        "run_id": "run-ü-1",
        "save_id": "f" * 32,
        "created_at": 1700000000.5,
        "state": ("model", "optimizer", "progress"),
        "versions": {"dckpt": "0.1.0", "torch": "2.13.0"},
        "mesh": {"world_size": 2, "dims": [2]},
        "precision": {"dtype": "bfloat16", "tf32": True},
        "config": {"lr": 0.001, "layers": [4, 8], "name": "café", "nested": {"a": None}},
        "loss": {"last": 1.25},
        "timings": {"write_s": 0.5},
        "bytes_per_rank": (4216, 0),
        "milestone": True,
        "metric": {"name": "val_loss", "value": 0.75},
    }
    fields.update(overrides)
    return Manifest(**fields).sealed()


def reseal(obj: Obj) -> Obj:
    """Recompute files_digest and self_digest, as a forger with write access would."""
    obj = dict(obj)
    # files that cannot even be digested keep the files_digest they had
    with contextlib.suppress(TypeError, KeyError):
        obj["files_digest"] = digest_of_digests(
            (f["path"], f["bytes"], f["digest"]) for f in obj["files"]
        )
    obj.pop("self_digest", None)
    obj["self_digest"] = fingerprint(obj)
    return obj


def write_obj(directory: Path, obj: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps(obj, indent=1, sort_keys=True), encoding="utf-8")
    return path


def valid_obj() -> Obj:
    return make_manifest().to_json_obj()


# --- round trip -------------------------------------------------------------------------------


def test_the_json_holds_every_field_as_the_dataclass_holds_it() -> None:
    """``to_json_obj`` builds its dict field by field (for speed at thousands of ranks): it
    holds what ``dataclasses.asdict`` would, tuples as lists, and shares no dict with the
    manifest (a caller that edits the JSON leaves the frozen record as it was)."""
    m = make_manifest(
        integrity={"nonfinite": ["model.w"]},
        incremental={"trainable": ["model.w"], "reused": {}},
        data={"epoch": 2, "batches": 1},
        capture={"items": 12},
        signature={"algorithm": "hmac-sha256", "key": "k", "mac": "0" * 64},
    )
    obj = m.to_json_obj()
    expected = json.loads(json.dumps(dataclasses.asdict(m)))
    assert {k: v for k, v in obj.items() if k != "self_digest"} == expected
    obj["config"]["nested"]["a"] = 1
    assert m.config["nested"]["a"] is None


def test_round_trip_equal(tmp_path: Path) -> None:
    original = make_manifest()
    record = write_manifest(tmp_path, original)
    loaded = read_manifest(tmp_path)
    assert loaded == original
    assert loaded.files == original.files
    assert loaded.config == {
        "lr": 0.001,
        "layers": [4, 8],
        "name": "café",
        "nested": {"a": None},
    }
    assert loaded.config_fingerprint == fingerprint(original.config)
    assert loaded.files_digest == digest_of_digests(
        (f.path, f.bytes, f.digest) for f in original.files
    )
    assert loaded.file_map()["__0_0.distcp"].bytes == 4096
    assert loaded.total_bytes == 120 + 4096
    # write_manifest reports what it wrote
    assert record.path == MANIFEST_FILE
    assert record.bytes == (tmp_path / MANIFEST_FILE).stat().st_size


def test_round_trip_minimal_and_sha256(tmp_path: Path) -> None:
    files = (FileRecord(path="a", bytes=1, digest="sha256:" + "0" * 64, rank=0),)
    original = Manifest(
        step=0, world_size=1, files=files, run_id="", save_id="s", created_at=0,
        digest_algorithm="sha256",
    ).sealed()  # fmt: skip
    write_manifest(tmp_path, original)
    assert read_manifest(tmp_path) == original


def test_manifest_is_json_with_schema_and_self_digest(tmp_path: Path) -> None:
    write_manifest(tmp_path, make_manifest())
    raw = (tmp_path / MANIFEST_FILE).read_bytes()
    obj = json.loads(raw)  # JSON, never pickle
    assert obj["schema_version"] == SCHEMA_VERSION
    body = {k: v for k, v in obj.items() if k != "self_digest"}
    assert obj["self_digest"] == fingerprint(body)
    assert [f["path"] for f in obj["files"]] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_from_json_obj_equals_read(tmp_path: Path) -> None:
    original = make_manifest()
    assert Manifest.from_json_obj(original.to_json_obj()) == original


def test_manifest_records_are_frozen() -> None:
    m = make_manifest()
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.step = 5  # type: ignore[misc]
    assert dataclasses.replace(m, step=5).step == 5


# --- validation -------------------------------------------------------------------------------


def set_path(i: int, value: Any) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        obj["files"][i]["path"] = value

    return mutate


def set_file(i: int, key: str, value: Any) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        obj["files"][i][key] = value

    return mutate


def set_top(key: str, value: Any) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        obj[key] = value

    return mutate


def drop_top(key: str) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        del obj[key]

    return mutate


def duplicate_file(obj: Obj) -> None:
    obj["files"].append(copy.deepcopy(obj["files"][1]))


BAD_MANIFESTS: dict[str, tuple[Callable[[Obj], None], str]] = {
    # unsafe or aliasing paths
    "dotdot": (set_path(1, "../x"), "escapes"),
    "dotdot-alone": (set_path(1, ".."), "escapes"),
    "absolute": (set_path(1, "/abs"), "escapes"),
    "absolute-etc": (set_path(1, "/etc/passwd"), "escapes"),
    "inner-dotdot": (set_path(1, "a/../b"), "escapes"),
    "backslash": (set_path(1, "a\\b"), "escapes"),
    "backslash-dotdot": (set_path(1, "..\\x"), "escapes"),
    "empty": (set_path(1, ""), "non-empty string"),
    "dot": (set_path(1, "."), "escapes"),
    "dot-prefix": (set_path(1, "./__0_0.distcp"), "escapes"),
    "double-slash": (set_path(1, "a//b"), "escapes"),
    "trailing-slash": (set_path(1, "a/"), "escapes"),
    "nul": (set_path(1, "a\0b"), "escapes"),
    "manifest-itself": (set_path(1, MANIFEST_FILE), "escapes or aliases"),
    "path-not-string": (set_path(1, 7), "non-empty string"),
    "path-missing": (lambda o: o["files"][1].pop("path"), "non-empty string"),
    "duplicate": (duplicate_file, "listed twice"),
    # schema
    "schema-2": (set_top("schema_version", 2), "upgrade"),
    "schema-0": (set_top("schema_version", 0), "upgrade"),
    "schema-str": (set_top("schema_version", "1"), "upgrade"),
    "schema-missing": (drop_top("schema_version"), "upgrade"),
    # sizes and ranks
    "bytes-negative": (set_file(1, "bytes", -1), "'bytes'"),
    "bytes-absurd": (set_file(1, "bytes", manifest_mod.MAX_FILE_BYTES + 1), "'bytes'"),
    "bytes-huge": (set_file(1, "bytes", 10**30), "'bytes'"),
    "bytes-float": (set_file(1, "bytes", 4096.0), "'bytes'"),
    "bytes-str": (set_file(1, "bytes", "4096"), "'bytes'"),
    "bytes-bool": (set_file(1, "bytes", True), "'bytes'"),
    "rank-eq-world": (set_file(2, "rank", 2), "'rank'"),
    "rank-above-world": (set_file(2, "rank", 99), "'rank'"),
    "rank-negative": (set_file(0, "rank", -1), "'rank'"),
    "world-zero": (set_top("world_size", 0), "'world_size'"),
    "world-absurd": (set_top("world_size", manifest_mod.MAX_WORLD_SIZE + 1), "'world_size'"),
    "step-negative": (set_top("step", -5), "'step'"),
    "step-str": (set_top("step", "12"), "'step'"),
    # digests
    "digest-algo": (set_file(0, "digest", "md5:" + "a" * 32), "malformed digest"),
    "digest-upper": (set_file(0, "digest", "xxh3_128:" + "A" * 32), "malformed digest"),
    "digest-short": (set_file(0, "digest", "xxh3_128:" + "a" * 31), "malformed digest"),
    "digest-empty": (set_file(0, "digest", ""), "malformed digest"),
    "digest-not-str": (set_file(0, "digest", 5), "'digest'"),
    # structure
    "files-not-list": (set_top("files", {"a": 1}), "'files'"),
    "files-missing": (drop_top("files"), "'files'"),
    "file-entry-not-object": (lambda o: o["files"].append("x"), "not an object"),
    "state-not-strings": (set_top("state", ["model", 3]), "'state'"),
    "bytes-per-rank-floats": (set_top("bytes_per_rank", [1.5]), "'bytes_per_rank'"),
    "created-at-str": (set_top("created_at", "now"), "'created_at'"),
    "milestone-int": (set_top("milestone", 1), "'milestone'"),
    "config-list": (set_top("config", [1, 2]), "'config'"),
    "run-id-missing": (drop_top("run_id"), "'run_id'"),
    "files-digest-wrong": (set_top("files_digest", "xxh3_128:" + "c" * 32), "'files_digest'"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_validation_rejects(tmp_path: Path, case: str) -> None:
    mutate, message = BAD_MANIFESTS[case]
    obj = copy.deepcopy(valid_obj())
    mutate(obj)
    obj = reseal(obj)
    if case == "files-digest-wrong":
        obj["files_digest"] = "xxh3_128:" + "c" * 32  # reseal recomputed it; forge it again
        obj.pop("self_digest")
        obj["self_digest"] = fingerprint(obj)
    write_obj(tmp_path, obj)
    with pytest.raises(ManifestError, match=message) as info:
        read_manifest(tmp_path)
    assert str(tmp_path / MANIFEST_FILE) in str(info.value)
    # the in-memory parser applies exactly the same rules
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json_obj(obj)


def test_unknown_schema_message_says_upgrade(tmp_path: Path) -> None:
    obj = reseal({**valid_obj(), "schema_version": SCHEMA_VERSION + 1})
    write_obj(tmp_path, obj)
    with pytest.raises(ManifestError) as info:
        read_manifest(tmp_path)
    msg = str(info.value)
    assert f"schema_version {SCHEMA_VERSION + 1}" in msg
    assert "upgrade dckpt" in msg


@pytest.mark.parametrize("version", [True, 1.0])
def test_schema_version_must_be_an_int(tmp_path: Path, version: Any) -> None:
    write_obj(tmp_path, reseal({**valid_obj(), "schema_version": version}))
    with pytest.raises(ManifestError):
        read_manifest(tmp_path)


def test_config_fingerprint_must_match_config(tmp_path: Path) -> None:
    obj = valid_obj()
    obj["config"] = {**obj["config"], "lr": 0.5}
    write_obj(tmp_path, reseal(obj))
    with pytest.raises(ManifestError):
        read_manifest(tmp_path)


def test_digest_algorithm_must_be_known(tmp_path: Path) -> None:
    write_obj(tmp_path, reseal({**valid_obj(), "digest_algorithm": "md5"}))
    with pytest.raises(ManifestError):
        read_manifest(tmp_path)


def test_self_digest_mismatch_is_integrity_error(tmp_path: Path) -> None:
    obj = valid_obj()
    obj["step"] = 1300  # edited without resealing
    write_obj(tmp_path, obj)
    with pytest.raises(IntegrityError, match="self-digest") as info:
        read_manifest(tmp_path)
    assert info.value.path == str(tmp_path / MANIFEST_FILE)
    # and a missing self_digest is the same failure
    obj = valid_obj()
    del obj["self_digest"]
    write_obj(tmp_path, obj)
    with pytest.raises(IntegrityError):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{not json",
        b'{"schema_version": 1,',
        b"\xff\xfe{}",  # not UTF-8
        b"NaN",
    ],
)
def test_invalid_json_rejected(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / MANIFEST_FILE).write_bytes(raw)
    with pytest.raises(ManifestError):
        read_manifest(tmp_path)


@pytest.mark.parametrize("top", [[], [valid_obj()], "manifest", 1, None])
def test_non_object_top_level_rejected(tmp_path: Path, top: Any) -> None:
    write_obj(tmp_path, top)
    with pytest.raises(ManifestError, match="not a JSON object"):
        read_manifest(tmp_path)


def test_non_finite_number_rejected(tmp_path: Path) -> None:
    obj = valid_obj()
    obj["loss"] = {"last": float("nan")}
    write_obj(tmp_path, obj)  # json.dumps writes NaN, json.loads reads it back
    with pytest.raises(ManifestError, match="non-finite"):
        read_manifest(tmp_path)


def test_oversized_manifest_rejected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_manifest(tmp_path, make_manifest())
    size = (tmp_path / MANIFEST_FILE).stat().st_size
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", size)
    assert read_manifest(tmp_path).step == 1200  # exactly at the limit is fine
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(ManifestError, match=f"{size} bytes, over {size - 1}"):
        read_manifest(tmp_path)


def test_symlinked_manifest_rejected(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_manifest(elsewhere, make_manifest())
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(elsewhere / MANIFEST_FILE, ckpt / MANIFEST_FILE)
    assert read_manifest(elsewhere).step == 1200  # the target itself is valid
    with pytest.raises(ManifestError, match="symlink"):
        read_manifest(ckpt)


@pytest.mark.timeout(10)
def test_fifo_manifest_rejected_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / MANIFEST_FILE)
    with pytest.raises(ManifestError, match="not a regular file"):
        read_manifest(tmp_path)


def test_directory_manifest_rejected(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_FILE).mkdir()
    with pytest.raises(ManifestError):
        read_manifest(tmp_path)


def test_missing_manifest_rejected(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not a committed checkpoint"):
        read_manifest(tmp_path)
    with pytest.raises(ManifestError):
        read_manifest(tmp_path / "no-such-dir")


def test_every_single_bit_flip_is_detected(tmp_path: Path) -> None:
    files = (FileRecord(path="__0_0.distcp", bytes=10, digest=DIGEST_A, rank=0),)
    original = make_manifest(files=files, world_size=1, bytes_per_rank=(10,))
    write_manifest(tmp_path, original)
    path = tmp_path / MANIFEST_FILE
    good = path.read_bytes()
    assert read_manifest(tmp_path) == original
    silently_different: list[tuple[int, int]] = []
    loaded_equal: list[tuple[int, int]] = []
    fd = os.open(path, os.O_RDWR)
    try:
        for pos in range(len(good)):
            for bit in range(8):
                # flip in place (no truncate-and-rewrite, which makes ext4 flush every time)
                os.pwrite(fd, bytes([good[pos] ^ (1 << bit)]), pos)
                try:
                    loaded = read_manifest(tmp_path)
                except (IntegrityError, ManifestError):
                    continue
                finally:
                    os.pwrite(fd, good[pos : pos + 1], pos)
                (loaded_equal if loaded == original else silently_different).append((pos, bit))
    finally:
        os.close(fd)
    assert path.read_bytes() == good
    assert silently_different == [], "bit flips loaded with different content"
    # The self-digest covers the parsed content, not the bytes: the only flips that may load
    # are the case of a hex letter in a \uXXXX escape, which decodes to the same character.
    for pos, bit in loaded_equal:
        escape_start = good.rfind(b"\\u", 0, pos + 1)
        assert bit == 5 and 0 <= pos - escape_start - 2 < 4, (pos, bit)
        assert chr(good[pos]) in "abcdef"


# --- check_layout -----------------------------------------------------------------------------


def layout(tmp_path: Path) -> tuple[Path, Manifest]:
    """A directory with real files and a manifest that describes them exactly."""
    ckpt = tmp_path / "step-00000001"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"m" * 17)
    (ckpt / "__0_0.distcp").write_bytes(os.urandom(1000))
    (ckpt / "empty.distcp").write_bytes(b"")
    records = []
    for name in (".metadata", "__0_0.distcp", "empty.distcp"):
        digest, size = hash_file(ckpt / name, "xxh3_128")
        records.append(FileRecord(path=name, bytes=size, digest=digest, rank=0))
    m = make_manifest(files=tuple(records), world_size=1, bytes_per_rank=(1017,))
    write_manifest(ckpt, m)
    return ckpt, m


def test_check_layout_accepts_exact_layout(tmp_path: Path) -> None:
    ckpt, m = layout(tmp_path)
    check_layout(ckpt, m)
    (ckpt / "unlisted.txt").write_text("extra files are not the layout's concern")
    check_layout(ckpt, m)


def test_check_layout_missing_file(tmp_path: Path) -> None:
    ckpt, m = layout(tmp_path)
    (ckpt / "__0_0.distcp").unlink()
    with pytest.raises(IntegrityError, match="file missing") as info:
        check_layout(ckpt, m)
    assert info.value.path == str(ckpt / "__0_0.distcp")


@pytest.mark.parametrize("delta", [-1, 1, -1000])
def test_check_layout_size_mismatch(tmp_path: Path, delta: int) -> None:
    ckpt, m = layout(tmp_path)
    target = ckpt / "__0_0.distcp"
    data = target.read_bytes()
    target.write_bytes(data[:delta] if delta < 0 else data + b"\0" * delta)
    with pytest.raises(IntegrityError, match="size mismatch") as info:
        check_layout(ckpt, m)
    assert "__0_0.distcp" in str(info.value)
    assert "1000 bytes" in str(info.value)


def test_check_layout_symlink_to_identical_file(tmp_path: Path) -> None:
    ckpt, m = layout(tmp_path)
    target = ckpt / "__0_0.distcp"
    copy_ = tmp_path / "copy.distcp"
    copy_.write_bytes(target.read_bytes())  # same size, same bytes: only the type is wrong
    target.unlink()
    os.symlink(copy_, target)
    with pytest.raises(IntegrityError, match="a symlink") as info:
        check_layout(ckpt, m)
    assert info.value.path == str(target)


def test_check_layout_fifo(tmp_path: Path) -> None:
    ckpt, m = layout(tmp_path)
    (ckpt / "__0_0.distcp").unlink()
    os.mkfifo(ckpt / "__0_0.distcp")
    with pytest.raises(IntegrityError, match="not a regular file"):
        check_layout(ckpt, m)


def test_check_layout_directory(tmp_path: Path) -> None:
    ckpt, m = layout(tmp_path)
    (ckpt / "empty.distcp").unlink()
    (ckpt / "empty.distcp").mkdir()
    with pytest.raises(IntegrityError, match="wrong file type"):
        check_layout(ckpt, m)


def test_check_layout_rejects_symlinked_parent_dir(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s" * 10)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside, ckpt / "sub")
    digest, size = hash_file(outside / "secret", "xxh3_128")
    m = make_manifest(
        files=(FileRecord(path="sub/secret", bytes=size, digest=digest, rank=0),),
        world_size=1,
        bytes_per_rank=(size,),
    )
    write_manifest(ckpt, m)
    with pytest.raises(ManifestError, match="escapes"):
        read_manifest(ckpt)  # a path with a separator could only be followed elsewhere
