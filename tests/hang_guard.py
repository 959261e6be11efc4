"""Telling a hung process from a slow one, for tests that must end a hang without turning the
machine's speed into a verdict.

``run_watched(cmd)`` runs a command to its end and returns its ``CompletedProcess``, or None
when it hung: it did not exit, and neither it nor any process it started used any CPU for
``quiet_s`` seconds in a row (a process blocked in ``open()`` of a FIFO, in a read that never
returns, at a lock). A process that is slow because the machine is busy still uses some CPU
and is waited for, up to ``cap_s`` (a generous bound that only ends a livelock). A hung
process is killed with its whole process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil

__all__ = ["cpu_seconds", "run_watched"]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` and every live process below it; 0 when gone."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return total
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return total


def run_watched(
    cmd: Sequence[str],
    *,
    quiet_s: float = 30.0,
    cap_s: float = 600.0,
    **popen: Any,
) -> subprocess.CompletedProcess[str] | None:
    """Run ``cmd`` (text output captured); None when it hung (see the module docstring)."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, **popen,
    )  # fmt: skip
    out: dict[str, str] = {}

    def drain() -> None:  # the pipes must be read while waiting, or a chatty process blocks
        out["stdout"], out["stderr"] = proc.communicate()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    start = last_change = time.monotonic()
    used = cpu_seconds(proc.pid)
    while proc.poll() is None:
        time.sleep(0.2)
        now = time.monotonic()
        cpu = cpu_seconds(proc.pid)
        if cpu > used:
            used, last_change = cpu, now
        if now - last_change > quiet_s or now - start > cap_s:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(timeout=10)
            return None
    reader.join()
    return subprocess.CompletedProcess(
        list(cmd), proc.returncode, out.get("stdout", ""), out.get("stderr", "")
    )
