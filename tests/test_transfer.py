"""Files moved between real gloo ranks over dckpt's own group (dckpt.collective.transfer): the
memory tier's replicas and a lost node's files at a resume.

Each test spawns 2 ranks; rank 0 sends a file of several chunks from its mapping, rank 1
receives it into its memory directory, hashing every chunk as it lands:

- the bytes arrive exactly, and are renamed to their name only after they hashed right;
- bytes that do not hash to the digest the receiver was given are never renamed in, and the
  error says so;
- a receiver whose memory is full takes the bytes and drops them (the sender is not hung), and
  says why;
- a receiver whose sender never sends gives up within the deadline (TransferError), it does
  not hang (dckpt's group connects lazily, and a message to a peer that never touched the
  pair can block in gloo's connect for a minute: the exchange meets its peers through the
  store first); so does one whose sender trickles (each chunk in time, the whole file not): the
  deadline is the exchange's, not each chunk's;
- files that arrive into a ``Taker`` (a lost node's file going straight into its state) come
  through the staging ring in order, every byte once, more chunks than the ring has buffers
  and across two files, nothing made in the node's memory; the digest judges each.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world

pytestmark = [pytest.mark.multiproc]

SIZE = (40 << 20) + 12345  # three chunks, the last one short


def _exchange(
    rank: int,
    world: int,
    base: str,
    digest: str | None,
    send: bool | str,
    size: int = SIZE,
    timeout_s: float = 30.0,
    gap_s: float = 0.0,
) -> dict[str, Any]:
    import mmap

    import torch

    from dckpt.collective.comm import Comm
    from dckpt.collective.transfer import CHUNK, Incoming, Outgoing, TransferError, move
    from dckpt.storage.digest import format_digest, new_hasher
    from dckpt.tiers.memory_layout import Slots

    assert size > 2 * CHUNK
    comm = Comm(60.0)
    node = Path(base) / f"node-{rank}"
    slots = Slots(node)
    data = torch.Generator().manual_seed(7)
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=data).numpy().tobytes()
    hasher = new_hasher("xxh3_128")
    hasher.update(payload)
    right = format_digest("xxh3_128", hasher)
    out: dict[str, Any] = {"right": right}
    t0 = time.perf_counter()
    try:
        if rank == 0:
            src = node / "own" / "f.mem"
            mm = slots.open(src, size).buffer
            mm[:] = payload
            if send == "trickle":  # each chunk well within the deadline, all of them not
                import torch.distributed as dist

                assert comm.meet({1}, 60.0) == []  # as every exchange opens, then the chunks
                buf = torch.frombuffer(mm, dtype=torch.uint8)
                works = []
                for i, a in enumerate(range(0, size, CHUNK)):
                    works.append(dist.isend(buf[a : a + CHUNK], 1, group=comm.group, tag=i))
                    time.sleep(gap_s)
                del works, buf
            elif send:
                move(comm, [Outgoing(mm, 1, size)], [], slots, timeout_s=60.0)
            else:  # alive, silent: past rank 1's deadline
                time.sleep(10)
        else:
            into = node / "replica" / "f.mem"
            got = move(
                comm,
                [],
                [Incoming(0, into, size, digest or right)],
                slots,
                timeout_s=timeout_s,
            )
            out["error"] = got[0].error
            out["exists"] = into.exists()
            out["parts"] = sorted(p.name for p in into.parent.iterdir())
            if into.exists():
                with open(into, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                    out["exact"] = m[:] == payload
            out["seconds"] = time.perf_counter() - t0
    except TransferError as exc:
        out["transfer_error"] = str(exc)
        out["seconds"] = time.perf_counter() - t0
    finally:
        slots.close()
    if send is True:  # rank 0 stays until rank 1 has every byte
        comm.barrier()
    return out


def test_a_file_arrives_exactly_and_is_named_only_once_it_hashed_right(tmp_path: Path) -> None:
    _, received = run_world(_exchange, 2, str(tmp_path), None, True)
    assert received["error"] is None and received["exists"] and received["exact"], received
    assert received["parts"] == ["f.mem"], received  # no part file left behind


def test_bytes_that_do_not_hash_right_are_never_named(tmp_path: Path) -> None:
    wrong = "xxh3_128:" + "0" * 32
    _, received = run_world(_exchange, 2, str(tmp_path), wrong, True)
    assert not received["exists"] and received["parts"] == [], received
    assert "digest mismatch" in received["error"] and wrong in received["error"], received


def test_a_full_memory_takes_the_bytes_and_drops_them(tmp_path: Path) -> None:
    """The receiver's memory directory is a 16 MiB tmpfs: the file cannot be held, the
    receiver says so, and the sender's sends complete (the exchange returns on both)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a private tmpfs")
    small = tmp_path / "node-1"
    small.mkdir()
    # mode=0700: a fresh tmpfs is 1777, which dckpt refuses (it never chmods what it did not make)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(small)], check=True
    )
    try:
        sent, received = run_world(_exchange, 2, str(tmp_path), None, True)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    assert "transfer_error" not in sent, sent
    assert not received["exists"], received
    assert "this node's memory cannot hold f.mem" in received["error"], received
    assert "No space left on device" in received["error"], received


