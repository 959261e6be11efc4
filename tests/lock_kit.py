"""A live lock of another host's job, for tests: its record in a root's lock file, renewed.

A run lock on another host is taken over only after a whole lease without a renewal, watched
on the taker's own clock (dckpt.root.lock), so "another host's live job" is a record whose
``beat`` moves, not one whose ``lease_until`` lies in the future.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path


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
