"""Every wait on the job's store, through a store that stalls and then answers again.

dckpt's ranks wait on the job's c10d store (torch's TCPStore) at the start gate, at the
memory tier's meetings, and read it for progress marks, stop flags, heartbeats and warmup
marks (dckpt/collective/). Each store call has a deadline of its own (``HINT_S``, or the
wait's), so a store that stalls for longer than one call's deadline, and then answers again
well within the wait's own deadline, must cost the wait that stall and nothing more: no
"lost the job's store" at the gate, no peer named gone at a meeting, no stop flag or mark
misread after it answered again, no live rank named silent. A stall longer than the wait's
deadline ends in the wait's named error, and not before its deadline.

The store here is real: a TCPStore hosted by a process of its own, which a rank stalls
with SIGSTOP and lets go with SIGCONT (connections and requests queue in the kernel
meanwhile, as on a link that stalls). Both ranks join it as clients, as torchrun's workers
join their agent's. TCPStore's ``set`` waits for no answer, so what dckpt puts (marks,
heartbeats, the gate's "open" and "wait longer") lands once the store answers again; what
stalls is every read, wait and claim. The ranks shorten the hint deadline (``HINT_S``, 1 s)
and the gate's slice (1 s) so that stalls of a few seconds outlast a call's deadline; every
case runs in one world of two ranks (``_cases``), and each test reads its case's outcome.

- ``gate``: rank 0 stalls the store and opens the gate while it is stalled; rank 1 waits at
  the gate through the stall. Both go on.
- ``gate_past``: a stall longer than the waiter's deadline: ``CheckpointError`` naming the lost
  store, not before that deadline.
- ``extend``: rank 0 tells the waiter to wait longer while the store is stalled; the waiter
  reads it once the store answers again.
- ``meet``: both ranks reach a meeting while the store is stalled: they meet.
- ``meet_second``: the store stalls as the second rank at a meeting claims its mark, and
  again as the first reads it once its wait for it returned: they meet.
- ``meet_past``: a stall longer than the meeting's deadline: ``StoreUnreachableError`` on both
  ranks (the store, not the peer, is named), not before that deadline; the next meeting meets.
- ``hints``: after a stall that one of this rank's calls did not survive, the store answers
  again: a wait begun while that call still waited gets its value once the store answers,
  a stop flag set since is seen (and none is seen while it stalls), every rank's
  progress marks read as there, the warmup names the rank that did not join, a rank whose
  heartbeat went on through the stall is not named silent (one whose beat stopped is).
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from dist_harness import _CTX, run_world

pytestmark = pytest.mark.multiproc

HINT_S = 1.0
"""The ranks' hint deadline (dckpt's is 5 s): a store call that does not answer in this long
times out."""
SLICE_S = 1.0
"""The gate's slice (dckpt's is 2 s): its wait calls have a deadline of SLICE_S + HINT_S."""
TOKEN = "5a1e5a1e5a1e5a1e5a1e5a1e5a1e5a1e"


def _host_the_store(out: Any) -> None:
    """The job's store, in a process of its own that a rank can stall (SIGSTOP)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(60)
    )
    out.put(store.port)
    time.sleep(3600)


def _join_the_store(rank: int, world: int, port: int) -> None:
    """This rank's process group through the test's TCPStore, as a client of it (the harness
    made one through a file: replaced, once both ranks are connected on it: a rank that tore
    it down while the other still connected ended that one's init)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    client = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("job", client),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


def _stall(pid: int, seconds: float) -> threading.Timer:
    """The store stops answering now, and answers again ``seconds`` later. Returns once it
    is stopped (SIGSTOP takes effect when the kernel next schedules it: until then it may
    still answer a request or two)."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + 10  # a bound for a broken run only
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.001)
    timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    timer.start()
    return timer


def _answers_again() -> None:
    """Return once the store answers (a plain call, not dckpt's) and every call of dckpt's
    left waiting on it through the stall has come back."""
    from dckpt.collective.store import default_store

    default_store().check(["anything"])
    end = time.monotonic() + 30  # a bound for a broken run only
    while time.monotonic() < end:
        if not any(t.name == "dckpt-store" for t in threading.enumerate()):
            return
        time.sleep(0.01)