def test_a_sender_that_never_sends_is_given_up_on_within_the_deadline(tmp_path: Path) -> None:
    results = run_world(_exchange, 2, str(tmp_path), None, False, SIZE, 3.0, expect_failure=True)
    received = results[1]
    assert "rank(s) 0 did not reach the exchange within 3 s" in received["transfer_error"], received
    assert 3 <= received["seconds"] < 60, received  # its own deadline (a hang's bound above)


def test_a_sender_that_trickles_is_given_up_on_at_the_exchanges_deadline(tmp_path: Path) -> None:
    """Five chunks, 5.5 s apart: each chunk is in time (8 s each, timeout_s), the whole file
    is not (8 s plus 1 s per chunk: 13 s, where the fourth chunk is sent no sooner than
    16.5 s). A chunk that came more than 8 s after the one before would have been the chunk's
    deadline, and the error says which it was; a loaded machine can only make the chunks
    later (a sleep is never shorter), never the whole file in time."""
    size = 5 * (16 << 20)
    results = run_world(
        _exchange, 2, str(tmp_path), None, "trickle", size, 8.0, 5.5, expect_failure=True
    )
    received = results[1]
    assert "the whole exchange's deadline passed" in received["transfer_error"], received
    assert "each chunk came within 8 s" in received["transfer_error"], received
    assert received["seconds"] >= 13, received


