"""A client of the job's store that is not the job plants values under dckpt's keys: each is
ignored and named, and the job trains, saves and resumes as if it were not there.

torch's TCPStore serves whoever reaches its port: ``list_keys`` shows dckpt's keys, random
token and all, and ``set`` writes any of them. Here the store is a real TCPStore that the test
hosts, as torchrun's agent does (the ranks join it as clients, as torchrun's workers join
their agent's), and the outsider is a client of its own that knows only the store's host and
port: what it plants, it found by listing the keys.

- ``test_values_planted_under_dckpts_keys_are_named_and_never_end_the_job``: a 2-rank job
  ("two nodes": the memory tier's replicas meet through the store) while rank 0 holds the gate
  of the start (a stand-in for a watch of another host's run lock, which tells the waiting
  rank to wait longer): the outsider plants a "wait longer" that is not JSON (before: rank 1
  died of it, ``JSONDecodeError``, and the job with it), then an "open" of the gate (before:
  rank 1 went on while rank 0 still held it). Before the memory saves it plants every
  meeting of both of dckpt's groups as taken and as abandoned ("gone": before, the replicas
  of step 2 failed, and every later save was refused: "restart the job"). Rank 1 stays at
  the gate until rank 0 opens it, every save commits with its replicas, each planted key is
  named in a warning, and a restart resumes the last step exactly.
- ``test_planted_stop_flags_and_marks_decide_nothing``: on one rank of the same kind of store,
  a stop flag planted under a save's key (before: the uploads of a healthy save to an s3://
  root stopped, and the save failed), every rank's progress marks planted (before: a rank
  that had not finished writing read as done, and rank 0 "may have committed"), a phase mark
  and a warmup mark that are not dckpt's (before: the error path that names late ranks raised
  ``ValueError`` on the mark, and a rank that never joined the warmup was not named).
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import pytest
from dist_harness import run_world
from fault_kit import SEED, build, train_step

pytestmark = pytest.mark.multiproc

TIMEOUT_S = 10.0
STEPS = ((1, "durable"), (2, "memory"), (3, "memory"), (4, "durable"))


def _serve() -> Any:
    """The job's store, hosted here as torchrun's agent hosts it."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )


def _join_the_store(rank: int, world: int, port: int, start: str) -> None:
    """This rank's process group, through the test's TCPStore as a client of it, as torchrun's
    worker joins its agent's (the harness made one through a file: replaced). Each start
    (``start``) has its own prefix, as each of torchrun's restarts has its own rendezvous
    round: gloo's addresses of an earlier start must not be read as this one's."""
    import torch.distributed as dist

    dist.barrier()  # both ranks done with the harness's group before either tears it down
    dist.destroy_process_group()
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"start-{start}", client),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


class Outsider:
    """A client of the job's store that is not of the job: it has the store's host and port,
    its own connection, and nothing of the job's; it lists keys and plants values."""

    def __init__(self, port: int) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )

    def keys(self) -> list[str]:
        return [str(k) for k in self.store.list_keys()]

    def find(self, *parts: str) -> list[str]:
        """Listed keys of dckpt's that contain every one of ``parts``."""
        return [k for k in self.keys() if "dckpt/" in k and all(p in k for p in parts)]

    def plant(self, key: str, value: str | bytes) -> str:
        """Set ``key`` (as listed: with torch's prefix, if any) to ``value``; returns the
        key as dckpt names it (from ``dckpt/`` on), which its warning must name."""
        self.store.set(key, value)
        return key[key.index("dckpt/") :]


def _logging(base: str, rank: int) -> list[str]:
    """dckpt's log lines of this rank, kept in a list and appended to a file the other rank
    can read while this one runs."""
    import logging

    lines: list[str] = []
    path = Path(base) / f"log-{rank}"

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())
            with path.open("a") as f:
                f.write(record.getMessage().replace("\n", " ") + "\n")

    logging.getLogger("dckpt").addHandler(Keep())
    return lines