def _outcome(fn: Any) -> dict[str, Any]:
    """``fn()``'s outcome: "ok" (and what it returned), or the error's type and words; with
    the seconds it took."""
    t0 = time.monotonic()
    try:
        value = fn()
        got: dict[str, Any] = {"ok": True, "value": value}
    except Exception as exc:
        got = {"ok": False, "error": type(exc).__name__, "words": str(exc)}
    got["s"] = time.monotonic() - t0
    return got


def _logged(base: str, rank: int) -> Path:
    """dckpt's log lines of ``rank``, in a file the other rank reads."""
    import logging

    path = Path(base) / f"log-{rank}"

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            with path.open("a") as f:
                f.write(record.getMessage().replace("\n", " ") + "\n")

    logging.getLogger("dckpt").addHandler(Keep())
    return path


def _until(check: Any, within_s: float = 20.0) -> bool:
    """Whether ``check()`` came true within ``within_s`` (a bound for a broken run only)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return False


def _gate(rank: int, pid: int, comm: Any) -> dict[str, Any]:
    """Rank 0 stalls the store and opens the gate while it stalls; rank 1 waits through it."""
    import torch.distributed as dist

    from dckpt.collective.gate import Gate

    gate = Gate(comm, "stalled", timeout_s=8.0)
    if rank == 0:
        timer = _stall(pid, 3.5)
        dist.barrier()
        got = _outcome(gate.open)
        timer.join()
    else:
        dist.barrier()
        got = _outcome(lambda: gate.wait("a start through a stalled store"))
    return got


def _gate_past(rank: int, pid: int, comm: Any) -> dict[str, Any]:
    """The store stalls longer than rank 1's deadline at the gate (3 s): it gives up."""
    import torch.distributed as dist

    from dckpt.collective.gate import Gate

    gate = Gate(comm, "stalled-too-long", timeout_s=3.0)
    if rank == 0:
        timer = _stall(pid, 5.5)
        dist.barrier()
        timer.join()
        return {"ok": True}
    dist.barrier()
    return _outcome(lambda: gate.wait("a start through a store stalled too long"))


def _extend(rank: int, pid: int, comm: Any, base: str) -> dict[str, Any]:
    """Rank 0 tells rank 1 to wait longer while the store is stalled, and opens once rank 1
    said it waits longer."""
    import torch.distributed as dist

    from dckpt.collective.gate import Gate

    gate = Gate(comm, "extended", timeout_s=8.0)
    if rank == 0:
        timer = _stall(pid, 3.0)
        dist.barrier()
        gate.extend(60.0, "a test tells it to wait longer while the store stalls")
        timer.join()
        told = _until(lambda: "wait longer while the store stalls" in _read(base, 1))
        gate.open()
        return {"ok": True, "told": told}
    dist.barrier()
    got = _outcome(lambda: gate.wait("a start told to wait longer"))
    got["log"] = _read(base, 1)
    return got


def _read(base: str, rank: int) -> str:
    path = Path(base) / f"log-{rank}"
    return path.read_text() if path.exists() else ""


def _meet(rank: int, pid: int, comm: Any) -> dict[str, Any]:
    """Both ranks reach a meeting (deadline 8 s) while the store stalls (3 s); then one more."""
    import torch.distributed as dist

    if rank == 0:
        timer = _stall(pid, 3.0)
        dist.barrier()
        got = _outcome(lambda: comm.meet([1], 8.0))
        timer.join()
    else:
        dist.barrier()
        got = _outcome(lambda: comm.meet([0], 8.0))
    _answers_again()
    dist.barrier()
    got["next"] = _outcome(lambda: comm.meet([1 - rank], 8.0))
    return got


def _meet_second(rank: int, pid: int, comm: Any) -> dict[str, Any]:
    """At a meeting (deadline 10 s), the store stalls (3 s) just as the second to arrive
    claims its mark, after it found the first one's claim; and again (3 s) just as the first
    reads that mark, once its wait for it returned. Each rank is set to stall the store at
    whichever of the two it comes to."""
    import torch.distributed as dist

    from dckpt.collective import sealed

    claim, get = sealed.claim, sealed.get
    timers: list[threading.Timer] = []

    def stalled_claim(store: Any, key: str, payload: str) -> str | None:
        if key.endswith("/second") and not timers:  # the second's claim of its mark
            timers.append(_stall(pid, 3.0))
        return claim(store, key, payload)

    def stalled_get(store: Any, key: str) -> str | None:
        if key.endswith("/second") and not timers:  # the first's read of that mark
            timers.append(_stall(pid, 3.0))
        return get(store, key)

    sealed.claim, sealed.get = stalled_claim, stalled_get  # type: ignore[assignment]
    try:
        dist.barrier()
        got = _outcome(lambda: comm.meet([1 - rank], 10.0))
    finally:
        sealed.claim, sealed.get = claim, get
        for timer in timers:
            timer.join()
    got["stalled_here"] = bool(timers)
    return got


