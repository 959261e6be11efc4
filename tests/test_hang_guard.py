"""The suite's hang guard (tests/hang_guard.py) calls a process hung only when it stopped
using CPU: one blocked opening a FIFO is killed after ``quiet_s``; one that computes for
longer than that (as a loaded machine's slow process does) is waited for to its end."""

from __future__ import annotations

import sys
from pathlib import Path

from hang_guard import run_watched


def test_a_blocked_process_is_hung_and_a_busy_one_is_not(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    blocked = f"import os; os.mkfifo({str(fifo)!r}); open({str(fifo)!r})"
    assert run_watched([sys.executable, "-c", blocked], quiet_s=1.0) is None
    busy = (
        "import time\n"
        "end = time.process_time() + 3\n"
        "while time.process_time() < end: pass\n"
        "print('done')"
    )
    done = run_watched([sys.executable, "-c", busy], quiet_s=1.0)
    assert done is not None and done.returncode == 0 and done.stdout == "done\n", done
