"""Item digests: a rank proves the items it reads of another rank's file, not the whole file.

- The writer's segments are DCP's items, exactly: one per item, each hashing to the item's
  bytes, tiling the file (a real DCP save through the hashing writer).
- A reader of a file it does not own (``owned``) hashes only the segments of the items it
  reads: a flipped bit inside one of them fails the load naming the file and the bytes; a
  flipped bit in an item it does not read is left to the file's owner (it loads; the owner's
  whole-file hash is what catches it, as ``test_resume_share`` shows on real ranks).
- A sidecar that does not tile its file, or is not the writer's shape, is refused before any
  item is read; a file without one, or an item past ``LIMIT`` (which gets no digest), is
  hashed whole.
- On two FSDP2 ranks with AdamW (whose step counters DCP spreads over both ranks' files),
  each rank hashes about its share of the checkpoint, not all of it, and a bit flipped in an
  item one rank reads from the other's file quarantines the step and falls back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_harness import run_world
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from dckpt.errors import IntegrityError, unwrap_dcp_error
from dckpt.storage import HashingWriter, SafeLoadPlanner, VerifyingReader
from dckpt.storage.digest import new_hasher
from dckpt.storage.item_digests import LIMIT, ItemHasher, items_name, parse_items

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD = "__0_0.distcp"


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 32, generator=gen),
        "b": torch.arange(16, dtype=torch.float64),
        "step": torch.tensor(7.0),
        "extra": {"name": "run", "lrs": [0.1, 0.2]},
    }


def _blank() -> dict[str, Any]:
    return {
        "w": torch.zeros(64, 32),
        "b": torch.zeros(16, dtype=torch.float64),
        "step": torch.tensor(0.0),
        "extra": {"name": None, "lrs": None},
    }


def _save(directory: Path) -> dict[str, Any]:
    writer = HashingWriter(directory, rank=0)
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    return {r.path: r for r in writer.records()}


def _spans(directory: Path) -> dict[str, tuple[int, int]]:
    """Each item's (offset, length) in the shard, by fqn, from DCP's own metadata."""
    md = FileSystemReader(str(directory)).read_metadata()
    return {
        idx.fqn: (info.offset, info.length)
        for idx, info in md.storage_data.items()
        if info.relative_path == SHARD
    }


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _load(
    directory: Path, records: dict[str, Any], target: dict[str, Any], owned: Any = frozenset()
) -> VerifyingReader:
    """DCP's load through the reader (owning nothing, by default), raising the reader's own
    error rather than DCP's wrapper, as dckpt's loads do."""
    reader = VerifyingReader(directory, records, owned=owned)
    try:
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointException as exc:
        raise unwrap_dcp_error(exc) from None
    return reader


def test_the_segments_are_dcps_items_and_tile_the_file(tmp_path: Path) -> None:
    records = _save(tmp_path)
    assert set(records) == {".metadata", SHARD, items_name(SHARD)}  # none for .metadata
    raw = (tmp_path / items_name(SHARD)).read_bytes()
    digests = parse_items(raw, SHARD, records[SHARD].bytes, "sidecar")
    spans = _spans(tmp_path)
    data = (tmp_path / SHARD).read_bytes()
    assert len(digests.digests) == len(spans)  # one segment per item, no more
    for offset, length in spans.values():
        (segment,) = digests.covering(offset, length)
        assert segment[:2] == (offset, length)
        hasher = new_hasher("xxh3_128")
        hasher.update(data[offset : offset + length])
        assert segment[2] == f"xxh3_128:{hasher.hexdigest()}"


def test_a_reader_that_owns_nothing_hashes_only_the_items_it_reads(tmp_path: Path) -> None:
    records = _save(tmp_path)
    target = _blank()
    reader = _load(tmp_path, records, target)
    assert torch.equal(target["w"], _state()["w"]) and target["extra"] == _state()["extra"]
    assert SHARD not in reader.verified and reader.items_checked == len(_spans(tmp_path))
    # a partial load: only "b" read, so only its bytes (and the small files) are hashed
    part = {"b": torch.zeros(16, dtype=torch.float64)}
    reader = _load(tmp_path, records, part)
    small = records[".metadata"].bytes + records[items_name(SHARD)].bytes
    assert reader.hashed_bytes == small + _spans(tmp_path)["b"][1]
    assert torch.equal(part["b"], _state()["b"])


def test_a_flipped_bit_in_an_item_read_is_named_and_one_not_read_is_left_to_the_owner(
    tmp_path: Path,
) -> None:
    records = _save(tmp_path)
    spans = _spans(tmp_path)
    offset, length = spans["w"]
    _flip(tmp_path / SHARD, offset + length // 2)
    with pytest.raises(IntegrityError) as caught:
        _load(tmp_path, records, {"w": torch.zeros(64, 32)})
    message = str(caught.value)
    assert SHARD in message and f"bytes {offset}-{offset + length}" in message, message
    assert "(an item this rank read)" in message and not caught.value.divergent
    # "b" is another item of the same file: its own bytes are intact, and it loads
    part = {"b": torch.zeros(16, dtype=torch.float64)}
    _load(tmp_path, records, part)
    assert torch.equal(part["b"], _state()["b"])
    # the whole-file reader (the owner's) refuses the file for the flip in "w"
    with pytest.raises(IntegrityError, match="digest mismatch"):
        _load(tmp_path, records, _blank(), owned=None)


def test_an_item_too_large_for_a_digest_makes_its_reader_hash_the_whole_file(
    tmp_path: Path,
) -> None:
    """Items past ``LIMIT`` get no digest (hashing every byte twice cost a background save a
    third more writer CPU): a reader of one hashes the whole file, as before item digests."""
    big = {"big": torch.arange((LIMIT // 4) + 1024, dtype=torch.float32), "small": torch.ones(3)}
    writer = HashingWriter(tmp_path, rank=0)
    dcp.save(big, storage_writer=writer, no_dist=True)
    records = {r.path: r for r in writer.records()}
    obj = json.loads((tmp_path / items_name(SHARD)).read_bytes())
    assert "" in obj["digests"] and all(
        (d == "") == (n > LIMIT) for n, d in zip(obj["lengths"], obj["digests"], strict=True)
    )
    small = {"small": torch.zeros(3)}
    reader = _load(tmp_path, records, small)  # a small item: its digest alone
    assert SHARD not in reader.verified and reader.items_checked == 1
    target = {"big": torch.zeros_like(big["big"])}
    reader = _load(tmp_path, records, target)  # the large one: the whole file
    assert reader.verified[SHARD] == records[SHARD].digest and reader.items_checked == 0
    assert torch.equal(target["big"], big["big"])


def test_a_file_without_item_digests_is_hashed_whole(tmp_path: Path) -> None:
    records = _save(tmp_path)
    del records[items_name(SHARD)]  # as written before item digests existed
    (tmp_path / items_name(SHARD)).unlink()
    reader = _load(tmp_path, records, _blank())
    assert reader.verified[SHARD] == records[SHARD].digest and reader.items_checked == 0


def _sidecar(**changes: Any) -> bytes:
    hasher = ItemHasher("xxh3_128")
    for part in (b"a" * 10, b"b" * 20):
        hasher.update(part)
        hasher.cut()
    obj = json.loads(hasher.encode("f"))
    obj.update(changes)
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (_sidecar(lengths=[10, 19]), "segments end at byte 29, the file has 30"),
        (_sidecar(lengths=[10, 25]), "segments end at byte 35"),
        (_sidecar(lengths=[0, 30]), "a segment length 0"),
        (_sidecar(lengths=[-10, 40]), "a segment length -10"),
        (_sidecar(lengths=[10.0, 20]), "a segment length 10.0"),
        (_sidecar(digests=["zz" * 16, "00" * 16]), "a segment digest"),
        (_sidecar(digests=["00" * 8, "00" * 16]), "a segment digest"),
        (_sidecar(digests=["00" * 16]), "2 lengths, 1 digests"),
        (_sidecar(digests=["", "00" * 16]), "a segment digest ''"),  # none: only past LIMIT
        (_sidecar(algorithm="md5"), "unknown digest algorithm 'md5'"),
        (_sidecar(file="other"), "describes 'other'"),
        (_sidecar(size=31), "of 31 bytes"),
        (b"[" * 100_000, "not JSON"),
        (b"[]", "not a JSON object"),
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_a_sidecar_that_does_not_tile_its_file_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_items(raw, "f", 30, "f.items")


def test_a_segment_past_the_limit_has_no_digest_and_covers_nothing() -> None:
    hasher = ItemHasher("xxh3_128")
    hasher.update(b"a" * 10)
    hasher.cut()
    hasher.update(bytes(LIMIT + 1))
    d = parse_items(hasher.encode("f"), "f", LIMIT + 11, "f.items")
    assert d.digests[1] == "" and d.covering(12, 5) is None
    assert d.covering(0, 10) is not None


def test_covering_names_every_segment_a_range_touches() -> None:
    d = parse_items(_sidecar(), "f", 30, "f.items")
    assert [s[:2] for s in d.covering(0, 10)] == [(0, 10)]
    assert [s[:2] for s in d.covering(5, 10)] == [(0, 10), (10, 20)]
    assert [s[:2] for s in d.covering(29, 1)] == [(10, 20)]
    assert d.covering(12, 0) == []
    with pytest.raises(ValueError, match="bytes 25-31 of a 30-byte file"):
        d.covering(25, 6)


def test_a_refused_sidecar_fails_the_load_naming_it(tmp_path: Path) -> None:
    records = _save(tmp_path)
    sidecar = tmp_path / items_name(SHARD)
    raw = sidecar.read_bytes()
    first = json.loads(raw)["digests"][0]  # a segment's digest changed, the size kept
    sidecar.write_bytes(
        raw.replace(first.encode(), (("1" if first[0] != "1" else "2") + first[1:]).encode())
    )
    with pytest.raises(IntegrityError, match="digest mismatch") as caught:
        _load(tmp_path, records, _blank())  # its digest no longer matches the manifest's
    assert items_name(SHARD) in str(caught.value)


# --- two FSDP2 ranks ---------------------------------------------------------------------------


def _fsdp(rank: int, world: int, root: str, mode: str) -> dict[str, Any]:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import dckpt

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    cfg = dckpt.CheckpointConfig(root=Path(root), async_save=False, timeout_s=60)
    with dckpt.CheckpointManager(cfg, dckpt.TrainState(model, opt)) as mgr:
        if mode == "save":
            mgr.save(1)
            model(torch.randn(4, 128)).sum().backward()
            opt.step()
            mgr.save(2)
            return {}
        report = mgr.resume()
    return {"step": report.step, "report": report.format()}


def test_each_fsdp_rank_hashes_its_share_and_a_flip_in_an_item_read_falls_back(
    tmp_path: Path,
) -> None:
    run_world(_fsdp, 2, str(tmp_path), "save")
    results = run_world(_fsdp, 2, str(tmp_path), "load")
    step = tmp_path / "step-00000002"
    total = sum(p.stat().st_size for p in step.iterdir() if p.name != "manifest.json")
    for r in results:
        assert r["step"] == 2, r
        found = re.search(r"rank \d hashed ([\d.]+) (KB|MB) of ([\d.]+) (KB|MB)", r["report"])
        assert found, r["report"]
        scale = {"KB": 1e3, "MB": 1e6}
        hashed = float(found[1]) * scale[found[2]]
        assert hashed <= 1.1 * total / 2, (hashed, total, r["report"])  # its share, not all
    # DCP spread the replicated values over the two files: some rank read items of the other's
    assert any("of other ranks' files by item digest" in r["report"] for r in results), results
    # A replicated value (an optimizer step counter) in rank 1's file is read by rank 0 too:
    # flip a bit in one, and the step is damage (quarantined), the resume falls back.
    md = FileSystemReader(str(step)).read_metadata()
    counters = [
        info
        for idx, info in md.storage_data.items()
        if info.relative_path == "__1_0.distcp" and idx.fqn.endswith(".step")
    ]
    assert counters, "no step counter in rank 1's file"
    _flip(step / "__1_0.distcp", counters[0].offset + counters[0].length // 2)
    results = run_world(_fsdp, 2, str(tmp_path), "load")
    for r in results:
        assert r["step"] == 1, r
        assert "skipped step 2 (quarantined)" in r["report"] and "__1_0.distcp" in r["report"]
