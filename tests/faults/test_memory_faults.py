"""The memory tier's faults (issue 24): SIGKILL at every memory phase, a node lost in the
middle of replication, a rotted replica, a full memory at the partner, a partner that never
answers. Each trial joins ``make faults``' table.

Every trial runs 2 real gloo ranks, each its own node (``GROUP_RANK`` = rank, one memory
directory each under a shared memory dir), over a root holding durable step 1 and memory step
2 (replicated): the fault is armed for memory step 3. Then, for every trial at once (one
spawn), a restart resumes and must land on the step the fault left as the newest restorable
one, bit for bit (the model as it was when that step was saved), from the tier it says, and
save again. The invariants of every fault trial hold too: every durable checkpoint verifies
and still loads bit-exact (tests/fault_kit.py), and the ledger's records parse.

What each fault leaves:
- SIGKILL before the commit (``memory_copy``, ``memory_hash`` on either rank, ``memory_commit``
  on rank 0): step 3 is not committed; the restart resumes memory step 2;
- SIGKILL in ``replicate`` (either rank): step 3 is committed, both nodes' own copies stand:
  the restart resumes memory step 3 from local memory;
- a node lost in the middle of replication (SIGKILL in ``replicate`` on rank 1, its memory
  wiped): step 3 is committed; if node 1's file of it reached node 0 whole before the kill,
  the restart resumes step 3, else step 2, which node 0 kept whole (nothing is retired before
  a replica is verified); node 1 receives its files from node 0 either way;
- a rotted replica (node 0's copy of node 1's file of step 3 flipped, node 1's memory wiped):
  no intact copy of step 3 is left: its record is quarantined, and the restart resumes durable
  step 1 (step 2 was retired once step 3's replicas were verified);
- a full memory (node 1's memory a tmpfs with room for one file, not two): memory step 2's
  replica to node 1 fails and step 3 cannot be held there; both are said in the log, step 3 is
  not committed, training goes on; the restart resumes step 2 from local memory;
- a full memory at a replaced node (node 1's memory wiped, then a tmpfs with no room for a
  file): node 1's rank is alone on its node, so step 3's files arrive straight into its
  state, which needs none of that memory: the restart resumes memory step 3 bit for bit,
  nothing is quarantined, and the copy it puts back behind the resume cannot be held there:
  rank 1 says so, and that the next memory save writes it;
- a partner that never answers (rank 1 sleeps in ``replicate`` past ``timeout_s``): rank 0's
  save of step 3 still returns committed within the bound, the log says the replicas failed
  and the group is lost, and rank 0's next save refuses (restart): the restart resumes step 3.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world
from fault_kit import Trials, build, capture, check, failed, train_step

from dckpt.faults import MEMORY_PHASES

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

FAULT = "memory tier"
TIMEOUT_S = 5.0


def _manager(base: str, model: Any, opt: Any, sched: Any) -> Any:
    from fault_kit import SEED

    import dckpt

    config = dckpt.CheckpointConfig(
        root=Path(base) / "root",
        memory=True,
        memory_dir=Path(base) / "mem",
        timeout_s=TIMEOUT_S,
        lock=False,
    )
    return dckpt.CheckpointManager(config, dckpt.TrainState(model, opt, scheduler=sched, seed=SEED))


def _want(base: str, rank: int, step: int) -> Path:
    return Path(base) / f"want-rank{rank}-step{step}.pt"


def saving_world(
    rank: int, world: int, base: str, fault: str | None, then_save: bool = False
) -> dict[str, Any]:
    """Durable 1, memory 2, then memory 3 with ``fault`` armed; the model at each step is kept
    for the restart to compare with. Returns how this rank ended."""
    import logging

    import torch

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("dckpt").addHandler(Keep())
    model, opt, sched = build(rank)
    out: dict[str, Any] = {"log": lines}
    t0 = time.monotonic()
    try:
        mgr = _manager(base, model, opt, sched)
        for step, tier in ((1, "durable"), (2, "memory"), (3, "memory")):
            train_step(model, opt, sched, step, rank)
            torch.save({k: v.clone() for k, v in model.module.state_dict().items()},
                       _want(base, rank, step))  # fmt: skip
            if step == 3 and fault is not None:
                os.environ["DCKPT_FAULT"] = fault
            result = mgr.save(step, tier=tier).result()
            out[f"result{step}"] = str(result.path)
        out["seconds"] = time.monotonic() - t0
        if then_save:
            try:
                mgr.save(4, tier="memory").result()
                out["next"] = "saved"
            except Exception as exc:
                out["next"] = f"{type(exc).__name__}: {exc}"
        mgr.close()
        out["end"] = "ok"
    except Exception as exc:
        out["end"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = time.monotonic() - t0
    return out


def resume_world(rank: int, world: int, bases: list[str]) -> list[dict[str, Any]]:
    """A restart of each trial: resume, compare the model with the step it landed on, save on."""
    import torch

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    found: list[dict[str, Any]] = []
    behind = _Said("behind the resume")
    logging.getLogger("dckpt").addHandler(behind)
    for base in bases:
        model, opt, sched = build(rank)
        behind.lines.clear()
        try:
            with _manager(base, model, opt, sched) as mgr:
                report = mgr.resume()
                got: dict[str, Any] = {"step": report.step, "origin": report.origin}
                got["report"] = report.format()
                if report.step is not None:
                    want = torch.load(_want(base, rank, report.step), weights_only=True)
                    live = model.module.state_dict()
                    got["exact"] = all(torch.equal(want[k], live[k]) for k in want)
                    train_step(model, opt, sched, report.step + 1, rank)
                    mgr.save(report.step + 1).result()
                    got["saved_next"] = True
            got["behind"] = list(behind.lines)  # the copy put back behind the resume, said
        except Exception as exc:
            got = {"error": f"{type(exc).__name__}: {exc}"}
        found.append(got)
    return found


class _Said(logging.Handler):
    """The log lines of this rank that contain ``words``."""

    def __init__(self, words: str) -> None:
        super().__init__(logging.INFO)
        self.words = words
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.lines.append(record.getMessage())


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _records_parse(base: Path) -> list[str]:
    from dckpt.root.manifest import parse_manifest

    problems = []
    for record in (base / "root" / "memory").glob("step-*.json"):
        try:
            parse_manifest(record.read_bytes(), str(record))
        except Exception as exc:
            problems.append(f"{record.name}: {exc}")
    return problems


CASES: list[tuple[str, str | None, int, str]] = [
    # (name, fault, the step the restart must land on, the tier it comes from)
    *[
        (f"SIGKILL at {p} rank {r}", f"phase={p},rank={r},action=sigkill,step=3", 2, "memory")
        for p in MEMORY_PHASES
        if p not in ("memory_commit", "replicate")
        for r in (0, 1)
    ],
    ("SIGKILL at memory_commit rank 0", "phase=memory_commit,rank=0,action=sigkill,step=3", 2,
     "memory"),
    *[
        (f"SIGKILL at replicate rank {r}", f"phase=replicate,rank={r},action=sigkill,step=3", 3,
         "memory")
        for r in (0, 1)
    ],
    ("node lost mid-replication", "phase=replicate,rank=1,action=sigkill,step=3", 2, "memory"),
    ("rotted replica", None, 1, "durable"),
    ("full memory", None, 2, "memory"),
    ("full memory at a replaced node", None, 3, "memory"),
    ("partner never answers", f"phase=replicate,rank=1,action=sleep,seconds={3 * TIMEOUT_S}"
     ",step=3", 3, "memory"),
]  # fmt: skip


def test_memory_faults(tmp_path: Path, fault_trials: Trials) -> None:
    bases: dict[str, Path] = {}
    why: dict[str, list[str]] = {}
    baselines: dict[str, Any] = {}
    mounted: list[Path] = []
    expect: dict[str, int] = {}
    try:
        for name, fault, _, _ in CASES:
            base = tmp_path / name.replace(" ", "-")
            bases[name], why[name] = base, []
            if name == "full memory":
                probe = tmp_path / "probe"
                run_world(saving_world, 2, str(probe), None)
                record = json.loads((probe / "root" / "memory" / "step-00000002.json").read_text())
                size = max(f["bytes"] for f in record["files"])  # the first, undivided save's
                room = (size + 4095) // 4096 * 4096 + 8192  # one file, not two
                node1 = base / "mem" / "node-1"
                node1.mkdir(parents=True)
                cmd = [
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    f"size={room},mode=0700",
                    f"dckpt-{uuid.uuid4().hex[:6]}",
                ]
                if subprocess.run([*cmd, str(node1)], check=False).returncode != 0:
                    pytest.skip("cannot mount a tmpfs here (needs root)")
                mounted.append(node1)
            results = run_world(
                saving_world, 2, str(base), fault, name == "partner never answers",
                expect_failure=True, timeout=120,
            )  # fmt: skip
            committed = (base / "root" / "memory" / "step-00000003.json").exists()
            killed = fault is not None and "sigkill" in fault
            if killed:
                victim = int(fault.split("rank=")[1].split(",")[0]) if fault else 0
                if "produced no result" not in str(results[victim]):
                    why[name].append(f"rank {victim} was not killed: {results[victim]}")
                other = results[1 - victim]
                if isinstance(other, dict) and other.get("seconds", 0) > 60:
                    why[name].append(f"the survivor took {other['seconds']:.0f} s: it hung")
            want_committed = name not in [*(c[0] for c in CASES[:5]), "full memory"]
            if committed != want_committed:
                why[name].append(f"step 3 committed={committed}, expected {want_committed}")
            if name == "node lost mid-replication":
                shutil.rmtree(base / "mem" / "node-1")
                # Did node 1's file of step 3 reach node 0, whole, before the kill?
                arrived = base / "mem" / "node-0" / "replica" / "node-1" / "step-00000003"
                expect[name] = 3 if (arrived / "rank-00001.mem").exists() else 2
            if name == "full memory at a replaced node":
                node1 = base / "mem" / "node-1"
                shutil.rmtree(node1)
                node1.mkdir()
                cmd = [
                    "mount",
                    "-t",
                    "tmpfs",
                    "-o",
                    "size=16k,mode=0700",
                    f"dckpt-{uuid.uuid4().hex[:6]}",
                ]
                if subprocess.run([*cmd, str(node1)], check=False).returncode != 0:
                    pytest.skip("cannot mount a tmpfs here (needs root)")
                mounted.append(node1)
            if name == "rotted replica":
                replica = base / "mem" / "node-0" / "replica" / "node-1" / "step-00000003"
                _flip(replica / "rank-00001.mem")
                shutil.rmtree(base / "mem" / "node-1")
            if name == "full memory":
                log = "\n".join(results[0]["log"])
                if "node 0 -> node 1 FAILED" not in log or "cannot hold" not in log:
                    why[name].append(f"rank 0 did not say the replica failed: {log[-600:]}")
                if "could not hold rank 1's" not in log or "Training goes on" not in log:
                    why[name].append(f"rank 0 did not say step 3 failed: {log[-600:]}")
            if name == "partner never answers":
                sent = results[0]
                if not str(sent.get("result3", "")).endswith("step-00000003.json"):
                    why[name].append(f"rank 0's save of step 3 did not return committed: {sent}")
                elif sent["seconds"] > 4 * TIMEOUT_S + 20:
                    why[name].append(f"rank 0 waited {sent['seconds']:.0f} s: not bounded")
                if "replicas failed" not in "\n".join(sent.get("log", [])):
                    why[name].append("rank 0 did not say the replicas failed")
                if "restart the job" not in str(sent.get("next", "")).lower():
                    why[name].append(f"rank 0's next save did not refuse: {sent.get('next')}")
            baselines[name] = capture(base / "root")
            why[name] += _records_parse(base)
        order = list(bases)
        resumed = run_world(resume_world, 2, [str(bases[n]) for n in order], timeout=240)
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)
    for i, (name, _fault, planned, tier) in enumerate(CASES):
        step = expect.get(name, planned)
        for r in (0, 1):
            got = resumed[r][i]
            from_memory = "memory tier" in got.get("origin", "")
            if (
                got.get("error")
                or got.get("step") != step
                or not got.get("exact")
                or not got.get("saved_next")
                or from_memory != (tier == "memory")
            ):
                why[name].append(f"restart on rank {r}: {json.dumps(got)[:1500]}")
        if name == "full memory at a replaced node":
            if list((bases[name] / "root" / "memory").glob("quarantine/*")):
                why[name].append("a step whose copy could not be held was quarantined")
            if "into the state" not in resumed[1][i].get("report", ""):
                why[name].append(f"step 3 did not arrive into the state: {resumed[1][i]}")
            said = " ".join(resumed[1][i].get("behind", []))
            if "not kept (this node's memory cannot hold it" not in said:
                why[name].append(f"rank 1 did not say its copy was not kept: {said!r}")
        if name == "rotted replica":
            if not (bases[name] / "root" / "memory" / "quarantine" / "step-00000003.json").exists():
                why[name].append("the damaged step's record was not quarantined")
            if "skipped step 3 (quarantined): IntegrityError" not in resumed[0][i].get(
                "report", ""
            ):
                why[name].append("the report does not name the quarantined step")
        outcome = check(bases[name] / "root", baselines[name])
        fault_trials.record_check(FAULT, name, outcome, detail="; ".join(why[name]))
    assert not any(why.values()), failed(fault_trials._sink)
