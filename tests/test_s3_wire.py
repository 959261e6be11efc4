"""What the way to the store can do to an s3:// root, against a real S3 server (moto's, on
127.0.0.1) behind a proxy that changes answers on their way back (``FaultProxy.mangle``):

- a root written as a plain string reaches the bucket; one that reads like a URL but lost
  its ``//`` (what ``pathlib.Path("s3://...")`` makes of it) is refused, never turned into a
  local directory;
- one bit flipped in one answer is read again, not called damage: for a ranged download (no
  checksum covers it, the digest finds it; a download and a check that only hashes alike)
  and for a whole-object GET (botocore's own checksum finds it); the same flip on every read
  is damage, named; reads damaged each differently, or failing botocore's checksum every
  time, are the way's fault (StorageError);
- a body longer than the range asked for is refused after one span of reading; a listing
  that repeats its continuation token stops at the second page;
- a 2-rank resume whose shard is flipped in its first GET (one GET per shard, and 5 MiB
  ranged GETs) resumes from that step, quarantines nothing and says what it re-read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from s3_kit import FaultProxy, MotoServer, moto_server
from torch import nn

from dckpt.errors import IntegrityError, StorageError
from dckpt.storage.digest import hash_file

pytestmark = pytest.mark.multiproc

PART = 5 << 20


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    with moto_server() as server:
        yield server


@pytest.fixture
def proxied(
    s3: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[FaultProxy, dict[str, str]]]:
    proxy = FaultProxy(s3.port)
    env = s3.env(proxy.endpoint)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        yield proxy, env
    finally:
        proxy.close()


def _store(bucket: str, **kwargs: Any) -> Any:
    from dckpt.tiers.s3_store import S3Store
    from dckpt.tiers.url import parse_url

    return S3Store(parse_url(f"s3://{bucket}/run"), **kwargs)


def _flip_first(match: Callable[[str, str, bytes], bool], times: int = 1) -> Any:
    """A ``mangle`` that flips one bit in the first ``times`` answers ``match`` accepts."""
    flipped: list[str] = []

    def mangle(method: str, path: str, status: int, body: bytes) -> bytes:
        if len(flipped) >= times or not body or not match(method, path, body):
            return body
        flipped.append(path)
        damaged = bytearray(body)
        damaged[len(damaged) // 3] ^= 0x04
        return bytes(damaged)

    mangle.flipped = flipped  # type: ignore[attr-defined]
    return mangle


def test_a_plain_string_root_reaches_the_bucket_and_a_mangled_url_is_refused(
    s3: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import dckpt_cli

    import dckpt

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DCKPT_CACHE_DIR", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    bucket = s3.bucket()
    model = nn.Linear(4, 4)
    state = dckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with dckpt.CheckpointManager(f"s3://{bucket}/plain", state) as mgr:  # the README's line
        mgr.save(1).result()
    keys = s3.keys(bucket)
    assert "plain/step-00000001/manifest.json" in keys and "plain/latest" in keys
    assert list(work.iterdir()) == []  # no ./s3:/ directory

    for root, hint in (
        (Path(f"s3://{bucket}/plain"), "pass the URL as a str"),  # pathlib ate a slash
        (f"s3:/{bucket}/plain", f"write 's3://{bucket}/plain'"),
        (f"s3:{bucket}/plain", f"write 's3://{bucket}/plain'"),
    ):
        with pytest.raises(ValueError, match=re.escape(hint)):
            dckpt.CheckpointManager(root, state)  # type: ignore[arg-type]
    listed = dckpt_cli("ls", f"s3:/{bucket}/plain")
    assert listed.returncode == 2 and "without its '//'" in listed.stderr, listed.stderr
    assert list(work.iterdir()) == []


def test_a_flipped_read_is_read_again_and_only_a_flip_on_every_read_is_damage(
    s3: MotoServer, proxied: tuple[FaultProxy, dict[str, str]], tmp_path: Path
) -> None:
    proxy, _ = proxied
    bucket = s3.bucket()
    store = _store(bucket, part_bytes=PART, concurrency=2, attempts=2)
    src = tmp_path / "shard"
    src.write_bytes(os.urandom(2 * PART + 777))
    want, size = hash_file(src, "xxh3_128")[0], src.stat().st_size
    store.upload_file(src, "run/shard", "xxh3_128")
    dest = tmp_path / "back"

    # One ranged answer flipped: no checksum covers a range, the digest finds it.
    proxy.mangle = _flip_first(lambda m, p, b: m == "GET" and "run/shard" in p and len(b) == PART)
    assert store.download_verified("run/shard", dest, size, want) == 2
    assert len(proxy.mangle.flipped) == 1 and dest.read_bytes() == src.read_bytes()
    # The same for a check that only hashes (`dckpt verify`, the bucket's look before a
    # quarantine, an object no rank read): the second reading is the answer.
    proxy.mangle = _flip_first(lambda m, p, b: m == "GET" and "run/shard" in p and len(b) == PART)
    assert store.check("run/shard", size, want) == want
    assert len(proxy.mangle.flipped) == 1
    # Flipped on every read: the object is damaged, said so, and nothing is left behind.
    proxy.mangle = _flip_first(lambda m, p, b: m == "GET" and len(b) == PART, times=10**6)
    with pytest.raises(
        IntegrityError, match=r"differ from the digest its writer computed \(read twice\)"
    ):
        store.download_verified("run/shard", dest, size, want)
    assert not dest.exists()
    assert store.check("run/shard", size, want) != want  # `dckpt verify`'s read: read twice too

    # A whole-object GET: botocore's own checksum catches the flip first; read again.
    small = tmp_path / "small"
    small.write_bytes(os.urandom(4096))
    small_want = hash_file(small, "xxh3_128")[0]
    store.upload_file(small, "run/small", "xxh3_128")
    proxy.mangle = _flip_first(lambda m, p, b: m == "GET" and "run/small" in p)
    assert store.download_verified("run/small", dest, 4096, small_want) == 2
    assert dest.read_bytes() == small.read_bytes()
    # Every read failing botocore's checksum cannot tell the store from the way: a
    # StorageError (check the network), not damage that would quarantine the step.
    proxy.mangle = _flip_first(lambda m, p, b: m == "GET" and "run/small" in p, times=10**6)
    with pytest.raises(StorageError, match="every read failed the store's own checksum"):
        store.download_verified("run/small", dest, 4096, small_want)

    # Two reads damaged differently (no checksum on a range): the way, not the store.
    flips = iter(range(1, 10**6))

    def elsewhere_each_time(method: str, path: str, status: int, body: bytes) -> bytes:
        if method != "GET" or "run/shard" not in path or len(body) != PART:
            return body
        damaged = bytearray(body)
        damaged[next(flips) * 4099 % len(damaged)] ^= 0x01
        return bytes(damaged)

    proxy.mangle = elsewhere_each_time
    with pytest.raises(StorageError, match="two reads gave two different digests"):
        store.download_verified("run/shard", dest, size, want)


def test_an_overlong_body_and_an_endless_listing_are_refused(
    s3: MotoServer, proxied: tuple[FaultProxy, dict[str, str]], tmp_path: Path
) -> None:
    proxy, _ = proxied
    bucket = s3.bucket()
    store = _store(bucket, part_bytes=PART, concurrency=1, attempts=2)
    src = tmp_path / "shard"
    src.write_bytes(os.urandom(2 * PART))
    store.upload_file(src, "run/shard", "xxh3_128")

    # A store that ignores Range and answers each GET with ten times the span.
    proxy.mangle = lambda m, p, s, b: b * 10 if m == "GET" and "run/shard" in p else b
    with pytest.raises(StorageError, match="ignores the Range header"):
        store.download_file("run/shard", tmp_path / "back", 2 * PART, "xxh3_128")

    # A listing that always says "more", with the same continuation token.
    page = (
        b"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult><Name>" + bucket.encode()
        + b"</Name><Prefix>run/</Prefix><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys>"
        b"<IsTruncated>true</IsTruncated><NextContinuationToken>again</NextContinuationToken>"
        b"</ListBucketResult>"
    )  # fmt: skip

    def endless(method: str, path: str, status: int, body: bytes) -> bytes | tuple[int, bytes]:
        return (200, page) if method == "GET" and "list-type=2" in path else body

    proxy.mangle = endless
    proxy.seen.clear()
    with pytest.raises(StorageError, match="a continuation marker it had already returned"):
        store.list("run/")
    assert sum(1 for m, p, _ in proxy.seen if "list-type=2" in p) == 2


def _listing(bucket: str, token: str, keys: list[str], more: bool) -> bytes:
    contents = "".join(
        f"<Contents><Key>{k}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
        f"<ETag>&quot;x&quot;</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass>"
        "</Contents>"
        for k in keys
    )
    tail = f"<NextContinuationToken>{token}</NextContinuationToken>" if more else ""
    return (
        f"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult><Name>{bucket}</Name>"
        f"<Prefix>run/</Prefix><KeyCount>{len(keys)}</KeyCount><MaxKeys>1000</MaxKeys>"
        f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>{contents}{tail}"
        "</ListBucketResult>"
    ).encode()


def test_a_listing_is_bounded_in_bytes_not_only_in_pages(
    s3: MotoServer,
    proxied: tuple[FaultProxy, dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hostile endpoint streaming a fresh marker with every page (the review: 234 MiB per
    1000 pages, ~23 GiB before the page cap) is refused by size: a marker longer than S3's
    is refused at once, and the keys and markers held stop at ``MAX_LISTING_BYTES`` (lowered
    here to 64 KiB). The other side: a listing of many short pages within it is read whole."""
    from dckpt.tiers import s3_store

    proxy, _ = proxied
    bucket = s3.bucket()
    store = _store(bucket, part_bytes=PART, concurrency=1, attempts=2)
    pages = iter(range(10**6))

    def huge_markers(method: str, path: str, status: int, body: bytes) -> Any:
        if method == "GET" and "list-type=2" in path:
            return (200, _listing(bucket, f"{next(pages):08d}" + "m" * 200_000, [], True))
        return body

    proxy.mangle = huge_markers
    proxy.seen.clear()
    with pytest.raises(StorageError, match="continuation marker of 2000"):
        store.list("run/")
    assert sum(1 for m, p, _ in proxy.seen if "list-type=2" in p) == 1

    monkeypatch.setattr(s3_store, "MAX_LISTING_BYTES", 64 << 10)
    long_keys = [f"run/{'k' * 900}{i}" for i in range(10)]

    def fresh_pages(method: str, path: str, status: int, body: bytes) -> Any:
        if method == "GET" and "list-type=2" in path:
            return (200, _listing(bucket, f"t{next(pages)}", long_keys, True))
        return body

    proxy.mangle = fresh_pages
    proxy.seen.clear()
    with pytest.raises(StorageError, match=r"over 65\.54 KB of keys and markers"):
        store.list("run/")
    assert sum(1 for m, p, _ in proxy.seen if "list-type=2" in p) <= 8

    served = iter(range(20))

    def twenty_pages(method: str, path: str, status: int, body: bytes) -> Any:
        if method == "GET" and "list-type=2" in path:
            n = next(served)
            return (200, _listing(bucket, f"t{n}", [f"run/step-{n:08d}/a"], n < 19))
        return body

    proxy.mangle = twenty_pages
    assert [o.key for o in store.list("run/")] == [f"run/step-{n:08d}/a" for n in range(20)]


