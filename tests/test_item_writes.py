"""The written half of the capture check, in-process (dckpt.storage.item_writes,
dckpt.storage.tensor_digest): the writer digests exactly the bytes torch.save hands it for an
expected tensor, in the form the capture took, and nothing else; the host's GPU fingerprint
is the device formula, computed another way."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from dckpt.storage import tensor_digest as td
from dckpt.storage.digest import new_hasher
from dckpt.storage.hashing_writer import _HashingStream
from dckpt.storage.item_writes import ItemWrites


class _Raw(io.RawIOBase):
    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.data += bytes(b)
        return len(memoryview(b))

    def tell(self) -> int:
        return len(self.data)


def _save(writes: ItemWrites, *tensors: torch.Tensor) -> bytes:
    raw = _Raw()
    stream = _HashingStream(raw, new_hasher("xxh3_128"), writes=writes)  # type: ignore[arg-type]
    for t in tensors:
        torch.save(t, stream)
    return bytes(raw.data)


def test_the_writer_digests_an_expected_tensors_bytes_as_the_capture_would() -> None:
    writes = ItemWrites()
    a, b, empty = torch.randn(300, 7), torch.arange(1000, dtype=torch.int32), torch.zeros(0)
    writes.expect("a", a, "x")
    writes.expect("b", b, "g")
    writes.expect("empty", empty, "x")
    other = torch.randn(300, 7)  # the same size, another storage: not what was expected
    _save(writes, a, other, b, empty)
    got = writes.written()
    assert got == {
        "a": td.host_digest(a),
        "b": td.fingerprint_digest(td.shape_prefix(b), td.fingerprint(b)),
        "empty": td.host_digest(empty),
    }


def test_a_tensor_changed_before_it_is_written_is_digested_as_written() -> None:
    """The stale-buffer case: the digest is of what went to the file, not of what was
    expected when the tensor was registered."""
    writes = ItemWrites()
    t = torch.randn(64, 64)
    captured = td.host_digest(t)
    writes.expect("w", t, "x")
    t[0, 0] += 1.0  # the buffer changes between the hand-off and the write
    _save(writes, t)
    assert writes.written()["w"] == td.host_digest(t) != captured


def test_copy_hashed_digests_the_source_whole_or_in_pieces() -> None:
    small, large = torch.randn(1000), torch.randn(3 * td.FUSED_PIECE // 4 + 5)
    for src in (small, large, torch.randn(40, 30).t()):
        dst = torch.empty_like(src.contiguous())
        assert td.copy_hashed(dst, src) == td.host_digest(src)
        assert torch.equal(dst, src)


def _int64_formula(t: torch.Tensor) -> list[int]:
    """The device formula, as the GPU computes it (int64 temporaries), on the CPU."""
    words = td._words(t)
    acc = torch.zeros(2, dtype=torch.int64)
    for start in range(0, words.numel(), td._CHUNK):
        chunk = words[start : start + td._CHUNK].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + chunk.numel())
        acc[0] += chunk.sum()
        acc[1] += (chunk * weights.mul_(td._MIX)).sum()
    return list(acc.tolist())


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(10),
        torch.randn(3 * 1024 * 1024 + 17),
        torch.randint(-(2**31), 2**31 - 1, (2**21 + 3,), dtype=torch.int32),
        torch.full((2**21,), 2**31 - 1, dtype=torch.int32),  # the largest words: 2**51 a block
        torch.full((2**21,), -(2**31), dtype=torch.int32),
        torch.randn(101, dtype=torch.bfloat16)[1:],  # at an odd offset
        torch.tensor([1, 2, 3], dtype=torch.uint8),  # not whole words
        torch.zeros(0),
    ],
    ids=["10", "3M+17", "int32", "max", "min", "offset", "bytes", "empty"],
)
def test_the_host_fingerprint_is_the_device_formula(tensor: torch.Tensor) -> None:
    assert td.fingerprint(tensor).tolist() == _int64_formula(tensor)
