"""The memory tier's survivors of issue 58's blind mutant round, each held to its behaviour.

- **fenced before the ledger's commit point** (one process, the run lock on): another job's
  record put in place of this job's lock right before the memory commit (its fault point):
  the memory save fails saying this job commits nothing more, and the root's ledger holds no
  record of that step (a check of the lock after the rename would have left one);
- on two gloo ranks, each its own node (``GROUP_RANK``), one world for the cases below, each
  in a root of its own:

  - ``refuse``: only rank 1's model differs (a tensor of another shape): the memory resume is
    refused on both ranks, and rank 0's tensors, which matched, are untouched, as are rank
    1's (a copy before the ranks agreed would have overwritten rank 0's);
  - ``refill``: node 1 lost its memory; the resume takes its files from node 0 straight into
    rank 1's state; the copy back into node 1's memory is held (a fault ``wait``) until a
    timer after the first optimizer step began: that step waits for it, so node 1's memory
    holds the restored step's files, each hashing to the ledger's digest (a step that ran
    first would have changed the state under the copy, and nothing would be kept);
  - ``squat``: node 1's directory was left writable by everyone: node 1's first rank refuses
    it, and the memory tier is off on every rank, the reason naming node 1 and the directory
    (a proof on rank 0's node only would have let the job write into it);
  - ``debris``: a file of a save in flight when the last workers died, in node 1's memory, is
    removed at the start by node 1's first rank (a file of the user's beside it stays).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_world
from test_memory_stream import HIDDEN, _Lines, _lose_node_1, _net, _same, _snap, _train

import dckpt
from dckpt.root.manifest import parse_manifest
from dckpt.root.memory_ledger import DirectoryLedger
from dckpt.storage.digest import hash_file

# --- fenced just before the memory ledger's commit point ----------------------------------------


def test_a_job_fenced_before_the_memory_commit_writes_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dckpt.faults import fault_point
    from dckpt.phases import Phase
    from dckpt.tiers import memory_commit

    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    config = dckpt.CheckpointConfig(root=root, memory=True, memory_dir=memory)  # the lock on
    theirs = {"host": "node-9", "pid": 77, "started": 1.0, "run_id": "job-z",
              "token": "theirs", "lease_until": 2.0}  # fmt: skip

    def taken_at_the_commit(phase: Any, rank: int, step: int | None = None, path: str = "") -> bool:
        if phase == Phase.MEMORY_COMMIT and step == 3:  # another job took over
            (root / ".dckpt-lock").write_text(json.dumps(theirs))
        return fault_point(phase, rank, step, path)

    monkeypatch.setattr(memory_commit, "fault_point", taken_at_the_commit)
    mgr = dckpt.CheckpointManager(config, dckpt.TrainState(net, opt))
    try:
        mgr.save(2, tier="memory").result()
        with pytest.raises(dckpt.SaveError, match="commits nothing more"):
            mgr.save(3, tier="memory").result()
    finally:
        with contextlib.suppress(dckpt.CheckpointError):
            mgr.close()
    assert DirectoryLedger(root).steps() == [2]
    assert not (root / "memory" / "step-00000003.json").exists()


# --- two ranks, two nodes -------------------------------------------------------------------------

TIMEOUT_S = 15.0


def _config(case: Path, **extra: Any) -> dckpt.CheckpointConfig:
    return dckpt.CheckpointConfig(
        root=case / "ckpt",
        lock=False,
        memory=True,
        memory_dir=case / "mem",
        loss_watch="off",
        timeout_s=TIMEOUT_S,
        **extra,
    )


def _refuse(rank: int, case: Path) -> dict[str, Any]:
    """Memory step 2 of each rank's own model (nothing shared: each node proves its own file
    in place, nothing moves); then rank 1 alone comes back with a model of other shapes."""
    net, opt = _net(8, rank)
    _train(net, opt)
    conf = _config(case, replica_check="off")  # each rank's model is its own
    with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt)) as mgr:
        mgr.save(2, tier="memory").result()
    net, opt = _net(8 if rank == 0 else 16, rank)  # rank 1: another shape
    _train(net, opt)
    _train(net, opt)  # not the saved state: a copy would show
    before = _snap(net, opt)
    error = ""
    try:
        with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt)) as mgr:
            report = mgr.resume()
            error = f"resumed step {report.step}: {report.origin}"
    except dckpt.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "untouched": _same(before, net, opt)}


def _refill(rank: int, case: Path) -> dict[str, Any]:
    """Durable 1, memory 2 (DDP; the first memory save writes every rank's tensors into its
    own file); node 1 loses its memory; the resume takes rank 1's file from node 0 into its
    state; one optimizer step, the copy back held until a second after that step began."""
    import torch.distributed as dist

    net, opt = _net(8)
    _train(net, opt)
    conf = _config(case)
    with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt)) as mgr:
        mgr.save(1).result()
        _train(net, opt)
        mgr.save(2, tier="memory").result()
    _lose_node_1(rank, case)
    go = case / "go"
    os.environ["DCKPT_FAULT"] = f"phase=memory_refill,rank=1,action=wait,path={go},seconds=60"
    out: dict[str, Any] = {}
    try:
        with dckpt.CheckpointManager(conf, dckpt.TrainState(net, opt)) as mgr:
            report = mgr.resume()
            out.update(step=report.step, origin=report.origin)
            net(torch.randn(4, HIDDEN)).square().mean().backward()
            # The copy back goes on a second after the first optimizer step began: a step
            # that did not wait for it has changed the state by then (a slow machine can
            # only hide that, never fail the code that waits).
            timer = threading.Timer(1.0, go.touch)
            timer.start()
            opt.step()
            timer.cancel()
            out["files"] = _held(case, rank)  # before close(), which waits for it too
            dist.barrier()
    finally:
        del os.environ["DCKPT_FAULT"]
    return out


def _held(case: Path, rank: int) -> dict[str, bool]:
    """This node's memory files of step 2: whether each hashes to the ledger's digest."""
    record = parse_manifest((case / "ckpt" / "memory" / "step-00000002.json").read_bytes(), "2")
    files = record.file_map()
    got = {}
    for path in sorted((case / "mem" / f"node-{rank}").rglob("step-00000002/*")):
        digest = files[path.name].digest if path.name in files else ""
        got[str(path.relative_to(case / "mem"))] = (
            hash_file(path, record.digest_algorithm)[0] == digest
        )
    return got


def _start(rank: int, case: Path) -> dict[str, Any]:
    """A start (``squat``, ``debris``): whether the memory tier is on, what it said, and
    what is left in node 1's directory once every rank's start ended."""
    import torch.distributed as dist

    net, opt = _net(8)
    lines = _Lines()
    logging.getLogger("dckpt").addHandler(lines)
    out: dict[str, Any] = {}
    try:
        with dckpt.CheckpointManager(_config(case), dckpt.TrainState(net, opt)) as mgr:
            dist.barrier()
            node_1 = case / "mem" / "node-1"
            out["left"] = sorted(str(p.relative_to(node_1)) for p in node_1.rglob("*"))
            handle = mgr.save(1, tier="memory")
            try:
                handle.result()
                out["memory"] = "saved"
            except dckpt.CheckpointError as exc:
                out["memory"] = str(exc)
    finally:
        logging.getLogger("dckpt").removeHandler(lines)
    out["log"] = lines.lines
    return out


def _cases(rank: int, world: int, base: str) -> dict[str, Any]:
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    out: dict[str, Any] = {}
    for name, case in (("refuse", _refuse), ("refill", _refill), ("squat", _start),
                       ("debris", _start)):  # fmt: skip
        try:
            out[name] = case(rank, Path(base) / name)
        except Exception as exc:  # one case's failure is that case's, the others still run
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


SQUATTED = "node-1"
DEBRIS = "own/step-00000005/.rank-00001.mem.part-0abc"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("survivors")
    squat = base / "squat" / "mem" / SQUATTED  # left writable by everyone: not the job's
    squat.mkdir(parents=True)
    (base / "squat" / "mem").chmod(0o700)
    squat.chmod(0o777)
    node_1 = base / "debris" / "mem" / "node-1"  # the job's own, with a dead save's file
    (node_1 / DEBRIS).parent.mkdir(parents=True)
    for d in (base / "debris" / "mem", node_1, node_1 / "own", (node_1 / DEBRIS).parent):
        d.chmod(0o700)
    (node_1 / DEBRIS).write_bytes(b"\0" * 4096)
    (node_1 / "notes.txt").write_text("the user's own file")
    yield run_world(_cases, 2, str(base), timeout=240)


def test_when_one_rank_alone_refuses_a_memory_resume_no_rank_is_overwritten(
    world: list[dict[str, Any]],
) -> None:
    for rank, got in enumerate(world):
        refuse = got["refuse"]
        assert isinstance(refuse, dict), refuse
        assert refuse["error"].startswith("StateMismatchError"), refuse
        assert refuse["untouched"], f"rank {rank}'s state was overwritten: {refuse}"


def test_the_first_step_after_a_partner_restore_waits_for_the_copy_back_into_memory(
    world: list[dict[str, Any]],
) -> None:
    for got in world:
        refill = got["refill"]
        assert isinstance(refill, dict), refill
        assert refill["step"] == 2 and "ranks [1] from other nodes' memory" in refill["origin"]
    held = world[1]["refill"]["files"]  # node 1's memory, right after that step
    assert held.get("node-1/own/step-00000002/rank-00001.mem"), held
    assert all(held.values()), held  # every file there is the writer's bytes


def test_each_nodes_first_rank_proves_its_nodes_directory(
    world: list[dict[str, Any]],
) -> None:
    for rank, got in enumerate(world):
        squat = got["squat"]
        assert isinstance(squat, dict), squat
        assert "memory tier is off" in squat["memory"], f"rank {rank}: {squat['memory']}"
        assert "node 1: " in squat["memory"], squat["memory"]
        assert squat["left"] == [], squat["left"]  # nothing written into it
    said = "\n".join(world[0]["squat"]["log"])
    assert "the memory tier is off for this start: node 1: " in said, said
    assert f"mem/{SQUATTED}" in said, said


def test_each_nodes_first_rank_cleans_its_nodes_abandoned_files(
    world: list[dict[str, Any]],
) -> None:
    for got in world:
        debris = got["debris"]
        assert isinstance(debris, dict), debris
        assert debris["memory"] == "saved", debris
        assert DEBRIS not in debris["left"], debris["left"]
        assert "notes.txt" in debris["left"], debris["left"]