def _model(width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(width, width), nn.ReLU()))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _save(rank: int, world: int, root: str, mirror: str, width: int) -> list[Any]:
    import dckpt

    model, opt = _model(width)
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(root=root, mirror=Path(mirror) / f"node{rank}")
    with dckpt.CheckpointManager(config, state) as mgr:
        for step in (4, 8):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            state.step = step
            mgr.save(step).result()
    return [p.detach().flatten()[:8].tolist() for p in model.parameters()]


def _resume(rank: int, world: int, root: str, mirror: str, width: int) -> Any:
    import dckpt

    model, opt = _model(width)
    state = dckpt.TrainState(model, opt)
    config = dckpt.CheckpointConfig(root=root, mirror=Path(mirror) / f"node{rank}")
    with dckpt.CheckpointManager(config, state) as mgr:
        report = mgr.resume()
    weights = [p.detach().flatten()[:8].tolist() for p in model.parameters()]
    return state.step, weights, report.format()


@pytest.mark.faults
@pytest.mark.parametrize(
    "width, ranged", [(16, False), (1600, True)], ids=["one-GET-per-shard", "ranged-GETs"]
)
def test_a_resume_through_one_flipped_read_resumes_from_that_step(
    s3: MotoServer,
    proxied: tuple[FaultProxy, dict[str, str]],
    tmp_path: Path,
    width: int,
    ranged: bool,
    fault_trials: Any,
) -> None:
    proxy, env = proxied
    env = {**env, "DCKPT_S3_PART_MB": "5"}
    bucket = s3.bucket()
    root = f"s3://{bucket}/r"
    saved = run_world(_save, 2, root, str(tmp_path / "save"), width, env=env)

    def first_shard_read(method: str, path: str, body: bytes) -> bool:
        return (
            method == "GET"
            and re.search(r"step-00000008/__\d+_0\.distcp", path) is not None
            and (len(body) == PART if ranged else True)
        )

    proxy.mangle = flip = _flip_first(first_shard_read)
    results = run_world(_resume, 2, root, str(tmp_path / "other-node"), width, env=env)
    assert len(flip.flipped) == 1, proxy.seen  # the flip really happened
    assert [r[0] for r in results] == [8, 8] and [r[1] for r in results] == saved
    assert not [k for k in s3.keys(bucket) if "quarantine" in k]
    reports = "\n".join(r[2] for r in results)
    # Said on rank 0 whichever rank met the flip: a warning with the rank and the file.
    assert re.search(r"rank \d re-read __\d+_0\.distcp: the first download differed", results[0][2])
    assert "a fresh read matched" in results[0][2], reports
    fault_trials.record(
        "s3: a bit flipped on the wire", "ranged GET" if ranged else "one GET", survived=True
    )
