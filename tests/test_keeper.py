"""The memory tier's keeper, with real processes: replication verified on arrival, reads
verified on the client, crash cleanup, the keep=1 memory bound, and the keeper's lifecycle
(it outlives its spawner, stops on request, exits when its memory is wiped)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from proc_kit import pid_alive

from dckpt.errors import IntegrityError, StorageError
from dckpt.root.layout import step_dir_name
from dckpt.root.manifest import Manifest, parse_manifest, write_manifest
from dckpt.storage.digest import hash_file
from dckpt.storage.records import FileRecord
from dckpt.tiers.keeper_client import (
    KeeperClient,
    advertised_host,
    ensure_keeper,
    parse_addr,
    read_keeper_file,
    recv_msg,
    send_msg,
)
from dckpt.tiers.memory_layout import (
    KEEPER_FILE,
    own_dir,
    replica_dir,
    spare_dir,
    take_spare,
    tmp_step_dir,
)

RANK0 = "rank-00000.mem"
RANK1 = "rank-00001.mem"
SIZE = 3 << 20


def _wait_dead(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``nodes(n)``: node n's memory dir; every keeper started on one is killed at the end."""
    made: list[Path] = []
    seen_pids: set[int] = set()

    def make(n: int) -> Path:
        d = tmp_path / "mem" / f"node-{n}"
        made.append(d)
        return d

    yield make
    for d in made:
        rec = read_keeper_file(d)
        if rec is not None:
            seen_pids.add(rec["pid"])
    for pid in seen_pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def _pid(node_dir: Path) -> int:
    rec = read_keeper_file(node_dir)
    assert rec is not None
    return int(rec["pid"])


def write_save(node_dir: Path, step: int, *, seed: int = 0, size: int = SIZE) -> FileRecord:
    """What node 0's workers do for a memory save: write rank 0's file (reusing a spare), then
    the whole save's manifest (rank 1 lives on node 1), and rename the dir committed."""
    own = own_dir(node_dir)
    own.mkdir(parents=True, exist_ok=True)
    tmp = tmp_step_dir(own, step)
    tmp.mkdir()
    target = tmp / RANK0
    take_spare(spare_dir(node_dir, "own"), RANK0, target)
    with open(target, "r+b" if target.exists() else "wb") as f:
        f.truncate(size)
        f.write(os.urandom(size) if seed == 0 else bytes([seed % 256]) * size)
    digest, _ = hash_file(target, "xxh3_128")
    rec0 = FileRecord(path=RANK0, bytes=size, digest=digest, rank=0)
    rec1 = FileRecord(path=RANK1, bytes=size, digest="xxh3_128:" + "1" * 32, rank=1)
    manifest = Manifest(
        step=step,
        world_size=2,
        files=(rec0, rec1),
        run_id="run-keeper",
        save_id="a" * 32,
        created_at=1700000000.5,
        mesh={"world_size": 2, "nodes": [0, 1]},
    )
    write_manifest(tmp, manifest)
    os.rename(tmp, own / step_dir_name(step))
    return rec0


def _flip_bit(path: Path, offset: int = 12345) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _two_keepers(nodes: Callable[[int], Path], keep: int = 1) -> tuple[Path, str, Path, str]:
    d0, d1 = nodes(0), nodes(1)
    a0 = ensure_keeper(d0, 0, keep=keep, host="127.0.0.1")
    a1 = ensure_keeper(d1, 1, keep=keep, host="127.0.0.1")
    return d0, a0, d1, a1


def _tree_bytes(node_dir: Path) -> int:
    return sum(
        p.stat().st_size
        for sub in ("own", "replica", "spare")
        for p in (node_dir / sub).rglob("*")
        if p.is_file()
    )


