"""The memory tier on a shared host (issue 42): what another local user plants, swaps or links
is never written, hashed or restored, and the job trains on. Each trial joins ``make faults``'
table.

Real gloo ranks on two "nodes" (``GROUP_RANK`` 0 and 1, as in test_memory_faults.py), the
memory directory under a sticky, world-writable directory like ``/dev/shm``. "Another user" is
uid ``OTHER``: the tests run as root, and a directory ``chown``-ed to that uid is what that
user's ``mkdir`` would have left (tests/test_owned.py also runs a real process as that uid).
Every trial ends with a restart that must resume what the job itself saved, bit for bit:

- **squat**: the job's memory base (``/dev/shm/dckpt-<uid>``'s place) was made by another
  user, world-writable, before the job's first start: the job starts, says which directory and
  whose, skips its memory saves and keeps saving to the root; nothing is written into the
  squatted directory; the restart resumes the durable step;
- **swap**: while a memory save runs, the file it just wrote is replaced under its name by a
  forged one of the same size (what the review's attacker did with inotify, 44 µs after the
  file appeared); the save hashes what it wrote, not what the name holds: the rename is
  refused, no forged step is recorded, training goes on, and the restart resumes the next
  memory step, exactly (the replica check is off in this trial: see ``_config``);
- **symlink**: links planted at the names a memory resume writes in a node's directory
  (``last-restore.json`` and the old tmp name ``.last-restore.json.part``), pointing at a file
  of the job's user: the resume replaces the link, never writes through it;
- **another root**: a second job of the same user, on another root, given the same
  ``memory_dir``: it is refused that directory (memory tier off for it, durable saves go on),
  and the first job's memory steps stay restorable; ``dckpt memory clear`` of the second root
  refuses, of the first frees only dckpt's files (a file of the user's in it stays);
- **store keys**: the keys of every replica meeting, under the names dckpt used before it put
  them under a random token, are set to "gone" in the job's store before the memory saves
  (torch's TCPStore takes writes from anyone who reaches its port): the replicas go through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world
from fault_kit import Trials, build, train_step

pytestmark = [pytest.mark.faults, pytest.mark.multiproc]

FAULT = "shared host"
OTHER = 4242
TIMEOUT_S = 10.0


def _config(base: str, case: str, root: str = "root", memory: str | None = None) -> Any:
    import dckpt

    return dckpt.CheckpointConfig(
        root=Path(base) / root,
        memory=True,
        memory_dir=Path(memory) if memory else None,
        timeout_s=TIMEOUT_S,
        lock=False,
        # The swap's forgery zeroes replicated tensors that one rank's file holds for all: the
        # replica check would see the ranks' copies differ and refuse the save too. Off here,
        # so the trial proves the digest alone (as for a model whose tensors are all sharded).
        replica_check="off" if case == "swap" else "error",
    )


def _job(rank: int, world: int, base: str, case: str, phase: str) -> dict[str, Any]:
    """One start of the job: resume, then durable 1, memory 2 and 3 (``phase`` "train"), or
    only the resume ("restart"). ``DCKPT_MEMORY_DIR`` is the shared directory's ``dckpt-0``."""
    import logging

    import torch
    from fault_kit import SEED

    import dckpt

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ["DCKPT_MEMORY_DIR"] = str(Path(base) / "shm" / "dckpt-0")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("dckpt").addHandler(Keep())
    out: dict[str, Any] = {"log": lines}
    model, opt, sched = build(rank)
    memory = str(Path(base) / "shared-mem") if case.startswith("another root") else None
    root = "root-b" if case == "another root, second job" else "root"
    config = _config(base, case, root, memory)
    if case == "swap" and phase == "train":
        _swap_after_the_copy(base, rank)
    state = dckpt.TrainState(model, opt, scheduler=sched, seed=SEED)
    with dckpt.CheckpointManager(config, state) as mgr:
        if case == "store keys" and rank == 0:
            _preset_old_meeting_keys(mgr)
        report = mgr.resume()
        out["resumed"] = report.step
        out["origin"] = report.origin
        out["report"] = report.format()
        if report.step is not None:
            want = torch.load(_want(base, rank, report.step), weights_only=True)
            live = model.module.state_dict()
            out["exact"] = all(torch.equal(want[k], live[k]) for k in want)
        if phase == "train":
            for step, tier in ((1, "durable"), (2, "memory"), (3, "memory")):
                train_step(model, opt, sched, step, rank)
                torch.save(
                    {k: v.clone() for k, v in model.module.state_dict().items()},
                    _want(base, rank, step),
                )
                handle = mgr.save(step, tier=tier)
                try:
                    handle.result()
                    out[f"save{step}"] = "ok"
                except dckpt.CheckpointError as exc:
                    out[f"save{step}"] = f"{type(exc).__name__}: {exc}"
            # Training goes on. A job whose last save is durable frees its memory at close;
            # one that ends on a memory save keeps it for the restart to resume.
            train_step(model, opt, sched, 4, rank)
            torch.save(
                {k: v.clone() for k, v in model.module.state_dict().items()}, _want(base, rank, 4)
            )
            last = (
                "durable"
                if case in ("squat", "store keys", "another root, second job")
                else "memory"
            )
            mgr.save(4, tier=last).result()
            out["save4"] = "ok"
    return out