def _until(check: Any, within_s: float = 15.0) -> bool:
    """Whether ``check()`` came true within ``within_s`` (a bound for a broken run, not a
    verdict on speed: a working one is there in a second or two)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return False


def _named(base: str, rank: int, key: str) -> bool:
    path = Path(base) / f"log-{rank}"
    return path.exists() and f"ignored the value under {key} " in path.read_text()


def _hold_the_gate(base: str, port: int, out: dict[str, Any]) -> None:
    """Rank 0: once it holds the run lock, it tells rank 1 to wait longer (as a watch of
    another host's lock does) and holds the gate while the outsider plants a "wait longer"
    that is not JSON, then an "open"; it opens only once rank 1 named both (or a bound
    passed: the old code), and notes whether rank 1 had gone on before."""
    from dckpt.root import lock

    original = lock.RunLock.acquire

    def acquire(self: Any, on_wait: Any = None) -> None:
        original(self, on_wait)
        if on_wait is None:
            return
        on_wait(3 * TIMEOUT_S, "a test holds the gate (as a watch of another host's lock)")
        outsider = Outsider(port)
        [longer] = outsider.find("/gate/open-root/longer")  # its name tells the token
        out["longer"] = outsider.plant(longer, "not json")
        out["longer_named"] = _until(lambda: _named(base, 1, out["longer"]))
        opened = longer.replace("/longer", "/open")
        out["open"] = outsider.plant(opened, "1")
        out["open_named"] = _until(lambda: _named(base, 1, out["open"]))
        out["passed_early"] = (Path(base) / "rank-1-passed-the-gate").exists()

    lock.RunLock.acquire = acquire  # type: ignore[method-assign]


def _note_the_gate_passed(base: str) -> None:
    """Rank 1: a file once its wait at the gate returned."""
    from dckpt.collective import gate

    original = gate.Gate.wait

    def wait(self: Any, what: str) -> None:
        original(self, what)
        (Path(base) / "rank-1-passed-the-gate").touch()

    gate.Gate.wait = wait  # type: ignore[method-assign]


def _plant_meetings(port: int) -> list[str]:
    """Every meeting of both of dckpt's groups ahead, as the outsider can name them from the
    listed keys (the token, and the groups from the heartbeats): taken by a rank that is not
    there, and marked abandoned."""
    outsider = Outsider(port)
    beats = outsider.find("/beat/")
    assert beats, outsider.keys()
    planted = []
    for group in sorted({k.rsplit("/", 1)[0] for k in beats}):  # .../beat/<group>
        base = group.replace("/beat/", "/meet/")
        for n in range(1, 12):
            planted.append(outsider.plant(f"{base}/0-1/{n}", "7"))
            planted.append(outsider.plant(f"{base}/0-1/{n}/second", "gone"))
    return planted


def _job(rank: int, world: int, port: int, base: str, phase: str) -> dict[str, Any]:
    """One start: on "train", saves 1 to 4 (memory 2 and 3, replicated to the other "node")
    under the outsider's plantings; on "restart", the resume alone."""
    import torch

    import dckpt

    _join_the_store(rank, world, port, phase)
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    out: dict[str, Any] = {"log": _logging(base, rank)}
    if phase == "train":
        if rank == 0:
            _hold_the_gate(base, port, out)
        else:
            _note_the_gate_passed(base)
    model, opt, sched = build(rank)
    config = dckpt.CheckpointConfig(
        root=Path(base) / "root",
        memory=True,
        memory_dir=Path(base) / "mem",
        timeout_s=TIMEOUT_S,
        lock=True,
    )
    state = dckpt.TrainState(model, opt, scheduler=sched, seed=SEED)
    with dckpt.CheckpointManager(config, state) as mgr:
        report = mgr.resume()
        out["resumed"] = report.step
        if report.step is not None:
            want = torch.load(Path(base) / f"want-{rank}-{report.step}.pt", weights_only=True)
            live = model.module.state_dict()
            out["exact"] = all(torch.equal(want[k], live[k]) for k in want)
        if phase != "train":
            return out
        for step, tier in STEPS:
            train_step(model, opt, sched, step, rank)
            torch.save(
                {k: v.clone() for k, v in model.module.state_dict().items()},
                Path(base) / f"want-{rank}-{step}.pt",
            )
            if step == 2 and rank == 0:
                out["meetings"] = _plant_meetings(port)
            try:
                mgr.save(step, tier=tier).result()
                out[f"save{step}"] = "ok"
            except dckpt.CheckpointError as exc:
                out[f"save{step}"] = f"{type(exc).__name__}: {exc}"
    return out


def test_values_planted_under_dckpts_keys_are_named_and_never_end_the_job(
    tmp_path: Path,
) -> None:
    server = _serve()
    base = str(tmp_path)
    started = run_world(_job, 2, server.port, base, "train", timeout=240, expect_failure=True)
    problems = [f"rank {r}: {got}" for r, got in enumerate(started) if not isinstance(got, dict)]
    assert not problems, "\n".join(problems)
    zero, one = started
    assert zero["longer_named"] and zero["open_named"], (
        f"rank 1 did not name the planted gate values: {one['log']}"
    )
    assert not zero["passed_early"], "rank 1 went past the gate on the outsider's 'open'"
    for r, got in enumerate(started):
        saves = {step: got.get(f"save{step}") for step, _ in STEPS}
        assert all(v == "ok" for v in saves.values()), f"rank {r}: {saves}"
    logged = "\n".join(zero["log"] + one["log"])
    replicas = [line for line in zero["log"] if "replicas:" in line]
    assert len(replicas) == 2 and not any("FAILED" in x for x in replicas), replicas
    named = [key for key in zero["meetings"] if f"ignored the value under {key} " in logged]
    assert named, f"no planted meeting key was named: {logged}"
    assert "Something outside this job writes to its store" in logged

    again = run_world(_job, 2, server.port, base, "restart", timeout=120)
    for r, got in enumerate(again):
        assert got["resumed"] == 4 and got["exact"], f"rank {r}: {got}"


def _one_rank(rank: int, world: int, port: int) -> dict[str, Any]:
    """The reads of a save's stop flag, its progress marks, the phase marks and the warmup's
    marks, with an outsider's values under their keys (one rank; the manager's token)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from dckpt.collective import world as world_mod
    from dckpt.collective.comm import Comm
    from dckpt.collective.progress import MARKED, Progress
    from dckpt.phases import Phase

    _join_the_store(rank, world, port, "one")
    out: dict[str, Any] = {"log": _logging(str(Path(os.environ["TMP_BASE"])), rank)}
    comm = Comm(TIMEOUT_S)
    comm.use_token("0123456789abcdef0123456789abcdef")
    outsider = Outsider(port)
    comm.begin("save")  # its phase mark and heartbeat show the keys' prefix
    assert _until(lambda: outsider.find("/beat/"), 10)
    [beat] = outsider.find("/beat/")
    token_prefix = beat[: beat.index("/beat/")]  # torch's prefix, if any, and dckpt's
    out["planted"] = []

    # a save's stop flag, named after its tmp directory, seen in its markers
    progress = Progress(comm)
    save_id = "f" * 32
    flag = progress.stop_flag(f"step-00000007.tmp-{save_id}")
    out["planted"].append(outsider.plant(f"{token_prefix}/stop/step-00000007.tmp-{save_id}", "1"))
    flag._asked = 0.0  # look now, not a second after the save began
    out["stopped"] = flag.is_set()

    # a world of two seen from rank 0: rank 1 marks nothing, the outsider marks for it
    two = SimpleNamespace(world_size=2, rank=0, keys=comm.keys, distributed=True)
    progress = Progress(two)  # type: ignore[arg-type]
    for phase in MARKED:
        progress.mark(save_id, phase)
        planted = outsider.plant(f"{token_prefix}/{save_id}/{phase.value}/1", "1")
        if phase in (MARKED[0], Phase.DCP_FINISH):  # what lagging and all_reported read
            out["planted"].append(planted)
    outsider.plant(f"{token_prefix}/{save_id}/{Phase.RENAME.value}/0", "1")
    out["lagging"] = progress.lagging(save_id)
    out["all_reported"] = progress.all_reported(save_id)

    # this rank's phase mark, overwritten with what is not dckpt's: the late ranks' words
    out["planted"].append(outsider.plant(f"{token_prefix}/at/save/0", "x"))
    try:
        out["late"] = comm.late()
    except Exception as exc:
        out["late"] = f"raised {type(exc).__name__}: {exc}"
    comm.end()

    # the warmup's marks: rank 1 (of a pretend world of two) never joined; the outsider
    # marks it joined
    nonce = f"{comm.keys}/warmup-nonce"
    out["planted"].append(outsider.plant(f"{token_prefix}/warmup-nonce/warmup/1", "1"))
    original = {"get_world_size": dist.get_world_size, "all_reduce": dist.all_reduce}

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the pretend world's all-reduce timed out")

    pretend = {"get_world_size": lambda *a, **k: 2, "all_reduce": fail}
    for name, fn in pretend.items():  # torch's functions, for this one call
        setattr(dist, name, fn)
    try:
        world_mod.warmup_collective(nonce, 1.0)
    except Exception as exc:
        out["warmup"] = str(exc)
    finally:
        for name, fn in original.items():
            setattr(dist, name, fn)
    comm.close()
    return out


def test_planted_stop_flags_and_marks_decide_nothing(tmp_path: Path) -> None:
    server = _serve()
    [got] = run_world(_one_rank, 1, server.port, env={"TMP_BASE": str(tmp_path)}, timeout=120)
    assert got["stopped"] is False, "a stop flag the outsider planted stopped the save"
    assert got["lagging"].startswith("rank(s) 1 did not complete"), got["lagging"]
    assert got["all_reported"] is False, "the outsider's marks made rank 1 read as done"
    assert not str(got["late"]).startswith("raised"), got["late"]
    assert "rank(s) 1 did not join" in got["warmup"], got["warmup"]
    logged = "\n".join(got["log"])
    for key in got["planted"]:
        assert f"ignored the value under {key} " in logged, (key, logged)