def test_replicate_read_hello_reuse(nodes: Callable[[int], Path]) -> None:
    d0, a0, d1, a1 = _two_keepers(nodes)
    rec = write_save(d0, 2)
    reply = KeeperClient(a0).committed(2, to=a1)
    assert reply["ok"], reply
    assert reply["replicated"] and reply["files"] == 1 and reply["bytes"] == SIZE

    committed = replica_dir(d1, 0) / step_dir_name(2)
    assert (committed / RANK0).read_bytes() == (own_dir(d0) / step_dir_name(2) / RANK0).read_bytes()
    assert not list(replica_dir(d1, 0).glob("*.tmp-*"))

    c1 = KeeperClient(a1)
    data = c1.read(0, 2, RANK0, rec.bytes, rec.digest)
    assert bytes(data) == (committed / RANK0).read_bytes()
    buf = bytearray(rec.bytes + 10)
    out = c1.read(0, 2, RANK0, rec.bytes, rec.digest, into=memoryview(buf))
    assert isinstance(out, memoryview) and bytes(buf[: rec.bytes]) == bytes(data)
    # the manifest, served from the replica and from the owner, is the writer's
    raw = c1.manifest(0, 2)
    assert raw == KeeperClient(a0).manifest(0, 2)
    assert parse_manifest(raw, "replica").step == 2
    # own files are served by their own keeper too
    assert bytes(KeeperClient(a0).read(0, 2, RANK0, rec.bytes, rec.digest)) == bytes(data)

    hello = c1.hello()
    assert hello["node"] == 1 and hello["replicas"] == {"0": [2]} and hello["own"] == []
    assert KeeperClient(a0).hello()["own"] == [2]

    pid = _pid(d1)
    assert ensure_keeper(d1, 1, host="127.0.0.1") == a1 and _pid(d1) == pid

    with pytest.raises(StorageError, match="cannot serve"):
        c1.read(0, 2, "../keeper.json", 1, rec.digest)
    with pytest.raises(StorageError, match="cannot serve"):
        c1.read(0, 3, RANK0, rec.bytes, rec.digest)
    with pytest.raises(IntegrityError, match="size mismatch"):
        c1.read(0, 2, RANK0, rec.bytes - 1, rec.digest)
    log = (d1 / "keeper.log").read_text()
    assert "started" in log and "committed replica of node 0 step 2" in log
    assert log.count("started") == 1  # written once, not once to the file and once to stderr


def test_flipped_bit_is_refused_by_partner(nodes: Callable[[int], Path]) -> None:
    d0, a0, d1, a1 = _two_keepers(nodes)
    write_save(d0, 2)
    _flip_bit(own_dir(d0) / step_dir_name(2) / RANK0)
    reply = KeeperClient(a0).committed(2, to=a1)
    assert not reply["ok"] and not reply["replicated"]
    assert RANK0 in reply["error"] and "expected xxh3_128:" in reply["error"]
    rdir = replica_dir(d1, 0)
    assert not rdir.exists() or not list(rdir.iterdir())
    assert KeeperClient(a1).hello()["replicas"].get("0", []) == []
    # the local copy stays committed
    assert KeeperClient(a0).hello()["own"] == [2]


def test_put_refuses_files_not_in_manifest(nodes: Callable[[int], Path]) -> None:
    d0, _, _, a1 = _two_keepers(nodes)
    write_save(d0, 2)
    raw = (own_dir(d0) / step_dir_name(2) / "manifest.json").read_bytes()
    for files in (
        [{"path": "../evil", "bytes": 1, "digest": "xxh3_128:" + "0" * 32}],
        [{"path": RANK1, "bytes": SIZE, "digest": "xxh3_128:" + "1" * 32}],  # node 1's
        [],
    ):
        host, port = parse_addr(a1)
        with socket.create_connection((host, port), timeout=10) as s:
            header = {"op": "put", "node": 0, "step": 2, "manifest_bytes": len(raw)}
            send_msg(s, {**header, "files": files})
            s.sendall(raw)
            reply = recv_msg(s)
        assert reply["ok"] is False and reply["error"], files


def test_flipped_bit_in_replica_fails_read(nodes: Callable[[int], Path]) -> None:
    d0, a0, d1, a1 = _two_keepers(nodes)
    rec = write_save(d0, 2)
    assert KeeperClient(a0).committed(2, to=a1)["ok"]
    _flip_bit(replica_dir(d1, 0) / step_dir_name(2) / RANK0, offset=SIZE - 7)
    with pytest.raises(IntegrityError) as info:
        KeeperClient(a1).read(0, 2, RANK0, rec.bytes, rec.digest)
    assert info.value.path == f"keeper://{a1}/node-0/{step_dir_name(2)}/{RANK0}"