def _meet_past(rank: int, pid: int, comm: Any) -> dict[str, Any]:
    """The store stalls (5 s) longer than a meeting's deadline (2.5 s); then one more."""
    import torch.distributed as dist

    if rank == 0:
        timer = _stall(pid, 5.0)
        dist.barrier()
        got = _outcome(lambda: comm.meet([1], 2.5))
        timer.join()
    else:
        dist.barrier()
        got = _outcome(lambda: comm.meet([0], 2.5))
    _answers_again()
    dist.barrier()
    got["next"] = _outcome(lambda: comm.meet([1 - rank], 8.0))
    return got


def _hints(rank: int, pid: int, comm: Any) -> dict[str, Any]:
    """The reads that only inform (stop flag, progress marks, heartbeats, warmup marks), once
    the store answers again after a stall that one of this rank's calls did not survive."""
    import torch.distributed as dist

    from dckpt.collective import sealed, world
    from dckpt.collective.progress import MARKED, Progress
    from dckpt.collective.store import default_store

    out: dict[str, Any] = {}
    progress = Progress(comm)
    save_id = "c" * 32
    for phase in MARKED:
        progress.mark(save_id, phase)
    flag = progress.stop_flag(f"step-00000009.tmp-{save_id}")
    told = f"{comm.keys}/told-after-the-stall"
    if rank == 1:
        comm.begin("save")  # its heartbeat goes on through the stall
    dist.barrier()
    if rank == 0:
        timer = _stall(pid, 2.5)
        flag._asked = 0.0  # look now
        out["stopped_while_stalled"] = flag.is_set()  # its call times out, and still waits
        # a wait that begins while that call still waits on the store (as the save thread's
        # may, while the foreground waits): it gets the value once the store answers
        out["waited"] = _outcome(lambda: sealed.wait(default_store(), told, 8.0))
        timer.join()
    else:
        sealed.put(default_store(), told, "here")
    _answers_again()
    dist.barrier()
    if rank == 1:
        flag.set()  # rank 1's upload failed for good, after the stall
    dist.barrier()
    if rank == 0:
        flag._asked = 0.0
        out["stopped"] = flag.is_set()
        out["all_reported"] = progress.all_reported(save_id)
        out["lagging"] = progress.lagging(save_id)
        comm.begin("save")
        out["late_moving"] = comm.late()  # rank 1 beats again: neither silent nor slow
        real = dist.all_reduce

        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the warmup all-reduce timed out (rank 1 never joined it)")

        dist.all_reduce = fail  # type: ignore[assignment]
        try:
            world.warmup_collective(f"{comm.keys}/warmup-after-stall", 1.0)
        except Exception as exc:
            out["warmup"] = str(exc)
        finally:
            dist.all_reduce = real
    dist.barrier()
    if rank == 1:
        comm.end()  # its heartbeat stops
    dist.barrier()
    if rank == 0:
        out["late_stopped"] = comm.late()
        comm.end()
    dist.barrier()
    return out


CASES = ("gate", "gate_past", "extend", "meet", "meet_second", "meet_past", "hints")


