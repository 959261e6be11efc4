"""dckpt's calls to the job's key-value store (torch's TCPStore), each with a deadline.

The store is torch's: one TCP connection per process to rank 0's host, shared with torch's own
groups. Its calls wait as long as the store's own timeout (minutes), and on a link that went
dead they wait on the socket: a save thread that set a progress marker, or a rank that looked
for the rank to blame after a failure, then never returned, and its process never ended (a
node that lost its network hung for over ten minutes).

So every call dckpt makes runs on a daemon thread and is waited for at most ``deadline_s``
(``HINT_S`` for markers and heartbeats, which only name a late rank and decide nothing): one
that does not answer in time raises ``StoreUnreachableError``, and after that every call
fails at once rather than leave another thread on the dead socket: until the calls that
timed out came back (the store answers again: a stall, not a dead link), for ``QUIET_S`` at
most. So a store that stalls and answers again costs a wait no more than the stall: a wait
with a deadline of its own (the gate, a meeting) looks again until that deadline. A thread
left waiting is a daemon: it never keeps the process alive. The store's own timeout is not
changed (torch's groups share it).

One more wait is not dckpt's and still ends a node: torchrun's agent. Its rendezvous
keep-alive talks to the rendezvous host without a deadline that holds on a dead link, and
its main loop waits for that (measured: a node whose link went down kept its agent for over
400 s after its worker exited). So at interpreter exit, a worker that once found the job's
store unreachable probes it once more (``HINT_S``); if it still does not answer, and the
parent is torchrun's agent, the worker sends it SIGTERM (which it handles: it stops its
workers and exits), saying why, and leaves a watcher that sends SIGKILL if the agent still
runs ``AGENT_GRACE_S`` later (an agent blocked in a rendezvous call on the dead link handles
the signal only when that call gives up, and its shutdown calls the store again: beside a
busy machine a node took over 180 s to end). ``DCKPT_END_AGENT=0`` turns both off.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["HINT_S", "StoreUnreachableError", "call", "default_store"]

T = TypeVar("T")

HINT_S = 5.0
"""How long a marker, a heartbeat or a look at the markers may wait: a store that answers
at all answers in milliseconds; one slower than this is as good as gone for a hint."""
AGENT_GRACE_S = 20.0
"""After this worker sent torchrun's agent SIGTERM (a node cut off from the job's store), how
long the agent has to exit before a watcher sends it SIGKILL."""
QUIET_S = 30.0
"""After a call timed out, calls fail at once for this long at most (no new thread on a dead
link), or until the calls that timed out came back."""

_quiet = {"until": 0.0, "failed": 0.0}  # calls may fail at once before "until"; "failed": ever
_stuck: list[threading.Thread] = []  # calls that timed out; while one waits, the link may be dead
_lock = threading.Lock()
log = logging.getLogger("dckpt")


class StoreUnreachableError(RuntimeError):
    """The job's store did not answer within the deadline (its host, rank 0's, may be
    unreachable from here)."""


def default_store() -> Any:
    """The job's store (None in a single process, or before the group exists)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def call(fn: Callable[..., T], *args: Any, deadline_s: float = HINT_S) -> T:
    """``fn(*args)`` (a store method), waited for at most ``deadline_s``; raises
    ``StoreUnreachableError`` past it, or at once while a call that did still waits on the
    store (for ``QUIET_S`` at most)."""
    if time.monotonic() < _quiet["until"] and _still_stuck():
        raise StoreUnreachableError("the job's store stopped answering a moment ago")
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn(*args)))
        except BaseException as exc:  # handed to the caller
            box.append((False, exc))

    thread = threading.Thread(target=run, name="dckpt-store", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if not box:
        with _lock:
            _stuck.append(thread)
            _quiet["until"] = time.monotonic() + QUIET_S
            if not _quiet["failed"]:
                _quiet["failed"] = 1.0
                _remember_store(getattr(fn, "__self__", None))
        raise StoreUnreachableError(
            f"the job's store did not answer within {deadline_s:.0f} s (its host, rank 0's "
            "node, may be unreachable from here)"
        )
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _still_stuck() -> bool:
    """Whether a call that timed out still waits on the store. One that came back (with an
    answer, or an error) shows the store answers again, or fails at once: either way a new
    call leaves no thread on a dead link."""
    with _lock:
        _stuck[:] = [t for t in _stuck if t.is_alive()]
        return bool(_stuck)


_STORE: list[Any] = []


def _remember_store(store: Any) -> None:
    """The store that stopped answering, for the probe at exit (registered once)."""
    if store is not None and not _STORE:
        _STORE.append(store)
        atexit.register(_end_agent_if_cut_off)


def _end_agent_if_cut_off() -> None:
    """At exit, after the job's store once stopped answering: if it still does not, and
    the parent is torchrun's agent, end the agent (see the module docstring)."""
    if os.environ.get("DCKPT_END_AGENT", "1") == "0" or not _STORE:
        return
    _quiet["until"] = 0.0  # a fresh look
    try:
        call(_STORE[0].check, ["dckpt/probe"], deadline_s=HINT_S)
        return  # it answers again: nothing hangs on it
    except Exception as exc:  # unreachable (or refusing): the agent would wait on it
        why = str(exc)
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return
    if "torch.distributed.run" not in cmdline and "torchrun" not in cmdline:
        return
    log.error(
        "dckpt: this node cannot reach the job's store (rank 0's host) any more: torchrun's "
        "agent (pid %d) would wait on its rendezvous without end, so it is sent SIGTERM and "
        "the node's job ends (DCKPT_END_AGENT=0 leaves it): %s",
        parent,
        why,
    )
    _kill_if_still_there(parent, AGENT_GRACE_S)
    with contextlib.suppress(OSError):
        os.kill(parent, signal.SIGTERM)


def _started(pid: int) -> str | None:
    """When ``pid`` started (``/proc/<pid>/stat``'s 22nd field), telling it from a later
    process that reuses its number; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None


def _kill_if_still_there(pid: int, grace_s: float) -> None:
    """Leave a watcher that ends ``pid`` (the agent) with SIGKILL if it still runs
    ``grace_s`` after this worker asked it to stop: an agent blocked in a store call on the
    dead link handles SIGTERM only when that call returns, and its shutdown makes more such
    calls (measured beside a busy machine: over 180 s). The watcher is its own session, so
    the agent's stopping of its workers does not take it along, and it exits as soon as the
    agent is gone."""
    started = _started(pid)
    if started is None:
        return
    try:
        ready, told = os.pipe()
        child = os.fork()
    except OSError:
        return
    if child == 0:  # the watcher: only os calls from here (a forked copy of a threaded process)
        try:
            os.setsid()
            os.write(told, b"x")
            end = time.monotonic() + grace_s
            while time.monotonic() < end:
                if _started(pid) != started:
                    os._exit(0)
                time.sleep(0.2)
            if _started(pid) == started:
                os.kill(pid, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(told)
    with contextlib.suppress(OSError):  # on its own session before the agent is told
        select.select([ready], [], [], 2.0)
    os.close(ready)
