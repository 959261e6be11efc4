"""Digest helpers: streaming equals one-shot, strict parsing, an order-free digest of digests."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from pathlib import Path

import pytest
import xxhash

from dckpt.storage import digest as digest_mod
from dckpt.storage.digest import (
    ALGORITHMS,
    digest_of_digests,
    hash_file,
    new_hasher,
    parse_digest,
)

XXH = "xxh3_128:" + "0123456789abcdef" * 2
SHA = "sha256:" + "0123456789abcdef" * 4


def one_shot(algorithm: str, data: bytes) -> str:
    """The reference digest, computed by the hash libraries directly (no dckpt code)."""
    if algorithm == "xxh3_128":
        return "xxh3_128:" + xxhash.xxh3_128_hexdigest(data)
    assert algorithm == "sha256"
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_random(path: Path, size: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


# --- hashing ----------------------------------------------------------------------------------


def test_algorithms_table_matches_hex_lengths() -> None:
    assert ALGORITHMS == {"xxh3_128": 32, "sha256": 64}
    for algorithm, hex_len in ALGORITHMS.items():
        assert len(one_shot(algorithm, b"x").split(":", 1)[1]) == hex_len


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 7])
def test_hash_file_streaming_equals_one_shot_small_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str, size: int
) -> None:
    # A small read chunk makes every size above exercise chunk boundaries (0, 1, many chunks).
    monkeypatch.setattr(digest_mod, "READ_CHUNK", 4096)
    data = write_random(tmp_path / "f.bin", size, seed=size)
    digest, nbytes = hash_file(tmp_path / "f.bin", algorithm)
    assert nbytes == size
    assert digest == one_shot(algorithm, data)
    parse_digest(digest)  # what hash_file produces is always well formed


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_hash_file_default_chunk_across_boundary(tmp_path: Path, algorithm: str) -> None:
    size = digest_mod.READ_CHUNK + 13
    data = write_random(tmp_path / "big.bin", size, seed=7)
    assert hash_file(str(tmp_path / "big.bin"), algorithm) == (one_shot(algorithm, data), size)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_new_hasher_streaming_any_split_equals_one_shot(algorithm: str) -> None:
    data = random.Random(1).randbytes(10_000)
    rng = random.Random(2)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 30)))
        hasher = new_hasher(algorithm)
        for lo, hi in itertools.pairwise([0, *cuts, len(data)]):
            # mix the accepted buffer types, as the writer and reader do
            piece = data[lo:hi]
            hasher.update(memoryview(piece) if lo % 2 else bytearray(piece))
        assert f"{algorithm}:{hasher.hexdigest()}" == one_shot(algorithm, data)


def test_hash_file_differs_on_one_flipped_bit(tmp_path: Path) -> None:
    data = bytearray(write_random(tmp_path / "f.bin", 1000, seed=3))
    before = {a: hash_file(tmp_path / "f.bin", a)[0] for a in ALGORITHMS}
    data[500] ^= 0x01
    (tmp_path / "f.bin").write_bytes(bytes(data))
    for algorithm, old in before.items():
        assert hash_file(tmp_path / "f.bin", algorithm)[0] != old


def test_hash_file_missing_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        hash_file(tmp_path / "nope", "xxh3_128")


@pytest.mark.parametrize("name", ["md5", "sha1", "XXH3_128", "xxh3_64", ""])
def test_new_hasher_rejects_unknown_algorithm(name: str) -> None:
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        new_hasher(name)


# --- parse_digest -----------------------------------------------------------------------------


def test_parse_digest_accepts_well_formed() -> None:
    assert parse_digest(XXH) == ("xxh3_128", "0123456789abcdef" * 2)
    assert parse_digest(SHA) == ("sha256", "0123456789abcdef" * 4)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "xxh3_128",
        "xxh3_128:",
        "0123456789abcdef" * 2,  # no algorithm
        "md5:" + "0" * 32,  # unknown algorithm
        "sha1:" + "0" * 40,
        "XXH3_128:" + "0" * 32,  # algorithm names are lowercase
        "xxh3_128:" + "0" * 31,  # too short
        "xxh3_128:" + "0" * 33,  # too long
        "xxh3_128:" + "0" * 64,  # a sha256-length hex under the xxh3 name
        "sha256:" + "0" * 32,  # an xxh3-length hex under the sha256 name
        "sha256:" + "0" * 63,
        "xxh3_128:" + "A" * 32,  # uppercase hex
        "sha256:" + "0123456789ABCDEF" * 4,
        "xxh3_128:" + "0" * 31 + "g",  # not hex
        "xxh3_128:" + "0" * 30 + "0x",
        "xxh3_128: " + "0" * 32,  # embedded space
        " xxh3_128:" + "0" * 32,  # leading space
        "xxh3_128:" + "0" * 32 + " ",  # trailing space
        "xxh3_128::" + "0" * 32,
        "sha256:xxh3_128:" + "0" * 32,
    ],
)
def test_parse_digest_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="malformed digest"):
        parse_digest(bad)


def test_parse_digest_rejects_trailing_newline() -> None:
    with pytest.raises(ValueError, match="malformed digest"):
        parse_digest(XXH + "\n")


# --- digest_of_digests ------------------------------------------------------------------------


def entries() -> list[tuple[str, int, str]]:
    return [
        (".metadata", 1234, one_shot("xxh3_128", b"meta")),
        ("__0_0.distcp", 5_000_000, one_shot("xxh3_128", b"rank0")),
        ("__1_0.distcp", 4_999_999, one_shot("xxh3_128", b"rank1")),
        ("__1_1.distcp", 0, one_shot("sha256", b"")),
    ]


def test_digest_of_digests_is_order_independent() -> None:
    base = entries()
    expected = digest_of_digests(base)
    for perm in itertools.permutations(base):
        assert digest_of_digests(perm) == expected
    assert digest_of_digests(iter(reversed(base))) == expected  # any iterable, consumed once
    assert parse_digest(expected)[0] == "xxh3_128"


def test_digest_of_digests_algorithm_is_selectable() -> None:
    sha = digest_of_digests(entries(), "sha256")
    assert parse_digest(sha)[0] == "sha256"
    assert sha != digest_of_digests(entries())
    with pytest.raises(ValueError):
        digest_of_digests(entries(), "md5")


def test_digest_of_digests_changes_when_anything_changes() -> None:
    base = entries()
    reference = digest_of_digests(base)
    seen = {reference}
    for i, (path, size, digest) in enumerate(base):
        algorithm, hex_ = parse_digest(digest)
        flipped_hex = ("1" if hex_[0] == "0" else "0") + hex_[1:]
        variants = [
            (path, size + 1, digest),
            (path, size - 1 if size else size + 2, digest),
            (path, size, f"{algorithm}:{flipped_hex}"),
            (path + "x", size, digest),
        ]
        for variant in variants:
            changed = [*base[:i], variant, *base[i + 1 :]]
            result = digest_of_digests(changed)
            assert result != reference, f"entry {i} changed to {variant} but digest did not"
            seen.add(result)
    # every single change gave a distinct digest (no two edits collide either)
    assert len(seen) == 1 + 4 * len(base)
    # dropping or duplicating an entry changes it too
    assert digest_of_digests(base[:-1]) != reference
    assert digest_of_digests([*base, base[0]]) != reference
    assert digest_of_digests([]) != reference


def test_digest_of_digests_fields_do_not_run_together() -> None:
    d = one_shot("xxh3_128", b"x")
    # the same characters split differently between path and size must not collide
    assert digest_of_digests([("a1", 2, d)]) != digest_of_digests([("a", 12, d)])
    assert digest_of_digests([("a", 1, d), ("b", 2, d)]) != digest_of_digests([("a", 12, d)])


def test_hash_file_accepts_pathlike_and_str(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    assert hash_file(path, "sha256") == hash_file(os.fspath(path), "sha256")
    assert hash_file(path, "sha256")[0] == one_shot("sha256", b"abc")