def _into_sinks(rank: int, world: int, base: str) -> dict[str, Any]:
    """Two files into sinks, through the staging ring (more chunks than its buffers, and
    the second file's first chunks posted while the first's last are consumed): the first
    with its writer's digest, the second with another."""
    import torch

    from dckpt.collective.comm import Comm
    from dckpt.collective.transfer import CHUNK, RING, Incoming, Outgoing, move
    from dckpt.storage.digest import format_digest, new_hasher
    from dckpt.tiers.memory_layout import Slots

    sizes = (5 * CHUNK + 100, 2 * CHUNK + 7)
    assert sum(-(-s // CHUNK) for s in sizes) > RING
    comm = Comm(60.0)
    node = Path(base) / f"node-{rank}"
    slots = Slots(node)
    payloads = [
        torch.randint(0, 256, (s,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(sizes)
    ]
    digests = []
    for p in payloads:
        hasher = new_hasher("xxh3_128")
        hasher.update(p.numpy().tobytes())
        digests.append(format_digest("xxh3_128", hasher))
    out: dict[str, Any] = {}
    try:
        if rank == 0:
            files = []
            for i, p in enumerate(payloads):
                mm = slots.open(node / "own" / f"f{i}.mem", sizes[i]).buffer
                mm[:] = p.numpy().tobytes()
                files.append(Outgoing(mm, 1, sizes[i], tag=i))
            move(comm, files, [], slots, timeout_s=60.0)
        else:

            class Collect:
                def __init__(self) -> None:
                    self.pieces: list[tuple[int, bytes]] = []

                def place(self, offset: int, end: int) -> torch.Tensor | None:
                    return None

                def take(self, offset: int, chunk: torch.Tensor) -> None:
                    self.pieces.append((offset, chunk.numpy().tobytes()))

            sinks = [Collect(), Collect()]
            wrong = "xxh3_128:" + "0" * 32
            got = move(
                comm,
                [],
                [
                    Incoming(0, node / "in" / f"f{i}.mem", sizes[i], d, tag=i, taker=sinks[i])
                    for i, d in enumerate([digests[0], wrong])
                ],
                slots,
                timeout_s=60.0,
            )
            out["errors"] = [g.error for g in got]
            out["offsets"] = [[o for o, _ in s.pieces] for s in sinks]
            out["exact"] = [
                b"".join(b for _, b in s.pieces) == p.numpy().tobytes()
                for s, p in zip(sinks, payloads, strict=True)
            ]
            out["made"] = sorted(str(p.relative_to(node)) for p in node.rglob("*") if p.is_file())
    finally:
        slots.close()
    comm.barrier()
    return out


def test_files_into_sinks_arrive_in_order_through_the_ring_and_are_judged(
    tmp_path: Path,
) -> None:
    from dckpt.collective.transfer import CHUNK

    _, received = run_world(_into_sinks, 2, str(tmp_path))
    assert received["exact"] == [True, True], received  # every byte, in order, once
    assert received["offsets"] == [
        [i * CHUNK for i in range(6)],
        [i * CHUNK for i in range(3)],
    ], received
    assert received["errors"][0] is None, received
    assert "digest mismatch" in received["errors"][1], received  # the verdict is the sink's
    assert received["made"] == [], received  # nothing was made in the node's memory


def _cut_in_place(first: memoryview, size: int) -> list[tuple[int, int]]:
    """Both ends' cut (``transfer.Split``): what the first bytes say (here: a fixed region
    ``[CHUNK + 4096, 3 * CHUNK + 4096)`` in two segments), the rest in pieces."""
    from dckpt.collective.transfer import CHUNK

    assert bytes(first[:4]) == b"CUT!"  # the very bytes the sender cut by
    lo, hi = CHUNK + 4096, 3 * CHUNK + 4096
    return [(CHUNK, lo), (lo, lo + CHUNK), (lo + CHUNK, hi), (hi, size)]


def _into_place(rank: int, world: int, base: str) -> dict[str, Any]:
    """One file, cut alike on both ends: the segments its taker places go straight into a
    tensor of its own, the others through the staging buffers; hashed in order either way."""
    import torch

    from dckpt.collective.comm import Comm
    from dckpt.collective.transfer import CHUNK, Incoming, Outgoing, move
    from dckpt.storage.digest import format_digest, new_hasher
    from dckpt.tiers.memory_layout import Slots

    size = 4 * CHUNK + 99
    lo, hi = CHUNK + 4096, 3 * CHUNK + 4096
    payload = torch.randint(
        0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    payload[:4] = torch.tensor(list(b"CUT!"), dtype=torch.uint8)
    hasher = new_hasher("xxh3_128")
    hasher.update(payload.numpy().tobytes())
    digest = format_digest("xxh3_128", hasher)
    comm = Comm(60.0)
    node = Path(base) / f"node-{rank}"
    slots = Slots(node)
    out: dict[str, Any] = {}
    try:
        if rank == 0:
            mm = slots.open(node / "own" / "f.mem", size).buffer
            mm[:] = payload.numpy().tobytes()
            move(comm, [Outgoing(mm, 1, size, split=_cut_in_place)], [], slots, timeout_s=60.0)
        else:
            region = torch.zeros(hi - lo, dtype=torch.uint8)

            class Place:
                def __init__(self) -> None:
                    self.pieces: list[tuple[int, int]] = []
                    self.placed: list[tuple[int, int]] = []

                def place(self, offset: int, end: int) -> torch.Tensor | None:
                    if lo <= offset and end <= hi:
                        self.placed.append((offset, end))
                        return region[offset - lo : end - lo]
                    return None

                def take(self, offset: int, chunk: torch.Tensor) -> None:
                    self.pieces.append((offset, offset + chunk.numel()))

            taker = Place()
            got = move(
                comm,
                [],
                [
                    Incoming(
                        0, node / "in" / "f.mem", size, digest, taker=taker, split=_cut_in_place
                    )
                ],
                slots,
                timeout_s=60.0,
            )
            out["error"] = got[0].error
            out["placed"] = taker.placed
            out["taken"] = taker.pieces
            out["exact"] = torch.equal(region, payload[lo:hi])
    finally:
        slots.close()
    comm.barrier()
    return out


def test_segments_a_taker_places_arrive_straight_there_and_are_hashed_in_order(
    tmp_path: Path,
) -> None:
    from dckpt.collective.transfer import CHUNK

    _, received = run_world(_into_place, 2, str(tmp_path))
    lo, hi = CHUNK + 4096, 3 * CHUNK + 4096
    assert received["error"] is None, received  # every byte hashed, in the file's order
    assert received["placed"] == [(lo, lo + CHUNK), (lo + CHUNK, hi)], received
    assert received["exact"], received
    assert received["taken"] == [(0, CHUNK), (CHUNK, lo), (hi, 4 * CHUNK + 99)], received
