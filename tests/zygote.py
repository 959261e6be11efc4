"""torchrun's contract, with ranks forked from a process that imported torch once.

Most of the suite's CPU went into starting interpreters: every ``torchrun`` launch of a
2-rank job starts three (the agent and two ranks), each importing torch, DCP, dckpt and, at
DDP's constructor, ``torch._dynamo`` (about 3-5 CPU-seconds each), before a single step. The
tests that run a training script as a job (``tests/conftest.py`` ``torchrun_train``, the
framework integrations) do not test torchrun itself, so here a *zygote* (one per test
process, started at its first job) imports all that once and forks each job from it:

- an **agent** (a forked child, its own session), which does what torchrun's does for a
  single-node ``--standalone`` job: hosts the job's TCPStore, sets every rank's environment
  (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT`` of its store, ``TORCHELASTIC_USE_AGENT_STORE``,
  ``TORCHELASTIC_RUN_ID`` (a fresh id per launch), ``TORCHELASTIC_RESTART_COUNT=0``,
  ``OMP_NUM_THREADS=1``), and when a rank fails, sends the others SIGTERM and, 30 s later,
  SIGKILL (torchrun's ``death_sig`` and grace period), then exits 1; 0 when every rank did;
- the **ranks** (forked from the agent): each resets what a fresh interpreter would have
  fresh (the RNGs: Python's and numpy's from the OS, torch's to its start-up seed; torch's
  threads from ``OMP_NUM_THREADS``, which torch reads at its import: a run of 2 threads and
  one of 1 round differently, and a resumed run must match its reference bit for bit; the
  faulthandler from ``PYTHONFAULTHANDLER``), puts the script's directory first on
  ``sys.path`` and runs it as ``__main__`` with its arguments; an uncaught exception prints
  its traceback and exits 1, as Python does.

Every job's stdout and stderr go to two files (the ranks share them, as torchrun's share the
agent's), read back into a ``subprocess.CompletedProcess`` as ``subprocess.run`` returns it;
the agent writes its exit status last, and a job that outlives ``timeout`` is killed (its
whole session) and raises ``subprocess.TimeoutExpired``. What stays on real torchrun: the
tests of torchrun's own behaviour (an agent that restarts workers, two nodes, a signal to the
agent, killing a rank from outside through the agent's children).

``DCKPT_TEST_ZYGOTE=0`` runs every such job under real torchrun instead (the same tests pass
either way: ``tests/test_zygote.py`` runs one job both ways and compares what it logged).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic.multiprocessing.errors",
    "numpy",
    "dckpt",
    "dckpt.manager",
    "dckpt.load.resumer",
    "dckpt.integrations",
)
GRACE_S = 30.0
"""torchrun's: how long the other ranks get after SIGTERM before SIGKILL."""


def enabled() -> bool:
    return os.environ.get("DCKPT_TEST_ZYGOTE", "1") != "0"


# --- the test side ------------------------------------------------------------------------


class Zygote:
    """The client: starts the zygote process once, sends it jobs, waits for their status."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._preload = preload
        """Modules imported beyond ``PRELOAD`` (a framework: its ranks import it once)."""

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
            env.pop("OMP_NUM_THREADS", None)  # torch's own default; each job's is set per rank
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "import zygote; zygote.serve()", *self._preload],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(HERE),
                env=env,
            )  # fmt: skip
        return self._proc

    def run(
        self,
        script: Path,
        args: list[str],
        *,
        nproc: int = 2,
        env: dict[str, str] | None = None,
        timeout: float = 240,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """``script`` with ``args`` as an ``nproc``-rank job; what ``subprocess.run`` returns
        for ``python -m torch.distributed.run --standalone --nproc-per-node N script args``."""
        work = Path(tempfile.mkdtemp(prefix="dckpt-zygote-"))
        request = {
            "script": str(script),
            "args": [str(a) for a in args],
            "nproc": nproc,
            "env": dict(os.environ if env is None else env),
            "cwd": str(cwd or Path.cwd()),
            "work": str(work),
        }
        with self._lock:  # one request line, one reply line
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            reply = proc.stdout.readline()
        if not reply:
            raise RuntimeError("the test zygote died (see the test's stderr)")
        agent = int(json.loads(reply)["agent"])
        cmd = ["zygote", str(script), *request["args"]]
        deadline = time.monotonic() + timeout
        status = work / "status"
        try:
            while not status.exists():
                if not _alive(agent):
                    break  # killed from outside, or by a rank's killpg: no status written
                if time.monotonic() > deadline:
                    _kill_session(agent)
                    out, err = _read(work)
                    raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
                time.sleep(0.05)
            code = int(status.read_text()) if status.exists() else -9
            out, err = _read(work)
            return subprocess.CompletedProcess(cmd, code, out, err)
        finally:
            for name in ("out", "err", "status"):
                (work / name).unlink(missing_ok=True)
            work.rmdir()

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive: the agent is reaped by init (its parent exited), so check state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_session(agent: int) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent, signal.SIGKILL)


def _read(work: Path) -> tuple[str, str]:
    def text(name: str) -> str:
        try:
            return (work / name).read_text(errors="replace")
        except OSError:
            return ""

    return text("out"), text("err")


FLAVORS: dict[str, tuple[str, ...]] = {
    "base": (),
    "hf": ("transformers", "accelerate", "dckpt.integrations.hf_trainer"),
    "lightning": ("lightning.pytorch", "dckpt.integrations.lightning"),
    "accelerate": ("accelerate", "dckpt.integrations.accelerate"),
}
"""A zygote per framework a test file's jobs import (started at that file's first job)."""
_CLIENTS: dict[str, Zygote] = {}


def client(flavor: str = "base") -> Zygote:
    """This process's zygote client for ``flavor``; the zygote is waited for at exit (its
    jobs' CPU time is then counted in this process's children, as a torchrun's would be)."""
    if flavor not in _CLIENTS:
        import atexit

        _CLIENTS[flavor] = Zygote(FLAVORS[flavor])
        atexit.register(_CLIENTS[flavor].close)
    return _CLIENTS[flavor]


