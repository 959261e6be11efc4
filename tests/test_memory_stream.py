"""A lost node's memory files arriving straight into its state (issue 43's partner restore).

A node that lost its memory receives its ranks' files from the node that keeps their replica;
a file only one rank reads goes through the transfer's staging ring into that rank's live
tensors (dckpt.storage.memory_file.StreamFill), hashed as it arrives, with no page of the
node's memory made for it; the node's memory gets its copy back behind the resume, from the
state and the bytes kept, hashed again through the mapping it was written into.

- ``StreamFill`` alone (no ranks): a file fed in chunks of every awkward size puts every
  tensor in place and keeps every other byte, so the image it gives back is the file, byte
  for byte; a non-contiguous tensor is kept and copied by ``StateFill``; a header that does
  not fit the state writes nothing.
- Two gloo ranks, each its own node (``GROUP_RANK``), DDP (the de-duplicated "world" layout:
  node 1 needs both files, both from node 0), one world per group of cases, each case in a
  root of its own:

  - ``lost``: the state comes back bit for bit from the partner, the report says the bytes
    went into the state; the node's memory holds both files again once the manager closed,
    and a second resume reads them there ("local memory"), bit for bit;
  - ``race``: the copy behind the resume is held (a fault ``wait``), the state is changed
    (``.data``, no optimizer step), then let go: the copy hashes otherwise and is not kept,
    said in a warning; the next resume takes the files from the partner again, exactly;
  - ``changed``: a model of other shapes: the arriving header does not fit, no byte goes
    into the state (its tensors are unchanged), and the resume refuses, naming the tensor;
  - ``flip``: a flipped byte in node 0's replica of rank 1's newest step: its bytes went
    into rank 1's tensors before the digest failed; the step is quarantined, the reason
    says which ranks had taken bytes in, and the older memory step (itself arriving into the
    state) is restored bit for bit: nothing of the damaged step is left;
  - ``all_bad``: every memory step's replica flipped and the durable step's shard too: the
    resume stops (never a fresh start from a half-written state), saying so.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world

import dckpt
from dckpt.storage.memory_file import StateFill, StreamFill, plan_flat, write_into

pytestmark = [pytest.mark.multiproc]

HIDDEN = 1536  # files of 2-3 chunks (16 MiB): tensors of 9 MiB arrive straight into the state


# --- StreamFill alone ---------------------------------------------------------------------------


def _state(seed: int, hidden: int = 64) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "a.weight": torch.randn(hidden, hidden, generator=g),
            "a.bias": torch.randn(hidden, generator=g),
            "b.weight": torch.randn(hidden, 3, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0),
            "ids": torch.arange(7, dtype=torch.int64) + seed,
        },
        "step": seed,
        "name": f"run-{seed}",
    }


def _file(state: dict[str, Any]) -> bytes:
    plan = plan_flat(state)
    buf = bytearray(plan.size)
    write_into(buf, plan)
    return bytes(buf)


def _feed(sink: StreamFill, data: bytes, cuts: list[int]) -> None:
    start = 0
    for end in [*cuts, len(data)]:
        if end > start:
            chunk = torch.frombuffer(bytearray(data[start:end]), dtype=torch.uint8)
            sink.take(start, chunk)
            start = end


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_file_fed_in_any_chunks_lands_in_the_state_and_its_image_is_the_file(seed: int) -> None:
    saved, live = _state(seed), _state(100 + seed)
    data = _file(saved)
    flat_live = {f"model.{k}": v for k, v in live["model"].items()}
    sink = StreamFill(len(data), "test file", flat_live, {}, own=True)
    rnd = random.Random(seed)
    cuts = [*rnd.sample(range(1, len(data)), 40), 17, 4096, 4097]
    _feed(sink, data, sorted(set(cuts)))
    assert sink.complete and sink.problem is None
    for key, tensor in saved["model"].items():
        if tensor.numel():
            assert f"model.{key}" in sink.placed, key
        assert torch.equal(live["model"][key], tensor), key  # in place, before any copy
    image = bytearray(len(data))
    for at, piece in sink.image():
        raw = piece.numpy().tobytes() if isinstance(piece, torch.Tensor) else bytes(piece)
        image[at : at + len(raw)] = raw
    assert bytes(image) == data  # header, padding, values: every byte kept or in place
    # StateFill takes the non-tensor values from the kept bytes, and copies no tensor again.
    fill = StateFill(live, sink, [])
    filled = fill.apply()
    assert filled["step"] == seed and filled["name"] == f"run-{seed}"


def test_a_non_contiguous_tensor_is_kept_and_copied_by_the_fill() -> None:
    saved = _state(5)
    live = _state(6)
    live["model"]["a.weight"] = torch.randn(64, 64).t()  # same shape, not contiguous
    data = _file(saved)
    flat_live = {f"model.{k}": v for k, v in live["model"].items()}
    sink = StreamFill(len(data), "test file", flat_live, {}, own=True)
    _feed(sink, data, list(range(1000, len(data), 1000)))
    assert "model.a.weight" not in sink.placed and "model.a.bias" in sink.placed
    assert not torch.equal(live["model"]["a.weight"], saved["model"]["a.weight"])
    StateFill(live, sink, []).apply()
    assert torch.equal(live["model"]["a.weight"], saved["model"]["a.weight"])


def test_a_header_that_does_not_fit_the_state_writes_nothing() -> None:
    saved = _state(7)
    live = _state(8, hidden=32)  # other shapes
    before = {k: v.clone() for k, v in live["model"].items()}
    data = _file(saved)
    flat_live = {f"model.{k}": v for k, v in live["model"].items()}
    sink = StreamFill(len(data), "test file", flat_live, {}, own=True)
    _feed(sink, data, [64, 5000])
    assert sink.problem is not None and "here" in sink.problem and not sink.damaged
    assert not sink.placed and not sink.wrote
    assert all(torch.equal(before[k], v) for k, v in live["model"].items())


def test_a_header_that_does_not_describe_its_bytes_is_damage_and_writes_nothing() -> None:
    saved = _state(9)
    data = bytearray(_file(saved))
    row = '"model.a.bias", "float32", [64], '
    at = data.index(row.encode()) + len(row)
    at = data.index(b", 256]", at) + 2
    data[at : at + 3] = b"252"  # a length its shape does not have, the header's width kept
    live = _state(10)
    flat_live = {f"model.{k}": v for k, v in live["model"].items()}
    before = {k: v.clone() for k, v in flat_live.items()}
    sink = StreamFill(len(data), "test file", flat_live, {}, own=True)
    _feed(sink, bytes(data), [])
    assert sink.damaged and "does not describe" in (sink.problem or "")
    assert all(torch.equal(before[k], v) for k, v in flat_live.items())


# --- two ranks, two nodes -----------------------------------------------------------------------


def _net(hidden: int, rank: int | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """DDP (its tensors written once, shared by both files: node 1 needs both), or, given
    ``rank``, a model of that rank's own, under names of its own (nothing shared: each rank
    reads its own file only, and node 0 never proves the replica it keeps of node 1's file,
    it only sends it)."""
    torch.manual_seed(0)
    net: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, hidden), torch.nn.Linear(hidden, HIDDEN)
    )
    if rank is None:
        net = torch.nn.parallel.DistributedDataParallel(net)
    else:
        net = torch.nn.ModuleDict({f"rank{rank}": net})
    opt = torch.optim.AdamW(net.parameters())
    return net, opt


def _train(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model = net if not isinstance(net, torch.nn.ModuleDict) else next(iter(net.values()))
    model(torch.randn(4, HIDDEN)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snap(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def _same(want: dict[str, torch.Tensor], net: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    got = _snap(net, opt)
    return set(got) == set(want) and all(torch.equal(want[k], got[k]) for k in want)


def _disturb(net: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)


def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)  # the middle: a tensor's bytes
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _prepared(rank: int, root: Path, keep: int, ddp: bool = True) -> tuple[Any, ...]:
    """A run that saved durable step 1 and memory steps 2-4 (one optimizer step each)."""
    net, opt = _net(HIDDEN, None if ddp else rank)
    _train(net, opt)
    state = dckpt.TrainState(net, opt)
    conf = dckpt.CheckpointConfig(
        root=root / "ckpt",
        lock=False,
        memory=True,
        memory_dir=root / "mem",
        memory_keep=keep,
        loss_watch="off",
        # a model of each rank's own: the optimizer's param groups differ, as they should
        replica_check="error" if ddp else "off",
    )
    snaps = {}
    with dckpt.CheckpointManager(conf, state) as mgr:
        mgr.save(1).result()
        snaps[1] = _snap(net, opt)
        for step in (2, 3, 4):
            _train(net, opt)
            mgr.save(step, tier="memory").result()
            snaps[step] = _snap(net, opt)
    return net, opt, state, conf, snaps


def _memory_files(root: Path, node: int) -> list[str]:
    base = root / "mem" / f"node-{node}"
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())


def _lose_node_1(rank: int, root: Path) -> None:
    import torch.distributed as dist

    if rank == 1:
        shutil.rmtree(root / "mem" / "node-1")
    dist.barrier()


def _memory_line(report: dckpt.ResumeReport) -> str:
    return next(c.detail for c in report.checks if c.name == "memory")


def _kept_cases(rank: int, world: int, base: str) -> dict[str, Any]:
    """``lost``, ``race`` and ``changed``, each in a root of its own."""
    import torch.distributed as dist

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    lines = _Lines()
    logging.getLogger("dckpt").addHandler(lines)
    logging.getLogger("dckpt").setLevel(logging.INFO)
    out: dict[str, Any] = {}

    # lost: the partner's files into the state, then back into the node's memory
    root = Path(base) / "lost"
    net, opt, state, conf, snaps = _prepared(rank, root, 1)
    _lose_node_1(rank, root)
    _disturb(net)
    with dckpt.CheckpointManager(conf, state) as mgr:
        report = mgr.resume()
        out["lost"] = {
            "step": report.step,
            "origin": report.origin,
            "memory": _memory_line(report),
            "digests": next(c.detail for c in report.checks if c.name == "digests"),
            "exact": _same(snaps[4], net, opt),
        }
    dist.barrier()
    out["lost"]["files"] = _memory_files(root, rank)
    _disturb(net)
    with dckpt.CheckpointManager(conf, state) as mgr:
        again = mgr.resume()
    out["lost"]["again"] = {
        "origin": again.origin,
        "memory": _memory_line(again),
        "exact": _same(snaps[4], net, opt),
    }
    out["lost"]["lines"] = [ln for ln in lines.lines if "behind the resume" in ln]
    lines.lines.clear()

    # race: the state changes before the copy behind the resume is taken
    root = Path(base) / "race"
    go = root / "go"
    net, opt, state, conf, snaps = _prepared(rank, root, 1)
    _lose_node_1(rank, root)
    os.environ["DCKPT_FAULT"] = f"phase=memory_refill,rank=1,action=wait,path={go},seconds=60"
    try:
        with dckpt.CheckpointManager(conf, state) as mgr:
            report = mgr.resume()
            exact = _same(snaps[4], net, opt)
            if rank == 1:
                for p in net.parameters():  # no optimizer step: nothing waits for the copy
                    p.data.add_(1.0)
                go.touch()
    finally:
        del os.environ["DCKPT_FAULT"]
    dist.barrier()
    files = _memory_files(root, rank)
    race_lines = [ln for ln in lines.lines if "behind the resume" in ln]
    _disturb(net)
    with dckpt.CheckpointManager(conf, state) as mgr:
        again = mgr.resume()
    out["race"] = {
        "exact": exact,
        "files": files,
        "lines": race_lines,
        "again": {"memory": _memory_line(again), "exact": _same(snaps[4], net, opt)},
    }
    lines.lines.clear()

    # changed: a model of other shapes; nothing of the arriving file goes into it
    root = Path(base) / "changed"
    *_, conf, snaps = _prepared(rank, root, 1)
    _lose_node_1(rank, root)
    other, other_opt = _net(HIDDEN // 2)
    _train(other, other_opt)
    before = _snap(other, other_opt)
    state = dckpt.TrainState(other, other_opt)
    error = ""
    try:
        with dckpt.CheckpointManager(conf, state) as mgr:
            mgr.resume()
    except dckpt.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    out["changed"] = {"error": error, "untouched": _same(before, other, other_opt)}
    logging.getLogger("dckpt").removeHandler(lines)
    dist.barrier()
    return out


def _damaged_cases(rank: int, world: int, base: str) -> dict[str, Any]:
    """``flip`` and ``all_bad``, each in a root of its own, each rank with a model of its
    own (nothing shared): node 0 sends the replica it keeps of rank 1's file unproven (it
    never reads it), so the damage is found by rank 1, after the bytes went into its state."""
    import torch.distributed as dist

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    logging.getLogger("dckpt").setLevel(logging.WARNING)
    out: dict[str, Any] = {}

    root = Path(base) / "flip"
    net, opt, state, conf, snaps = _prepared(rank, root, 2, ddp=False)
    replica = root / "mem" / "node-0" / "replica" / "node-1"
    if rank == 0:
        _flip(replica / "step-00000004" / "rank-00001.mem")
    _lose_node_1(rank, root)
    _disturb(net)
    with dckpt.CheckpointManager(conf, state) as mgr:
        report = mgr.resume()
    reason = root / "ckpt" / "memory" / "quarantine" / "step-00000004.reason.txt"
    out["flip"] = {
        "step": report.step,
        "origin": report.origin,
        "text": report.format(),
        "reason": reason.read_text() if reason.is_file() else "",
        "exact": _same(snaps[3], net, opt),
    }

    root = Path(base) / "all_bad"
    net, opt, state, conf, snaps = _prepared(rank, root, 2, ddp=False)
    replica = root / "mem" / "node-0" / "replica" / "node-1"
    if rank == 0:
        for step in (3, 4):
            _flip(replica / f"step-0000000{step}" / "rank-00001.mem")
        shard = max((root / "ckpt" / "step-00000001").rglob("*.distcp"), key=os.path.getsize)
        _flip(shard)
    _lose_node_1(rank, root)
    error = ""
    try:
        with dckpt.CheckpointManager(conf, state) as mgr:
            mgr.resume()
    except dckpt.CheckpointError as exc:
        error = str(exc)
    out["all_bad"] = {"error": error}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("stream_kept")
    yield run_world(_kept_cases, 2, str(base), timeout=240)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("stream_damaged")
    yield run_world(_damaged_cases, 2, str(base), timeout=240)


def test_a_lost_nodes_files_arrive_into_its_state_and_back_into_its_memory(
    kept: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(kept):
        lost = r["lost"]
        assert lost["step"] == 4 and lost["exact"], lost
        assert "ranks [1] from other nodes' memory" in lost["origin"], lost
        assert "rank 1: from node 0 (" in lost["memory"], lost
        assert "hashed as it arrived into the state" in lost["memory"], lost
        assert "ranks [1] took the files they received into their state" in lost["digests"]
        # Once the manager closed, node 1's memory holds both files again (its own, and
        # the replica it keeps of node 0), and the next resume reads them there.
        want = [
            "own/step-00000004/rank-00001.mem",
            "replica/node-0/step-00000004/rank-00000.mem",
        ]
        if rank == 1:
            assert [f for f in lost["files"] if "step-" in f] == want, lost["files"]
            assert len(lost["lines"]) == 1, lost["lines"]
            assert "(rank-00000.mem kept, rank-00001.mem kept;" in lost["lines"][0]
        else:
            assert not lost["lines"], lost["lines"]
        assert lost["again"]["exact"], lost["again"]
        assert lost["again"]["memory"] == "rank 0: local memory; rank 1: local memory"


def test_a_state_changed_before_the_copy_behind_the_resume_is_not_kept(
    kept: list[dict[str, Any]],
) -> None:
    rank1 = kept[1]["race"]
    assert rank1["exact"], rank1
    assert not [f for f in rank1["files"] if "step-" in f], rank1["files"]  # nor a part file
    assert len(rank1["lines"]) == 1, rank1["lines"]
    line = rank1["lines"][0]
    assert "not kept (the state changed before its copy was taken)" in line, line
    assert "the next memory save writes them" in line, line
    for r in kept:  # never silently wrong: the next resume takes them from the partner again
        assert r["race"]["again"]["exact"], r["race"]
        assert "rank 1: from node 0 (" in r["race"]["again"]["memory"], r["race"]


def test_an_arriving_file_that_does_not_fit_the_state_writes_nothing_into_it(
    kept: list[dict[str, Any]],
) -> None:
    for r in kept:
        changed = r["changed"]
        assert changed["error"].startswith("StateMismatchError"), changed
        assert "here" in changed["error"], changed  # the tensor, its shape there and here
        assert "had taken the arriving bytes" not in changed["error"], changed
        assert changed["untouched"], changed


def test_a_flipped_byte_on_the_way_leaves_nothing_of_that_step_in_the_state(
    damaged: list[dict[str, Any]],
) -> None:
    for r in damaged:
        flip = r["flip"]
        # The older memory step, itself arriving into the state, bit for bit.
        assert flip["step"] == 3 and flip["exact"], flip
        assert "ranks [1] from other nodes' memory" in flip["origin"], flip
        assert "digest mismatch" in flip["text"], flip["text"]
        assert "skipped step 4 (quarantined): IntegrityError" in flip["text"], flip["text"]
        assert "rank(s) [1] had taken the arriving bytes into their tensors" in flip["reason"]


def test_when_nothing_loads_after_bytes_arrived_into_the_state_the_resume_stops(
    damaged: list[dict[str, Any]],
) -> None:
    for r in damaged:
        error = r["all_bad"]["error"]
        assert "passed verification" in error, error
        assert "The model may be partly overwritten by the failed attempts" in error, error