def _want(base: str, rank: int, step: int) -> Path:
    return Path(base) / f"want-rank{rank}-step{step}.pt"


def _swap_after_the_copy(base: str, rank: int) -> None:
    """Replace this rank's file of memory step 3 under its name, right after ``save()`` wrote
    it and before the background hashes it: a forged file of the same size (zeros)."""
    from dckpt.save import memory as save_memory

    original = save_memory.MemoryRoute.write

    def write(self: Any, staged: Any, *args: Any, **kwargs: Any) -> Any:
        if "step-00000003" in str(staged.part):
            forged = staged.part.with_name("forged")
            forged.write_bytes(bytes(staged.size))
            os.replace(forged, staged.part)
            Path(base, f"swapped-{rank}").touch()
        return original(self, staged, *args, **kwargs)

    save_memory.MemoryRoute.write = write  # type: ignore[method-assign]


def _preset_old_meeting_keys(mgr: Any) -> None:
    """What an outside writer of the job's store could aim at before the token: every
    meeting of every dckpt group, marked abandoned ahead of time."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    for comm in (mgr._ctl, mgr._io):
        for n in range(1, 40):
            store.set(f"dckpt/meet/{comm.group.group_name}/0-1/{n}/second", "gone")


def _shared(tmp: Path) -> Path:
    shm = tmp / "shm"
    shm.mkdir(parents=True, exist_ok=True)
    shm.chmod(0o1777)
    return shm


def _verdict(fault_trials: Trials, case: str, problems: list[str]) -> None:
    """The trial for ``make faults``' table, and the test's own verdict."""
    fault_trials.record(FAULT, case, survived=not problems, detail="; ".join(problems))
    assert not problems, problems


def _resumed_exactly(results: list[Any], step: int) -> bool:
    """Every rank of a restart resumed ``step``, its model exactly what was saved there."""
    return all(isinstance(r, dict) and r.get("resumed") == step and r.get("exact") for r in results)


def _run(base: Path, case: str, phase: str) -> list[Any]:
    return run_world(_job, 2, str(base), case, phase, expect_failure=True, timeout=240)


def test_squat(tmp_path: Path, fault_trials: Trials) -> None:
    base = tmp_path / "squat"
    squat = _shared(base) / "dckpt-0"
    squat.mkdir()
    squat.chmod(0o777)
    os.chown(squat, OTHER, OTHER)
    started = _run(base, "squat", "train")
    restarted = _run(base, "squat", "restart")
    problems = []
    for r, got in enumerate(started):
        if not isinstance(got, dict):
            problems.append(f"rank {r} did not end its start: {got}")
            continue
        if got.get("save1") != "ok" or got.get("save4") != "ok":
            problems.append(f"rank {r}'s durable saves did not go on: {got}")
        if "memory tier is off" not in str(got.get("save2")):
            problems.append(f"rank {r}'s memory save was not skipped: {got.get('save2')}")
    logged = "\n".join(started[0]["log"]) if isinstance(started[0], dict) else ""
    if f"{squat} belongs to uid {OTHER}" not in logged:
        problems.append(f"the start did not name the squatted directory and its owner: {logged}")
    if list(squat.iterdir()):
        problems.append(f"files were written into the squatted directory: {list(squat.iterdir())}")
    if not _resumed_exactly(restarted, 4):
        problems.append(f"the restart did not resume durable step 4 exactly: {restarted}")
    _verdict(fault_trials, "memory base squatted by another user", problems)


def test_swap(tmp_path: Path, fault_trials: Trials) -> None:
    base = tmp_path / "swap"
    _shared(base)
    started = _run(base, "swap", "train")
    problems = []
    if not all((base / f"swapped-{r}").exists() for r in (0, 1)):
        problems.append("the swap did not happen on every rank")
    for r, got in enumerate(started):
        if not isinstance(got, dict):
            problems.append(f"rank {r} did not end its start: {got}")
            continue
        if got.get("save2") != "ok" or got.get("save4") != "ok":
            problems.append(f"rank {r}: the saves around the swap did not go on: {got}")
        if got.get("save3") == "ok":
            problems.append(f"rank {r}: the save of the swapped file committed")
    ledger = sorted(p.name for p in (base / "root" / "memory").glob("step-*.json"))
    if "step-00000003.json" in ledger:
        problems.append(f"the forged step was recorded: {ledger}")
    restarted = _run(base, "swap", "restart")
    if not _resumed_exactly(restarted, 4):
        problems.append(f"the restart did not resume memory step 4 exactly: {restarted}")
    _verdict(fault_trials, "memory file swapped after save() wrote it", problems)


def test_symlink(tmp_path: Path, fault_trials: Trials) -> None:
    base = tmp_path / "symlink"
    _shared(base)
    started = _run(base, "symlink", "train")
    assert all(isinstance(r, dict) and r.get("save4") == "ok" for r in started), started
    victim = base / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o600)
    memory = next((base / "shm" / "dckpt-0").iterdir())
    for node in ("node-0", "node-1"):
        for name in ("last-restore.json", ".last-restore.json.part"):
            (memory / node / name).symlink_to(victim)
    restarted = _run(base, "symlink", "restart")
    problems = []
    if victim.read_text() != "precious":
        problems.append(f"the resume wrote through a planted link: {victim.read_text()[:80]!r}")
    if not _resumed_exactly(restarted, 4):
        problems.append(f"the restart did not resume memory step 4 exactly: {restarted}")
    record = memory / "node-0" / "last-restore.json"
    if record.is_symlink() or json.loads(record.read_text()).get("step") != 4:
        problems.append("the restore note is not a file of the job's own")
    _verdict(fault_trials, "links planted at the resume's records", problems)


def test_another_root_on_one_memory_dir(tmp_path: Path, fault_trials: Trials) -> None:
    base = tmp_path / "two-roots"
    _shared(base)
    first = _run(base, "another root, first job", "train")
    assert all(isinstance(r, dict) and r.get("save4") == "ok" for r in first), first
    shared = base / "shared-mem"
    held = sorted(p.relative_to(shared) for p in shared.rglob("*.mem"))
    (shared / "notes.txt").write_text("the user's own file")
    second = _run(base, "another root, second job", "train")
    problems = []
    for r, got in enumerate(second):
        if not isinstance(got, dict) or got.get("save4") != "ok":
            problems.append(f"rank {r} of the second job did not go on: {got}")
        elif "memory tier is off" not in str(got.get("save2")):
            problems.append(f"rank {r} of the second job used the first's memory dir: {got}")
    logged = "\n".join(second[0]["log"]) if isinstance(second[0], dict) else ""
    if f"holds the memory tier of {base / 'root'}" not in logged:
        problems.append(f"the second job did not say whose the directory is: {logged[:400]}")
    if sorted(p.relative_to(shared) for p in shared.rglob("*.mem")) != held:
        problems.append("the second job changed the first's memory files")
    cli = [sys.executable, "-m", "dckpt.cli", "memory", "clear", "--memory-dir", str(shared)]
    refused = subprocess.run([*cli[:5], str(base / "root-b"), *cli[5:]], capture_output=True,
                             text=True, timeout=120, check=False)  # fmt: skip
    if refused.returncode == 0 or not list(shared.rglob("*.mem")):
        problems.append(f"memory clear of the other root freed the first's: {refused.stdout}")
    again = _run(base, "another root, first job", "restart")
    if not _resumed_exactly(again, 4):
        problems.append(f"the first job's memory step 4 was not restored exactly: {again}")
    cleared = subprocess.run([*cli[:5], str(base / "root"), *cli[5:]], capture_output=True,
                             text=True, timeout=120, check=False)  # fmt: skip
    if cleared.returncode != 0 or list(shared.rglob("*.mem")):
        problems.append(f"memory clear of its own root did not free it: {cleared.stderr}")
    if (shared / "notes.txt").read_text() != "the user's own file":
        problems.append("memory clear removed a file that is not dckpt's")
    _verdict(fault_trials, "two roots given one memory_dir", problems)


def test_preset_store_keys_do_not_stop_the_replicas(tmp_path: Path, fault_trials: Trials) -> None:
    base = tmp_path / "keys"
    _shared(base)
    started = _run(base, "store keys", "train")
    problems = []
    for r, got in enumerate(started):
        if not isinstance(got, dict) or got.get("save3") != "ok" or got.get("save4") != "ok":
            problems.append(f"rank {r}: {got}")
    logged = "\n".join(started[0]["log"]) if isinstance(started[0], dict) else ""
    replicas = [line for line in logged.splitlines() if "replicas:" in line]
    if len(replicas) != 2 or any("FAILED" in line for line in replicas):
        problems.append(f"the replicas did not go through: {replicas}")
    _verdict(fault_trials, "meeting keys pre-set in the job's store", problems)
