"""Lock records for tests: another host's live job (its record in a root's lock file,
renewed); a job of this host that is gone; a second pid namespace to run a process in.

A run lock on another host is taken over only after a whole lease without a renewal, watched
on the taker's own clock (dckpt.root.lock), so "another host's live job" is a record whose
``beat`` moves, not one whose ``lease_until`` lies in the future. The same holds for a job in
another pid namespace on this host (a container): its pid means nothing here.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def renewing(path: Path, record: dict[str, object], lease_s: float = 10.0) -> Iterator[None]:
    """``record`` in the lock file at ``path``, renewed twice a second (written whole)."""
    stop = threading.Event()

    def write(beat: int) -> None:
        tmp = path.with_name(f"{path.name}.renewing")
        tmp.write_text(json.dumps({**record, "beat": beat, "lease_s": lease_s}))
        os.replace(tmp, path)

    def renew() -> None:
        beat = 0
        while not stop.wait(0.5):
            beat += 1
            write(beat)

    write(0)  # in place before the caller goes on (a thread may start late on a busy host)

    thread = threading.Thread(target=renew, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]
"""A command's prefix that runs it as pid 1 of a new pid namespace, with its own /proc."""


def unshare_or_skip() -> list[str]:
    """``UNSHARE``, or a skip saying why this machine cannot make a pid namespace."""
    try:
        probe = subprocess.run(
            [*UNSHARE, "true"], capture_output=True, text=True, timeout=30, check=False
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1) here: cannot run a process in a second pid namespace")
    if probe.returncode != 0:
        pytest.skip(
            f"{' '.join(UNSHARE)} is not permitted here ({probe.stderr.strip()}): a second "
            "pid namespace needs root or unprivileged user namespaces"
        )
    return UNSHARE


def gone(run_id: str = "gone-run", lease_s: float = 3.0, **changes: object) -> dict[str, object]:
    """The record a job of this process's host, boot and pid namespace left when it died (read
    from /proc here, not from dckpt): its pid is a real process that has exited. ``changes``
    replace fields; None removes one (an older dckpt's record has no ``boot_id``, ``pid_ns``)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    now = time.time()
    record: dict[str, object] = {
        "host": socket.gethostname(), "pid": dead.pid, "started": now - 60,
        "run_id": run_id, "token": "t0ken", "lease_until": now + lease_s, "beat": 0,
        "lease_s": lease_s,
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "pid_ns": os.stat("/proc/self/ns/pid").st_ino,
    }  # fmt: skip
    record.update(changes)
    return {k: v for k, v in record.items() if v is not None}