def _cases(rank: int, world: int, port: int, pid: int, base: str) -> dict[str, Any]:
    """Every case in turn on this rank, each after the store answered again; a case that
    raised is recorded as such and the next one runs."""
    import torch.distributed as dist

    from dckpt.collective import gate, sealed, store
    from dckpt.collective.comm import Comm

    _join_the_store(rank, world, port)
    # the hint deadline, where dckpt reads it: every call's default, and a wait's margin
    store.HINT_S = sealed.HINT_S = HINT_S
    store.call.__kwdefaults__["deadline_s"] = HINT_S
    gate.SLICE_S = SLICE_S
    _logged(base, rank)
    comm = Comm(30.0)
    comm.use_token(TOKEN)
    run = {
        "gate": lambda: _gate(rank, pid, comm),
        "gate_past": lambda: _gate_past(rank, pid, comm),
        "extend": lambda: _extend(rank, pid, comm, base),
        "meet": lambda: _meet(rank, pid, comm),
        "meet_second": lambda: _meet_second(rank, pid, comm),
        "meet_past": lambda: _meet_past(rank, pid, comm),
        "hints": lambda: _hints(rank, pid, comm),
    }
    out: dict[str, Any] = {}
    for name in CASES:
        _answers_again()
        dist.barrier()
        t0 = time.monotonic()
        try:
            out[name] = run[name]()
            out[name]["case_s"] = time.monotonic() - t0
        except Exception as exc:
            out[name] = {"raised": f"{type(exc).__name__}: {exc}"}
    _answers_again()
    comm.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' outcomes of every case (one world, one store, for the whole module)."""
    ports = _CTX.Queue()
    server = _CTX.Process(target=_host_the_store, args=(ports,), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        base = str(tmp_path_factory.mktemp("comes-back"))
        got = run_world(_cases, 2, port, server.pid, base, timeout=240, expect_failure=True)
    finally:
        assert server.pid is not None
        os.kill(server.pid, signal.SIGCONT)  # a rank that died mid-stall left it stopped
        server.kill()
        server.join()
    problems = [f"rank {r}: {x}" for r, x in enumerate(got) if not isinstance(x, dict)]
    assert not problems, "\n".join(problems)
    return got


def _case(ranks: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    zero, one = (r[name] for r in ranks)
    assert "raised" not in zero and "raised" not in one, (zero, one)
    return zero, one


def test_the_gate_opens_through_a_stall(ranks: list[dict[str, Any]]) -> None:
    opener, waiter = _case(ranks, "gate")
    assert opener["ok"], f"rank 0 could not open the gate once the store answered: {opener}"
    assert waiter["ok"], f"rank 1 gave up at the gate on a store that answered again: {waiter}"


def test_the_gate_wait_past_its_deadline_names_the_lost_store(ranks: list[dict[str, Any]]) -> None:
    _, waiter = _case(ranks, "gate_past")
    assert not waiter["ok"] and waiter["error"] == "CheckpointError", waiter
    assert "lost the job's store" in waiter["words"], waiter
    assert waiter["s"] >= 3.0, f"rank 1 gave up before its deadline (3 s): {waiter}"


def test_a_longer_wait_told_while_the_store_stalls_reaches_the_waiter(
    ranks: list[dict[str, Any]],
) -> None:
    opener, waiter = _case(ranks, "extend")
    assert waiter["ok"], waiter
    assert "wait longer while the store stalls" in waiter["log"], waiter["log"]
    assert opener["told"], "rank 1 never said it waits longer"


def test_ranks_meet_through_a_stall(ranks: list[dict[str, Any]]) -> None:
    for r, got in enumerate(_case(ranks, "meet")):
        assert got["ok"] and got["value"] == [], f"rank {r}: {got}"
        assert got["next"]["ok"] and got["next"]["value"] == [], f"rank {r}: {got}"


def test_a_meeting_met_through_a_stall_at_the_second_mark(ranks: list[dict[str, Any]]) -> None:
    got = _case(ranks, "meet_second")
    assert all(g["stalled_here"] for g in got), got  # at the second's claim, the first's read
    for r, one in enumerate(got):
        assert one["ok"] and one["value"] == [], f"rank {r}: {one}"


def test_a_meeting_past_its_deadline_names_the_store_not_the_peer(
    ranks: list[dict[str, Any]],
) -> None:
    for r, got in enumerate(_case(ranks, "meet_past")):
        assert not got["ok"] and got["error"] == "StoreUnreachableError", f"rank {r}: {got}"
        assert got["s"] >= 2.5, f"rank {r} gave up before the meeting's deadline: {got}"
        assert got["next"]["ok"] and got["next"]["value"] == [], f"rank {r}: {got}"


def test_marks_flags_and_heartbeats_read_right_once_the_store_answers_again(
    ranks: list[dict[str, Any]],
) -> None:
    zero, _ = _case(ranks, "hints")
    assert zero["stopped_while_stalled"] is False, zero
    assert zero["waited"]["ok"] and zero["waited"]["value"] == "here", zero["waited"]
    assert zero["stopped"] is True, f"rank 1's stop flag, set after the stall, was not seen: {zero}"
    assert zero["all_reported"] is True, zero
    assert zero["lagging"].startswith("rank 0 did not complete the commit"), zero
    assert "rank(s) 1 did not join" in zero["warmup"], zero
    assert "rank 1" not in zero["late_moving"], f"a live rank was named: {zero['late_moving']}"
    assert "rank 1 (silent" in zero["late_stopped"], zero