# --- the zygote ---------------------------------------------------------------------------


def serve() -> None:
    """The zygote: import what every rank imports, then fork one agent per request line."""
    import importlib
    import signal

    for name in (*PRELOAD, *sys.argv[1:]):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)

    def reap(*_: object) -> None:  # the agents are the zygote's: their CPU is counted
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    signal.signal(signal.SIGCHLD, reap)
    for line in sys.stdin:
        request = json.loads(line)
        agent = os.fork()
        if agent == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                code = _agent(request)
            except BaseException:  # the agent's own failure: status 1
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        print(json.dumps({"agent": agent}), flush=True)
    while True:  # stdin closed: wait for the jobs still running, then go
        try:
            os.wait()
        except ChildProcessError:
            break


def _agent(request: dict[str, Any]) -> int:
    import signal
    import uuid

    from torch.distributed import TCPStore

    os.setsid()  # the job's own session: a timeout kills it whole
    work = Path(request["work"])
    out = os.open(work / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(work / "err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the zygote's request pipe is not the job's
    os.close(null)
    port = _free_port()  # the store starts after the ranks are forked: no thread is forked
    nproc = int(request["nproc"])
    env = dict(request["env"])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_WORLD_SIZE=str(nproc),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RUN_ID=uuid.uuid4().hex,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )
    ranks: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            os._exit(_rank(request, rank_env))
        ranks[pid] = rank
    # The job's store, as torchrun's agent hosts it (the ranks connect as clients, retrying
    # until it listens).
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True)
    codes: dict[int, int] = {}
    failed_at: float | None = None
    first_failed = -1
    while len(codes) < nproc:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for p, r in ranks.items():
                    if r not in codes:
                        _signal(p, signal.SIGKILL)
            time.sleep(0.05)
            continue
        code = os.waitstatus_to_exitcode(status)
        codes[ranks[pid]] = code
        if code != 0 and failed_at is None:  # torchrun: the others get SIGTERM, then SIGKILL
            failed_at = time.monotonic()
            first_failed = ranks[pid]
            for p, r in ranks.items():
                if r not in codes:
                    _signal(p, signal.SIGTERM)
    bad = {r: c for r, c in sorted(codes.items()) if c != 0}
    if bad:
        _failures(bad, first_failed, {r: p for p, r in ranks.items()}, request["script"])
    code = 1 if bad else 0
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = work / "status.tmp"
    tmp.write_text(str(code))
    os.replace(tmp, work / "status")
    del store
    return code


def _failures(bad: dict[int, int], first: int, pids: dict[int, int], script: str) -> None:
    """torchrun's failure summary, in its words (``exitcode  : N (pid: P)``, ``Signal 9
    (SIGKILL) received by PID P``): the rank that failed first is the root cause."""
    import signal
    import socket

    def block(rank: int, code: int) -> list[str]:
        pid = pids[rank]
        if code < 0:
            name = signal.Signals(-code).name
            why = f"Signal {-code} ({name}) received by PID {pid}"
        else:
            why = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
        return [
            f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S')}",
            f"  host      : {socket.gethostname()}",
            f"  rank      : {rank} (local_rank: {rank})",
            f"  exitcode  : {code} (pid: {pid})",
            "  error_file: <N/A>",
            f"  traceback : {why}",
        ]

    others = [r for r in bad if r != first]
    lines = ["=" * 60, f"{script} FAILED (zygote agent, as torchrun)", "-" * 60, "Failures:"]
    for i, rank in enumerate(others, 1):
        lines += [f"[{i}]:", *block(rank, bad[rank])]
    if not others:
        lines.append("  <NO_OTHER_FAILURES>")
    lines += ["-" * 60, "Root Cause (first observed failure):", "[0]:", *block(first, bad[first])]
    print("\n".join([*lines, "=" * 60]), file=sys.stderr)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _rank(request: dict[str, Any], env: dict[str, str]) -> int:
    import atexit
    import faulthandler
    import random
    import runpy
    import signal
    import traceback

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    # What a fresh interpreter has fresh: the RNGs and the fault handler.
    random.seed()
    try:
        import numpy as np

        np.random.seed()
    except ImportError:
        pass
    import torch

    torch.manual_seed(67280421310721)  # torch's default seed at start-up
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # what torch reads at its import
        torch.set_num_threads(int(threads))
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # as the interpreter: traceback, status 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code