def test_keeper_killed_mid_put_leaves_nothing(nodes: Callable[[int], Path]) -> None:
    d0, _, d1, a1 = _two_keepers(nodes)
    size = 16 << 20
    rec = write_save(d0, 2, size=size)
    sdir = own_dir(d0) / step_dir_name(2)
    raw = (sdir / "manifest.json").read_bytes()
    host, port = parse_addr(a1)
    pid = _pid(d1)
    with socket.create_connection((host, port), timeout=10) as s:
        send_msg(
            s,
            {
                "op": "put",
                "node": 0,
                "step": 2,
                "manifest_bytes": len(raw),
                "files": [{"path": RANK0, "bytes": rec.bytes, "digest": rec.digest}],
            },
        )
        s.sendall(raw)
        assert recv_msg(s)["ok"]
        s.sendall((sdir / RANK0).read_bytes()[: size // 2])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the half has landed in the tmp dir
            tmps = list(replica_dir(d1, 0).glob("*.tmp-*"))
            if tmps and (tmps[0] / RANK0).exists() and (tmps[0] / RANK0).stat().st_size:
                break
            time.sleep(0.01)
        else:
            pytest.fail("the keeper never started writing the put")
        os.kill(pid, signal.SIGKILL)
    assert _wait_dead(pid, 5)
    a1b = ensure_keeper(d1, 1, host="127.0.0.1")
    assert _pid(d1) != pid
    assert KeeperClient(a1b).hello()["replicas"].get("0", []) == []
    assert not list(replica_dir(d1, 0).glob("*.tmp-*"))


def test_keep_one_bounds_memory(nodes: Callable[[int], Path]) -> None:
    d0, a0, d1, a1 = _two_keepers(nodes, keep=1)
    c0 = KeeperClient(a0)
    sizes: dict[int, tuple[int, int]] = {}
    for step in range(1, 6):
        write_save(d0, step, seed=step)
        reply = c0.committed(step, to=a1)
        assert reply["ok"], reply
        sizes[step] = (_tree_bytes(d0), _tree_bytes(d1))
        assert c0.hello()["own"] == [step]
        assert KeeperClient(a1).hello()["replicas"] == {"0": [step]}
        assert (replica_dir(d1, 0) / step_dir_name(step) / RANK0).read_bytes()[:1] == bytes([step])
    for d, kind in ((d0, "own"), (d1, "node-0")):
        names = [p.name.split("@", 1)[0] for p in spare_dir(d, kind).iterdir()]
        assert len(names) == len(set(names)) <= 1, names
        assert not list((d / "own").glob("*.tmp-*"))
    assert sizes[5] == sizes[2], sizes


def test_keeper_outlives_spawner_stops_and_exits_when_wiped(
    nodes: Callable[[int], Path],
) -> None:
    d0 = nodes(0)
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from dckpt.tiers.keeper_client import ensure_keeper
        print(ensure_keeper(Path({str(d0)!r}), 0, host="127.0.0.1"), flush=True)
        time.sleep(120)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        addr = child.stdout.readline().strip()
        assert addr, "the spawner printed no address"
    finally:
        child.kill()
        child.wait()
    time.sleep(0.2)
    hello = KeeperClient(addr).hello()
    pid = hello["pid"]
    assert pid_alive(pid) and hello["node"] == 0

    write_save(d0, 2)
    assert KeeperClient(addr).committed(2, to=None)["ok"]
    KeeperClient(addr).stop(drop=True)
    assert _wait_dead(pid, 5)
    assert not (d0 / "own").exists() and not (d0 / "spare").exists()
    assert not (d0 / KEEPER_FILE).exists()
    assert "stopped (stop requested" in (d0 / "keeper.log").read_text()

    # the memory wiped under a live keeper: it notices and exits
    addr2 = ensure_keeper(d0, 0, host="127.0.0.1")
    pid2 = KeeperClient(addr2).hello()["pid"]
    assert pid2 != pid
    shutil.rmtree(d0)
    assert _wait_dead(pid2, 5)


def test_replaced_record_and_sigterm_stop_keeper(nodes: Callable[[int], Path]) -> None:
    d0 = nodes(0)
    addr = ensure_keeper(d0, 0, host="127.0.0.1")
    pid = _pid(d0)
    os.kill(pid, signal.SIGTERM)
    assert _wait_dead(pid, 5)
    assert "stopped (SIGTERM)" in (d0 / "keeper.log").read_text()
    assert read_keeper_file(d0) is None
    with pytest.raises(StorageError, match="unreachable"):
        KeeperClient(addr, timeout_s=2).hello()
    ensure_keeper(d0, 0, host="127.0.0.1")
    pid2 = _pid(d0)
    (d0 / KEEPER_FILE).write_text('{"pid": 1, "host": "x", "port": 1, "node": 0}')
    assert _wait_dead(pid2, 5)


def test_idle_exit(nodes: Callable[[int], Path]) -> None:
    d0 = nodes(0)
    d0.mkdir(parents=True)
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "dckpt.tiers.keeper", "--dir", str(d0), "--node", "0"),
            *("--host", "127.0.0.1", "--idle-exit-s", "0.5"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "idle for 0.5 s" in err
    assert (d0 / "keeper.log").read_text().count("started") == 1


def test_advertised_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCKPT_KEEPER_HOST", "10.1.2.3")
    assert advertised_host() == "10.1.2.3"
    monkeypatch.delenv("DCKPT_KEEPER_HOST")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert advertised_host() == "127.0.0.1"
    monkeypatch.delenv("MASTER_ADDR")
    assert advertised_host() == "127.0.0.1"


def test_unreachable_keeper_is_storage_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StorageError, match=f"127.0.0.1:{port}"):
        KeeperClient(f"127.0.0.1:{port}", timeout_s=2).read(0, 1, RANK0, 1, "xxh3_128:" + "0" * 32)
